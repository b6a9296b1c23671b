"""Moving entries: stored keys re-rotated by delta positions, against a prefill computed at
the new positions.

A sequence is prefilled at positions p..p+n-1, its keys rotated by delta in every layer, and
compared with the same tokens prefilled at p+delta... Keys agree within 2 * P * 2**-24 *
max|K|, P the largest position involved: two roundings of an fp32 angle at P, the precision
`cos_sin` itself has (measured: 8e-5 * max|K| at P = 3000 on qwen3, head dim 32; 2e-6 on the
llama3-scaled llama). Values of layer 0 are identical, of later layers within the same bound
(they see positions only through attention, which is relative). The logits of a following
token attending to the moved cache are within the parity tolerance ATOL = 1e-4 (measured:
3.5e-6 at P = 3000).
"""

from __future__ import annotations

import random

import pytest
import torch
from checkpoints import make_checkpoint

from symphony.engine.engine import Batch, Engine
from symphony.engine.rope import Rotary, apply_rotary, rotate_keys

ATOL = 1e-4  # tests/test_engine_parity.py's
N = 37
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


# llama: llama3 rope_scaling, head dim 8 (all three bands); qwen3: plain RoPE, head dim 32.
@pytest.fixture(scope="module", params=["llama", "qwen3"])
def engine(request, tmp_path_factory) -> Engine:
    directory = tmp_path_factory.mktemp(request.param)
    make_checkpoint(directory, request.param)
    return Engine(directory, device="cpu", kv_pages=32, page_size=16)


def prefill(engine: Engine, ids: list[int], positions: list[int]) -> list[int]:
    """The sequence written into shuffled pages, with room for one more token."""
    pages = engine.pool.allocate(8)
    random.Random(positions[0]).shuffle(pages)
    engine.pool.free(pages[3:])
    n = len(ids)
    engine.forward(Batch(ids, positions, [n], [n], [pages[:3]], [n - 1]))
    return pages[:3]


def pool_rows(engine: Engine, pages: list[int], n: int) -> torch.Tensor:
    size = engine.page_size
    return torch.tensor([pages[i // size] * size + i % size for i in range(n)])


def layer_rows(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return cache.view(-1, *cache.shape[2:])[rows]


def close(got: torch.Tensor, want: torch.Tensor, rel: float) -> bool:
    return bool((got - want).abs().max() <= rel * want.abs().max())


@pytest.mark.parametrize("start, delta", [(1000, -993), (40, 2900), (3000, -2600)])
def test_shifted_keys_equal_a_prefill_at_the_new_positions(engine, start, delta):
    ids = torch.randint(0, 320, (N,), generator=torch.Generator().manual_seed(start)).tolist()
    moved = prefill(engine, ids, list(range(start, start + N)))
    bystander = prefill(engine, ids, list(range(N)))  # rows that must not move
    rows, other = pool_rows(engine, moved, N), pool_rows(engine, bystander, N)
    untouched = [layer_rows(k, other).clone() for k in engine.pool.k]
    for k in engine.pool.k:
        rotate_keys(k, rows, delta, engine.model.rotary)
    fresh = prefill(engine, ids, list(range(start + delta, start + delta + N)))
    want = pool_rows(engine, fresh, N)
    # Two roundings of an fp32 angle at the largest position: what cos_sin resolves there.
    rel = 2 * (max(start, start + delta) + N) * 2**-24
    for layer, (k, v) in enumerate(zip(engine.pool.k, engine.pool.v, strict=True)):
        assert close(layer_rows(k, rows), layer_rows(k, want), rel)
        assert torch.equal(layer_rows(k, other), untouched[layer])
        assert close(layer_rows(v, rows), layer_rows(v, want), 0 if layer == 0 else rel)
    # A following token attends to the moved entries as to the recomputed ones.
    position = start + delta + N
    got = engine.forward(Batch([7], [position], [1], [N + 1], [moved], [0]))
    expected = engine.forward(Batch([7], [position], [1], [N + 1], [fresh], [0]))
    assert (got - expected).abs().max() < ATOL
    for pages in (moved, bystander, fresh):
        engine.pool.free(pages)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotate_keys_is_a_rotation_to_the_new_position(dtype):
    """Against keys rotated at the new positions directly. A bf16 cache costs two bf16
    roundings (stored, then cast back), no more: the rotation itself runs in fp32."""
    rotary = Rotary(64, 500000.0, LLAMA3)
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(64, 2, 64, generator=gen)
    positions = torch.randint(1234, 4000, (64,), generator=gen)
    cache = torch.randn(16, 8, 2, 64, generator=gen).to(dtype)
    rows = torch.randperm(128, generator=gen)[:64]
    flat = cache.view(-1, 2, 64)
    flat[rows] = apply_rotary(keys, *rotary.cos_sin(positions, torch.float32)).to(dtype)
    before = cache.clone()
    rotate_keys(cache, rows, -1234, rotary)
    want = apply_rotary(keys, *rotary.cos_sin(positions - 1234, torch.float32))
    rel = 2 * 4000 * 2**-24 if dtype == torch.float32 else 2**-8
    assert close(flat[rows].float(), want, rel)
    rest = torch.ones(128, dtype=torch.bool)
    rest[rows] = False
    assert torch.equal(flat[rest], before.view(-1, 2, 64)[rest])
