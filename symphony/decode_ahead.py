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
guessed one but for the controls. A masked pred takes a guess made after a plain one only
while it is not computed yet.

A LIP whose round trip outlasts a step (32 processes sharing two cores with the forward
pass) would still miss every other step: its guess waits, computed, and the next is made
only when its pred comes. So a computed plain guess is itself guessed on, the engine running
up to DEPTH preds ahead of the LIP: each guess of the chain in a reservation stacked on the
one before (fs.reserve_after), computed once the one before is.

The guess table holds one chain per file, its first guess the one the next pred may take.
The scheduler asks it what to compute in spare room, which guess a pred is, and to drop
guesses; a drop rolls the whole chain back, last guess first, when the step that may be
writing its last guess ends.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable

import torch

from kvfs.errors import FSError
from kvfs.fs import FileSystem, Handle, Reservation
from kvfs.inode import Inode
from symphony.pred_job import JobState, PredJob, PredSpec
from symphony.process import Process
from symphony.sched_stats import SchedStats
from symphony.step import StepPlan

DEPTH = 2  # guesses per file at most: the LIP may come back a whole step late


class DecodeAhead:
    def __init__(self, fs: FileSystem, stats: SchedStats, *, enabled: bool, eos: set[int],
                 context: int, device: torch.device, seq: Callable[[], int]):
        self.fs, self.stats = fs, stats
        self.enabled, self.eos, self.context, self.device = enabled, eos, context, device
        self.seq = seq  # the scheduler's arrival numbers, which guesses share
        self.guesses: dict[Inode, PredJob] = {}  # the first of each file's chain
        # Chains dropped while the running step computes their last guess, by that guess:
        # rolled back when the step ends.
        self._dropping: dict[PredJob, list[PredJob]] = {}
        # Per open file: (token, file length, sampler) of its last sampled pred.
        self.sampled: weakref.WeakKeyDictionary[Handle, tuple] = weakref.WeakKeyDictionary()

    def answered(self, job: PredJob) -> None:
        """A pred was committed: remember what it sampled for its file's next pred."""
        if job.samples_last:
            self.sampled[job.handle] = (job.outputs[-1].token, job.handle.inode.length,
                                        job.spec.params)

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
                and spec.params == guessed.params):
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
        return following is not None and self._go_on(self._chain(following)[-1])

    def go_ahead(self, job: PredJob, file_queued: bool) -> bool:
        """After job was answered: guess the pred its LIP will most likely send next.
        `file_queued`: another pred on the file waits already (it goes first). Whether a
        guess was made."""
        handle, inode = job.handle, job.handle.inode
        if not (self.enabled and job.follows and job.samples_last):
            return False
        token, position = job.outputs[-1].token, job.positions[-1] + 1
        if (token in self.eos or position >= self.context or not job.proc.alive
                or handle.closed or inode.busy or inode in self.guesses or file_queued):
            return False
        try:
            res = self.fs.reserve(handle, 1)
        except FSError:  # no room: guessing must never cost anyone a page
            return False
        self.guesses[inode] = self._guess(job, res, keep_logits=job.spec.controls is not None)
        return True

    def _go_on(self, guess: PredJob) -> bool:
        """After a guess was computed or its chain's first taken: guess on from the chain's
        last, computed guess while the chain is shorter than DEPTH. Not after a masked pred
        (the next token is the mask's to choose), an end of sequence, or the context's end.
        Whether a guess was made."""
        first = self.guesses.get(guess.handle.inode)
        chain = self._chain(first) if first is not None else []
        if (not chain or chain[-1] is not guess or not guess.done or len(chain) >= DEPTH
                or guess.keep_logits or not guess.proc.alive or guess.handle.closed
                or guess.outputs[-1].token in self.eos
                or guess.positions[-1] + 1 >= self.context):
            return False
        try:
            res = self.fs.reserve_after(guess.res, 1)
        except FSError:  # no room, or the file's pages moved: no guessing then
            return False
        guess.following = self._guess(guess, res, keep_logits=False)
        return True

    def _guess(self, after: PredJob, res: Reservation, keep_logits: bool) -> PredJob:
        """The guess of the pred that feeds back `after`'s sample, in `res`."""
        self.stats.ahead += 1
        params = after.spec.params
        spec = PredSpec([after.outputs[-1].token], [after.positions[-1] + 1], [0], params)
        return PredJob(after.proc, after.handle, spec, params.generator(self.device),
                       asyncio.get_running_loop().create_future(), self.seq(),
                       positions=spec.positions, state=JobState.AHEAD, res=res, follows=True,
                       keep_logits=keep_logits)

    @staticmethod
    def _chain(first: PredJob) -> list[PredJob]:
        chain = [first]
        while chain[-1].following is not None:
            chain.append(chain[-1].following)
        return chain

    def to_compute(self, slots: int) -> list[PredJob]:
        """Up to `slots` guesses not yet computed (the last of their chains), lowest virtual
        runtime first."""
        lasts = (self._chain(first)[-1] for first in self.guesses.values())
        waiting = sorted((j for j in lasts if not j.done), key=lambda j: (j.proc.vruntime, j.seq))
        return waiting[:max(0, slots)]

    def drop(self, inode: Inode, running: StepPlan | None) -> PredJob | None:
        """Forget the guesses on inode. When the running step computes the last of them,
        the chain is rolled back when the step ends: that guess is returned, so that a
        caller can wait for that."""
        first = self.guesses.pop(inode, None)
        if first is None:
            return None
        chain = self._chain(first)
        for guess in chain:
            guess.state = JobState.DROPPED
        if running is not None and running.computes(chain[-1]):
            self._dropping[chain[-1]] = chain
            return chain[-1]
        self._release(chain)
        return None

    def drop_all(self, running: StepPlan | None) -> bool:
        """Every guess gives its pages back (those in the running step when it ends).
        Whether there were any."""
        inodes = list(self.guesses)
        for inode in inodes:
            self.drop(inode, running)
        return bool(inodes)

    def drop_process(self, proc: Process, running: StepPlan | None) -> None:
        for inode in [i for i, j in self.guesses.items() if j.proc is proc]:
            self.drop(inode, running)

    def computed(self, guess: PredJob, done: int, seconds: float) -> bool:
        """The step computing a guess ended: it waits for its pred, guessed on, or, dropped
        meanwhile, is rolled back now with its chain. Whether a new guess was made."""
        if guess.state is JobState.DROPPED:
            self._release(self._dropping.pop(guess))
            return False
        guess.done, guess.seconds = done, seconds
        return self._go_on(guess)

    def lost(self, guess: PredJob) -> None:
        """The step computing a guess (its chain's last) failed: the chain is rolled back."""
        chain = self._dropping.pop(guess, None)
        if chain is None:
            chain = self._chain(self.guesses.pop(guess.handle.inode))
        for g in chain:
            g.state = JobState.DROPPED
        self._release(chain)

    def _release(self, chain: list[PredJob]) -> None:
        """Roll a chain back, last guess first (its reservations are stacked)."""
        for guess in reversed(chain):
            self.fs.rollback(guess.res)
            guess.res, guess.following = None, None

    def procs(self) -> set[Process]:
        """Processes with a guess: its work fills a step already."""
        return {j.proc for j in self.guesses.values()}
