"""Triton kernels against their torch references, and the references against a per-token oracle.

Without a GPU the kernels run under TRITON_INTERPRET=1 (tests/conftest.py), so sizes stay small.
"""

import math

import pytest
import torch

from kernels import (
    decode_attention,
    decode_attention_ref,
    prefill_attention,
    prefill_attention_ref,
    store_kv,
    store_kv_ref,
)
from symphony.engine.tree import ancestor_bits

pytestmark = pytest.mark.slow  # the Triton interpreter

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
TOL = {torch.float32: 1e-3, torch.float16: 1e-2, torch.bfloat16: 2e-2}
# (GQA ratio, kv heads, head_dim): every ratio once, with non-power-of-two head dims mixed in.
HEADS = [(1, 2, 40), (4, 2, 64), (8, 1, 24)]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert not torch.isnan(got).any()
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def make_pool(kv_lens, page_size, num_kv_heads, head_dim, dtype, gen):
    """Random pool plus a shuffled, non-contiguous page table with garbage padding."""
    pages_needed = [math.ceil(n / page_size) for n in kv_lens]
    num_pages = sum(pages_needed) + 3  # a few pages nobody owns
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    batch, width = len(kv_lens), max(pages_needed) + 1
    # Transposed storage: strides (1, batch). Padding is random but in range, so using it
    # by mistake gives wrong numbers rather than a crash.
    table = torch.randint(0, num_pages, (width, batch), generator=gen, dtype=torch.int32).t()
    perm = torch.randperm(num_pages, generator=gen).to(torch.int32)
    used = 0
    for b, n in enumerate(pages_needed):
        table[b, :n] = perm[used : used + n]
        used += n
    return k_cache, v_cache, table.to(DEVICE)


def make_excluded(ranges_per_seq):
    width = max(1, max(len(r) for r in ranges_per_seq))
    ex = torch.zeros(len(ranges_per_seq), width, 2, dtype=torch.int32)
    for b, ranges in enumerate(ranges_per_seq):
        for r, (start, end) in enumerate(ranges):
            ex[b, r, 0], ex[b, r, 1] = start, end
    return ex.to(DEVICE)


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def dense_oracle(q_rows, q_pos, seq, k_cache, v_cache, page_table, excluded, scale):
    """One query, one head, one key at a time: softmax over the allowed keys, in float64."""
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q_rows.shape[1] // num_kv_heads
    out = torch.zeros(q_rows.shape, dtype=torch.float64)
    ranges = [] if excluded is None else excluded[seq].tolist()
    for i, pos in enumerate(q_pos):
        for h in range(q_rows.shape[1]):
            scores, values = [], []
            for j in range(pos + 1):
                if any(s <= j < e for s, e in ranges):
                    continue
                page = int(page_table[seq, j // page_size])
                key = k_cache[page, j % page_size, h // group].double()
                scores.append(float(key @ q_rows[i, h].double()) * scale)
                values.append(v_cache[page, j % page_size, h // group].double())
            if scores:
                p = torch.softmax(torch.tensor(scores, dtype=torch.float64), dim=0)
                out[i, h] = sum(w * val for w, val in zip(p, values, strict=True))
    return out


# ---------------------------------------------------------------------------------------------
# store_kv


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv(page_size, dtype):
    gen = torch.Generator().manual_seed(1)
    num_pages, num_kv_heads, head_dim, tokens = 6, 2, 40, 50
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    # Non-contiguous source rows: every other token of a bigger tensor.
    k = torch.randn(2 * tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)[::2]
    v = torch.randn(2 * tokens, num_kv_heads, head_dim, generator=gen).to(dtype).to(DEVICE)[::2]
    slots = torch.randperm(num_pages * page_size, generator=gen)[:tokens]
    slots[torch.randperm(tokens, generator=gen)[:10]] = -1
    slots = slots.to(DEVICE)

    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kv_ref(k, v, k_ref, v_ref, slots)
    store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)

    # The reference itself: stored rows land in their slots, everything else is untouched.
    flat_before = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    flat_after = flat_before.clone()
    store_kv_ref(k, k, flat_after, flat_after.clone(), slots)
    before = flat_before.view(-1, num_kv_heads, head_dim)
    after = flat_after.view(-1, num_kv_heads, head_dim)
    written = torch.zeros(before.shape[0], dtype=torch.bool, device=DEVICE)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            written[slot] = True
            assert torch.equal(after[slot], k[t])
    assert torch.equal(after[~written], before[~written])


# ---------------------------------------------------------------------------------------------
# references against the per-token oracle (tiny, page size 4, GQA 2)


def tiny_case():
    gen = torch.Generator().manual_seed(2)
    # (q_len, kv_len): a full prefill, an extend with a prefix, a single-token extend.
    seqs = [(6, 6), (2, 9), (1, 3)]
    kv_lens = [kv for _, kv in seqs]
    k_cache, v_cache, table = make_pool(kv_lens, 4, 2, 8, torch.float32, gen)
    # Seq 0 loses its first two keys (queries 0 and 1 see nothing); seq 1 loses a whole page
    # and part of another; seq 2 loses everything.
    excluded = make_excluded([[(0, 2)], [(4, 8), (1, 2)], [(0, 3)]])
    return seqs, k_cache, v_cache, table, excluded, gen


def test_prefill_reference_matches_oracle():
    seqs, k_cache, v_cache, table, excluded, gen = tiny_case()
    total = sum(q for q, _ in seqs)
    q = torch.randn(total, 4, 8, generator=gen).to(DEVICE)
    q_start = i32([0, *torch.tensor([s[0] for s in seqs]).cumsum(0).tolist()])
    kv_lens = i32([kv for _, kv in seqs])
    args = (q, k_cache, v_cache, table, q_start, kv_lens, excluded, 0.3, 6)
    want = torch.cat([
        dense_oracle(q[q_start[b] : q_start[b + 1]].cpu(), range(kv - ql, kv), b,
                     k_cache.cpu(), v_cache.cpu(), table.cpu(), excluded.cpu(), 0.3)
        for b, (ql, kv) in enumerate(seqs)
    ])
    assert want[0].abs().sum() == 0 and want[-1].abs().sum() == 0  # the oracle saw the holes
    got_ref = prefill_attention_ref(*args)
    assert rel_err(got_ref, want) < 1e-5
    assert rel_err(prefill_attention(*args), want) < 1e-5


def test_decode_reference_matches_oracle():
    seqs, k_cache, v_cache, table, excluded, gen = tiny_case()
    q = torch.randn(len(seqs), 4, 8, generator=gen).to(DEVICE)
    kv_lens = i32([kv for _, kv in seqs])
    args = (q, k_cache, v_cache, table, kv_lens, excluded, 0.3)
    want = torch.cat([
        dense_oracle(q[b : b + 1].cpu(), [kv - 1], b, k_cache.cpu(), v_cache.cpu(),
                     table.cpu(), excluded.cpu(), 0.3)
        for b, (_, kv) in enumerate(seqs)
    ])
    assert want[-1].abs().sum() == 0
    assert rel_err(decode_attention_ref(*args), want) < 1e-5
    assert rel_err(decode_attention(*args, num_splits=2), want) < 1e-5
    # A single excluded range per sequence (Triton specialises an int argument equal to 1).
    one = excluded[:, :1]
    want = torch.cat([
        dense_oracle(q[b : b + 1].cpu(), [kv - 1], b, k_cache.cpu(), v_cache.cpu(),
                     table.cpu(), one.cpu(), 0.3)
        for b, (_, kv) in enumerate(seqs)
    ])
    args = (q, k_cache, v_cache, table, kv_lens, one, 0.3)
    assert rel_err(decode_attention_ref(*args), want) < 1e-5
    assert rel_err(decode_attention(*args, num_splits=2), want) < 1e-5


# ---------------------------------------------------------------------------------------------
# prefill / extend


def prefill_case(page_size, group, num_kv_heads, head_dim, dtype, with_excluded, seed):
    gen = torch.Generator().manual_seed(seed)
    ps = page_size
    # (q_len, kv_len): full prefills (partial last page), a one-token extend over a long
    # prefix, a long extend, and a one-token sequence.
    seqs = [(37, 37), (1, 200), (70, 300), (1, 1), (130, 130)]
    excluded = make_excluded([
        [(0, 3)],  # queries 0..2 attend to nothing
        [(ps, 2 * ps), (70, 75)],  # a whole page, and part of one
        [(2 * ps, 3 * ps), (233, 240), (290, 300)],  # also hides some of the new tokens
        [(0, 1)],  # the only key is gone
        [],
    ]) if with_excluded else None
    kv_lens = [kv for _, kv in seqs]
    k_cache, v_cache, table = make_pool(kv_lens, ps, num_kv_heads, head_dim, dtype, gen)
    q_lens = [q for q, _ in seqs]
    q = torch.randn(sum(q_lens), group * num_kv_heads, head_dim, generator=gen)
    q_start = i32([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    scale = head_dim**-0.5
    return (q.to(dtype).to(DEVICE), k_cache, v_cache, table, q_start, i32(kv_lens), excluded,
            scale, max(q_lens))


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("group,num_kv_heads,head_dim", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention(page_size, group, num_kv_heads, head_dim, dtype):
    args = prefill_case(page_size, group, num_kv_heads, head_dim, dtype, True, seed=3)
    want = prefill_attention_ref(*args)
    got = prefill_attention(*args)
    assert got.dtype == dtype and got.shape == args[0].shape
    assert rel_err(got, want) < TOL[dtype]
    # Queries with nothing to attend to are exactly zero (seq 0 rows 0..2, seq 3's row).
    assert got[:3].abs().max() == 0 and got[37 + 1 + 70].abs().max() == 0


def test_prefill_attention_no_excluded():
    args = prefill_case(16, 4, 2, 64, torch.float32, False, seed=4)
    assert rel_err(prefill_attention(*args), prefill_attention_ref(*args)) < 1e-3


# ---------------------------------------------------------------------------------------------
# decode


def decode_case(page_size, group, num_kv_heads, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    ps = page_size
    kv_lens = [1, 5, 64, 65, 200, 300, 17, 0]  # the last is an idle batch slot
    # With 4 splits, the 300-row sequence gets chunks of 128: the second is fully excluded
    # and the fourth is empty; short sequences leave most splits empty.
    excluded = make_excluded([
        [],
        [(0, 5)],  # everything: output zero
        [(ps, 2 * ps), (3, 9)],  # a whole page, and part of one
        [(64, 65)],  # the last row alone
        [(190, 210)],
        [(128, 256), (10, 11)],
        [],
        [],
    ])
    k_cache, v_cache, table = make_pool(kv_lens, ps, num_kv_heads, head_dim, dtype, gen)
    q = torch.randn(len(kv_lens), group * num_kv_heads, head_dim, generator=gen)
    return (q.to(dtype).to(DEVICE), k_cache, v_cache, table, i32(kv_lens), excluded,
            head_dim**-0.5)


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("group,num_kv_heads,head_dim", HEADS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_attention(page_size, group, num_kv_heads, head_dim, dtype):
    args = decode_case(page_size, group, num_kv_heads, head_dim, dtype, seed=5)
    want = decode_attention_ref(*args)
    got = decode_attention(*args, num_splits=4)
    assert got.dtype == dtype and got.shape == args[0].shape
    assert rel_err(got, want) < TOL[dtype]
    assert got[1].abs().max() == 0 and got[7].abs().max() == 0


@pytest.mark.parametrize("num_splits", [1, 3, 7, None])
def test_decode_attention_splits(num_splits):
    args = decode_case(16, 4, 2, 64, torch.float32, seed=6)
    assert rel_err(decode_attention(*args, num_splits=num_splits), decode_attention_ref(*args)) \
        < 1e-3
    no_ex = (*args[:5], None, args[6])
    assert rel_err(decode_attention(*no_ex, num_splits=num_splits), decode_attention_ref(*no_ex)) \
        < 1e-3


# ---------------------------------------------------------------------------------------------
# tree attention


def ancestors_of(parents, i):
    """Row i and its ancestors, walking the parents one by one."""
    rows = set()
    while i >= 0:
        rows.add(i)
        i = parents[i]
    return rows


def masked_oracle(q_rows, allowed, seq, k_cache, v_cache, page_table, scale):
    """SDPA in float64 over a sequence's first allowed.shape[1] keys with a dense mask."""
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    j = torch.arange(allowed.shape[1])
    pages = page_table[seq, j // page_size].long()
    k = k_cache[pages, j % page_size].double().transpose(0, 1)  # [Hkv, L, D]
    v = v_cache[pages, j % page_size].double().transpose(0, 1)
    group = q_rows.shape[1] // num_kv_heads
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    o = torch.nn.functional.scaled_dot_product_attention(
        q_rows.double().transpose(0, 1), k, v, attn_mask=allowed, scale=scale
    )
    return torch.where(allowed.any(-1)[:, None, None], o.transpose(0, 1), 0.0)


def tree_case(dtype):
    gen = torch.Generator().manual_seed(7)
    # Seq 0: a 21-row prefix, then a 40-row tree (two bit words) of which this chunk holds the
    # last 25 rows. Seq 1: causal, beside it. Seq 2: a 12-row tree with no prefix, whole.
    parents0 = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, 40)]
    parents2 = [-1, 0, 0, 1, 1, 2, -1, 6, 7, 3, 9, 5]
    seqs = [(25, 61, 21, parents0), (9, 30, None, None), (12, 12, 0, parents2)]
    excluded = make_excluded([[(3, 7), (23, 25)], [(5, 8)], [(2, 3)]])
    kv_lens = [kv for _, kv, _, _ in seqs]
    k_cache, v_cache, table = make_pool(kv_lens, 16, 2, 16, dtype, gen)
    q_lens = [q for q, _, _, _ in seqs]
    q = torch.randn(sum(q_lens), 4, 16, generator=gen).to(dtype).to(DEVICE)
    q_start = i32([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    starts = [2**31 - 1 if s is None else s for _, _, s, _ in seqs]
    bits = torch.zeros(sum(q_lens), 2, dtype=torch.int32)
    row = 0
    for q_len, kv, start, parents in seqs:
        if parents is not None:
            tree = torch.from_numpy(ancestor_bits(parents))
            bits[row : row + q_len, : tree.shape[1]] = tree[kv - start - q_len :]
        row += q_len
    args = (q, k_cache, v_cache, table, q_start, i32(kv_lens), excluded, 0.25, max(q_lens),
            i32(starts), bits.to(DEVICE))
    # The dense masks, from the parents and the excluded ranges directly.
    want = []
    for b, (q_len, kv, start, parents) in enumerate(seqs):
        allowed = torch.zeros(q_len, kv, dtype=torch.bool)
        for i in range(q_len):
            pos = kv - q_len + i
            tree = ancestors_of(parents, pos - start) if parents else set()
            for j in range(pos + 1):
                hidden = any(s <= j < e for s, e in excluded[b].tolist())
                allowed[i, j] = not hidden and (not parents or j < start or j - start in tree)
        rows = q[q_start[b] : q_start[b + 1]].cpu()
        want.append(masked_oracle(rows, allowed, b, k_cache.cpu(), v_cache.cpu(), table.cpu(),
                                  0.25))
    return args, torch.cat(want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_attention_tree(dtype):
    args, want = tree_case(dtype)
    ref = prefill_attention_ref(*args)
    assert rel_err(ref, want) < TOL[dtype]
    got = prefill_attention(*args)
    assert got.dtype == dtype and rel_err(got, want) < TOL[dtype]
    # The mask matters: plain causal attention differs on the tree sequences.
    causal = prefill_attention_ref(*args[:9])
    assert rel_err(causal[:25], want[:25]) > 0.1 and rel_err(causal[-12:], want[-12:]) > 0.1
    assert rel_err(causal[25:34], want[25:34]) < TOL[dtype]  # and is the causal sequence's
