"""The KV pool: every layer's K and V pages, allocated once at start.

Layout per layer is [pages, page_size, kv_heads, head_dim], the layout `kernels/` reads.
Pages are handed out by id; who owns them and for how long is kvfs's business.
"""

from __future__ import annotations

import os

import torch

from symphony.engine.config import ModelConfig


class PoolExhausted(MemoryError):
    """Not enough free pages; nothing was allocated."""


def pages_for_fraction(
    cfg: ModelConfig, page_size: int, dtype: torch.dtype, device: torch.device, fraction: float
) -> int:
    """How many pages fit in `fraction` of the device's free memory."""
    if not 0 < fraction <= 1:
        raise ValueError(f"kv memory fraction must be in (0, 1], got {fraction}")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    per_page = 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    return max(1, int(free * fraction) // per_page)


class KVPool:
    def __init__(
        self,
        cfg: ModelConfig,
        num_pages: int,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        if num_pages < 1 or page_size < 1:
            raise ValueError(
                f"kv pool needs pages >= 1 and page size >= 1, got {num_pages}, {page_size}"
            )
        self.num_pages, self.page_size = num_pages, page_size
        shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Low ids last so that pop() hands them out first: easier to read in dumps.
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"kv pool: {n} pages wanted, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def copy_page(self, src: int, dst: int) -> None:
        self.k[:, dst].copy_(self.k[:, src])
        self.v[:, dst].copy_(self.v[:, src])

    def read_rows(self, page: int, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `count` rows of a page, every layer: two [layers, count, heads, dim]."""
        return self.k[:, page, start : start + count].clone(), self.v[
            :, page, start : start + count
        ].clone()

    def write_rows(self, page: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[:, page, start : start + k.shape[1]].copy_(k)
        self.v[:, page, start : start + v.shape[1]].copy_(v)
