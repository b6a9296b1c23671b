"""One query token per sequence over a paged KV cache (decode), split-K "flash-decoding".

A batch of decodes has too few queries to fill a GPU, so each sequence's KV range is cut into
``num_splits`` chunks handled by separate programs (stage 1, partial outputs plus log-sum-exp),
then merged (stage 2). One stage-1 program serves every query head of a kv head (the GQA group)
so each K/V block is loaded once per group.
"""

import math
from typing import NamedTuple

import torch
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
def _decode_split_kernel(
    Q, K, V, PT, KVLENS, EX, MID_O, MID_LSE,
    scale_log2,
    stride_qb, stride_qh, stride_qd,
    stride_cp, stride_cs, stride_ch, stride_cd,
    stride_ptb, stride_ptp,
    stride_exb, stride_exr, stride_exe,
    stride_mob, stride_moh, stride_mos, stride_mod,
    stride_mlb, stride_mlh, stride_mls,
    num_ranges, page_size, head_dim, num_splits,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(KVLENS + b)
    # Chunks are a whole number of key blocks; short sequences leave their last splits empty.
    chunk = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    kv_start = split * chunk
    kv_end = tl.minimum(kv_start + chunk, kv_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < head_dim
    heads = kv_head * GROUP + offs_g
    b64 = b.to(tl.int64)
    q = tl.load(Q + b64 * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    pt_row = PT + b64 * stride_ptb
    ex_row = EX + b64 * stride_exb
    for start_n in range(kv_start, kv_end, BLOCK_N):
        kv_idx = start_n + offs_n
        n_mask = kv_idx < kv_end
        page, offset = page_rows(pt_row, stride_ptp, kv_idx, n_mask, page_size)
        rows = page * stride_cp + offset * stride_cs + kv_head * stride_ch
        kv_ptrs = rows[:, None] + offs_d[None, :] * stride_cd
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + kv_ptrs, mask=kv_mask, other=0.0)
        # ieee: on GPU the fp32 default is tf32, too coarse for 1e-3; ignored for fp16/bf16.
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2

        allowed = n_mask
        if num_ranges > 0:
            allowed = allowed & keep_mask(ex_row, stride_exr, stride_exe, num_ranges, kv_idx)
        s = tl.where(allowed[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Nothing allowed yet keeps m = -inf; subtracting 0 instead avoids inf - inf = NaN.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + kv_ptrs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    # Empty or fully excluded split: lse = -inf gives it zero weight in the merge.
    has_any = l_i > 0
    lse = tl.where(has_any, m_i + tl.log2(tl.where(has_any, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(has_any, l_i, 1.0)[:, None]
    mo = MID_O + b64 * stride_mob + split * stride_mos
    tl.store(mo + heads[:, None] * stride_moh + offs_d[None, :] * stride_mod, out,
             mask=g_mask[:, None] & d_mask[None, :])
    tl.store(MID_LSE + b64 * stride_mlb + heads * stride_mlh + split * stride_mls, lse,
             mask=g_mask)


@triton.jit
def _decode_merge_kernel(
    MID_O, MID_LSE, OUT,
    stride_mob, stride_moh, stride_mos, stride_mod,
    stride_mlb, stride_mlh, stride_mls,
    stride_ob, stride_oh, stride_od,
    num_splits, head_dim,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < head_dim
    lse = tl.load(MID_LSE + b * stride_mlb + head * stride_mlh + offs_s * stride_mls,
                  mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.exp2(lse - lse_max)  # base 2, as stage 1 wrote it
    mo = MID_O + b * stride_mob + head * stride_moh
    parts = tl.load(mo + offs_s[:, None] * stride_mos + offs_d[None, :] * stride_mod,
                    mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    total = tl.sum(weight, 0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(OUT + b * stride_ob + head * stride_oh + offs_d * stride_od,
             out.to(OUT.dtype.element_ty), mask=d_mask)


# Fewer keys than this per split and the merge costs more than the parallelism gains.
_MIN_KEYS_PER_SPLIT = 256
_MAX_SPLITS = 16


def default_num_splits(max_kv_len: int, batch: int, num_kv_heads: int) -> int:
    """Enough splits to give a GPU a few hundred programs, never tiny chunks."""
    by_length = triton.cdiv(max(max_kv_len, 1), _MIN_KEYS_PER_SPLIT)
    by_occupancy = triton.cdiv(256, max(1, batch * num_kv_heads))
    return max(1, min(by_length, by_occupancy, _MAX_SPLITS))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    excluded: torch.Tensor | None,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Paged attention of ``q`` (``[B, Hq, D]``) over rows ``j < kv_lens[b]`` minus ``excluded``.

    ``num_splits=None`` bounds the longest length by the page table's width (no device sync).
    """
    check_pool(q, k_cache, v_cache)
    batch, num_q_heads, head_dim = q.shape
    num_pages_per_seq, page_size, num_kv_heads = page_table.shape[1], *k_cache.shape[1:3]
    group = num_q_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(num_pages_per_seq * page_size, batch, num_kv_heads)
    ex, num_ranges, *ex_strides = excluded_args(excluded, q.device)

    # fp32 scratch: each split's normalised output and its base-2 log-sum-exp.
    mid_o = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32,
                        device=q.device)
    mid_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)

    # tl.dot needs every dimension >= 16 on GPU: pad the group and head_dim.
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = kv_block_size(block_d * k_cache.element_size())
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, page_table, kv_lens, ex, mid_o, mid_lse,
        scale * math.log2(math.e),
        *q.stride(), *k_cache.stride(), *page_table.stride(), *ex_strides,
        *mid_o.stride(), *mid_lse.stride(),
        num_ranges, page_size, head_dim, num_splits,
        GROUP=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=4,
        num_stages=2,
    )
    _decode_merge_kernel[(batch, num_q_heads)](
        mid_o, mid_lse, out,
        *mid_o.stride(), *mid_lse.stride(), *out.stride(),
        num_splits, head_dim,
        BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1,
    )
    return out


class DecodePlan(NamedTuple):
    """What the torch reference derives from the page tables: the same for every layer of a
    step, so the engine builds it once per step (:func:`plan_decode_ref`)."""

    pages: torch.Tensor  # [B, P] int64: the pages holding each sequence's first L rows
    bias: torch.Tensor  # [B * Hkv, 1, L] fp32: 0 where a key is attended to, -inf elsewhere
    empty: torch.Tensor | None  # [B * Hkv, 1, 1] bool: nothing to attend to; None if none
    num_rows: int  # L, the longest sequence


def plan_decode_ref(
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    excluded: torch.Tensor | None,
) -> DecodePlan:
    """The pages to gather and the key mask (as an additive bias) of one decode step."""
    num_kv_heads = k_cache.shape[2]
    # Only as many rows as the longest sequence needs, not the table's full width.
    num_rows = int(kv_lens.max()) if kv_lens.numel() else 0
    mask = key_mask_ref(kv_lens, excluded, num_rows)  # [B, L]
    bias = torch.zeros(mask.shape, device=k_cache.device).masked_fill_(~mask, float("-inf"))
    bias = bias.repeat_interleave(num_kv_heads, dim=0)[:, None, :]
    empty = ~mask.any(-1)
    empty = empty.repeat_interleave(num_kv_heads)[:, None, None] if bool(empty.any()) else None
    return DecodePlan(page_ids_ref(k_cache, page_table, num_rows), bias, empty, num_rows)


def decode_with_plan_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
) -> torch.Tensor:
    """:func:`decode_attention_ref` for one layer, given the step's :class:`DecodePlan`."""
    batch, num_q_heads, head_dim = q.shape
    if batch == 0 or plan.num_rows == 0:
        return torch.zeros_like(q)
    group = num_q_heads // k_cache.shape[2]
    k = gather_rows_ref(k_cache, plan.pages, plan.num_rows).flatten(0, 1)  # [B * Hkv, L, D]
    v = gather_rows_ref(v_cache, plan.pages, plan.num_rows).flatten(0, 1)
    # Batched matmuls over (sequence, kv head) with the GQA group as rows: shorter than SDPA
    # with a mask for a single query, and the mask is one precomputed additive bias.
    queries = q.float().reshape(-1, group, head_dim)
    scores = torch.baddbmm(plan.bias, queries, k.transpose(1, 2), alpha=scale)
    out = torch.bmm(scores.softmax(-1), v)  # [B * Hkv, G, D]
    if plan.empty is not None:  # softmax over nothing is NaN; such a sequence gets zeros
        out = out.masked_fill_(plan.empty, 0.0)
    return out.view(batch, num_q_heads, head_dim).to(q.dtype)


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    excluded: torch.Tensor | None,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Plain-torch :func:`decode_attention`, batched (the engine's CPU decode path, which
    builds the plan once per step rather than once per layer).

    ``num_splits`` is accepted for signature parity and ignored.
    """
    plan = plan_decode_ref(k_cache, page_table, kv_lens, excluded)
    return decode_with_plan_ref(q, k_cache, v_cache, plan, scale)
