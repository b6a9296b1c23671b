"""The paged KV kernels of ``paged_cpu.c`` (fp32, CPU), called through ctypes.

Same arguments as the Triton kernels, so the engine can swap one for the other.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels.cbuild import check, load


class _Cache(ctypes.Structure):
    _fields_ = [
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("num_pages", ctypes.c_int64),
        ("stride_page", ctypes.c_int64),
        ("stride_slot", ctypes.c_int64),
        ("stride_head", ctypes.c_int64),
        ("page_size", ctypes.c_int32),
        ("num_kv_heads", ctypes.c_int32),
        ("head_dim", ctypes.c_int32),
    ]


@functools.cache
def library() -> ctypes.CDLL:
    """The built ``paged_cpu.c``; RuntimeError if it won't build."""
    lib = load("paged_cpu")
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.store_kv_f32.argtypes = [ctypes.POINTER(_Cache), p, p, i64, i64, i64, i64, p, i64]
    lib.store_kv_f32.restype = i32
    lib.decode_attention_f32.argtypes = [
        ctypes.POINTER(_Cache), p, i64, i64, p, i64, i64, p, p, i64, p, i64, i32,
        ctypes.c_float,
    ]
    lib.decode_attention_f32.restype = i32
    lib.prefill_attention_f32.argtypes = [
        ctypes.POINTER(_Cache), p, i64, i64, p, i64, i64, p, p, p, i64, p, p, i64, p, i64, i64,
        i32, ctypes.c_float,
    ]
    lib.prefill_attention_f32.restype = i32
    return lib


_caches: dict[tuple, _Cache] = {}


def _cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> _Cache:
    # The pool's tensors live as long as the engine: checked once, then looked up.
    key = (k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape, k_cache.stride())
    cache = _caches.get(key)
    if cache is None:
        check("k_cache", k_cache)
        check("v_cache", v_cache)
        if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
            raise ValueError("k_cache and v_cache must share shape and strides")
        num_pages, page_size, num_kv_heads, head_dim = k_cache.shape
        cache = _caches[key] = _Cache(k_cache.data_ptr(), v_cache.data_ptr(), num_pages,
                                      *k_cache.stride()[:3], page_size, num_kv_heads, head_dim)
    return cache


def store_kv_c(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """:func:`kernels.store_kv` in C: row ``t`` of k/v to pool slot ``slot_mapping[t]``
    (``-1`` skips it)."""
    cache = _cache(k_cache, v_cache)
    check("k", k)
    check("v", v)
    slots = slot_mapping.to(torch.int64).contiguous()
    if (k.dim() != 3 or k.shape[1:] != k_cache.shape[2:] or v.shape != k.shape
            or slots.shape != (len(k),)):
        raise ValueError("k, v and slot_mapping disagree with each other or with the cache")
    if library().store_kv_f32(
        ctypes.byref(cache), k.data_ptr(), v.data_ptr(), *k.stride()[:2], *v.stride()[:2],
        slots.data_ptr(), len(slots),
    ):
        raise ValueError("store_kv: a slot outside the pool")


def _excluded(excluded: torch.Tensor | None, batch: int) -> tuple[torch.Tensor | None, int]:
    """The excluded ranges as the C code reads them, and how many a sequence has."""
    if excluded is None or excluded.shape[1] == 0:
        return None, 0
    if excluded.shape != (batch, excluded.shape[1], 2):
        raise ValueError("excluded must be [batch, ranges, 2]")
    return excluded.to(torch.int32).contiguous(), excluded.shape[1]


def decode_attention_c(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    excluded: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """:func:`kernels.decode_attention` in C, reading K/V in place through the page tables."""
    cache = _cache(k_cache, v_cache)
    check("q", q)
    page_table = page_table.to(torch.int32).contiguous()
    kv_lens = kv_lens.to(torch.int32).contiguous()
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, heads, head_dim], got {list(q.shape)}")
    batch, num_q_heads, head_dim = q.shape
    # The C code indexes these by sequence without bounds: they must match the batch.
    if (head_dim != cache.head_dim or num_q_heads % cache.num_kv_heads
            or kv_lens.shape != (batch,) or page_table.dim() != 2
            or page_table.shape[0] != batch):
        raise ValueError("q, page_table, kv_lens and the cache disagree in heads, head_dim "
                         "or batch")
    excluded, num_ranges = _excluded(excluded, batch)
    out = torch.empty(q.shape, dtype=torch.float32)
    err = library().decode_attention_f32(
        ctypes.byref(cache), q.data_ptr(), *q.stride()[:2], page_table.data_ptr(),
        page_table.stride(0), page_table.shape[1], kv_lens.data_ptr(),
        excluded.data_ptr() if num_ranges else None, num_ranges, out.data_ptr(), batch,
        num_q_heads, scale,
    )
    if err == -2:
        raise MemoryError("decode_attention: no memory for the scores")
    if err:
        raise ValueError("decode_attention: a sequence longer than its page table, or a page "
                         "outside the pool")
    return out


def prefill_attention_c(
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
    """:func:`kernels.prefill_attention` in C, reading K/V in place through the page tables
    (``max_q_len`` unused). Queries with nothing to attend to get zeros."""
    cache = _cache(k_cache, v_cache)
    check("q", q)
    page_table = page_table.to(torch.int32).contiguous()
    q_start = q_start.to(torch.int32).contiguous()
    kv_lens = kv_lens.to(torch.int32).contiguous()
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim], got {list(q.shape)}")
    num_tokens, num_q_heads, head_dim = q.shape
    batch = len(kv_lens)
    if (head_dim != cache.head_dim or num_q_heads % cache.num_kv_heads
            or kv_lens.shape != (batch,) or q_start.shape != (batch + 1,)
            or page_table.dim() != 2 or page_table.shape[0] != batch):
        raise ValueError("q, page_table, q_start, kv_lens and the cache disagree in heads, "
                         "head_dim or batch")
    excluded, num_ranges = _excluded(excluded, batch)
    trees = (None, None, 0)  # tree_start, tree_bits, words
    if tree_bits is not None:
        tree_start = tree_start.to(torch.int32).contiguous()
        tree_bits = tree_bits.to(torch.int32).contiguous()
        if tree_start.shape != (batch,) or tree_bits.dim() != 2 or len(tree_bits) != num_tokens:
            raise ValueError("tree_start must be [batch] and tree_bits [tokens, words]")
        trees = (tree_start.data_ptr(), tree_bits.data_ptr(), tree_bits.shape[1])
    out = torch.zeros(q.shape, dtype=torch.float32)  # rows outside every sequence stay 0
    err = library().prefill_attention_f32(
        ctypes.byref(cache), q.data_ptr(), *q.stride()[:2], page_table.data_ptr(),
        page_table.stride(0), page_table.shape[1], q_start.data_ptr(), kv_lens.data_ptr(),
        excluded.data_ptr() if num_ranges else None, num_ranges, *trees, out.data_ptr(), batch,
        num_tokens, num_q_heads, scale,
    )
    if err == -2:
        raise MemoryError("prefill_attention: no memory for the scratch")
    if err:
        raise ValueError("prefill_attention: q_start, kv_lens and tree_bits disagree, or a "
                         "sequence longer than its page table, or a page outside the pool")
    return out
