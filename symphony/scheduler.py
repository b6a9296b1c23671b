"""Two-level scheduling of pred calls onto batched forward passes.

Level 1 (processes) decides whose work goes first: fair share by weighted tokens (CFS's
virtual runtime with nice weights), with admission when device pages are short
(relief.py). Level 2 (batches) packs the chosen work into one forward pass per step, up to
a token budget, so a long prompt is chunked and decodes keep flowing. A pred reserves its
pages once, on admission, and commits once, when its last chunk is done: a failed or
cancelled pred leaves its file as it was. Spare room computes guesses (decode_ahead.py).

A step is two public functions over plain data, as vLLM v1's schedule() and
update_from_output(): `schedule()` picks and admits the work and returns a StepPlan;
`finish(plan, result)` takes the StepResult: outputs to the preds, commit or roll back,
accounting. `run()` drives them: wait for work, hold for the processes just served,
schedule, run the forward pass in the engine process, finish; pipelined, the next step is
scheduled and sent while one computes, so two may be in flight (docs/architecture.md,
"Pipelined steps").

Everything here runs on the event loop's thread except the forward pass itself, which
runs in the engine process (engine_process.py); the loop keeps answering other syscalls
meanwhile.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterable

import torch

from kvfs.errors import FSError
from kvfs.fs import FileSystem, Handle
from kvfs.inode import Inode
from symphony.decode_ahead import DecodeAhead
from symphony.decode_stream import DecodeStream, Slot
from symphony.engine.sampler import RowControl, SamplingParams
from symphony.engine_process import EngineDied, EngineProcess
from symphony.pred_job import JobState, Output, PredJob, PredSpec, Reply
from symphony.process import Process
from symphony.relief import Relief
from symphony.sched_stats import SchedStats, StepRecord
from symphony.step import Chunk, StepPlan, StepResult, resample

log = logging.getLogger("symphony.scheduler")

# A prompt waits at most this long for decodes that tie with it (its own process's, whose
# virtual runtime is its own); then it goes in arrival order.
PREFILL_PATIENCE = 0.05
HOLD_MAX, HOLD_SHARE = 0.010, 1.0  # the longest wait for just-served processes, absolute
# and as a share of the last step
PIPELINE_LEAD = 0.2  # pipelined, the next step is planned this share of a step before the
# one in flight should end: later, fewer of its answers' next preds are in it; earlier, a
# step that ends early waits for the next to be planned
SLEEP_GRACE = 0.1  # seconds between two preds that still count as running, not asleep


def exiting() -> FSError:
    return FSError(errno.EINTR, "pred: cancelled, the process is exiting")


def taken_back() -> FSError:
    return FSError(errno.ECANCELED, "pred: cancelled by its caller")


def output_of(job: PredJob, row: int, result: StepResult, i: int,
              control: RowControl | None) -> Output:
    """Logit row i of a step's result, as the Output of job's row `row`."""
    n = job.spec.params.top_logprobs
    output = Output(row, result.tokens[i], result.logprobs[i], result.top_ids[i][:n] if n else (),
                    result.top_logprobs[i][:n] if n else ())
    if control is not None:
        controlled(output, job, control, result, i)
    return output


def controlled(output: Output, job: PredJob, control: RowControl, result: StepResult,
               i: int) -> None:
    """What a controlled row adds to its Output (logit row i of the step): the model's own
    logprob when a mask or a bias changed the distribution, its scores, and with
    score_next the next token's logprob, which is the row's last score."""
    if control.allowed is not None or control.bias_ids:
        output.model_logprob = result.model_logprobs[i]
    if control.score_ids:
        scores = result.scores[i][:len(control.score_ids)]
        if job.spec.score_next and output.row < len(job.spec.tokens) - 1:
            output.next_logprob = scores.pop()
        output.scores = scores


async def _done_or_timeout(loop: asyncio.AbstractEventLoop, future: asyncio.Future,
                           seconds: float) -> None:
    """Wait until the future is done or `seconds` have passed: asyncio.wait([future],
    timeout=seconds) without its sets and task wrapping, once a step."""
    waiter = loop.create_future()

    def wake(_: object = None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    timer = loop.call_later(seconds, wake)
    future.add_done_callback(wake)
    try:
        await waiter
    finally:
        timer.cancel()
        future.remove_done_callback(wake)


class Scheduler:
    def __init__(
        self,
        engine: EngineProcess,
        fs: FileSystem,
        procs: Callable[[], Iterable[Process]],
        token_budget: int,
        max_seqs: int,
        decode_ahead: bool,
        pipeline: bool = False,
    ):
        self.engine, self.fs = engine, fs
        self.token_budget, self.max_seqs = token_budget, max_seqs
        self.pipeline = pipeline
        self.context = engine.config.max_position_embeddings
        self.queue: list[PredJob] = []  # the run queue, in arrival order
        self._queued_on: dict[Inode, int] = {}  # jobs in the queue per file (no scan a pred)
        # The steps in flight, oldest first (two at most, pipelined): schedule to finish.
        self.running: list[StepPlan] = []
        self.min_vruntime = 0.0
        self.stats = SchedStats()
        self._seqs = itertools.count()
        self.ahead = DecodeAhead(fs, self.stats, enabled=decode_ahead,
                                 eos=set(engine.eos_ids()), context=self.context,
                                 device=engine.device, seq=self._seqs.__next__,
                                 new_future=self._new_future, enqueue=self._enqueue,
                                 pipelined=pipeline)
        self.relief = Relief(fs, procs, self._working, self.stats)
        self._masked: list[PredJob] = []  # guesses taken by masked preds, to sample (_take)
        self._wake = asyncio.Event()
        self._step_end = asyncio.Event()  # set, and replaced, each time a step ends

    @property
    def decode_ahead(self) -> bool:
        return self.ahead.enabled

    @functools.cached_property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop that serves the preds: the one run() drives, or, before run(), the one
        first asked for. Asked once: Python 3.11's get_running_loop() makes a getpid system
        call each time, 6% of the loop's CPU when it was once a pred."""
        return asyncio.get_running_loop()

    def _new_future(self) -> asyncio.Future:
        return self.loop.create_future()

    # -- level 1: submission, fair share, cancellation -----------------------------------

    def submit(self, proc: Process, handle: Handle, spec: PredSpec,
               reply: Reply | None = None) -> asyncio.Future:
        """Queue a checked pred; the future gets its Outputs, or the error that failed it,
        and `reply`, if given, is called with the same at once (before submit returns,
        when the pred is answered right away)."""
        # Decoding ahead guesses the preds of decode loops, plain or masked: a guess
        # computed without this pred's scores, tree or cut is not its answer, and after it
        # the next pred will carry its own. A mask is applied when the pred takes the guess
        # (decode_ahead.py).
        stream = self.ahead.streams.get(handle.inode)
        if stream is not None:  # from here on, the file's guesses are jobs
            self.ahead.unstream(stream)
        looping = not spec.score_next and spec.tree is None and spec.cut is None
        guess = self.ahead.match(handle, spec) if looping else None
        if guess is not None and (spec.controls is None or self._maskable(guess)):
            # The pred owns the guess: its request is the guessed one (match) but for its
            # controls, which a step still to build or the sampling of kept logits applies.
            guess.spec, guess.reply = spec, reply
            return self._take(guess)
        self.ahead.drop(handle.inode, self.running)  # any other pred on the file drops it
        self._arrive(proc)
        job = PredJob(proc, handle, spec, spec.params.generator(self.engine.device),
                      self.loop.create_future(), next(self._seqs),
                      positions=spec.positions, reply=reply,
                      follows=looping and self.ahead.follows(handle, spec))
        self._enqueue(job)
        self._wake.set()
        return job.future

    def take_guess(self, handle: Handle, token: int, params: SamplingParams,
                   reply: Reply | None) -> asyncio.Future | None:
        """A plain decode pred (`token` fed back, sampled with `params`, nothing else) that is
        the file's guess takes it as submit would, keeping the guess's spec, which is the
        same request; None when it is not the guess (then submit it). The first slot of the
        file's stream it takes with no job at all (decode_stream.py)."""
        stream = self.ahead.stream_of(handle, token, params) if reply is not None else None
        if stream is not None:  # a slot's pred is answered through its reply alone
            return self._take_slot(stream, reply)
        stream = self.ahead.streams.get(handle.inode)
        if stream is not None:
            self.ahead.unstream(stream)
        guess = self.ahead.decode_guess(handle, token, params)
        if guess is None:
            return None
        guess.reply = reply
        return self._take(guess)

    def _take_slot(self, stream: DecodeStream, reply: Reply) -> asyncio.Future:
        """_take for a stream's first slot: answered now when computed, else when the step
        computing it ends (finish)."""
        self._arrive(stream.proc)
        stream.reply = reply
        made = self.ahead.take_slot(stream)
        slot = stream.slots[0]
        future = self.loop.create_future()
        if slot.output is not None:  # already computed: answer now
            self._charge_proc(stream.proc, 1, slot.seconds)
            future.set_result(self._answer_slot(stream))
            if made:
                self._wake.set()
        else:  # to plan, or in the running step: the hold (run) may wait for this pred
            stream.future = future
            self._wake.set()
        return future

    def _answer_slot(self, stream: DecodeStream) -> list[Output]:
        """_complete for a stream's taken first slot, computed: its entry joins the file,
        its pred is answered, and the stream guesses on."""
        slot = stream.slots.pop(0)
        proc = stream.proc
        self.fs.commit(slot.res, [slot.token], [slot.position])
        self.stats.preds += 1
        proc.pending -= 1
        if proc.waiting and not any(j.proc is proc and j.state is JobState.QUEUED
                                    for j in self.queue):
            proc.waiting = False
        proc.last_active = proc.answered = time.monotonic()
        outputs = [slot.output]
        reply, future = stream.reply, stream.future
        stream.reply = stream.future = None
        # The stream is whole again before its pred is answered: a reply that sends the
        # next pred at once, or raises, finds it so.
        if self.ahead.slot_answered(stream, slot):
            self._wake.set()
        if future is not None and not future.done():
            future.set_result(outputs)
        reply(outputs, None)
        return outputs

    def _arrive(self, proc: Process) -> None:
        """A pred of proc arrives: the wake-up clamp, its think time, its pending count."""
        if proc.pending == 0:
            gap = time.monotonic() - proc.answered if proc.answered else None
            if gap is None or gap > SLEEP_GRACE:
                # Waking up: no credit for time asleep beyond one step's worth, as CFS
                # bounds a waker's lead.
                proc.vruntime = max(proc.vruntime, self.min_vruntime - self.token_budget)
            # A process only between two preds (its own syscalls, its Python) keeps its
            # lead: while it was away a niced process ran and raised min_vruntime, and the
            # clamp would hand that process the next steps too. When its round trip
            # outlasted the hold, nice 0 against nice 10 fell from 9.3x to 6x.
            if gap is not None:
                proc.think = gap if not proc.think else (proc.think + gap) / 2
        proc.pending += 1
        proc.swapped = False

    def _maskable(self, guess: PredJob) -> bool:
        """Whether a masked pred can take the guess: its logits are kept, or it is not
        computed yet (then it is computed with the mask)."""
        return guess.keep_logits or not guess.planned

    @staticmethod
    def _resample(taken: list[tuple[PredJob, torch.Tensor]]) -> None:
        """Guesses' kept logits sampled with the controls of the preds that took them,
        their outputs set."""
        jobs, logits = [job for job, _ in taken], [row for _, row in taken]
        result = resample(jobs, logits)
        for i, job in enumerate(jobs):
            spec = job.spec
            job.outputs = [output_of(job, spec.rows[0], result, i, spec.controls[0])]

    def _take(self, guess: PredJob) -> asyncio.Future:
        """The pred computed ahead arrived: it owns the work from now on."""
        if self.ahead.take(guess):
            self._wake.set()
        self._arrive(guess.proc)
        self._enqueue(guess)
        if guess.done and guess.spec.controls is not None:
            # Sampled with its mask together with the other masked preds that take computed
            # guesses before the loop turns (their frames come in together): one batch, as a
            # step's rows are, instead of a sampler call each. It stays queued meanwhile,
            # with nothing left to compute, so a cancel or an exit still finds it.
            self._masked.append(guess)
            if len(self._masked) == 1:
                self.loop.call_soon(self._answer_masked)
            return guess.future
        guess.logits = None
        if guess.done:  # already computed: answer now
            self._charge(guess, guess.done, guess.seconds)
            self._complete(guess)
        else:  # queued or in the running step: it goes on as any admitted pred
            self._wake.set()
        return guess.future

    def _answer_masked(self) -> None:
        """The computed guesses masked preds took since the loop last turned: their kept
        logits sampled in one batch, and the preds answered (those cancelled meanwhile
        failed already)."""
        taken = [j for j in self._masked if j.state is JobState.ADMITTED]
        self._masked = []
        if taken:
            self._resample([(job, job.logits) for job in taken])
        for job in taken:
            job.logits = None
            self._charge(job, job.done, job.seconds)
            self._complete(job)

    async def settle(self, inode: Inode) -> None:
        """Before a call changes inode other than by pred: no work ahead is left on it, nor
        a pred its caller took back that the running step still writes (a gRPC client
        cancels without waiting for the rollback)."""
        stream = self.ahead.streams.get(inode)
        if stream is not None:  # its taken slot, if any, joins the queue
            self.ahead.unstream(stream)
        # A pred whose future its caller cancelled (the rpc's cancellation, a CANCEL frame)
        # is taken back by a task that may not have run yet: take it back here, or a call
        # that comes right after the cancellation would find the file busy.
        for job in [j for j in self.queue if j.handle.inode is inode
                    and j.future.cancelled() and j.state is not JobState.CANCELLED]:
            self._cancel(job, taken_back())
        dropped = self.ahead.drop(inode, self.running) is not None
        if dropped or self.ahead.dropping(inode) or any(
                j.state is JobState.CANCELLED and j.handle.inode is inode for j in self.queue):
            await self.quiesce()

    async def give_way(self) -> bool:
        """A call is short of pages: every guess gives its pages back (after the step
        that may be writing one). Whether there were any."""
        dropped = self.ahead.drop_all(self.running)
        if dropped and self.running:
            await self.quiesce()
        return dropped

    async def cancel(self, future: asyncio.Future) -> None:
        """The caller took the pred back: it fails with ECANCELED, and its file is as it was
        when this returns (a pred a step in flight computes is rolled back when the last
        such step ends, after the guesses stacked on it; a step that does not compute it is
        not waited for)."""
        steps = list(self.running)  # what computes it, or the guesses stacked on it
        for stream in [s for s in self.ahead.streams.values() if s.future is future]:
            self.ahead.unstream(stream)
        for job in [j for j in self.queue if j.future is future]:
            self._cancel(job, taken_back())
            inode = job.handle.inode
            while ((job.state is JobState.CANCELLED or self.ahead.dropping(inode))
                   and any(s is p for s in steps for p in self.running)):
                await self._step_end.wait()

    def cancel_process(self, proc: Process) -> None:
        """Its preds fail with EINTR; a pred in the running step is rolled back after it."""
        self.ahead.unstream_process(proc)
        for job in [j for j in self.queue if j.proc is proc]:
            self._cancel(job, exiting())
        self.ahead.drop_process(proc, self.running)

    def _cancel(self, job: PredJob, err: FSError) -> None:
        if self._computing(job):
            job.state, job.error = JobState.CANCELLED, err  # finish rolls it back
        else:
            self._fail(job, err)

    def _computing(self, job: PredJob) -> bool:
        """Whether a step in flight computes the job."""
        return any(plan.computes(job) for plan in self.running)

    def _enqueue(self, job: PredJob) -> None:
        self.queue.append(job)
        inode = job.handle.inode
        self._queued_on[inode] = self._queued_on.get(inode, 0) + 1

    def _leave(self, job: PredJob) -> None:
        """Out of the run queue."""
        self.queue.remove(job)
        inode = job.handle.inode
        if self._queued_on[inode] == 1:
            del self._queued_on[inode]
        else:
            self._queued_on[inode] -= 1
        job.proc.pending -= 1
        if job.proc.waiting and not any(j.proc is job.proc and j.state is JobState.QUEUED
                                        for j in self.queue):
            job.proc.waiting = False

    def _fail(self, job: PredJob, err: Exception) -> None:
        if job.state is not JobState.QUEUED:
            # A pred that took a guess a step in flight computes may have guesses stacked
            # on its reservation (pipelined): they go first, and it with them.
            self.ahead.drop(job.handle.inode, self.running)
            if not self.ahead.roll_back_with(job):
                self.fs.rollback(job.res)
                job.res = None
        job.state = JobState.FAILED
        self._leave(job)
        if not job.future.done():
            # A syscall's error goes to its caller without its traceback, whose frames (the
            # job, its tokens) would make a cycle with the future only a collection frees:
            # refused preds of millions of tokens held gigabytes.
            err = err.with_traceback(None) if isinstance(err, OSError) else err
            job.future.set_exception(err)
            if job.reply is not None:  # the reply is its caller: the future's error is seen
                job.future.exception()  # (else asyncio logs it, a line a failed pred)
                job.reply(None, err)

    def uses(self, handle: Handle) -> bool:
        return (any(j.handle is handle for j in self.queue)
                or any(s.handle is handle for s in self.ahead.taken_streams()))

    def run_queue(self) -> int:
        """Preds queued or running: the run queue's, and those that took a stream's slot."""
        return len(self.queue) + len(self.ahead.taken_streams())

    async def quiesce(self) -> None:
        """Wait until the steps in flight now have ended (before freeing what they may
        touch); steps planned meanwhile do not hold it up."""
        steps = list(self.running)
        while any(s is p for s in steps for p in self.running):
            await self._step_end.wait()

    def _ended(self, plan: StepPlan) -> None:
        self.running = [p for p in self.running if p is not plan]
        self._step_end.set()
        self._step_end = asyncio.Event()

    def poke(self) -> None:
        """Something that may make room happened (a close, an exit): try again."""
        self._wake.set()

    # -- the driver ---------------------------------------------------------------------

    async def run(self) -> None:
        self.loop = asyncio.get_running_loop()
        served: list[Process] = []
        last_step = 0.0
        answers: list[asyncio.Future] = []  # of the steps in flight, as self.running
        started = 0.0  # when the oldest step in flight began computing
        while True:
            if not self.running:
                await self._wake.wait()
                self._wake.clear()
                await self._hold_for(served, last_step)
                if not self._launch(answers):
                    continue
                started = time.monotonic()
            plan, answer = self.running[0], answers[0]
            if self.pipeline and len(self.running) == 1 and last_step:
                # The next step is planned a little before this one should end and sent
                # behind it, so that the engine starts it the moment this one is done; its
                # decodes on guesses this one computes take their tokens in the engine.
                due = started + last_step * (1 - PIPELINE_LEAD) - time.monotonic()
                if due > 0:
                    await _done_or_timeout(self.loop, answer, due)
                if not answer.done():
                    self._launch(answers)
            try:
                result = await answer
            except EngineDied as e:  # no step can run any more: the kernel stops
                self._fail_in_flight(answers, e)
                raise
            except Exception as e:  # the step failed as a whole: so does every pred in it
                log.exception("forward pass failed")
                answers.pop(0)
                started = time.monotonic()  # the step behind, if any, computes from now
                self.fail_step(plan, FSError(errno.EIO, f"pred: the forward pass failed: {e}"))
            else:
                answers.pop(0)
                now = time.monotonic()
                last_step, started = now - started, now
                result.seconds = last_step  # the engine's answer is the scheduler's own
                self.finish(plan, result)
            served = [c.job.proc for c in plan.chunks if c.job.future.done()] + plan.served

    def _launch(self, answers: list[asyncio.Future]) -> bool:
        """Plan a step and send it to the engine process; whether there was work."""
        plan = self.schedule()
        if plan is None:
            return False
        self._wake.set()  # more may be runnable after this step
        answers.append(self.engine.send(plan.work))
        self.stats.pipelined += len(self.running) > 1
        return True

    def _fail_in_flight(self, answers: list[asyncio.Future], err: Exception) -> None:
        for plan in list(self.running):
            self.fail_step(plan, err)
        for answer in answers:  # each failed with the engine: seen, so asyncio logs none
            if answer.done() and not answer.cancelled():
                answer.exception()
        answers.clear()

    async def _hold_for(self, served: list[Process], last_step: float) -> None:
        """Wait a little for the processes just served to send their next pred.

        A LIP with one pred in flight is not queued during its round trip. Planning at once
        would run a step of whoever happens to be back (a batch of 32 LIPs would run as
        steps of a few), and hand the turn of a process that would go first to whoever is
        queued, so nice would count for nothing. So the next step waits for the processes
        it would want: any of them while the step has room, and those that would go first
        when it is full. It waits only for processes that usually come back in time (their
        think time): to fill the step, at most HOLD_SHARE of a step; for a process whose
        turn it is, up to HOLD_MAX, however short the step, or a short step would hand its
        turn away whenever its round trip is longer (a truncate between two preds)."""
        now = time.monotonic()
        fill_by, turn_by = now + min(HOLD_MAX, HOLD_SHARE * last_step), now + HOLD_MAX
        while True:
            queued, taken = self.queue, self.ahead.taken_streams()
            full = (len({j.proc for j in queued} | {s.proc for s in taken}) >= self.max_seqs
                    or sum(j.unplanned for j in queued)
                    + sum(not s.slots[0].planned for s in taken) >= self.token_budget)
            first = min([j.proc.vruntime for j in queued] + [s.proc.vruntime for s in taken],
                        default=float("inf"))
            worth = 0.0  # the latest time a missing process is worth waiting until
            guessed = self.ahead.procs()
            for p in served:
                if p.alive and not p.pending:
                    if p in guessed:
                        # Its work ahead fills the step; wait only if it would go first.
                        by = turn_by if p.vruntime < first < float("inf") else 0.0
                    else:
                        by = turn_by if p.vruntime < first else 0.0 if full else fill_by
                    if p.answered + p.think < by:
                        worth = max(worth, by)
            left = worth - time.monotonic()
            if left <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                return

    # -- level 2: planning a step -----------------------------------------------------------

    def schedule(self) -> StepPlan | None:
        """Plan the next step and admit its work; None when there is nothing to run. The
        plan is the running step until finish() or fail_step() is given it."""
        picked = self._pick()
        if not picked:
            return None
        plan = StepPlan.build(picked)
        for c in plan.chunks:
            c.job.planned = c.start + c.size
        for slot in plan.streamed:
            slot.planned, slot.plan = True, plan
        self.running.append(plan)
        if self.pipeline:  # guesses on the guesses just planned, for the step after
            for w in picked:
                if type(w) is Slot:
                    self.ahead.slot_planned(w)
                elif w.job.state is JobState.AHEAD:
                    self.ahead.planned(w.job)
        return plan

    def _pick(self) -> list[Chunk | Slot]:
        """Chunks of queued work in virtual-runtime order (decodes first among equals, but
        not past a prompt that has waited PREFILL_PATIENCE: the threads of one process, equal
        by nature, would starve its prompts), then guesses in the room left. A prefill chunk
        leaves one token of the budget for each decode still queued, so that decodes keep
        flowing past long prompts. Ordering all decodes before all prefills would instead
        starve a prefill whenever decodes fill the step.

        Behind a step in flight (pipelined), a pred goes only if its process would go before
        every process that step answers (they may be back with their next pred before the
        step ends: the hold in run() waits for them otherwise, or nice would count for
        nothing), and a seeded pred's next chunk waits for its generator to come back.

        The work in the order picked: a stream's slot goes as itself (decode_stream.py), a
        taken one as a pred, an untaken one as a guess."""
        picked: list[Chunk | Slot] = []
        budget = self.token_budget
        # One pass over the queue: the decodes in it, each file's first pred not admitted
        # yet, and the jobs with tokens to plan (not those in flight, nor a masked pred's
        # computed guess, sampled soon): in a decode loop the queue is mostly preds that
        # took a guess a step in flight computes, and only the rest is sorted.
        decodes = 0
        first: dict[int, int] = {}  # id(inode) -> seq of its earliest pred not yet admitted
        todo: list[PredJob] = []
        for j in self.queue:
            left = len(j.spec.tokens) - j.planned
            decodes += left == 1
            if j.state is JobState.QUEUED:
                key = id(j.handle.inode)
                first[key] = min(first.get(key, j.seq), j.seq)
            if left and j.state is not JobState.CANCELLED:
                todo.append(j)
        taken = [s.slots[0] for s in self.ahead.taken_streams() if not s.slots[0].planned]
        if not todo and not taken:  # a decode loop's steady state: guesses only
            return self._guesses_to_compute(picked, budget)
        decodes += len(taken)
        # Behind a step in flight, each process counts with what that step will charge it
        # (finish charges it): else the process whose turn it was also got the step behind,
        # two steps a turn (three each, two at nice 0), whatever the step in flight gave it.
        owed: dict[Process, float] = {}
        ending: list[Process] = []  # whose preds a step in flight answers
        for plan in self.running:
            for c in plan.chunks:
                if c.job.state not in (JobState.AHEAD, JobState.DROPPED):
                    owed[c.job.proc] = (owed.get(c.job.proc, 0.0)
                                        + c.size * 1024 / c.job.proc.weight)
                    if (c.job.state is JobState.ADMITTED
                            and c.start + c.size == len(c.job.spec.tokens)):
                        ending.append(c.job.proc)
            for slot in plan.streamed:
                stream = slot.stream
                if slot.job is None and stream.reply is not None and stream.slots[0] is slot:
                    owed[stream.proc] = owed.get(stream.proc, 0.0) + 1024 / stream.proc.weight
                    ending.append(stream.proc)

        def vruntime(p: Process) -> float:
            return p.vruntime + owed.get(p, 0.0)

        answered = min([vruntime(p) for p in ending], default=float("inf"))
        patient = time.monotonic() - PREFILL_PATIENCE

        def order(j: PredJob | Slot) -> tuple:
            if type(j) is Slot:  # a taken slot: one token, queued since its take
                return vruntime(j.proc), False, j.seq
            return vruntime(j.proc), j.unplanned > 1 and j.enqueued > patient, j.seq

        todo += taken
        todo.sort(key=order)
        for job in todo:
            if type(job) is Slot:
                if self.running and vruntime(job.proc) > answered:
                    continue
                if budget == 0 or len(picked) == self.max_seqs:
                    break
                decodes -= 1
                picked.append(job)  # as its job's chunk, should it become one (below)
                budget -= 1
                continue
            if self.running and (vruntime(job.proc) > answered or (
                    job.generator is not None and self._computing(job))):
                continue
            if budget == 0 or len(picked) == self.max_seqs:
                break
            if job.unplanned == 1:
                decodes -= 1
            if job.state is JobState.QUEUED:
                inode = job.handle.inode
                if inode.busy or first[id(inode)] != job.seq:
                    continue  # preds on one file are served in the order they came
                if not self._admit(job, others=bool(picked or self.running)
                                   or self._admitted()):
                    continue
            room = self.max_seqs - len(picked) - 1  # sequences left for the queued decodes
            size = min(job.unplanned, max(1, budget - min(decodes, room)))
            picked.append(Chunk(job, job.planned, size))
            budget -= size
        # A pred short of pages may have had the guesses give way (relief), turning the
        # streams of slots picked above into jobs: such a slot goes as its job's chunk.
        picked = [Chunk(w.job, 0, 1) if type(w) is Slot and w.job is not None else w
                  for w in picked]
        return self._guesses_to_compute(picked, budget)

    def _guesses_to_compute(self, picked: list[Chunk | Slot], budget: int
                            ) -> list[Chunk | Slot]:
        """The work picked with guesses added in the room left: work ahead only fills room
        no pred wants, so a guess never delays a pred."""
        for guess in self.ahead.to_compute(min(budget, self.max_seqs - len(picked)),
                                           self.running):
            picked.append(guess if type(guess) is Slot else Chunk(guess, 0, 1))
        return picked

    def _working(self) -> set[Process]:
        """Processes with work admitted or in a step: their pages never move."""
        return ({j.proc for j in self.queue if j.state is not JobState.QUEUED}
                | {s.proc for s in self.ahead.taken_streams()})

    def _admitted(self) -> bool:
        return (any(j.state is JobState.ADMITTED for j in self.queue)
                or bool(self.ahead.taken_streams()))

    def _admit(self, job: PredJob, others: bool) -> bool:
        """Reserve the job's pages, making room if need be. False: it waits (or failed)."""
        handle, proc, spec = job.handle, job.proc, job.spec
        try:
            if handle.closed:
                raise FSError(errno.EBADF, "pred: the file was closed")
            inode, cut = handle.inode, spec.cut
            if cut is not None and cut > inode.length:
                raise FSError(errno.EINVAL, f"pred: truncate {cut} is past the file's "
                              f"length ({inode.length})")
            positions = job.positions
            if positions is None:  # read now: earlier preds on the file have committed
                kept = inode.length if cut is None else cut
                last = inode.positions[kept - 1] if kept else -1
                # The highest before the list: a pred past the context may be millions long.
                top = last + 1 + (max(spec.depths) if spec.depths is not None
                                  else len(spec.tokens) - 1)
            else:
                top = max(positions)
            if top >= self.context:
                raise FSError(errno.EOVERFLOW, f"pred: position {top} is past "
                              f"the model's context ({self.context})")
            if positions is None:
                positions = ([last + 1 + d for d in spec.depths] if spec.depths is not None
                             else list(range(last + 1, last + 1 + len(spec.tokens))))
            # Guesses give way to preds: a guess never costs a pred its pages.
            res = self.relief.reserve(handle, len(spec.tokens), cut=cut, others=others,
                                      give_way=lambda: self.ahead.drop_all(self.running),
                                      asker=proc)
        except FSError as e:
            if not e.message.startswith("pred"):  # the pool's or the quota's: name the file
                e = FSError(e.errno, f"pred on fd {proc.fd_of(handle)}: {e.message}")
            self._fail(job, e)
            return False
        if res is None:  # others are running: they may go idle and give up their pages
            proc.waiting = True
            return False
        job.res, job.positions, job.state = res, positions, JobState.ADMITTED
        proc.waiting = False
        self.stats.delays.append(time.monotonic() - job.enqueued)
        return True

    # -- finishing a step -------------------------------------------------------------------

    def finish(self, plan: StepPlan, result: StepResult) -> None:
        """The step is done: its samples go to their preds, a pred whose last chunk it was
        commits and is answered, work given up meanwhile is rolled back, and each process
        is charged its tokens and its share of the step's time."""
        self._ended(plan)
        if self.ahead.waiting_tokens():
            for i, (job, _) in enumerate(plan.samples):
                self.ahead.sampled_token(job, result.tokens[i])
        taken = []  # guesses masked preds took during the step, with their kept logits
        for i, (job, row) in enumerate(plan.samples):
            kept = result.kept.get(i)
            if kept is not None and job.state in (JobState.AHEAD, JobState.DROPPED):
                job.logits = kept  # for a masked pred to take
            elif kept is not None and job.spec.controls is not None:
                taken.append((job, kept))
                continue
            job.outputs.append(output_of(job, row, result, i, None if plan.controls is None
                                         else plan.controls[i]))
        if taken:
            self._resample(taken)
        if plan.streamed:
            self._slot_outputs(plan, result)
        total = plan.tokens
        prefill = decode = 0
        # In the order the work was picked: the guesses its answers make (and their pages,
        # when pages are short) go in that order, streams or not.
        for c in plan.in_order():
            if type(c) is Slot:
                decode += 1
                self._slot_done(plan, c, result.seconds / total)
                continue
            job, seconds = c.job, result.seconds * c.size / total
            if c.size == 1 and len(job.spec.tokens) == 1:
                decode += 1
            else:
                prefill += c.size
            if job.state in (JobState.AHEAD, JobState.DROPPED):
                self.ahead.computed(job, c.start + c.size, seconds)  # charged when taken
                continue
            self._charge(job, c.size, seconds)
            if job.future.cancelled():  # taken back, before its canceller ran cancel()
                job.state, job.error = JobState.CANCELLED, taken_back()
            if job.state is JobState.CANCELLED:
                if not self._computing(job):  # else when the last step computing it ends
                    self._fail(job, job.error)
                continue
            job.done = c.start + c.size
            if job.remaining == 0:
                self._complete(job)
        self.stats.record(StepRecord(time.monotonic(), result.seconds, plan.seqs,
                                     prefill, decode, time.thread_time(), self.stats.preds))
        # As CFS's: the least of the queued and of those that just ran ("current"), never
        # going back. Counting the queue alone would let a process that is only between
        # two preds be clamped to the other's vruntime on its next pred, losing its lead.
        runnable = ([j.proc.vruntime for j in self.queue]
                    + [c.job.proc.vruntime for c in plan.chunks]
                    + [slot.stream.proc.vruntime for slot in plan.streamed]
                    + [s.proc.vruntime for s in self.ahead.taken_streams()])
        self.min_vruntime = max(self.min_vruntime, min(runnable))

    def _slot_outputs(self, plan: StepPlan, result: StepResult) -> None:
        """finish() for the step's stream slots first (their logit rows follow the chunks'):
        each slot's output, and the slot after it learns its token. The slot of a stream
        turned into jobs meanwhile (or now: its pred was taken back before cancel() ran)
        gives its output to its job."""
        tokens, logprobs = result.tokens, result.logprobs
        for i, slot in enumerate(plan.streamed, len(plan.samples)):
            stream = slot.stream
            if (slot.job is None and stream.future is not None and stream.slots[0] is slot
                    and stream.future.cancelled()):
                self.ahead.unstream(stream)
            job = slot.job
            if job is not None:  # its chunk goes in finish's loop
                if self.ahead.waiting_tokens():
                    self.ahead.sampled_token(job, tokens[i])
                job.outputs.append(output_of(job, 0, result, i, None))
                continue
            slot.plan = None
            n = stream.params.top_logprobs
            slot.output = Output(0, tokens[i], logprobs[i],
                                 result.top_ids[i][:n] if n else (),
                                 result.top_logprobs[i][:n] if n else ())
            slots = stream.slots
            at = slots.index(slot)
            if at + 1 < len(slots) and slots[at + 1].after is slot:
                slots[at + 1].token, slots[at + 1].after = tokens[i], None

    def _slot_done(self, plan: StepPlan, slot: Slot, seconds: float) -> None:
        """A slot the step computed: a taken one committed and its pred answered, charged;
        an untaken one guessed on, charged when a pred takes it."""
        stream = slot.stream
        if stream.reply is not None and stream.slots[0] is slot:
            self._charge_proc(stream.proc, 1, seconds)
            self._answer_slot(stream)
            plan.served.append(stream.proc)
        else:
            slot.seconds = seconds
            self.ahead.slot_computed(slot)

    def fail_step(self, plan: StepPlan, err: Exception) -> None:
        """The forward pass failed: every pred in the step fails with err, and its guesses
        are dropped (a pred or guess that a later step in flight computes too is rolled
        back when that one ends)."""
        self._ended(plan)
        for slot in plan.streamed:  # as jobs, the plan's chunks
            if slot.job is None:
                self.ahead.unstream(slot.stream)
        for c in plan.chunks:
            if c.job.state in (JobState.AHEAD, JobState.DROPPED):
                self.ahead.lost(c.job, self.running)
            elif self._computing(c.job):
                c.job.state, c.job.error = JobState.CANCELLED, err
            else:
                self._fail(c.job, err)

    def _charge(self, job: PredJob, tokens: int, seconds: float) -> None:
        self._charge_proc(job.proc, tokens, seconds)

    @staticmethod
    def _charge_proc(proc: Process, tokens: int, seconds: float) -> None:
        proc.tokens += tokens
        proc.vruntime += tokens * 1024 / proc.weight
        proc.accel_seconds += seconds

    def _complete(self, job: PredJob) -> None:
        """Its last chunk is done: the entries join the file and the pred is answered."""
        self.fs.commit(job.res, job.spec.tokens, job.positions)
        job.res, job.state = None, JobState.ANSWERED
        self.stats.preds += 1
        self._leave(job)
        job.proc.last_active = job.proc.answered = time.monotonic()
        if not job.future.done():
            job.future.set_result(job.outputs)
            if job.reply is not None:
                job.reply(job.outputs, None)
        if self.ahead.answered(job, file_queued=job.handle.inode in self._queued_on):
            self._wake.set()
