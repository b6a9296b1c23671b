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
is the one it would have drawn). A masked pred takes a guess made after a plain one only
while it is not computed yet.

The guess table holds at most one guess per file. The scheduler asks it what to compute
in spare room, which guess a pred is, and to drop guesses; a guess in the running step
is rolled back when the step ends.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable

import torch

from kvfs.errors import FSError
from kvfs.fs import FileSystem, Handle
from kvfs.inode import Inode
from symphony.engine.sampler import SamplingParams
from symphony.pred_job import JobState, PredJob
from symphony.process import Process
from symphony.sched_stats import SchedStats
from symphony.step import StepPlan


class DecodeAhead:
    def __init__(self, fs: FileSystem, stats: SchedStats, *, enabled: bool, eos: set[int],
                 context: int, device: torch.device, seq: Callable[[], int]):
        self.fs, self.stats = fs, stats
        self.enabled, self.eos, self.context, self.device = enabled, eos, context, device
        self.seq = seq  # the scheduler's arrival numbers, which guesses share
        self.guesses: dict[Inode, PredJob] = {}
        # Per open file: (token, file length, sampler) of its last sampled pred.
        self.sampled: weakref.WeakKeyDictionary[Handle, tuple] = weakref.WeakKeyDictionary()

    def answered(self, job: PredJob) -> None:
        """A pred was committed: remember what it sampled for its file's next pred."""
        if job.samples_last:
            self.sampled[job.handle] = (job.outputs[-1].token, job.handle.inode.length,
                                        job.params)

    def follows(self, handle: Handle, tokens: list[int], positions: list[int] | None,
                rows: list[int], params: SamplingParams) -> bool:
        """Whether a pred feeds back its file's last sample, next in line (a decode loop)."""
        inode = handle.inode
        return (self.sampled.get(handle) == (tokens[0], inode.length, params)
                and rows == [0] and len(tokens) == 1
                and positions in (None, [inode.positions[-1] + 1]))

    def match(self, handle: Handle, tokens: list[int], positions: list[int] | None,
              rows: list[int], params: SamplingParams) -> PredJob | None:
        """The guess on the file if this pred is the one it guessed."""
        guess = self.guesses.get(handle.inode)
        if (guess is not None and guess.handle is handle and guess.tokens == tokens
                and rows == guess.rows and positions in (None, guess.positions)
                and params == guess.params):
            return guess
        return None

    def take(self, guess: PredJob) -> None:
        """Its pred arrived: the guess leaves the table, and the pred owns the work."""
        del self.guesses[guess.handle.inode]
        guess.state = JobState.ADMITTED
        self.stats.ahead_used += 1

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
        self.guesses[inode] = PredJob(
            job.proc, handle, [token], [position], [0], job.params,
            job.params.generator(self.device), asyncio.get_running_loop().create_future(),
            self.seq(), state=JobState.AHEAD, res=res, follows=True,
            keep_logits=job.controls is not None)
        self.stats.ahead += 1
        return True

    def to_compute(self, slots: int) -> list[PredJob]:
        """Up to `slots` guesses not yet computed, lowest virtual runtime first."""
        waiting = sorted((j for j in self.guesses.values() if not j.done),
                         key=lambda j: (j.proc.vruntime, j.seq))
        return waiting[:max(0, slots)]

    def drop(self, inode: Inode, running: StepPlan | None) -> PredJob | None:
        """Forget the guess on inode. One the running step computes is rolled back when the
        step ends: returned, so that a caller can wait for that."""
        guess = self.guesses.pop(inode, None)
        if guess is None:
            return None
        guess.state = JobState.DROPPED
        if running is not None and running.computes(guess):
            return guess
        self._release(guess)
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

    def computed(self, guess: PredJob, done: int, seconds: float) -> None:
        """The step computing a guess ended: it waits for its pred, or, dropped meanwhile,
        is rolled back now."""
        if guess.state is JobState.DROPPED:
            self._release(guess)
        else:
            guess.done, guess.seconds = done, seconds

    def lost(self, guess: PredJob) -> None:
        """The step computing a guess failed."""
        self.guesses.pop(guess.handle.inode, None)
        guess.state = JobState.DROPPED
        self._release(guess)

    def _release(self, guess: PredJob) -> None:
        self.fs.rollback(guess.res)
        guess.res = None

    def procs(self) -> set[Process]:
        """Processes with a guess: its work fills a step already."""
        return {j.proc for j in self.guesses.values()}
