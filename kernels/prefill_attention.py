"""Causal attention for a ragged batch of new tokens over a paged KV cache (prefill and extend).

Sequence ``b`` brings ``q_len_b`` new query tokens whose K/V are already stored; its cache holds
``kv_lens[b]`` rows in total, so query ``i`` sits at KV index ``kv_lens[b] - q_len_b + i`` and
attends to every earlier-or-equal index that is not excluded.

A tree (``tree_start``, ``tree_bits``) narrows that further: query ``t`` of the batch sees KV
index ``j >= tree_start[b]`` only if bit ``j - tree_start[b]`` of row ``t`` of ``tree_bits`` is
set (bit ``c % 32`` of int32 word ``c // 32``); indices before ``tree_start[b]`` stay visible.
"""

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._paged import (
    check_pool,
    excluded_args,
    gather_rows_ref,
    keep_mask,
    key_mask_ref,
    kv_block_size,
    page_ids_ref,
    page_rows,
)


@triton.jit
def _prefill_kernel(
    Q, K, V, OUT, PT, QSTART, KVLENS, EX, TREE_START, TREE_BITS,
    scale_log2,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_cp, stride_cs, stride_ch, stride_cd,
    stride_ptb, stride_ptp,
    stride_exb, stride_exr, stride_exe,
    stride_tbt, stride_tbw,
    num_ranges, page_size, head_dim,
    GROUP: tl.constexpr, HAS_TREE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    b = tl.program_id(2)
    q_begin = tl.load(QSTART + b)
    q_len = tl.load(QSTART + b + 1) - q_begin
    m_start = pid_m * BLOCK_M
    # The grid is sized for the longest sequence; shorter ones have idle blocks.
    if m_start >= q_len:
        return
    kv_len = tl.load(KVLENS + b)
    prefix = kv_len - q_len
    kv_head = head // GROUP

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < head_dim
    q_rows = (q_begin + offs_m).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = prefix + offs_m

    # Online softmax in base 2 (scale folded into scale_log2); m_i = -inf means "nothing yet".
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    pt_row = PT + b.to(tl.int64) * stride_ptb
    ex_row = EX + b.to(tl.int64) * stride_exb
    if HAS_TREE:
        tree_start = tl.load(TREE_START + b)
        bits_rows = TREE_BITS + q_rows[:, None] * stride_tbt
    # Causality: no query of this block sees past its last position.
    kv_end = tl.minimum(kv_len, prefix + tl.minimum(m_start + BLOCK_M, q_len))
    for start_n in range(0, kv_end, BLOCK_N):
        kv_idx = start_n + offs_n
        n_mask = kv_idx < kv_end
        page, offset = page_rows(pt_row, stride_ptp, kv_idx, n_mask, page_size)
        rows = page * stride_cp + offset * stride_cs + kv_head * stride_ch
        kv_ptrs = rows[:, None] + offs_d[None, :] * stride_cd
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + kv_ptrs, mask=kv_mask, other=0.0)
        # ieee: on GPU the fp32 default is tf32, too coarse for 1e-3; ignored for fp16/bf16.
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2

        allowed = n_mask[None, :] & (kv_idx[None, :] <= q_pos[:, None])
        if num_ranges > 0:
            keep = keep_mask(ex_row, stride_exr, stride_exe, num_ranges, kv_idx)
            allowed = allowed & keep[None, :]
        if HAS_TREE:
            c = kv_idx - tree_start  # the key's row in the tree; negative: before the tree
            in_tree = (c >= 0) & n_mask
            c = tl.maximum(c, 0)
            word = tl.load(bits_rows + (c // 32)[None, :] * stride_tbw,
                           mask=m_mask[:, None] & in_tree[None, :], other=0)
            bit = (word >> (c % 32)[None, :]) & 1
            allowed = allowed & ((bit != 0) | ~in_tree[None, :])
        s = tl.where(allowed, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows with nothing allowed so far keep m = -inf; subtracting 0 instead avoids NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_ptrs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    # A query that attended to nothing has l = 0 and acc = 0: output zeros.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(OUT + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
             out.to(OUT.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    q_start: torch.Tensor,
    kv_lens: torch.Tensor,
    excluded: torch.Tensor | None,
    scale: float,
    max_q_len: int,
    tree_start: torch.Tensor | None = None,
    tree_bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged causal attention; ``q`` is ``[T, Hq, D]``, the batch's queries back to back.

    ``q_start`` (int32 ``[B+1]``) delimits the sequences, ``kv_lens`` (int32 ``[B]``) counts
    each sequence's KV rows including the new ones, ``excluded`` (int32 ``[B, R, 2]`` or None)
    lists KV ranges to ignore. ``max_q_len`` sizes the grid without a device sync.
    ``tree_start`` (int32 ``[B]``, 2**31 - 1 for no tree) and ``tree_bits`` (int32 ``[T, W]``)
    restrict each query to its ancestors from ``tree_start`` on; None, None: plain causal.
    """
    check_pool(q, k_cache, v_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    batch = kv_lens.shape[0]
    if num_tokens == 0 or batch == 0 or max_q_len <= 0:
        return out.zero_()
    ex, num_ranges, *ex_strides = excluded_args(excluded, q.device)
    has_tree = tree_bits is not None
    if not has_tree:  # dummies the kernel never reads
        tree_start = tree_bits = ex

    # tl.dot needs every dimension >= 16 on GPU.
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m = min(64, max(16, triton.next_power_of_2(max_q_len)))
    block_n = kv_block_size(block_d * k_cache.element_size())
    grid = (triton.cdiv(max_q_len, block_m), num_q_heads, batch)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, page_table, q_start, kv_lens, ex, tree_start, tree_bits,
        scale * math.log2(math.e),
        *q.stride(), *out.stride(), *k_cache.stride(), *page_table.stride(), *ex_strides,
        *(tree_bits.stride() if has_tree else (0, 0)),
        num_ranges, k_cache.shape[1], head_dim,
        GROUP=num_q_heads // num_kv_heads, HAS_TREE=has_tree,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=4 if block_d <= 64 else 8,
        num_stages=2,
    )
    return out


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    q_start: torch.Tensor,
    kv_lens: torch.Tensor,
    excluded: torch.Tensor | None,
    scale: float,
    max_q_len: int,
    tree_start: torch.Tensor | None = None,
    tree_bits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-torch :func:`prefill_attention` (also the engine's CPU prefill path)."""
    out = torch.zeros_like(q)
    starts = q_start.tolist()
    no_tree = 2**31 - 1
    trees = [no_tree] * kv_lens.shape[0] if tree_start is None else tree_start.tolist()
    for b, kv_len in enumerate(kv_lens.tolist()):
        q_begin, q_end = starts[b], starts[b + 1]
        q_len = q_end - q_begin
        if q_len == 0:
            continue
        pages = page_ids_ref(k_cache, page_table[b : b + 1], kv_len)
        k = gather_rows_ref(k_cache, pages, kv_len)[0]  # [Hkv, L, D]
        v = gather_rows_ref(v_cache, pages, kv_len)[0]
        # SDPA's fused CPU kernel (flash, GQA-aware) wants 4-d [batch, heads, rows, dim].
        qs = q[q_begin:q_end].float().transpose(0, 1)[None]  # [1, Hq, n, D]
        k, v = k[None], v[None]
        ex = None if excluded is None else excluded[b : b + 1]
        if q_len == kv_len and (ex is None or not ex.any()) and trees[b] == no_tree:
            # The common fresh prefill: the causal flag lets SDPA skip the masked half.
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            j = torch.arange(kv_len, device=q.device)
            pos = kv_len - q_len + torch.arange(q_len, device=q.device)
            key_ok = key_mask_ref(kv_lens[b : b + 1], ex, kv_len)[0]
            mask = (j[None, :] <= pos[:, None]) & key_ok[None, :]  # [n, L]
            if trees[b] != no_tree:
                mask[:, trees[b]:] &= tree_mask(tree_bits[q_begin:q_end], kv_len - trees[b])
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale,
                                               enable_gqa=True)
            # A query left with nothing to attend to gets zeros, not SDPA's NaN.
            o = torch.where(mask.any(-1)[:, None], o, 0.0)
        out[q_begin:q_end] = o[0].transpose(0, 1).to(q.dtype)
    return out


def tree_mask(bits: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``[n, num_rows]`` bool: the packed ``[n, W]`` int32 rows of bits, unpacked."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    unpacked = (bits[:, :, None] >> shifts) & 1  # [n, W, 32]; bit c % 32 of word c // 32
    return unpacked.flatten(1)[:, :num_rows].bool()
