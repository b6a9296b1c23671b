"""The KV pool: the memory kvfs manages, every layer's K and V pages, allocated once at start.

A page holds `page_size` entries of every layer's K and V. Its shape (`PageShape`: layers, KV
heads, head dim, page size, dtype) is all the pool knows of the model. There are three tiers:
DEVICE, the arrays the attention kernels read; HOST, CPU memory that idle files move down to;
DISK, a swap file (kvfs/pages.py). Page ids are per tier; who holds a page and for how long is
kvfs's business (pages.py), never the pool's.

Tensor parallelism. With N ranks, rank r computes attention for the KV heads of its shard, so
the device tier is N shard arrays, K and V each, shard r of shape
[layers, pages, page_size, heads of r, head_dim], the layout `kernels/` reads. KV heads are
split in contiguous blocks (`shard_heads`); a model with fewer KV heads than ranks has them
replicated, rank r holding head r * kv_heads // N, as vLLM does. A page id names the same page
in every shard, and every page operation here (copy-on-write copies, moves between tiers,
writes, row moves) applies to every shard. The host tier stays whole, in the canonical layout
[layers, pages, page_size, kv_heads, head_dim]: moving a page down gathers the shards (each
head from the first rank holding it), moving it up scatters. Reads for export come back
canonical, and imports are scattered, so the KV file format does not depend on N. N = 1 is the
one-shard case: shard 0 is the whole layout, as before sharding.

The interface a tensor-parallel engine uses:
- `KVPool(shape, pages, host_pages, device, shards=N)` allocates N shards; or pass
  `arrays=[(k0, v0), ..., (kN-1, vN-1)]`, zeroed tensors of `pool_shard_shape(shape, pages, N,
  r)` in memory of the caller's (shared with the engine processes, on each rank's device).
- `pool.shard(r)` is rank r's (k, v) device arrays; `pool.heads(r)` (= `shard_heads(kv_heads,
  N, r)`) the global KV heads they hold, in order.
- `pool.key_layers()` is every shard's every layer's K array, for rotating keys in place
  (kvfs's shift hands the rows to rotate to the engine, which owns the rotary math).
- A rank's own engine computes in a one-shard pool over its shard's arrays (`PageShape` with
  that rank's head count), where `pool.k` and `pool.v` are the device tier.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

DEVICE, HOST, DISK = "device", "host", "disk"
TIERS = (DEVICE, HOST, DISK)


class PoolExhausted(MemoryError):
    """Not enough free pages; nothing was allocated."""


@dataclass(frozen=True)
class PageShape:
    """What one page holds: `page_size` entries of `layers` layers of `kv_heads` heads."""

    layers: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    def __post_init__(self):
        dims = (self.layers, self.kv_heads, self.head_dim, self.page_size)
        if min(dims) < 1:
            raise ValueError(
                f"kv page shape needs layers, kv heads, head dim and page size "
                f">= 1; got {', '.join(map(str, dims))}"
            )

    @property
    def dims(self) -> tuple[int, int, int, int]:
        """One page's K (or V), canonical: [layers, page_size, kv_heads, head_dim]."""
        return self.layers, self.page_size, self.kv_heads, self.head_dim

    @property
    def bytes(self) -> int:
        """Bytes of one page: K and V of every layer and head."""
        return (
            2 * self.layers * self.page_size * self.kv_heads * self.head_dim * self.dtype.itemsize
        )


def shard_heads(kv_heads: int, shards: int, rank: int) -> range:
    """The global KV heads rank `rank` of `shards` holds: a contiguous block of
    kv_heads / shards, or, with fewer heads than ranks, the one head rank * kv_heads // shards."""
    if not 0 <= rank < shards:
        raise ValueError(f"kv pool: rank {rank} outside [0, {shards})")
    if kv_heads >= shards:
        if kv_heads % shards:
            raise ValueError(f"kv pool: {kv_heads} KV heads do not split over {shards} ranks")
        per = kv_heads // shards
        return range(rank * per, (rank + 1) * per)
    if shards % kv_heads:
        raise ValueError(f"kv pool: {shards} ranks do not share {kv_heads} KV heads evenly")
    head = rank * kv_heads // shards
    return range(head, head + 1)


def pool_shard_shape(shape: PageShape, pages: int, shards: int, rank: int) -> tuple[int, ...]:
    """Shape of rank `rank`'s device K (or V) array: [layers, pages, page_size, heads, dim]."""
    heads = len(shard_heads(shape.kv_heads, shards, rank))
    return shape.layers, pages, shape.page_size, heads, shape.head_dim


def pages_for_fraction(shape: PageShape, device: torch.device, fraction: float) -> int:
    """How many pages of `shape` fit in `fraction` of the device's free memory."""
    if not 0 < fraction <= 1:
        raise ValueError(f"kv memory fraction must be in (0, 1], got {fraction}")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(1, int(free * fraction) // shape.bytes)


class KVPool:
    """The device tier (N shards) and the host tier (whole) of pages; see the module's
    docstring for the layout."""

    def __init__(
        self,
        shape: PageShape,
        num_pages: int,
        host_pages: int = 0,
        device: str | torch.device = "cpu",
        shards: int = 1,
        *,
        arrays: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    ):
        """`arrays`: each shard's device K and V, zeroed, in memory of the caller's (shared
        with the engine processes: engine_process.py); else they are allocated on `device`."""
        if num_pages < 1 or host_pages < 0 or shards < 1:
            raise ValueError(
                f"kv pool needs pages >= 1, host pages >= 0, shards >= 1; "
                f"got {num_pages}, {host_pages}, {shards}"
            )
        self.shape, self.num_pages, self.host_pages = shape, num_pages, host_pages
        self.page_size, self.dtype, self.shards = shape.page_size, shape.dtype, shards
        self._heads = [shard_heads(shape.kv_heads, shards, r) for r in range(shards)]
        self._slices = [slice(h.start, h.stop) for h in self._heads]
        # The ranks whose heads a gather takes: the first holder of each head, in head order.
        self._owners = [r for r in range(shards) if r == 0 or self._heads[r] != self._heads[r - 1]]
        want = [pool_shard_shape(shape, num_pages, shards, r) for r in range(shards)]
        if arrays is None:
            arrays = [
                (
                    torch.zeros(s, dtype=shape.dtype, device=device),
                    torch.zeros(s, dtype=shape.dtype, device=device),
                )
                for s in want
            ]
        got = [(tuple(k.shape), tuple(v.shape)) for k, v in arrays]
        if got != [(s, s) for s in want]:
            raise ValueError(f"kv pool arrays of shapes {got}, want K and V of {want}")
        if any(t.dtype != shape.dtype for pair in arrays for t in pair):
            raise ValueError(f"kv pool arrays must be of dtype {shape.dtype}")
        self._shards = [tuple(pair) for pair in arrays]
        host_shape = (shape.layers, host_pages, *shape.dims[1:])
        pin = any(k.device.type == "cuda" for k, _ in self._shards)  # copies asynchronously
        self.host_k = torch.zeros(host_shape, dtype=shape.dtype, pin_memory=pin)
        self.host_v = torch.zeros(host_shape, dtype=shape.dtype, pin_memory=pin)
        # Low ids last so that pop() hands them out first: easier to read in dumps.
        self._free = {
            DEVICE: list(range(num_pages - 1, -1, -1)),
            HOST: list(range(host_pages - 1, -1, -1)),
        }

    # -- shards ---------------------------------------------------------------------------

    def shard(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank `rank`'s device K and V: [layers, pages, page_size, heads(rank), head_dim]."""
        return self._shards[rank]

    def heads(self, rank: int) -> range:
        """The global KV heads shard `rank` holds, in its order."""
        return self._heads[rank]

    @property
    def k(self) -> torch.Tensor:
        """The device tier's K of a one-shard pool (an engine's own)."""
        return self._one()[0]

    @property
    def v(self) -> torch.Tensor:
        """The device tier's V of a one-shard pool (an engine's own)."""
        return self._one()[1]

    def _one(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.shards != 1:
            raise ValueError(f"kv pool of {self.shards} shards: use shard(rank)")
        return self._shards[0]

    def key_layers(self) -> Iterator[torch.Tensor]:
        """Every shard's every layer's device K, [pages, page_size, heads, dim] each."""
        for k, _ in self._shards:
            yield from k

    # -- allocation -----------------------------------------------------------------------

    @property
    def free_count(self) -> int:
        return len(self._free[DEVICE])

    def free_in(self, tier: str) -> int:
        return len(self._free[tier])

    def capacity(self, tier: str) -> int:
        return self.num_pages if tier == DEVICE else self.host_pages

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in the canonical layout (replicated heads counted once)."""
        return self.shape.bytes

    def allocate(self, n: int, tier: str = DEVICE) -> list[int]:
        free = self._free[tier]
        if n > len(free):
            raise PoolExhausted(f"kv pool: {n} {tier} pages wanted, {len(free)} free")
        return [free.pop() for _ in range(n)]

    def free(self, pages: list[int], tier: str = DEVICE) -> None:
        self._free[tier].extend(reversed(pages))

    # -- contents -------------------------------------------------------------------------

    def _get(self, tier: str, index: tuple, k: torch.Tensor, v: torch.Tensor) -> None:
        """Copy the tier's entries at `index` (basic indexing of [layers, pages, ...]) into
        canonical k and v: gathered from the shards on the device."""
        if tier == HOST:
            k.copy_(self.host_k[index])
            v.copy_(self.host_v[index])
            return
        for r in self._owners:
            sk, sv = self._shards[r]
            k[..., self._slices[r], :].copy_(sk[index])
            v[..., self._slices[r], :].copy_(sv[index])

    def _put(self, tier: str, index: tuple, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write canonical k and v to the tier's entries at `index`: scattered on the device."""
        if tier == HOST:
            self.host_k[index].copy_(k)
            self.host_v[index].copy_(v)
            return
        for (sk, sv), heads in zip(self._shards, self._slices, strict=True):
            sk[index].copy_(k[..., heads, :])
            sv[index].copy_(v[..., heads, :])

    def copy_page(self, src: int, dst: int) -> None:
        """Device page src to device page dst, every layer of every shard."""
        for sk, sv in self._shards:
            sk[:, dst].copy_(sk[:, src])
            sv[:, dst].copy_(sv[:, src])

    def move(self, page: int, src: str, dst: str) -> int:
        """Copy a page between the device and the host tier (gathered going down, scattered
        going up) and free it here; returns its id there."""
        (new,) = self.allocate(1, dst)
        if src == HOST:
            self._put(dst, (slice(None), new), self.host_k[:, page], self.host_v[:, page])
        else:
            self._get(src, (slice(None), page), self.host_k[:, new], self.host_v[:, new])
        self.free([page], src)
        return new

    def read_page(self, page: int, tier: str = DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a whole page on the CPU, canonical: two [layers, page_size, heads, dim]."""
        k, v = (torch.empty(self.shape.dims, dtype=self.dtype) for _ in range(2))
        self._get(tier, (slice(None), page), k, v)
        return k, v

    def write_page(self, page: int, k: torch.Tensor, v: torch.Tensor, tier: str = DEVICE) -> None:
        """Fill a page with canonical K and V, [layers, page_size, heads, dim] each."""
        self._put(tier, (slice(None), page), k, v)

    def write_rows(self, page: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Device page rows from `start` on: canonical [layers, rows, heads, dim] each."""
        self._put(DEVICE, (slice(None), page, slice(start, start + k.shape[1])), k, v)

    def write_pages(self, pages: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Whole device pages in one scatter: canonical [layers, len(pages), page_size,
        heads, dim] each."""
        for (sk, sv), heads in zip(self._shards, self._slices, strict=True):
            ids = torch.tensor(pages, device=sk.device)
            sk.index_copy_(1, ids, k[..., heads, :].to(sk.device))
            sv.index_copy_(1, ids, v[..., heads, :].to(sv.device))

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        """Device rows (page * page_size + offset) src[i] to dst[i], every layer and shard:
        one gather, then one scatter, so that the two may overlap."""
        for cache in (t for pair in self._shards for t in pair):
            rows = cache.view(cache.shape[0], -1, *cache.shape[3:])
            rows[:, torch.tensor(dst, device=cache.device)] = rows[
                :, torch.tensor(src, device=cache.device)
            ]

    def layer_pages(self, tier: str, which: int, layer: int, pages: list[int]) -> torch.Tensor:
        """K (`which` 0) or V (1) of one layer of some device or host pages, canonical on
        the CPU: [len(pages), page_size, kv_heads, head_dim]."""
        if tier == HOST:
            parts = [(self.host_k, self.host_v)[which][layer]]
        else:
            parts = [self._shards[r][which][layer] for r in self._owners]
        # On the CPU by numpy indexing of byte views: small torch ops there fan out to OpenMP
        # threads, which stall badly on a busy machine.
        got = [
            p.view(torch.uint8).numpy()[pages]
            if p.device.type == "cpu"
            else p.index_select(0, torch.tensor(pages, device=p.device))
            .cpu()
            .view(torch.uint8)
            .numpy()
            for p in parts
        ]
        whole = got[0] if len(got) == 1 else np.concatenate(got, axis=-2)
        return torch.from_numpy(whole).view(self.dtype)
