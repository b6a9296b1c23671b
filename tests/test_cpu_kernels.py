"""The C kernels (kernels/*_cpu.c) against the torch references, and how they are built."""

import logging

import pytest
import torch
from test_kernels import HEADS, decode_case, make_excluded, make_pool, rel_err

from kernels import cbuild, decode_attention_ref, layer_cpu, paged_cpu, store_kv_ref
from symphony.engine import attention
from symphony.engine.ops import add_rms_norm, silu_mul
from symphony.engine.rope import Rotary, apply_rotary


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
