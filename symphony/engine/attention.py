"""Paged attention for one forward pass: store the new K/V, then attend through page tables."""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch

import kernels
from symphony.engine.kv_pool import KVPool

BACKEND_ENV = "SYMPHONY_ATTENTION"


def select_kernels(device: torch.device) -> SimpleNamespace:
    """Triton on CUDA, the torch reference elsewhere; SYMPHONY_ATTENTION=triton|torch forces."""
    choice = os.environ.get(BACKEND_ENV) or ("triton" if device.type == "cuda" else "torch")
    if choice == "triton":
        return SimpleNamespace(
            name="triton",
            store_kv=kernels.store_kv,
            prefill=kernels.prefill_attention,
            decode=kernels.decode_attention,
        )
    if choice == "torch":
        return SimpleNamespace(
            name="torch",
            store_kv=kernels.store_kv_ref,
            prefill=kernels.prefill_attention_ref,
            decode=kernels.decode_attention_ref,
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

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        m, k_cache, v_cache = self.meta, self.pool.k[layer], self.pool.v[layer]
        self.ops.store_kv(k, v, k_cache, v_cache, m.slot_mapping)
        if m.decode_only:
            return self.ops.decode(
                q, k_cache, v_cache, m.page_table, m.kv_lens, m.excluded, self.scale
            )
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
