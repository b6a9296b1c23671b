"""Scatter freshly computed K/V rows into their pages of the paged KV pool.

The pool layout is ``[num_pages, page_size, num_kv_heads, head_dim]``; a row's slot is
``page * page_size + offset``. A negative slot marks a row that must not be stored (e.g. a
padding token, or a token whose KV the caller does not keep).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    K, V, KC, VC, SLOTS,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_kcp, stride_kcs, stride_kch, stride_kcd,
    stride_vcp, stride_vcs, stride_vch, stride_vcd,
    page_size, num_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(SLOTS + t)
    if slot < 0:
        return
    page = slot // page_size
    offset = slot % page_size
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < head_dim)
    # 64-bit row offsets: a large pool overflows int32 element offsets.
    t64 = t.to(tl.int64)
    k = tl.load(K + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
                mask=mask)
    v = tl.load(V + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
                mask=mask)
    kc = KC + page * stride_kcp + offset * stride_kcs
    vc = VC + page * stride_vcp + offset * stride_vcs
    tl.store(kc + offs_h[:, None] * stride_kch + offs_d[None, :] * stride_kcd,
             k.to(KC.dtype.element_ty), mask=mask)
    tl.store(vc + offs_h[:, None] * stride_vch + offs_d[None, :] * stride_vcd,
             v.to(VC.dtype.element_ty), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``k[t], v[t]`` (``[T, Hkv, D]``) to slot ``slot_mapping[t]``; skip negative slots."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    page_size = k_cache.shape[1]
    slots = slot_mapping.to(torch.int64)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slots,
        *k.stride(), *v.stride(), *k_cache.stride(), *v_cache.stride(),
        page_size, num_heads, head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Plain-torch :func:`store_kv`."""
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    slots = slot_mapping.to(torch.int64)
    # A contiguous pool views as one row per slot: a single index_copy_ per cache.
    for src, cache in ((k, k_cache), (v, v_cache)):
        if cache.is_contiguous():
            cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, src.to(cache.dtype))
        else:
            cache[slots // cache.shape[1], slots % cache.shape[1]] = src.to(cache.dtype)
