"""The C kernels (kernels/*_cpu.c) against the torch references, and how they are built."""

import logging
import random

import pytest
import torch
from test_kernels import HEADS, decode_case, make_excluded, make_pool, rel_err, tree_case

from kernels import (
    cbuild,
    decode_attention_ref,
    layer_cpu,
    paged_cpu,
    prefill_attention_ref,
    store_kv_ref,
)
from symphony.engine import attention
from symphony.engine.ops import add_rms_norm, silu_mul
from symphony.engine.rope import Rotary, apply_rotary
from symphony.engine.tree import ancestor_bits


def cpu(args):
    return tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)


# head_dim 20 and 36 take the scalar tail after the 8- and 32-wide paths.
C_HEADS = [*HEADS, (2, 3, 20), (4, 1, 36)]


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("group,num_kv_heads,head_dim", C_HEADS)
def test_decode_attention_c(page_size, group, num_kv_heads, head_dim):
    args = cpu(decode_case(page_size, group, num_kv_heads, head_dim, torch.float32, seed=5))
    want = decode_attention_ref(*args)
    got = paged_cpu.decode_attention_c(*args)
    assert got.shape == args[0].shape and rel_err(got, want) < 1e-5
    assert got[1].abs().max() == 0 and got[7].abs().max() == 0  # all excluded; no rows
    no_ex = (*args[:5], None, args[6])
    assert rel_err(paged_cpu.decode_attention_c(*no_ex), decode_attention_ref(*no_ex)) < 1e-5


def test_decode_attention_c_strided_query_and_threads():
    """q as the engine hands it (a view into the qkv rows), on 1 and 2 threads alike."""
    gen = torch.Generator().manual_seed(3)
    kv_lens = [1, 15, 16, 17, 100, 257]
    k_cache, v_cache, table = make_pool(kv_lens, 16, 2, 32, torch.float32, gen)
    k_cache, v_cache, table = k_cache.cpu(), v_cache.cpu(), table.cpu().contiguous()
    qkv = torch.randn(len(kv_lens), 8 + 2 * 2, 32, generator=gen)
    q = qkv[:, :8]
    lens = torch.tensor(kv_lens, dtype=torch.int32)
    ex = make_excluded([[], [(0, 3)], [], [(16, 17)], [(5, 90)], [(0, 0), (256, 257)]]).cpu()
    want = decode_attention_ref(q.contiguous(), k_cache, v_cache, table, lens, ex, 0.2)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got = paged_cpu.decode_attention_c(q, k_cache, v_cache, table, lens, ex, 0.2)
            assert rel_err(got, want) < 1e-5
    finally:
        torch.set_num_threads(threads)


def test_decode_attention_c_refuses_what_would_read_outside_the_pool():
    gen = torch.Generator().manual_seed(4)
    k_cache, v_cache, table = (t.cpu() for t in make_pool([40], 16, 1, 8, torch.float32, gen))
    q = torch.randn(1, 1, 8)
    bad = table.clone()
    bad[0, 1] = k_cache.shape[0]  # one past the last page
    with pytest.raises(ValueError, match="outside the pool"):
        paged_cpu.decode_attention_c(q, k_cache, v_cache, bad, torch.tensor([40]), None, 1.0)
    with pytest.raises(ValueError, match="longer than its page table"):
        paged_cpu.decode_attention_c(
            q, k_cache, v_cache, table[:, :2], torch.tensor([33]), None, 1.0
        )
    with pytest.raises(ValueError, match="float32"):
        paged_cpu.decode_attention_c(q.half(), k_cache, v_cache, table, torch.tensor([40]),
                                     None, 1.0)
    # Per-sequence inputs shorter than the batch would be read past their end.
    q2, lens2 = torch.randn(2, 1, 8), torch.tensor([40, 40])
    with pytest.raises(ValueError, match="disagree"):
        paged_cpu.decode_attention_c(q2, k_cache, v_cache, table, lens2, None, 1.0)
    with pytest.raises(ValueError, match="disagree"):
        paged_cpu.decode_attention_c(q2, k_cache, v_cache, table.expand(2, -1),
                                     torch.tensor([40]), None, 1.0)
    with pytest.raises(ValueError, match=r"\[batch, ranges, 2\]"):
        paged_cpu.decode_attention_c(q2, k_cache, v_cache, table.expand(2, -1), lens2,
                                     torch.zeros(1, 1, 2, dtype=torch.int32), 1.0)


NO_TREE = 2**31 - 1


def prefill_c_case(seqs, ranges, page_size, group, num_kv_heads, head_dim, seed):
    """The arguments of prefill attention for sequences (q_len, kv_len, tree): tree None, or
    (start, parents) for a tree of len(parents) rows from KV index start, of which the chunk
    holds the q_len rows ending at kv_len; pages shuffled, padding garbage."""
    gen = torch.Generator().manual_seed(seed)
    kv_lens = [kv for _, kv, _ in seqs]
    k_cache, v_cache, table = (t.cpu() for t in make_pool(kv_lens, page_size, num_kv_heads,
                                                          head_dim, torch.float32, gen))
    q_lens = [q for q, _, _ in seqs]
    q = torch.randn(sum(q_lens), group * num_kv_heads, head_dim, generator=gen)
    q_start = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    starts = torch.full((len(seqs),), NO_TREE, dtype=torch.int32)
    words = max((-(-len(t[1]) // 32) for _, _, t in seqs if t), default=0)
    bits = torch.zeros(sum(q_lens), words, dtype=torch.int32)
    for b, (q_len, kv_len, tree) in enumerate(seqs):
        if tree:
            start, parents = tree
            rows = torch.from_numpy(ancestor_bits(parents))[kv_len - start - q_len :]
            starts[b] = start
            bits[q_start[b] : q_start[b + 1], : rows.shape[1]] = rows[:q_len]
    trees = (starts, bits) if words else ()
    return (q, k_cache, v_cache, table, q_start, torch.tensor(kv_lens, dtype=torch.int32),
            make_excluded(ranges).cpu() if ranges else None, head_dim**-0.5, max(q_lens),
            *trees)


def chain_and_forks(n, seed):
    rng = random.Random(seed)
    return [-1] + [rng.randrange(0, i) if rng.random() < 0.5 else i - 1 for i in range(1, n)]


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("group,num_kv_heads,head_dim", C_HEADS)
def test_prefill_attention_c(page_size, group, num_kv_heads, head_dim):
    """One batch as the engine sends it: a decode row, a fresh prefill, chunks mid-file, a
    whole draft tree, chunks starting mid-tree, an empty sequence, excluded ranges."""
    ps = page_size
    seqs = [
        (1, 200, None),
        (37, 37, None),
        (64, 300, None),
        (10, 31, (21, chain_and_forks(10, 1))),
        (25, 90, (50, chain_and_forks(40, 2))),  # the last 25 rows of a 40-row tree
        (1, 70, (30, chain_and_forks(40, 3))),  # its last row alone
        (0, 20, None),
        (5, 5, None),
    ]
    ranges = [[(ps, 2 * ps)], [(0, 3), (30, 34)], [(5, 9), (250, 260)], [(25, 26)],
              [(40, 55)], [(0, 0)], [], [(0, 5)]]
    args = prefill_c_case(seqs, ranges, ps, group, num_kv_heads, head_dim, seed=11)
    want = prefill_attention_ref(*args)
    got = paged_cpu.prefill_attention_c(*args)
    assert got.shape == want.shape and rel_err(got, want) < 1e-5
    # Nothing to attend to: the first rows of the fresh prefill, the last sequence.
    assert got[1:4].abs().max() == 0 and got[-5:].abs().max() == 0
    no_ex = (*args[:6], None, *args[7:])
    assert rel_err(paged_cpu.prefill_attention_c(*no_ex), prefill_attention_ref(*no_ex)) < 1e-5


@pytest.mark.parametrize("seed", range(12))
def test_prefill_attention_c_random_batches(seed):
    """Random shapes, q_len 1 to 64 (so 1 to 4 query blocks), trees entered anywhere."""
    rng = random.Random(seed)
    group, num_kv_heads, head_dim = rng.choice(C_HEADS)
    seqs, ranges = [], []
    for _ in range(rng.randint(1, 5)):
        q_len, prefix = rng.randint(1, 64), rng.randint(0, 150)
        tree = None
        if rng.random() < 0.5:
            before = rng.randint(0, 40)  # tree rows already in the cache
            tree = (prefix, chain_and_forks(before + q_len, rng.random()))
            prefix += before
        kv_len = prefix + q_len
        seqs.append((q_len, kv_len, tree))
        cuts = sorted(rng.randint(0, kv_len) for _ in range(2 * rng.randint(0, 2)))
        ranges.append(list(zip(cuts[::2], cuts[1::2], strict=True)))
    args = prefill_c_case(seqs, ranges, rng.choice([8, 16]), group, num_kv_heads, head_dim,
                          seed)
    assert rel_err(paged_cpu.prefill_attention_c(*args), prefill_attention_ref(*args)) < 1e-5


def test_prefill_attention_c_tree_against_the_oracle():
    args, want = tree_case(torch.float32)
    assert rel_err(paged_cpu.prefill_attention_c(*cpu(args)), want) < 1e-5


def test_prefill_attention_c_strided_query_and_threads():
    """q as the engine hands it (a view into the qkv rows), on 1 and 2 threads alike."""
    seqs = [(40, 140, None), (1, 33, None), (16, 16, None)]
    args = prefill_c_case(seqs, [[(3, 9)], [], []], 16, 4, 2, 32, seed=6)
    qkv = torch.cat([args[0], torch.randn(57, 4, 32)], dim=1)
    want = prefill_attention_ref(*args)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got = paged_cpu.prefill_attention_c(qkv[:, :8], *args[1:])
            assert rel_err(got, want) < 1e-5
    finally:
        torch.set_num_threads(threads)


def test_prefill_attention_c_refuses_what_would_read_outside_its_inputs():
    seqs = [(5, 40, (30, chain_and_forks(10, 0)))]
    q, k_cache, v_cache, table, q_start, kv_lens, _, scale, n, starts, bits = prefill_c_case(
        seqs, None, 16, 1, 1, 8, seed=4)
    run = paged_cpu.prefill_attention_c
    bad = table.clone()
    bad[0, 2] = k_cache.shape[0]
    with pytest.raises(ValueError, match="outside the pool"):
        run(q, k_cache, v_cache, bad, q_start, kv_lens, None, scale, n, starts, bits)
    with pytest.raises(ValueError, match="longer than its page table"):
        run(q, k_cache, v_cache, table[:, :2], q_start, kv_lens, None, scale, n)
    with pytest.raises(ValueError, match="disagree"):  # more queries than rows
        run(q, k_cache, v_cache, table, q_start, torch.tensor([4]), None, scale, n)
    with pytest.raises(ValueError, match="disagree"):  # past the last query
        run(q, k_cache, v_cache, table, q_start + 1, kv_lens, None, scale, n)
    with pytest.raises(ValueError, match="tree_bits disagree"):  # 35 tree rows need 2 words
        run(q, k_cache, v_cache, table, q_start, kv_lens, None, scale, n, starts - 25, bits)
    with pytest.raises(ValueError, match=r"\[tokens, words\]"):
        run(q, k_cache, v_cache, table, q_start, kv_lens, None, scale, n, starts, bits[:4])
    with pytest.raises(ValueError, match="disagree in heads"):
        run(q, k_cache, v_cache, table, q_start[:1], kv_lens, None, scale, n)


def test_c_backend_leaves_long_prefills_to_sdpa(monkeypatch):
    monkeypatch.setenv(attention.BACKEND_ENV, "c")
    ops = attention.select_kernels(torch.device("cpu"), torch.float32)
    calls = []
    monkeypatch.setattr(paged_cpu, "prefill_attention_c", lambda *a: calls.append("c"))
    monkeypatch.setattr(attention.kernels, "prefill_attention_ref",
                        lambda *a: calls.append("sdpa"))
    for max_q_len in (1, 64, attention.C_PREFILL_MAX, attention.C_PREFILL_MAX + 1):
        ops.prefill(None, None, None, None, None, None, None, 1.0, max_q_len)
    assert calls == ["c", "c", "c", "sdpa"]


def test_store_kv_c():
    gen = torch.Generator().manual_seed(1)
    shape = (6, 16, 2, 40)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    k = torch.randn(100, 2, 40, generator=gen)[::2]  # non-contiguous rows
    v = torch.randn(100, 2, 40, generator=gen)[::2]
    slots = torch.randperm(6 * 16, generator=gen)[:50]
    slots[torch.randperm(50, generator=gen)[:10]] = -1  # padding tokens store nothing
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, k_ref, v_ref, slots)
    paged_cpu.store_kv_c(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    # A slot past the pool: an error, and nothing stored, not even the rows before it.
    before = k_cache.clone()
    slots[0], slots[-1] = 3, 6 * 16
    with pytest.raises(ValueError, match="outside the pool"):
        paged_cpu.store_kv_c(k + 1, v + 1, k_cache, v_cache, slots)
    assert torch.equal(k_cache, before)
    with pytest.raises(ValueError, match="disagree"):
        paged_cpu.store_kv_c(k, v, k_cache, v_cache, slots[:-1])
    assert torch.equal(k_cache, before)


def test_layer_kernels_refuse_shapes_they_cannot_take():
    with pytest.raises(ValueError, match="even"):
        layer_cpu.silu_mul_c(torch.randn(2, 7))
    with pytest.raises(ValueError, match="even"):
        layer_cpu.silu_mul_c(torch.randn(2, 0))
    with pytest.raises(ValueError, match="empty"):
        layer_cpu.add_rms_norm_c(torch.randn(2, 0), None, torch.randn(0), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        layer_cpu.add_rms_norm_c(torch.randn(8, 4).t(), None, torch.randn(8), 1e-5)
    x = torch.randn(3, 2, 5)
    with pytest.raises(ValueError, match="even head_dim"):
        layer_cpu.rotary_c(x, torch.ones(3, 1, 5), torch.zeros(3, 1, 5))


@pytest.mark.parametrize("rows,n", [(1, 256), (33, 100), (600, 64)])  # 600: the parallel path
def test_add_rms_norm_c(rows, n):
    gen = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, n, generator=gen), torch.randn(rows, n, generator=gen)
    weight = torch.randn(n, generator=gen)
    want, want_sum = add_rms_norm(x, residual, weight, 1e-5)
    got, got_sum = layer_cpu.add_rms_norm_c(x, residual.clone(), weight, 1e-5)
    assert rel_err(got, want) < 1e-6 and rel_err(got_sum, want_sum) < 1e-7
    got, same = layer_cpu.add_rms_norm_c(x, None, weight, 1e-5)
    assert same is x and rel_err(got, add_rms_norm(x, None, weight, 1e-5)[0]) < 1e-6


def test_silu_mul_c_over_the_whole_float_range():
    x = torch.cat([torch.linspace(-100, 100, 20001), torch.tensor([-1e30, 1e30, -87.5, 88.5])])
    up = torch.randn(len(x), generator=torch.Generator().manual_seed(0))
    gate_up = torch.cat([x, up])[None]
    got, want = layer_cpu.silu_mul_c(gate_up)[0], silu_mul(gate_up)[0]
    assert ((got - want).abs() <= 1e-6 * want.abs() + 1e-30).all()


def test_rotary_c_in_place_on_a_strided_view():
    gen = torch.Generator().manual_seed(2)
    heads = torch.randn(7, 3 + 2 * 1, 32, generator=gen)  # [tokens, q + k + v heads, dim]
    cos, sin = Rotary(32, 10000.0, {}).cos_sin(torch.tensor([0, 1, 5, 9, 100, 1000, 3]),
                                              torch.float32)
    qk = heads[:, :4]
    want = apply_rotary(qk, cos, sin)
    v_before = heads[:, 4].clone()
    got = layer_cpu.rotary_c(qk, cos, sin)
    assert got.data_ptr() == qk.data_ptr() and rel_err(got, want) < 1e-6
    assert torch.equal(heads[:, 4], v_before)  # v untouched


def test_a_failed_build_names_the_compiler_and_falls_back_to_torch(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv(cbuild.CACHE_ENV, str(tmp_path))  # nothing built here yet
    monkeypatch.delenv(attention.BACKEND_ENV, raising=False)
    libraries = (cbuild.load, paged_cpu.library, layer_cpu.library)
    for lib in libraries:
        lib.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="/nonexistent/cc"):
            cbuild.load("layer_cpu")
        with caplog.at_level(logging.WARNING):
            assert attention.select_kernels(torch.device("cpu"), torch.float32).name == "torch"
        assert "C attention kernels are unavailable" in caplog.text
        monkeypatch.setenv(attention.BACKEND_ENV, "c")
        with pytest.raises(RuntimeError, match="/nonexistent/cc"):
            attention.select_kernels(torch.device("cpu"), torch.float32)
    finally:
        for lib in libraries:
            lib.cache_clear()


def test_build_is_cached_by_content(tmp_path, monkeypatch):
    monkeypatch.setenv(cbuild.CACHE_ENV, str(tmp_path))
    cbuild.load.cache_clear()
    try:
        cbuild.load("layer_cpu")
        (built,) = tmp_path.iterdir()
        assert built.name.startswith("layer_cpu-")
        inode = built.stat().st_ino
        cbuild.load.cache_clear()
        cbuild.load("layer_cpu")  # as a second process would: finds the file, builds nothing
        assert list(tmp_path.iterdir()) == [built] and built.stat().st_ino == inode
    finally:
        cbuild.load.cache_clear()


def test_backend_choice(monkeypatch):
    monkeypatch.delenv(attention.BACKEND_ENV, raising=False)
    assert attention.select_kernels(torch.device("cpu"), torch.float32).name == "c"
    assert attention.select_kernels(torch.device("cpu"), torch.float16).name == "torch"
    monkeypatch.setenv(attention.BACKEND_ENV, "c")
    with pytest.raises(ValueError, match="fp32 on the CPU"):
        attention.select_kernels(torch.device("cpu"), torch.float16)
