"""The engine against Hugging Face transformers on the same random-weight checkpoints."""

from __future__ import annotations

import random

import pytest
import torch
from checkpoints import FAMILIES, make_checkpoint

from symphony.engine.engine import Batch, Engine
from symphony.engine.generate import generate
from symphony.engine.sampler import GREEDY

ATOL = 1e-4


# Both CPU paths: the C kernels (the default in fp32) and the torch references.
CPU_BACKENDS = ["c", "torch"]


@pytest.fixture(scope="module", params=[(f, b) for f in sorted(FAMILIES) for b in CPU_BACKENDS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def pair(request, tmp_path_factory):
    family, backend = request.param
    directory = tmp_path_factory.mktemp(family)
    reference = make_checkpoint(directory, family)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SYMPHONY_ATTENTION", backend)
        engine = Engine(directory, kv_pages=256, page_size=16)
    assert engine.kernels.name == backend
    return reference, engine


def reference_logits(model, ids, positions=None) -> torch.Tensor:
    with torch.no_grad():
        kwargs = {} if positions is None else {"position_ids": torch.tensor([positions])}
        return model(torch.tensor([ids]), **kwargs).logits[0]


def shuffled_pages(engine: Engine, n: int) -> list[int]:
    pages = engine.pool.allocate(n + 8)
    random.Random(n).shuffle(pages)
    engine.pool.free(pages[n:])
    return pages[:n]


def test_prefill_then_decode_match_transformers(pair):
    reference, engine = pair
    ids = torch.randint(
        0, engine.config.vocab_size, (53,), generator=torch.Generator().manual_seed(1)
    )
    ids = ids.tolist()
    want = reference_logits(reference, ids)
    pages = shuffled_pages(engine, 4)
    got = engine.forward(Batch(ids[:37], list(range(37)), [37], [37], [pages], list(range(37))))
    assert (got - want[:37]).abs().max() < ATOL
    for i in range(37, 53):  # one token at a time: the decode path
        got = engine.forward(Batch([ids[i]], [i], [1], [i + 1], [pages], [0]))
        assert (got[0] - want[i]).abs().max() < ATOL
    engine.pool.free(pages)


def test_ragged_batch_gives_each_sequence_its_own_logits(pair):
    _, engine = pair
    gen = torch.Generator().manual_seed(2)
    lengths = [1, 5, 16, 17, 31, 48, 64, 90]
    prompts = [
        torch.randint(0, engine.config.vocab_size, (n,), generator=gen).tolist() for n in lengths
    ]
    alone = []
    for p in prompts:
        pages = shuffled_pages(engine, -(-len(p) // 16))
        alone.append(
            engine.forward(
                Batch(p, list(range(len(p))), [len(p)], [len(p)], [pages], list(range(len(p))))
            )
        )
        engine.pool.free(pages)
    tables = [shuffled_pages(engine, -(-(len(p) + 1) // 16)) for p in prompts]
    flat = [t for p in prompts for t in p]
    together = engine.forward(
        Batch(
            flat,
            [i for p in prompts for i in range(len(p))],
            lengths,
            lengths,
            tables,
            list(range(len(flat))),
        )
    )
    start = 0
    for n, want in zip(lengths, alone, strict=True):
        assert (together[start : start + n] - want).abs().max() < ATOL
        start += n
    # A batched decode step after the ragged prefill: each sequence extends on its own pages.
    nxt = [int(a[-1].argmax()) for a in alone]
    step = engine.forward(
        Batch(nxt, lengths, [1] * 8, [n + 1 for n in lengths], tables, list(range(8)))
    )
    for i, p in enumerate(prompts):
        solo = shuffled_pages(engine, -(-(len(p) + 1) // 16))
        want = engine.forward(
            Batch(
                p + [nxt[i]], list(range(len(p) + 1)), [len(p) + 1], [len(p) + 1], [solo], [len(p)]
            )
        )
        engine.pool.free(solo)
        assert (step[i] - want[0]).abs().max() < ATOL
    for t in tables:
        engine.pool.free(t)


def test_explicit_positions_with_a_gap(pair):
    reference, engine = pair
    ids = list(range(3, 43))
    positions = list(range(20)) + list(range(100, 120))  # a Prompt-Cache-style gap
    want = reference_logits(reference, ids, positions)
    pages = shuffled_pages(engine, 3)
    got = engine.forward(Batch(ids, positions, [40], [40], [pages], list(range(40))))
    engine.pool.free(pages)
    assert (got - want).abs().max() < ATOL


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_continuation_matches_generate(family, backend, tmp_path, monkeypatch):
    reference = make_checkpoint(tmp_path, family, weight_scale=4.0, seed=3)
    monkeypatch.setenv("SYMPHONY_ATTENTION", backend)
    engine = Engine(tmp_path, kv_pages=64)
    prompt = [5, 17, 99, 23, 42, 8, 150]
    with torch.no_grad():
        want = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=64,
            min_new_tokens=64,
            do_sample=False,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    free = engine.pool.free_count
    got = generate(engine, [prompt], GREEDY, 64, stop_ids=())[0]
    assert got == want
    assert engine.pool.free_count == free


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama-backends")
    make_checkpoint(directory, "llama")
    return directory


@pytest.mark.parametrize("backend", ["torch", "triton", "c"])
def test_excluded_range_equals_a_gap_in_the_file(llama_dir, backend, monkeypatch):
    """Punched tokens leave attention: what follows sees exactly the file without them."""
    monkeypatch.setenv("SYMPHONY_ATTENTION", backend)
    engine = Engine(llama_dir, kv_pages=16)
    assert engine.kernels.name == backend
    ids = list(range(10, 50))
    kept = [i for i in range(40) if not 12 <= i < 30]
    pages = shuffled_pages(engine, 3)
    punched = engine.forward(
        Batch(ids, list(range(40)), [40], [40], [pages], list(range(40)), [[(12, 30)]])
    )
    # The same file written without the punched rows, positions unchanged.
    solo = shuffled_pages(engine, 2)
    gapped = engine.forward(
        Batch(
            [ids[i] for i in kept], kept, [len(kept)], [len(kept)], [solo], list(range(len(kept)))
        )
    )
    assert (punched[kept] - gapped).abs().max() < ATOL
    # Decoding after the punch: one more token, the range still excluded.
    step = engine.forward(Batch([7], [40], [1], [41], [pages], [0], [[(12, 30)]]))
    want = engine.forward(Batch([7], [40], [1], [len(kept) + 1], [solo], [0]))
    assert (step - want).abs().max() < ATOL


def test_backends_generate_alike(llama_dir, monkeypatch):
    """The engine wired to the Triton kernels (interpreted on a CPU) and to the C kernels,
    against the references."""
    out = {}
    for backend in ("torch", "triton", "c"):
        monkeypatch.setenv("SYMPHONY_ATTENTION", backend)
        engine = Engine(llama_dir, kv_pages=16)
        out[backend] = generate(engine, [[1, 2, 3, 4, 5], [9] * 20], GREEDY, 6, stop_ids=())
    assert out["triton"] == out["torch"] == out["c"]
