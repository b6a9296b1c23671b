"""One engine step as plain data: what the scheduler plans (StepPlan), what the engine
process is sent of it (StepWork), what the forward pass and the sampler give back
(StepResult), and the function that turns the work into the result in the engine process."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from symphony.engine.engine import Batch, Engine, TreeRows
from symphony.engine.sampler import RowControl, Samples, SamplingParams, sample
from symphony.pred_job import JobState, PredJob

if TYPE_CHECKING:
    from symphony.decode_stream import Slot
    from symphony.process import Process


class Chunk(NamedTuple):
    """Tokens [start, end) of a job's tokens, computed in this step. A named tuple: a
    step makes one a pred, and a frozen dataclass sets each field through
    object.__setattr__."""

    job: PredJob
    start: int
    size: int

    @property
    def end(self) -> int:
        return self.start + self.size


@dataclass
class StepPlan:
    chunks: list[Chunk]
    batch: Batch
    samples: list[tuple[PredJob, int]]  # per logit row of the chunks: its job, and its row
    controls: list[RowControl | None] | None = None  # per logit row; None: no control at all
    # Logit rows of guesses a masked pred may take: their logits are kept, to be sampled
    # again with the pred's controls (decode_ahead.py).
    kept: list[int] = field(default_factory=list)
    # (index in the batch's tokens, logit row of the step before): tokens the step before
    # samples, planned while it ran (scheduler.py, pipelined steps).
    placeholders: list[tuple[int, int]] = field(default_factory=list)
    # Slots of decode streams (decode_stream.py), a row each after the chunks' rows: their
    # logit rows follow the samples'. A stream turned into jobs meanwhile adds its slots'
    # jobs to `chunks` (the slot keeps its job), so `tokens` and `seqs` are counted once.
    streamed: list[Slot] = field(default_factory=list)
    # Per slot, how many of the chunks were picked before it: finish() goes in that order.
    streamed_at: list[int] = field(default_factory=list)
    picked: int = 0  # chunks picked (those after are slots' jobs added since)
    tokens: int = 0  # computed in the step
    seqs: int = 0  # sequences in its batch
    served: list[Process] = field(default_factory=list)  # whose stream preds it answered
    # computes() is asked of every guess as each step is planned: a set, not a scan.
    jobs: frozenset[PredJob] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.jobs = frozenset([c.job for c in self.chunks])

    @classmethod
    def build(cls, picked: list[Chunk | Slot]) -> StepPlan:
        """The step of the work picked, in that order: chunks' rows first, then slots'."""
        ids, pos, q_lens, kv_lens, tables, rows, excluded = [], [], [], [], [], [], []
        samples, kept, placeholders = [], [], []
        chunks, streamed, streamed_at = [], [], []
        for work in picked:
            if type(work) is Chunk:
                chunks.append(work)
            else:
                streamed.append(work)
                streamed_at.append(len(chunks))
        treed = controlled = False  # only a step with a tree or a control pays for them
        tokens = 0
        for job, start, size in chunks:
            end, spec, res = start + size, job.spec, job.res
            treed = treed or spec.tree is not None
            controlled = controlled or spec.controls is not None
            base = len(ids)
            ids += spec.tokens[start:end]
            if job.after is not None:  # a guess on a guess the step before samples
                placeholders.append((base, job.after.logit_row))
                ids[base] = 0
            pos += job.positions[start:end]
            q_lens.append(size)
            kv_lens.append(res.start + end)
            tables.append(res.page_table)
            excluded.append(res.excluded)
            tokens += size
            for r in spec.rows:
                if start <= r < end:
                    rows.append(base + r - start)
                    if job.keep_logits and job.state is JobState.AHEAD:
                        kept.append(len(samples))
                    job.logit_row = len(samples)
                    samples.append((job, r))
        row = len(samples)
        for slot in streamed:  # one token each, sampled
            res = slot.res
            if slot.after is not None:  # its token is the slot before's, sampled in flight
                placeholders.append((len(ids), slot.after.logit_row))
                ids.append(0)
            else:
                ids.append(slot.token)
            rows.append(len(pos))
            pos.append(slot.position)
            kv_lens.append(res.start + 1)
            tables.append(res.page_table)
            excluded.append(res.excluded)
            slot.logit_row = row
            row += 1
        q_lens += [1] * len(streamed)
        trees = controls = None
        if treed:
            trees = [None if c.job.spec.tree is None
                     else TreeRows(c.job.res.start, c.job.spec.tree[c.start:c.end])
                     for c in chunks] + [None] * len(streamed)
        if controlled:
            controls = [None if s.controls is None else s.controls[i]
                        for c in chunks for s in (c.job.spec,)
                        for i, r in enumerate(s.rows) if c.start <= r < c.end]
            controls += [None] * len(streamed)
        return cls(chunks, Batch(ids, pos, q_lens, kv_lens, tables, rows, excluded, trees=trees),
                   samples, controls, kept, placeholders, streamed, streamed_at, len(chunks),
                   tokens + len(streamed), len(chunks) + len(streamed))

    @property
    def work(self) -> StepWork:
        """What the engine process computes: the batch and its rows' sampling, no jobs."""
        params = [job.spec.params for job, _ in self.samples]
        generators = [job.generator for job, _ in self.samples]
        if self.streamed:  # unseeded (decode_stream.streams)
            params += [slot.stream.params for slot in self.streamed]
            generators += [None] * len(self.streamed)
        return StepWork(self.batch, params, generators, self.controls, self.kept,
                        self.placeholders)

    def in_order(self) -> Iterator[Chunk | Slot]:
        """The work as it was picked; a slot whose stream was turned into jobs since, as its
        job's chunk."""
        at, k = self.streamed_at, 0
        for i in range(self.picked + 1):
            while k < len(at) and at[k] == i:
                slot = self.streamed[k]
                yield slot if slot.job is None else Chunk(slot.job, 0, 1)
                k += 1
            if i < self.picked:
                yield self.chunks[i]

    @property
    def rows(self) -> int:
        """Logit rows: the chunks' samples, then a row a slot."""
        return len(self.samples) + len(self.streamed)

    def computes(self, job: PredJob) -> bool:
        return job in self.jobs


@dataclass
class StepWork:
    """A plan as the engine process takes it: plain data that pickles. Per logit row: its
    sampler, its seeded generator (None: unseeded), its control."""

    batch: Batch
    params: list[SamplingParams]
    generators: list[torch.Generator | None]
    controls: list[RowControl | None] | None
    kept: list[int]
    placeholders: list[tuple[int, int]] = field(default_factory=list)  # as StepPlan's


def fill_placeholders(work: StepWork, sampled: list[int] | None) -> None:
    """In the engine process, before the step: its placeholders take the tokens the step
    before sampled (`sampled`; None: that step failed, and so does this one)."""
    if not work.placeholders:
        return
    if sampled is None:
        raise ValueError("a step planned on the samples of the step before, which failed")
    ids = work.batch.token_ids
    for at, row in work.placeholders:
        ids[at] = sampled[row]


@dataclass
class StepResult:
    """Per logit row of the plan's batch, in order: the sampled token, its logprob, and the
    top ids and logprobs (as many as the batch's largest top_logprobs). With controls: the
    model's own logprobs of the tokens (set when some row has a mask or a bias), and the
    scores at each row's score_ids (padded to the longest)."""

    tokens: list[int]
    logprobs: list[float]
    top_ids: np.ndarray | list[list[int]]  # [rows, n]: arrays from the engine
    top_logprobs: np.ndarray | list[list[float]]
    seconds: float = 0.0  # the step's time, shared out by tokens computed
    model_logprobs: list[float] | None = None
    scores: list[list[float]] | None = None
    kept: dict[int, torch.Tensor] = field(default_factory=dict)  # plan.kept's logits, by row
    # The work's generators after sampling: the engine process drew from copies of them.
    generators: list[torch.Generator | None] = field(default_factory=list)


def _result(s: Samples) -> StepResult:
    # The top logprobs as arrays: thousands a row pickle and reach the reply as bytes
    # (symphony/top_wire.py), where lists of Python numbers took seconds.
    return StepResult(s.tokens.tolist(), s.logprobs.tolist(), s.top_ids.cpu().numpy(),
                      s.top_logprobs.cpu().numpy(),
                      model_logprobs=None if s.model_logprobs is None
                      else s.model_logprobs.tolist(),
                      scores=None if s.scores is None else s.scores.tolist())


def forward(engine: Engine, work: StepWork) -> StepResult:
    """In the engine process: the forward pass and the sampling of its logit rows."""
    logits = engine.forward(work.batch)
    if not work.params:
        return StepResult([], [], [], [])
    result = _result(sample(logits, work.params, work.generators, work.controls))
    if work.kept:
        result.kept = dict(zip(work.kept, logits[work.kept].float(), strict=True))
    result.generators = work.generators
    return result


def resample(jobs: list[PredJob], logits: list[torch.Tensor]) -> StepResult:
    """Kept logit rows sampled again, one per job, with the controls of the pred that took
    the job's guess and the fresh generator that pred would have had: in one batch, as a
    step's rows are."""
    specs = [j.spec for j in jobs]
    return _result(sample(torch.stack(logits), [s.params for s in specs],
                          [s.params.generator(logits[0].device) for s in specs],
                          [s.controls[0] for s in specs]))
