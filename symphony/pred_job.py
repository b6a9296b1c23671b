"""A pred call in the scheduler: what it asked (PredSpec, frozen), the work that answers
it (PredJob), and the one state that says where that stands."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

import numpy as np
import torch

from kvfs.fs import Handle, Reservation
from symphony.engine.sampler import RowControl, SamplingParams
from symphony.process import Process


class JobState(Enum):
    """Where a job stands. The step now running is the scheduler's to know, not the job's:
    a job of any live state but QUEUED may be in it.

    QUEUED -> ADMITTED -> ANSWERED, the usual course; a guess starts AHEAD and becomes
    ADMITTED when its pred takes it. CANCELLED and DROPPED are the states of work given up
    while a step writes it: the step's end rolls it back."""

    QUEUED = "queued"  # in the run queue, no pages reserved yet
    ADMITTED = "admitted"  # in the run queue, its pages reserved; computed chunk by chunk
    AHEAD = "ahead"  # a guess (decoding ahead), its entry reserved; no pred owns it yet
    CANCELLED = "cancelled"  # its caller gave up during a step computing it
    DROPPED = "dropped"  # a guess given up: rolled back, or to be when its step ends
    ANSWERED = "answered"  # committed to its file and answered
    FAILED = "failed"  # rolled back and failed with an error


@dataclass
class Output:
    row: int
    token: int
    logprob: float
    # The row's most likely ids, first the likeliest, and their logprobs: rows of the
    # step's arrays (lists in a step without an engine)
    top_ids: Sequence[int]
    top_logprobs: Sequence[float]
    model_logprob: float | None = None  # of token, the model's own: set for a row with a
    # mask or a bias (without, it is logprob)
    scores: Sequence[float] = ()  # at the row's score_ids, in order
    next_logprob: float | None = None  # score_next: of the pred's next token, tokens[row + 1]


class PredSpec(NamedTuple):
    """What a pred asked, checked once at the syscall (syscall_table.submit_pred) and never
    changed after: the job that does the work holds it (PredJob.spec). A guess's spec is
    the pred it guessed, until the pred that takes it brings its own (a plain decode pred
    known by its bytes keeps the guess's: decode_ahead.py). A named tuple, not a frozen
    dataclass: two are made a decode loop's pred, and a tuple is made in a third of the
    time."""

    tokens: list[int]
    positions: list[int] | None  # None: after the file's last position, read on admission
    rows: list[int]  # rows of `tokens` to sample at, sorted
    params: SamplingParams
    # Per entry of rows (None: no control). With score_next, a row's last score id is its
    # next token, split out as the Output's next_logprob.
    controls: list[RowControl | None] | None = None
    score_next: bool = False
    tree: np.ndarray | None = None  # ancestor bits [len(tokens), W]; None: causal
    depths: list[int] | None = None  # of a tree's tokens: default positions are last + 1 + depth
    cut: int | None = None  # truncate the file to this many entries first (None: append)


# Called once a pred is settled, with its Outputs or the error that failed it (the other
# None): the lifeline's and the rings' answer, with no wait on the job's future.
Reply = Callable[[list[Output] | None, BaseException | None], None]


@dataclass(eq=False)
class PredJob:
    """A pred's progress: its request is `spec`; the rest is where the work stands."""

    proc: Process
    handle: Handle
    spec: PredSpec
    generator: torch.Generator | None
    future: asyncio.Future
    seq: int  # arrival order
    # Where its tokens go: spec.positions, or, when that is None, read on admission.
    positions: list[int] | None = None
    state: JobState = JobState.QUEUED
    enqueued: float = field(default_factory=time.monotonic)
    res: Reservation | None = None  # the room its entries are written into, once admitted
    done: int = 0  # tokens computed so far
    planned: int = 0  # tokens in steps planned so far (done, or in a step in flight)
    logit_row: int = -1  # its last sampled row's index among the logit rows of its step
    outputs: list[Output] = field(default_factory=list)
    follows: bool = False  # its tokens are the sample of its file's last pred, next in line
    seconds: float = 0.0  # accelerator time of work done ahead, charged when a pred takes it
    error: Exception | None = None  # what a CANCELLED job fails with when its step ends
    # A guess made after a masked pred keeps its row's logits (`logits`, once computed): the
    # next pred will carry a mask the guess could not know, and samples them again.
    keep_logits: bool = False
    logits: torch.Tensor | None = None
    # A computed guess's own guess: the pred after the one this guess is (decode_ahead.py).
    following: PredJob | None = None
    # A guess on a guess in a step still in flight: its token is that guess's sample, which
    # the engine process fills in (StepPlan.placeholders) and finish() then learns.
    after: PredJob | None = None
    reply: Reply | None = None  # Scheduler.submit's

    @property
    def remaining(self) -> int:
        return len(self.spec.tokens) - self.done

    @property
    def unplanned(self) -> int:
        """Tokens no step planned yet."""
        return len(self.spec.tokens) - self.planned

    @property
    def samples_last(self) -> bool:
        """Whether it sampled after its last token (what the next pred of a decode loop
        feeds back)."""
        return bool(self.outputs) and self.outputs[-1].row == len(self.spec.tokens) - 1
