"""What crosses between the kernel and its engine process (symphony/step_wire.py): plain
steps as fixed-layout bytes, anything else pickled."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from symphony.engine.engine import Batch, TreeRows
from symphony.engine.sampler import RowControl, SamplingParams
from symphony.step import StepResult, StepWork
from symphony.step_wire import (
    PARAM_FLOATS,
    PARAM_INTS,
    RESULT,
    WORK,
    dumps,
    loads,
    pickle_dumps,
)


def test_kept_logit_rows_cross_as_their_own_rows_not_the_steps_logits():
    logits = torch.randn(32, 4096)
    kept = {row: logits[row] for row in range(32)}  # views, as forward() keeps them
    data = pickle_dumps(kept)
    assert len(data) < 33 * 4096 * 4  # torch's own pickling: 32 times the whole matrix
    back = pickle.loads(data)
    assert back.keys() == kept.keys()
    assert all(torch.equal(back[row], kept[row]) for row in kept)


def test_masks_generators_and_other_tensors_come_back_equal():
    gen = torch.Generator().manual_seed(7)
    torch.rand(3, generator=gen)
    message = {"mask": torch.tensor([5, -1], dtype=torch.int32), "gen": gen,
               "bf16": torch.ones(2, dtype=torch.bfloat16), "flag": torch.tensor([True])}
    back = pickle.loads(pickle_dumps(message))
    assert back["mask"].dtype == torch.int32 and back["mask"].tolist() == [5, -1]
    assert torch.equal(back["gen"].get_state(), gen.get_state())
    assert back["bf16"].dtype == torch.bfloat16 and back["bf16"].tolist() == [1.0, 1.0]
    assert back["flag"].tolist() == [True]


GREEDY = SamplingParams()
NUCLEUS = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, top_logprobs=3)


def work(samplers: list[SamplingParams], **changes) -> StepWork:
    """Two sequences: a 3-token prefill chunk over 2 pages with an excluded range, and a
    decode whose token the step before samples (a placeholder)."""
    batch = Batch([11, 12, 13, 0], [0, 1, 2, 40], [3, 1], [3, 41], [[7, 9], [2, 3, 4]], [2, 3],
                  [[(0, 1)], []])
    fields = {"batch": batch, "params": samplers, "generators": [None] * len(samplers),
              "controls": None, "kept": [], "placeholders": [(3, 1)], **changes}
    return StepWork(**fields)


def test_a_plain_step_crosses_as_numbers_and_comes_back_equal():
    step = work([GREEDY, NUCLEUS])
    data = dumps((step, []))
    assert data[0] == WORK and len(data) < len(pickle_dumps((step, [])))
    back, dirty = loads(data)
    assert back == step and dirty == []
    assert back.batch.excluded[0][0] == (0, 1)  # ranges as tuples, as kvfs keeps them


def test_rows_that_share_a_sampler_share_one_object_on_arrival():
    back, _ = loads(dumps((work([NUCLEUS, SamplingParams(**dataclasses.asdict(NUCLEUS))]), [])))
    assert back.params[0] is back.params[1] and back.params[0] == NUCLEUS


def test_every_sampler_field_is_sent():
    # A field added to SamplingParams and not to the layout would arrive as its default.
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert names == {*PARAM_INTS, *PARAM_FLOATS, "seed"}


@pytest.mark.parametrize("changes", [
    {"controls": [None, RowControl(bias_ids=[1], bias_values=[2.0])]},
    {"kept": [1]},
    {"generators": [None, torch.Generator().manual_seed(3)]},
    {"params": [GREEDY, SamplingParams(seed=5)]},
    {"batch": Batch([1, 2], [0, 1], [2], [2], [[0]], [1], [[]],
                    trees=[TreeRows(0, np.zeros((2, 1), np.int32))])},
])
def test_anything_else_is_pickled_and_comes_back(changes):
    step = work([GREEDY, NUCLEUS], **changes)
    data = dumps((step, []))
    assert data[0] == pickle.PROTO[0]
    back, _ = loads(data)
    assert back.params == step.params and back.kept == step.kept
    assert back.batch.token_ids == step.batch.token_ids


def test_dirty_rows_of_a_tensor_parallel_engine_are_pickled():
    assert dumps((work([GREEDY, GREEDY]), [5, 6]))[0] == pickle.PROTO[0]


def test_a_plain_result_comes_back_exactly():
    top_ids = np.array([[5, 1, 2], [9, 8, 7]], dtype=np.int64)
    top_logprobs = np.array([[-0.1, -2.5, -3.25], [-0.5, -1.0, -7.0]], dtype=np.float32)
    result = StepResult([5, 9], [-0.10000000149011612, -0.5], top_ids, top_logprobs, 0.0071,
                        generators=[None, None])
    data = dumps(("done", result))
    assert data[0] == RESULT
    kind, back = loads(data)
    assert kind == "done" and back.tokens == [5, 9] and back.seconds == 0.0071
    assert back.logprobs == result.logprobs  # float64 on the wire: the float32s exact
    assert back.top_ids.dtype == np.int64 and np.array_equal(back.top_ids, top_ids)
    assert back.top_logprobs.dtype == np.float32
    assert np.array_equal(back.top_logprobs, top_logprobs)
    assert back.generators == [None, None] and back.kept == {} and back.scores is None


def test_a_result_without_top_logprobs_has_empty_rows():
    result = StepResult([3], [-1.5], np.zeros((1, 0), np.int64), np.zeros((1, 0), np.float32),
                        0.5, generators=[None])
    _, back = loads(dumps(("done", result)))
    assert list(back.top_ids[0][:0]) == [] and len(back.top_logprobs[0]) == 0
    assert back.tokens == [3] and back.logprobs == [-1.5]
    _, empty = loads(dumps(("done", StepResult([], [], [], []))))
    assert empty.tokens == [] and empty.generators == []


def test_results_with_more_are_pickled():
    scored = StepResult([3], [-1.5], [[]], [[]], scores=[[-0.5]], generators=[None])
    kept = StepResult([3], [-1.5], [[]], [[]], kept={0: torch.zeros(4)}, generators=[None])
    for result in (scored, kept):
        data = dumps(("done", result))
        assert data[0] == pickle.PROTO[0] and loads(data)[1].tokens == [3]
    assert loads(dumps(("error", ValueError("x"))))[0] == "error"


ints = st.integers(0, 2**40)


@st.composite
def plain_works(draw) -> StepWork:
    seqs = draw(st.integers(0, 5))
    q_lens = [draw(st.integers(1, 4)) for _ in range(seqs)]
    tokens = sum(q_lens)
    rows = draw(st.lists(st.integers(0, max(tokens - 1, 0)), max_size=tokens if tokens else 0))
    excluded = draw(st.none() | st.just([draw(st.lists(st.tuples(ints, ints), max_size=3))
                                         for _ in range(seqs)]))
    params = [SamplingParams(draw(st.floats(0, 4)), draw(st.integers(0, 100)),
                             draw(st.floats(0.01, 1)), draw(st.floats(0, 1)),
                             top_logprobs=draw(st.integers(0, 20))) for _ in rows]
    batch = Batch(draw(st.lists(ints, min_size=tokens, max_size=tokens)),
                  draw(st.lists(ints, min_size=tokens, max_size=tokens)), q_lens,
                  draw(st.lists(ints, min_size=seqs, max_size=seqs)),
                  [draw(st.lists(ints, max_size=6)) for _ in range(seqs)], rows, excluded)
    spots = draw(st.lists(st.tuples(ints, ints), max_size=3))
    return StepWork(batch, params, [None] * len(rows), None, [], spots)


@given(plain_works())
def test_any_plain_step_comes_back_equal(step):
    data = dumps((step, []))
    assert data[0] == WORK
    assert loads(data) == (step, [])
