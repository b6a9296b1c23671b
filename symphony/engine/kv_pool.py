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


def page_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one page: K and V of every layer."""
    return 2 * cfg.num_layers * page_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize


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
    return max(1, int(free * fraction) // page_bytes(cfg, page_size, dtype))


DEVICE, HOST = "device", "host"


class KVPool:
    """Two arenas of pages with the same layout: the device tier the kernels read, and a host
    tier in CPU memory that idle files are moved down to. Page ids are per tier."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_pages: int,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        host_pages: int = 0,
        *,
        arrays: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """`arrays`: the device tier's K and V, zeroed, in memory of the caller's (shared
        with the engine process: engine_process.py); else they are allocated here."""
        if num_pages < 1 or page_size < 1 or host_pages < 0:
            raise ValueError(
                f"kv pool needs pages >= 1, page size >= 1, host pages >= 0; "
                f"got {num_pages}, {page_size}, {host_pages}"
            )
        self.num_pages, self.page_size, self.host_pages = num_pages, page_size, host_pages
        self.config, self.dtype = cfg, dtype
        shape = (cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        if arrays is not None:
            self.k, self.v = arrays
            if self.k.shape != shape or self.v.shape != shape:
                raise ValueError(f"kv pool arrays of shape {tuple(self.k.shape)}, want {shape}")
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        host_shape = (cfg.num_layers, host_pages, *shape[2:])
        pin = torch.device(device).type == "cuda"  # pinned host memory copies asynchronously
        self.host_k = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
        self.host_v = torch.zeros(host_shape, dtype=dtype, pin_memory=pin)
        # Low ids last so that pop() hands them out first: easier to read in dumps.
        self._free = {
            DEVICE: list(range(num_pages - 1, -1, -1)),
            HOST: list(range(host_pages - 1, -1, -1)),
        }

    @property
    def free_count(self) -> int:
        return len(self._free[DEVICE])

    def free_in(self, tier: str) -> int:
        return len(self._free[tier])

    def capacity(self, tier: str) -> int:
        return self.num_pages if tier == DEVICE else self.host_pages

    @property
    def page_bytes(self) -> int:
        return page_bytes(self.config, self.page_size, self.dtype)

    def allocate(self, n: int, tier: str = DEVICE) -> list[int]:
        free = self._free[tier]
        if n > len(free):
            raise PoolExhausted(f"kv pool: {n} {tier} pages wanted, {len(free)} free")
        return [free.pop() for _ in range(n)]

    def free(self, pages: list[int], tier: str = DEVICE) -> None:
        self._free[tier].extend(reversed(pages))

    def _arrays(self, tier: str) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.k, self.v) if tier == DEVICE else (self.host_k, self.host_v)

    def copy_page(self, src: int, dst: int) -> None:
        """Device page src to device page dst, every layer."""
        self.k[:, dst].copy_(self.k[:, src])
        self.v[:, dst].copy_(self.v[:, src])

    def move(self, page: int, src: str, dst: str) -> int:
        """Copy a page to another tier and free it here; returns its id there."""
        (new,) = self.allocate(1, dst)
        (sk, sv), (dk, dv) = self._arrays(src), self._arrays(dst)
        dk[:, new].copy_(sk[:, page])
        dv[:, new].copy_(sv[:, page])
        self.free([page], src)
        return new

    def read_page(self, page: int, tier: str = DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a whole page on the CPU: two [layers, page_size, heads, dim]."""
        k, v = self._arrays(tier)
        return k[:, page].to("cpu", copy=True), v[:, page].to("cpu", copy=True)

    def write_page(self, page: int, k: torch.Tensor, v: torch.Tensor, tier: str = DEVICE) -> None:
        dk, dv = self._arrays(tier)
        dk[:, page].copy_(k)
        dv[:, page].copy_(v)

    def write_rows(self, page: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        rows = slice(start, start + k.shape[1])
        self.k[:, page, rows].copy_(k)
        self.v[:, page, rows].copy_(v)
