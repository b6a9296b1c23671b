"""Decoding ahead: the KV cache's readahead.

A LIP in a decode loop sends, as its next pred, the token its last pred sampled, at the
next position, with the same sampler. So when a pred that continued its file that way
completes, the kernel reserves one entry and computes that pred at once, in room the step
has to spare, while the answer travels to the LIP and the LIP decides. If the pred that
arrives is that one, it takes the work (done, or in progress) and is answered as soon as
it is done; the round trip is hidden behind the forward pass. If it is anything else, or
any other call would change the file, the guess is dropped first: until a pred takes it,
it is not in the file, and nobody sees it. A seeded sampler draws from a fresh generator
per pred, so the guess samples exactly what the pred would; the process is charged for the
work only when a pred uses it.

A decode loop's pred, plain or masked, takes a guess or makes one; one with scores, a tree
or a truncation is not what a guess computed without them would answer, and the pred after
it will carry its own (the scheduler's submit decides). A grammar-constrained loop sends a
mask the guess cannot know: so a guess made after a masked pred keeps its row's logits, and
the pred that takes it samples them with its mask (its own seeded generator, so the token
is the one it would have drawn). A pred that takes a guess brings its own PredSpec: the
guessed one but for the controls; a decode loop's plain pred known by its bytes
(known_preds.py) builds none and keeps the guess's, the same request. A masked pred takes
a guess made after a plain one only while it is not computed yet.

A LIP whose round trip outlasts a step (32 processes sharing two cores with the forward
pass) would still miss every other step: its guess waits, computed, and the next is made
only when its pred comes. So a computed plain guess is itself guessed on, the engine running
up to DEPTH preds ahead of the LIP: each guess of the chain in a reservation stacked on the
one before (fs.reserve_after), computed once the one before is.

The guess table holds one chain per file, its first guess the one the next pred may take.
The scheduler asks it what to compute in spare room, which guess a pred is, and to drop
guesses; a drop rolls the whole chain back, last guess first, when the step that may be
writing its last guess ends. A plain decode loop's chain on the rings or the lifeline is
kept as a stream instead (decode_stream.py), with the same rules of guessing on; anything
but its next pred turns it into such a chain first (`unstream`).
"""

from __future__ import annotations

import asyncio
import operator
import weakref
from collections.abc import Callable

import torch

from kvfs.errors import FSError
from kvfs.fs import FileSystem, Handle, Reservation
from kvfs.inode import Inode
from symphony.decode_stream import DecodeStream, Slot, streams, to_jobs
from symphony.engine.sampler import SamplingParams
from symphony.pred_job import JobState, PredJob, PredSpec
from symphony.process import Process
from symphony.sched_stats import SchedStats
from symphony.step import StepPlan

DEPTH = 2  # guesses per file at most: the LIP may come back a whole step late
BY_VRUNTIME = operator.attrgetter("proc.vruntime", "seq")


class DecodeAhead:
    def __init__(self, fs: FileSystem, stats: SchedStats, *, enabled: bool, eos: set[int],
                 context: int, device: torch.device, seq: Callable[[], int],
                 new_future: Callable[[], asyncio.Future],
                 enqueue: Callable[[PredJob], None], pipelined: bool = False):
        self.fs, self.stats = fs, stats
        self.pipelined = pipelined  # a guess may follow one a step in flight computes
        self.enabled, self.eos, self.context, self.device = enabled, eos, context, device
        self.seq = seq  # the scheduler's arrival numbers, which guesses share
        self.new_future = new_future  # a future of the scheduler's loop
        self.enqueue = enqueue  # into the run queue: a stream's taken slot, as a job
        self.guesses: dict[Inode, PredJob] = {}  # the first of each file's chain
        self.streams: dict[Inode, DecodeStream] = {}  # files whose chain is a stream
        # Chains dropped while the running step computes their last guess, by that guess:
        # rolled back when the step ends.
        self._dropping: dict[PredJob, list[PredJob]] = {}
        # Per open file: (token, file length, sampler) of its last sampled pred.
        self.sampled: weakref.WeakKeyDictionary[Handle, tuple] = weakref.WeakKeyDictionary()
        # Guesses whose token a step in flight samples, by the job that samples it.
        self._unknown: dict[PredJob, PredJob] = {}

    def follows(self, handle: Handle, spec: PredSpec) -> bool:
        """Whether a pred feeds back its file's last sample, next in line (a decode loop)."""
        inode, tokens = handle.inode, spec.tokens
        return (self.sampled.get(handle) == (tokens[0], inode.length, spec.params)
                and spec.rows == [0] and len(tokens) == 1
                and spec.positions in (None, [inode.positions[-1] + 1]))

    def match(self, handle: Handle, spec: PredSpec) -> PredJob | None:
        """The guess on the file if this pred is the one it guessed (its controls aside)."""
        guess = self.guesses.get(handle.inode)
        if guess is None or guess.handle is not handle:
            return None
        guessed = guess.spec
        if (guessed.tokens == spec.tokens and spec.rows == guessed.rows
                and spec.positions in (None, guess.positions)
                and (spec.params is guessed.params or spec.params == guessed.params)):
            return guess
        return None

    def decode_guess(self, handle: Handle, token: int, params: SamplingParams) -> PredJob | None:
        """The guess on the file if a plain decode pred of `token` sampled with `params` is
        the one it guessed (a guess is one token at the next position, sampled at it)."""
        guess = self.guesses.get(handle.inode)
        if guess is None or guess.handle is not handle:
            return None
        guessed = guess.spec
        if guessed.tokens[0] == token and (guessed.params is params or guessed.params == params):
            return guess
        return None

    def take(self, guess: PredJob) -> bool:
        """Its pred arrived: the guess leaves the table, and the pred owns the work; the
        guess after it, if any, is the file's first. Whether a new guess was made."""
        inode, following = guess.handle.inode, guess.following
        if following is None:
            del self.guesses[inode]
        else:
            self.guesses[inode], guess.following = following, None
        guess.state = JobState.ADMITTED
        self.stats.ahead_used += 1
        if following is None:
            return False
        while following.following is not None:  # to the chain's last
            following = following.following
        return self._go_on(following)

    def answered(self, job: PredJob, file_queued: bool) -> bool:
        """A pred was committed: remember what it sampled for its file's next pred, and
        guess that pred, the one its LIP will most likely send next. `file_queued`: another
        pred on the file waits already (it goes first). Whether a guess was made."""
        if not job.samples_last:
            return False
        handle, inode, token = job.handle, job.handle.inode, job.outputs[-1].token
        self.sampled[handle] = (token, inode.length, job.spec.params)
        if not (self.enabled and job.follows):
            return False
        position = job.positions[-1] + 1
        if (token in self.eos or position >= self.context or not job.proc.alive
                or handle.closed or inode.busy or inode in self.guesses or file_queued):
            return False
        try:
            res = self.fs.reserve(handle, 1)
        except FSError:  # no room: guessing must never cost anyone a page
            return False
        spec = job.spec
        if streams(spec.params, job.reply, spec.controls):
            stream = self.streams[inode] = DecodeStream(job.proc, handle, spec.params)
            self.stats.ahead += 1
            stream.slots.append(Slot(stream, res, position, token, None, self.seq()))
            return True
        self.guesses[inode] = self._guess(job, res, keep_logits=spec.controls is not None)
        return True

    def stream_of(self, handle: Handle, token: int, params: SamplingParams
                  ) -> DecodeStream | None:
        """The file's stream if a plain decode pred of `token` sampled with `params` is its
        first slot's, which no pred took yet."""
        stream = self.streams.get(handle.inode)
        if (stream is None or stream.handle is not handle or stream.reply is not None
                or stream.slots[0].token != token):
            return None
        if stream.params is params or stream.params == params:
            return stream
        return None

    def take_slot(self, stream: DecodeStream) -> bool:
        """A pred took the stream's first slot: guess on from its last, the stream having
        one guess less. Whether a guess was made."""
        self.stats.ahead_used += 1
        return len(stream.slots) > 1 and self._stream_on(stream.slots[-1])

    def slot_planned(self, slot: Slot) -> bool:
        """A step in flight computes the slot (pipelined): guess on from it, unless a pred
        took it (as a guess job taken is planned as a pred: its answer guesses on). Whether
        a guess was made."""
        stream = slot.stream
        if stream.reply is not None and stream.slots[0] is slot:
            return False
        return self._stream_on(slot)

    def slot_computed(self, slot: Slot) -> bool:
        """No pred took the slot its step computed: guess on from it. Whether a guess was
        made."""
        return self._stream_on(slot)

    def slot_answered(self, stream: DecodeStream, slot: Slot) -> bool:
        """The stream's taken slot was committed and its pred answered: remember what it
        sampled, and, when it was the stream's last, guess the next pred (the stream ends
        when none can be). Whether a guess was made."""
        handle, inode, token = stream.handle, stream.handle.inode, slot.output.token
        self.sampled[handle] = (token, inode.length, stream.params)
        if stream.slots:
            return False
        position = slot.position + 1
        if not (token in self.eos or position >= self.context or not stream.proc.alive
                or handle.closed or inode.busy):
            try:
                res = self.fs.reserve(handle, 1)
            except FSError:
                pass
            else:
                self.stats.ahead += 1
                stream.slots.append(Slot(stream, res, position, token, None, self.seq()))
                return True
        del self.streams[inode]
        return False

    def _stream_on(self, slot: Slot) -> bool:
        """_go_on for a stream: from its last slot, planned or computed, while it has fewer
        than DEPTH guesses."""
        stream = slot.stream
        if stream.slots[-1] is not slot:
            return False
        output = slot.output
        if (not (slot.planned if self.pipelined else output is not None)
                or stream.guessed >= DEPTH or not stream.proc.alive or stream.handle.closed
                or (output is not None and output.token in self.eos)
                or slot.position + 1 >= self.context):
            return False
        try:
            res = self.fs.reserve_after(slot.res, 1)
        except FSError:  # no room, or the file's pages moved: no guessing then
            return False
        self.stats.ahead += 1
        if output is None:  # its token is the one the step in flight samples
            stream.slots.append(Slot(stream, res, slot.position + 1, -1, slot, self.seq()))
        else:
            stream.slots.append(Slot(stream, res, slot.position + 1, output.token, None,
                                     self.seq()))
        return True

    def unstream(self, stream: DecodeStream) -> PredJob | None:
        """Turn the stream into a chain of guess PredJobs (decode_stream.to_jobs); the
        PredJob of the pred that took its first slot, if one did, for the run queue."""
        if self.streams.get(stream.handle.inode) is not stream:
            return None
        del self.streams[stream.handle.inode]
        taken = stream.reply is not None
        jobs = to_jobs(stream, self.new_future)
        for job in jobs:
            if job.after is not None:
                self._unknown[job.after] = job
        first = jobs.pop(0) if taken else None
        if jobs:
            self.guesses[jobs[0].handle.inode] = jobs[0]
        if first is not None:
            self.enqueue(first)
        return first

    def unstream_process(self, proc: Process) -> None:
        for stream in [s for s in self.streams.values() if s.proc is proc]:
            self.unstream(stream)

    def taken_streams(self) -> list[DecodeStream]:
        """Streams whose first slot a pred took: preds, as those in the run queue."""
        return [s for s in self.streams.values() if s.reply is not None]

    def _go_on(self, guess: PredJob) -> bool:
        """After a guess was planned, computed or its chain's first taken: guess on from the
        chain's last guess, planned or computed, while the chain is shorter than DEPTH. Not
        after a masked pred (the next token is the mask's to choose), an end of sequence,
        or the context's end. Whether a guess was made."""
        if guess.following is not None:  # not its chain's last (a computed guess, mostly)
            return False
        last, length = self.guesses.get(guess.handle.inode), 1  # the chain's last, its length
        if last is None:
            return False
        while last.following is not None:
            last, length = last.following, length + 1
        ready = guess.planned if self.pipelined else guess.done
        if (last is not guess or not ready or length >= DEPTH
                or guess.keep_logits or not guess.proc.alive or guess.handle.closed
                or (guess.done and guess.outputs[-1].token in self.eos)
                or guess.positions[-1] + 1 >= self.context):
            return False
        try:
            res = self.fs.reserve_after(guess.res, 1)
        except FSError:  # no room, or the file's pages moved: no guessing then
            return False
        guess.following = self._guess(guess, res, keep_logits=False)
        return True

    def _guess(self, after: PredJob, res: Reservation, keep_logits: bool) -> PredJob:
        """The guess of the pred that feeds back `after`'s sample, in `res`. While a step in
        flight computes `after`, the token is unknown (-1, which no pred sends): the step
        that computes the guess takes it from the engine (StepPlan.placeholders)."""
        self.stats.ahead += 1
        params = after.spec.params
        token = after.outputs[-1].token if after.done else -1
        spec = PredSpec([token], [after.positions[-1] + 1], [0], params)
        guess = PredJob(after.proc, after.handle, spec, params.generator(self.device),
                        self.new_future(), self.seq(),
                        positions=spec.positions, state=JobState.AHEAD, res=res, follows=True,
                        keep_logits=keep_logits)
        if not after.done:
            guess.after = after
            self._unknown[after] = guess
        return guess

    def planned(self, guess: PredJob) -> bool:
        """A step in flight computes the guess (pipelined): guess on from it. Whether a
        guess was made."""
        return self._go_on(guess)

    def waiting_tokens(self) -> bool:
        """Whether some guess waits for the token of a job a step in flight computes."""
        return bool(self._unknown)

    def sampled_token(self, job: PredJob, token: int) -> None:
        """A step sampled `token` for job: the guess made on it while it was in flight, if
        any, learns its token."""
        guess = self._unknown.pop(job, None)
        if guess is not None:  # a guess's spec has these four fields alone (_guess)
            spec = guess.spec
            guess.spec = PredSpec([token], spec.positions, spec.rows, spec.params)
            guess.after = None

    @staticmethod
    def _chain(first: PredJob) -> list[PredJob]:
        chain = [first]
        while chain[-1].following is not None:
            chain.append(chain[-1].following)
        return chain

    def to_compute(self, slots: int, running: list[StepPlan]) -> list[PredJob | Slot]:
        """Up to `slots` guesses not yet planned (the last of their chains or streams),
        lowest virtual runtime first. One whose token is unknown only if the step in
        flight, the one this step follows, samples it."""
        before = running[-1] if running else None
        sampled_next = before.jobs if before is not None else frozenset()  # what it computes
        waiting: list[PredJob | Slot] = []
        for last in self.guesses.values():  # every file, every step: walked, not listed
            while last.following is not None:
                last = last.following
            if not last.planned and (last.after is None or last.after in sampled_next):
                waiting.append(last)
        for stream in self.streams.values():
            last = stream.slots[-1]
            if (not last.planned and (last.after is None or last.after.plan is before)
                    and (stream.reply is None or len(stream.slots) > 1)):
                waiting.append(last)
        waiting.sort(key=BY_VRUNTIME)
        return waiting[:max(0, slots)]

    def drop(self, inode: Inode, running: list[StepPlan]) -> PredJob | None:
        """Forget the guesses on inode. When steps in flight compute some of them, the
        chain is rolled back when the last such step ends: the guess it computes is
        returned, so that a caller can wait for that."""
        stream = self.streams.get(inode)
        if stream is not None:
            self.unstream(stream)
        first = self.guesses.pop(inode, None)
        if first is None:
            return None
        chain = self._chain(first)
        for guess in chain:
            guess.state = JobState.DROPPED
        return self._release_after_steps(chain, running)

    def _release_after_steps(self, chain: list[PredJob], running: list[StepPlan]
                             ) -> PredJob | None:
        """Roll a dropped chain back now, or, when steps in flight compute some of it, when
        the last of those ends (the guess returned ends it)."""
        for plan in reversed(running):
            computed = [g for g in chain if plan.computes(g)]
            if computed:
                self._dropping[computed[-1]] = chain
                return computed[-1]
        self._release(chain)
        return None

    def dropping(self, inode: Inode) -> bool:
        """Whether a dropped chain on inode waits for a step in flight to be rolled back."""
        return any(chain[0].handle.inode is inode for chain in self._dropping.values())

    def roll_back_with(self, job: PredJob) -> bool:
        """A pred on whose reservation a dropped chain waiting for a step in flight is
        stacked failed: it is rolled back after the chain. Whether there was one."""
        for chain in self._dropping.values():
            if chain[0].handle.inode is job.handle.inode:
                chain.insert(0, job)
                return True
        return False

    def drop_all(self, running: list[StepPlan]) -> bool:
        """Every guess gives its pages back (those in the running step when it ends).
        Whether there were any."""
        for stream in list(self.streams.values()):
            self.unstream(stream)
        inodes = list(self.guesses)
        for inode in inodes:
            self.drop(inode, running)
        return bool(inodes)

    def drop_process(self, proc: Process, running: list[StepPlan]) -> None:
        self.unstream_process(proc)
        for inode in [i for i, j in self.guesses.items() if j.proc is proc]:
            self.drop(inode, running)

    def computed(self, guess: PredJob, done: int, seconds: float) -> bool:
        """The step computing a guess ended: it waits for its pred, guessed on, or, dropped
        meanwhile, is rolled back now with its chain. Whether a new guess was made."""
        if guess.state is JobState.DROPPED:  # rolled back when its chain's last step ends
            chain = self._dropping.pop(guess, None)
            if chain is not None:
                self._release(chain)
            return False
        guess.done, guess.seconds = done, seconds
        return self._go_on(guess)

    def lost(self, guess: PredJob, running: list[StepPlan]) -> None:
        """The step computing a guess failed: its chain is rolled back (when the steps still
        in flight that compute some of it end)."""
        chain = self._dropping.pop(guess, None)
        if chain is None:
            if guess.state is JobState.DROPPED:
                return  # the chain waits for a later step computing another of its guesses
            chain = self._chain(self.guesses.pop(guess.handle.inode))
        for g in chain:
            g.state = JobState.DROPPED
        self._release_after_steps(chain, running)

    def _release(self, chain: list[PredJob]) -> None:
        """Roll a chain back, last guess first (its reservations are stacked)."""
        for guess in reversed(chain):
            self.fs.rollback(guess.res)
            guess.res, guess.following = None, None
            if guess.after is not None:
                self._unknown.pop(guess.after, None)
                guess.after = None

    def procs(self) -> set[Process]:
        """Processes with a guess: its work fills a step already."""
        return ({j.proc for j in self.guesses.values()}
                | {s.proc for s in self.streams.values() if s.guessed})
