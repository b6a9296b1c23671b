"""The engine against transformers on the device the engine runs on (CUDA when there is one).

tests/test_engine_parity.py holds the CPU's paths (C kernels and torch references, fp32). This
file holds what a GPU adds: the Triton kernels wired into the engine, in fp32 with TF32 off
(within the CPU's tolerance) and in bf16 (greedy continuations identical on peaked random
checkpoints, where no step is decided by a rounding). On a machine without CUDA it runs the
same tests on the CPU (bench/gpu.py --dry-run), so that they cannot rot between GPU runs.
SYMPHONY_TEST_DEVICE picks the device.
"""

from __future__ import annotations

import os

import pytest
import torch
from checkpoints import FAMILIES, make_checkpoint

from symphony.engine.engine import Batch, Engine
from symphony.engine.generate import generate
from symphony.engine.sampler import GREEDY

pytestmark = pytest.mark.slow  # transformers and random checkpoints

DEVICE = os.environ.get("SYMPHONY_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
ATOL = 1e-4  # tests/test_engine_parity.py's
NEW_TOKENS = 32


@pytest.fixture(autouse=True)
def no_tf32():
    """fp32 means fp32: TF32 matmuls would be 1e-3 off."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp32_prefill_and_decode_logits_match_transformers(family, tmp_path):
    reference = make_checkpoint(tmp_path, family).to(DEVICE)
    engine = Engine(tmp_path, device=DEVICE, dtype=torch.float32, kv_pages=64, page_size=16)
    if DEVICE == "cuda":
        assert engine.kernels.name == "triton"
    ids = torch.randint(0, engine.config.vocab_size, (53,),
                        generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = reference(torch.tensor([ids], device=DEVICE)).logits[0].float()
    pages = engine.pool.allocate(4)
    got = engine.forward(Batch(ids[:37], list(range(37)), [37], [37], [pages], list(range(37))))
    assert (got.float() - want[:37]).abs().max().item() < ATOL
    for i in range(37, 53):  # one token at a time: the decode path
        got = engine.forward(Batch([ids[i]], [i], [1], [i + 1], [pages], [0]))
        assert (got[0].float() - want[i]).abs().max().item() < ATOL
    engine.pool.free(pages)


@pytest.mark.xfail(DEVICE != "cuda", strict=False,
                   reason="bf16 on the CPU is the torch reference, not the GPU path: on this "
                   "machine's random checkpoints greedy meets a bf16 near-tie early (llama at "
                   "token 18, qwen2 at 4); the claim is the GPU's")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_greedy_continuation_matches_generate(family, tmp_path):
    reference = make_checkpoint(tmp_path, family, weight_scale=4.0, seed=3)
    reference = reference.to(DEVICE, torch.bfloat16)
    engine = Engine(tmp_path, device=DEVICE, dtype=torch.bfloat16, kv_pages=64)
    prompts = [[5, 17, 99, 23, 42, 8, 150], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]]
    want = []
    with torch.no_grad():
        for prompt in prompts:
            out = reference.generate(torch.tensor([prompt], device=DEVICE),
                                     max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                     do_sample=False, pad_token_id=0)
            want.append(out[0, len(prompt):].tolist())
    free = engine.pool.free_count
    got = generate(engine, prompts, GREEDY, NEW_TOKENS, stop_ids=())  # both in one batch
    for g, w in zip(got, want, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), None)
        assert first is None, f"diverges at token {first}: {g[first:first + 4]} vs {w[first:]}"
    assert engine.pool.free_count == free
