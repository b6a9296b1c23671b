"""What crosses between the kernel and its engine process (symphony/engine_process.py)."""

from __future__ import annotations

import pickle

import torch

from symphony.engine_process import dumps


def test_kept_logit_rows_cross_as_their_own_rows_not_the_steps_logits():
    logits = torch.randn(32, 4096)
    kept = {row: logits[row] for row in range(32)}  # views, as forward() keeps them
    data = dumps(kept)
    assert len(data) < 33 * 4096 * 4  # torch's own pickling: 32 times the whole matrix
    back = pickle.loads(data)
    assert back.keys() == kept.keys()
    assert all(torch.equal(back[row], kept[row]) for row in kept)


def test_masks_generators_and_other_tensors_come_back_equal():
    gen = torch.Generator().manual_seed(7)
    torch.rand(3, generator=gen)
    message = {"mask": torch.tensor([5, -1], dtype=torch.int32), "gen": gen,
               "bf16": torch.ones(2, dtype=torch.bfloat16), "flag": torch.tensor([True])}
    back = pickle.loads(dumps(message))
    assert back["mask"].dtype == torch.int32 and back["mask"].tolist() == [5, -1]
    assert torch.equal(back["gen"].get_state(), gen.get_state())
    assert back["bf16"].dtype == torch.bfloat16 and back["bf16"].tolist() == [1.0, 1.0]
    assert back["flag"].tolist() == [True]
