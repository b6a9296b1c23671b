"""An engine's settings, worked out once (symphony/engine/settings.py), on the shipped model."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvfs.pool import KVPool
from symphony.engine.config import ModelConfig
from symphony.engine.engine import Engine
from symphony.engine.settings import PAGE_SIZE, EngineSettings

MODEL = Path(os.environ["SYMPHONY_MODEL"])  # the tiny model (conftest.py)


def test_the_defaults_are_filled_in():
    s = EngineSettings.resolve(MODEL, device="cpu")
    assert (s.model_dir, s.device, s.dtype, s.page_size) == (
        MODEL,
        torch.device("cpu"),
        torch.float32,
        PAGE_SIZE,
    )
    assert s.config == ModelConfig.from_file(MODEL / "config.json")
    assert s.eos_ids() == s.tokenizer.eos_ids and s.eos_ids()
    shape = s.page_shape
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.page_size) == (
        s.config.num_layers,
        s.config.num_kv_heads,
        s.config.head_dim,
        PAGE_SIZE,
    )
    assert s.kv_pages(1e-6) >= 1
    with pytest.raises(ValueError, match=r"kv memory fraction must be in \(0, 1\], got 0"):
        s.kv_pages(0)


def test_an_engine_over_a_given_pool_takes_its_page_size():
    settings = EngineSettings.resolve(MODEL, device="cpu", page_size=8)
    pool = KVPool(settings.page_shape, 4)
    engine = Engine(MODEL, device="cpu", pool=pool)
    assert engine.pool is pool and engine.page_size == 8
    assert replace(engine.settings, tokenizer=None) == replace(settings, tokenizer=None)
    assert engine.eos_ids() == settings.eos_ids()
