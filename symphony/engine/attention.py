"""Paged attention for one forward pass: store the new K/V, then attend through page tables."""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch

import kernels
from symphony.engine.kv_pool import KVPool

BACKEND_ENV = "SYMPHONY_ATTENTION"


def _plan_triton(
    k_cache: torch.Tensor,
    page_table: torch.Tensor,
    kv_lens: torch.Tensor,
    excluded: torch.Tensor | None,
) -> tuple:
    return page_table, kv_lens, excluded  # the kernel reads the page tables itself


def _decode_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: tuple, scale: float
) -> torch.Tensor:
    return kernels.decode_attention(q, k_cache, v_cache, *plan, scale)


def select_kernels(device: torch.device) -> SimpleNamespace:
    """Triton on CUDA, the torch reference elsewhere; SYMPHONY_ATTENTION=triton|torch forces.

    Decode is in two parts: `plan_decode` once per forward, `decode` once per layer.
    """
    choice = os.environ.get(BACKEND_ENV) or ("triton" if device.type == "cuda" else "torch")
    if choice == "triton":
        return SimpleNamespace(
            name="triton",
            store_kv=kernels.store_kv,
            prefill=kernels.prefill_attention,
            plan_decode=_plan_triton,
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
    raise ValueError(f"{BACKEND_ENV} must be 'triton' or 'torch', got {choice!r}")


@dataclass
class PagedMetadata:
    """Device tensors describing a ragged batch; built once per forward, used by every layer."""

    slot_mapping: torch.Tensor  # [T] int64: pool slot of each new token's K/V
    page_table: torch.Tensor  # [B, max_pages] int32
    q_start: torch.Tensor  # [B + 1] int32
    kv_lens: torch.Tensor  # [B] int32, including the new tokens
    excluded: torch.Tensor | None  # [B, R, 2] int32 half-open KV-index ranges, or None
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
        )
