"""Paged attention for one forward pass: store the new K/V, then attend through page tables."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch

import kernels
from kernels import layer_cpu, paged_cpu
from kvfs.pool import KVPool

BACKEND_ENV = "SYMPHONY_ATTENTION"
log = logging.getLogger(__name__)


def _plan_tables(
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    excluded: torch.Tensor | None,
) -> tuple:
    return page_table, kv_lens, excluded  # the kernels read the page tables themselves


def _decode_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: tuple, scale: float
) -> torch.Tensor:
    return kernels.decode_attention(q, k_cache, v_cache, *plan, scale)


def _decode_c(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: tuple, scale: float
) -> torch.Tensor:
    return paged_cpu.decode_attention_c(q, k_cache, v_cache, *plan, scale)


# Query tokens per sequence up to which the C kernel beats gathering K/V for SDPA: measured
# 1.1x to 3x faster on 2 cores at head_dim 32 to 128 up to 1024 (most for short chunks over
# a long context), while SDPA won fresh prefills of 2048 at head_dim 128.
C_PREFILL_MAX = 1024


def _prefill_c(
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
    prefill = (paged_cpu.prefill_attention_c if max_q_len <= C_PREFILL_MAX
               else kernels.prefill_attention_ref)
    return prefill(q, k_cache, v_cache, page_table, q_start, kv_lens, excluded, scale,
                   max_q_len, tree_start, tree_bits)


def _default_backend(device: torch.device, dtype: torch.dtype) -> str:
    if device.type == "cuda":
        return "triton"
    if dtype != torch.float32:
        return "torch"
    try:
        paged_cpu.library()
        layer_cpu.library()
    except (RuntimeError, OSError) as e:
        log.warning("the C attention kernels are unavailable, using torch's: %s", e)
        return "torch"
    return "c"


def select_kernels(device: torch.device, dtype: torch.dtype) -> SimpleNamespace:
    """Triton on CUDA; on the CPU the C kernels for fp32 where a C compiler builds them, else
    the torch reference. SYMPHONY_ATTENTION=triton|c|torch forces one.

    Decode is in two parts: `plan_decode` once per forward, `decode` once per layer.
    """
    choice = os.environ.get(BACKEND_ENV) or _default_backend(device, dtype)
    if choice == "c":
        if device.type != "cpu" or dtype != torch.float32:
            raise ValueError(f"{BACKEND_ENV}=c runs fp32 on the CPU, not {dtype} on {device}")
        paged_cpu.library()  # a build failure surfaces here, not in the first forward
        layer_cpu.library()
        return SimpleNamespace(
            name="c",
            store_kv=paged_cpu.store_kv_c,
            prefill=_prefill_c,
            plan_decode=_plan_tables,
            decode=_decode_c,
        )
    if choice == "triton":
        return SimpleNamespace(
            name="triton",
            store_kv=kernels.store_kv,
            prefill=kernels.prefill_attention,
            plan_decode=_plan_tables,
            decode=_decode_triton,
        )
    if choice == "torch":
        return SimpleNamespace(
            name="torch",
            store_kv=kernels.store_kv_ref,
            prefill=kernels.prefill_attention_ref,
            plan_decode=kernels.plan_decode_ref,
            decode=kernels.decode_with_plan_ref,
        )
    raise ValueError(f"{BACKEND_ENV} must be 'triton', 'c' or 'torch', got {choice!r}")


@dataclass
class PagedMetadata:
    """Device tensors describing a ragged batch; built once per forward, used by every layer."""

    slot_mapping: torch.Tensor  # [T] int64: pool slot of each new token's K/V
    page_table: torch.Tensor  # [B, max_pages] int32
    q_start: torch.Tensor  # [B + 1] int32
    kv_lens: torch.Tensor  # [B] int32, including the new tokens
    excluded: torch.Tensor | None  # [B, R, 2] int32 half-open KV-index ranges, or None
    tree_start: torch.Tensor | None  # [B] int32 KV index of each tree, 2**31 - 1 for none
    tree_bits: torch.Tensor | None  # [T, W] int32 packed ancestor bits of every query
    max_q_len: int
    decode_only: bool


class PagedAttention:
    def __init__(self, pool: KVPool, meta: PagedMetadata, ops: SimpleNamespace, scale: float):
        self.pool, self.meta, self.ops, self.scale = pool, meta, ops, scale
        self._decode_plan = None  # built at the first layer, reused by the others

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        m, k_cache, v_cache = self.meta, self.pool.k[layer], self.pool.v[layer]
        self.ops.store_kv(k, v, k_cache, v_cache, m.slot_mapping)
        if m.decode_only:
            if self._decode_plan is None:
                self._decode_plan = self.ops.plan_decode(
                    k_cache, m.page_table, m.kv_lens, m.excluded
                )
            return self.ops.decode(q, k_cache, v_cache, self._decode_plan, self.scale)
        return self.ops.prefill(
            q,
            k_cache,
            v_cache,
            m.page_table,
            m.q_start,
            m.kv_lens,
            m.excluded,
            self.scale,
            m.max_q_len,
            m.tree_start,
            m.tree_bits,
        )
