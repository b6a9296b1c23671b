"""Pieces shared by the paged attention kernels and their references.

A sequence's KV row ``j`` lives at page ``page_table[b, j // page_size]``, offset
``j % page_size``. ``excluded`` holds half-open KV-index ranges ``[start, end)`` per sequence
that attention must skip; ``(0, 0)`` is padding.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def page_rows(PT_ROW, stride_ptp, kv_idx, kv_mask, page_size):
    """Element offsets (in rows of the pool) of KV rows ``kv_idx`` of one sequence.

    Masked-off rows never read the page table: entries past a sequence's pages are garbage.
    """
    page = tl.load(PT_ROW + (kv_idx // page_size) * stride_ptp, mask=kv_mask, other=0)
    return page.to(tl.int64), (kv_idx % page_size).to(tl.int64)


@triton.jit
def keep_mask(EX_ROW, stride_exr, stride_exe, num_ranges, kv_idx):
    """True for each ``kv_idx`` outside every excluded range of one sequence."""
    keep = kv_idx >= 0
    for r in range(num_ranges):
        start = tl.load(EX_ROW + r * stride_exr)
        end = tl.load(EX_ROW + r * stride_exr + stride_exe)
        keep = keep & ((kv_idx < start) | (kv_idx >= end))
    return keep


def kv_block_size(row_bytes: int) -> int:
    """Keys per block: K and V blocks (double-buffered) must fit in GPU shared memory."""
    if row_bytes <= 256:  # e.g. fp16 with head_dim <= 128
        return 64
    return 32 if row_bytes <= 512 else 16


def check_pool(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    # The kernels address K and V with one set of strides.
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share shape and strides")
    # tl.dot takes operands of one dtype.
    if not q.dtype == k_cache.dtype == v_cache.dtype:
        raise ValueError("q, k_cache and v_cache must share a dtype")
    if q.shape[1] % k_cache.shape[2] or q.shape[2] != k_cache.shape[3]:
        raise ValueError("query heads must be a multiple of kv heads, with the same head_dim")


def excluded_args(excluded: torch.Tensor | None, device: torch.device) -> tuple:
    """(tensor, num_ranges, stride_b, stride_r, stride_e) for the kernels; a dummy when None."""
    if excluded is None or excluded.shape[1] == 0:
        return torch.zeros(1, dtype=torch.int32, device=device), 0, 0, 0, 0
    return (excluded, excluded.shape[1], *excluded.stride())


def page_ids_ref(cache: torch.Tensor, page_table: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``[B, pages]`` int64: the pages holding rows ``[0, num_rows)`` of every sequence."""
    num_pages = triton.cdiv(num_rows, cache.shape[1])
    # Padding entries may hold anything; clamp so the gather stays in bounds (masked later).
    return page_table[:, :num_pages].long().clamp_(0, cache.shape[0] - 1)


def gather_rows_ref(cache: torch.Tensor, pages: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Rows ``[0, num_rows)`` of every sequence as contiguous fp32 ``[B, H, num_rows, D]``,
    given the sequences' :func:`page_ids_ref`.

    Heads before rows so per-head matmuls see plain matrices; the dtype conversion and the
    transpose happen in the same copy, the dominant cost on CPU.
    """
    # index_select copies whole pages; advanced indexing (cache[pages]) is several times slower.
    rows = cache.index_select(0, pages.flatten()).view(pages.shape[0], -1, *cache.shape[2:])
    rows = rows[:, :num_rows]  # [B, num_rows, H, D]
    # Not .to(memory_format=...): with an unchanged dtype it returns the strided view as is.
    out = torch.empty(rows.shape[0], rows.shape[2], num_rows, rows.shape[3],
                      dtype=torch.float32, device=cache.device)
    return out.copy_(rows.transpose(1, 2))


def key_mask_ref(
    kv_lens: torch.Tensor, excluded: torch.Tensor | None, num_rows: int
) -> torch.Tensor:
    """``[B, num_rows]`` bool: row exists and is not excluded."""
    j = torch.arange(num_rows, device=kv_lens.device)
    mask = j[None, :] < kv_lens[:, None].long()
    if excluded is not None and excluded.shape[1] > 0:
        start = excluded[:, :, 0, None].long()
        end = excluded[:, :, 1, None].long()
        inside = (j[None, None, :] >= start) & (j[None, None, :] < end)  # [B, R, num_rows]
        mask &= ~inside.any(dim=1)
    return mask
