"""Decoding ahead for a plain decode loop: one stream a file, a slot a guessed pred.

The steady state of decoding ahead (decode_ahead.py) is a LIP on the rings or the lifeline
sending, pred after pred, the token its last pred sampled, with the same unseeded sampler
and nothing else: its preds known by their bytes (known_preds.py). For such a file the
guess chain is a DecodeStream instead of a chain of PredJobs: a Slot for each guessed pred
(its reservation, position and token, and its output once computed), in order, and, while
the pred that took the first slot waits for it, that pred's reply and future. A step
computes slots as rows after its chunks' (StepPlan.streamed), and when a taken slot's row
comes back the scheduler commits it and answers its pred: a pred costs the kernel a slot,
a row, a reply and the future its caller may cancel, not a spec, a job and a chunk.

Anything else that touches the file (another pred, a cancel, a call that settles it, the
process's exit, a failed step, a call short of pages) first turns its stream into what
decoding ahead keeps otherwise (`to_jobs`): its untaken slots a chain of guess PredJobs,
its taken slot an admitted PredJob, and the steps in flight computing them chunks of those
jobs. From there everything goes as it did before streams.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from kvfs.fs import Handle, Reservation
from symphony.engine.sampler import SamplingParams
from symphony.pred_job import JobState, Output, PredJob, PredSpec, Reply
from symphony.process import Process
from symphony.step import Chunk, StepPlan


class Slot:
    """One guessed pred of a stream: one token at the next position, sampled once."""

    __slots__ = ("stream", "res", "position", "token", "after", "seq", "plan", "planned",
                 "output", "seconds", "logit_row", "job")

    def __init__(self, stream: DecodeStream, res: Reservation, position: int, token: int,
                 after: Slot | None, seq: int):
        self.stream, self.res, self.position, self.seq = stream, res, position, seq
        # -1 while the step in flight computing `after`, the slot before, samples it: the
        # step computing this one takes it from the engine (StepPlan.placeholders).
        self.token, self.after = token, after
        self.plan: StepPlan | None = None  # the step in flight computing it
        self.planned = False  # in a step planned so far (in flight, or done)
        self.output: Output | None = None  # once computed
        self.seconds = 0.0  # accelerator time, charged when a pred takes it
        self.logit_row = -1  # its row among the logit rows of the step computing it
        self.job: PredJob | None = None  # its PredJob, once its stream was turned into jobs

    @property
    def proc(self) -> Process:
        return self.stream.proc


class DecodeStream:
    """A file's guessed preds, oldest first; `reply` set while a pred that took the first
    waits for it to be computed."""

    __slots__ = ("proc", "handle", "params", "slots", "reply", "future")

    def __init__(self, proc: Process, handle: Handle, params: SamplingParams):
        self.proc, self.handle, self.params = proc, handle, params
        self.slots: list[Slot] = []
        self.reply: Reply | None = None
        self.future: asyncio.Future | None = None

    @property
    def taken(self) -> bool:
        """Whether a pred took the first slot and waits for it."""
        return self.reply is not None

    @property
    def guessed(self) -> int:
        """Slots no pred took yet: the stream's guesses."""
        return len(self.slots) - (self.reply is not None)


def streams(params: SamplingParams, reply: Reply | None, controls: object) -> bool:
    """Whether a pred's file may decode ahead as a stream: answered by a reply (the rings
    and the lifeline), unseeded (a seeded guess needs a generator of its own), and with no
    control (a guess after a masked pred keeps its logits for the next mask)."""
    return reply is not None and params.seed is None and controls is None


def to_jobs(stream: DecodeStream, new_future: Callable[[], asyncio.Future]) -> list[PredJob]:
    """The stream as decoding ahead keeps it otherwise: a PredJob a slot, in order, chained
    as guesses; the first ADMITTED with the stream's reply and future when a pred took it;
    each one a step in flight computes added to that step as a chunk. The slots keep their
    jobs (Slot.job), by which the step's end finds them."""
    jobs: list[PredJob] = []
    proc, handle, params = stream.proc, stream.handle, stream.params
    for slot in stream.slots:
        spec = PredSpec([slot.token], [slot.position], [0], params)
        job = PredJob(proc, handle, spec, None, new_future(), slot.seq,
                      positions=spec.positions, state=JobState.AHEAD, res=slot.res,
                      follows=True, seconds=slot.seconds, logit_row=slot.logit_row)
        if slot.planned:
            job.planned = 1
        if slot.output is not None:
            job.done = 1
            job.outputs.append(slot.output)
        if slot.after is not None:
            job.after = slot.after.job
        if jobs:
            jobs[-1].following = job
        slot.job = job
        if slot.plan is not None:
            slot.plan.chunks.append(Chunk(job, 0, 1))
            slot.plan.jobs = slot.plan.jobs | {job}
        jobs.append(job)
    if stream.reply is not None:
        first = jobs[0]
        first.state, first.reply, first.future = JobState.ADMITTED, stream.reply, stream.future
        first.following = None
    stream.slots, stream.reply, stream.future = [], None, None
    return jobs
