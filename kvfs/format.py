"""The canonical serialized form of a KV file: a safetensors file (see docs/kv-format.md).

Every region's place in the file follows from the entry count N and the number of excluded
ranges R alone, so the mount can give a file's size without reading it and serve any byte
range of it by reading only the pages that range covers.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from math import prod

import numpy as np
import torch

from kvfs.errors import FSError
from kvfs.inode import Inode
from kvfs.kv_header import (
    INT_TENSORS,
    RawHeader,
    Shape,
    header_length,
    read_header,
    tensor_shapes,
)
from kvfs.kv_header import bad as _bad
from kvfs.pages import Page, PageStore
from kvfs.pool import DEVICE, DISK, HOST, KVPool
from kvfs.ranges import overlapping

DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_DTYPES = {name: dt for dt, name in DTYPE_NAMES.items()}
# Integer views of the same width: excluded rows must be zero *bits* (-0.0 == 0.0 but would
# make two byte streams for one file).
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
_NP_BITS = {torch.int32: np.dtype("<i4"), torch.int16: np.dtype("<i2")}


@dataclass(frozen=True)
class Layout:
    """What a KV file must match to be imported: the model and the pool's page shape."""

    fingerprint: str
    dtype: torch.dtype
    page_size: int
    layers: int
    kv_heads: int
    head_dim: int

    def __post_init__(self):
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"kv format: unsupported dtype {self.dtype}")

    @classmethod
    def of(cls, pool: KVPool, fingerprint: str) -> Layout:
        """The pool's canonical page shape, whatever its shards: the format does not depend
        on tensor parallelism."""
        shape = pool.shape
        return cls(fingerprint, pool.dtype, pool.page_size, shape.layers, shape.kv_heads,
                   shape.head_dim)

    @property
    def row_bytes(self) -> int:
        """Bytes of one entry's K (or V) in one layer."""
        return self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def shape(self) -> Shape:
        """As a header names it."""
        return Shape(self.fingerprint, DTYPE_NAMES[self.dtype], self.page_size, self.layers,
                     self.kv_heads, self.head_dim)

    @classmethod
    def of_shape(cls, shape: Shape) -> Layout:
        return cls(shape.fingerprint, _DTYPES[shape.dtype], shape.page_size, shape.layers,
                   shape.kv_heads, shape.head_dim)


# -- export -------------------------------------------------------------------------------


def _plan(n: int, r: int, layout: Layout) -> tuple[bytes, list[tuple[str, int, int]]]:
    """The 8-byte length and padded JSON header, and each region's absolute [start, end)."""
    head: dict = {"__metadata__": layout.shape.metadata()}
    spans, off = [], 0
    for name, (dtype, shape) in tensor_shapes(n, r, layout.shape).items():
        size = prod(shape) * (8 if dtype == "I64" else layout.dtype.itemsize)
        head[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + size]}
        spans.append((name, off, off + size))
        off += size
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-aligned, as safetensors writers do
    prefix = struct.pack("<Q", len(text)) + text
    base = len(prefix)
    return prefix, [("header", 0, base)] + [(nm, base + a, base + b) for nm, a, b in spans]


def exported_size(inode: Inode, layout: Layout) -> int:
    """Bytes of the file's export, from its lengths alone."""
    return _plan(len(inode.tokens), len(inode.excluded), layout)[1][-1][2]


def export_bytes(inode: Inode, store: PageStore, layout: Layout) -> bytes:
    return read_range(inode, store, layout, 0, exported_size(inode, layout))


def read_range(inode: Inode, store: PageStore, layout: Layout, offset: int, size: int) -> bytes:
    """Bytes [offset, offset + size) of the export (fewer at the end, like read(2)).

    Reads only the pages whose rows the range covers, and of those only the layers it covers.
    """
    if offset < 0 or size < 0:
        raise FSError(errno.EINVAL, f"kv export: bad range offset {offset} size {size}")
    n, r = len(inode.tokens), len(inode.excluded)
    prefix, regions = _plan(n, r, layout)
    stop = min(offset + size, regions[-1][2])
    out, cache = [], {}
    for name, start, end in regions:
        a, b = max(offset, start) - start, min(stop, end) - start
        if a >= b:
            continue
        if name == "header":
            out.append(prefix[a:b])
        elif name == "token_ids":
            out.append(_int_bytes(inode.tokens, a, b))
        elif name == "positions":
            out.append(_int_bytes(inode.positions, a, b))
        elif name == "excluded":
            i0, i1 = a // 16, -(-b // 16)
            pairs = np.asarray(inode.excluded[i0:i1], dtype="<i8").tobytes()
            out.append(pairs[a - i0 * 16:b - i0 * 16])
        else:
            out.append(_kv_bytes(inode, store, layout, name == "v", a, b, cache))
    return b"".join(out)


def _int_bytes(values: list[int], a: int, b: int) -> bytes:
    i0, i1 = a // 8, -(-b // 8)
    return np.asarray(values[i0:i1], dtype="<i8").tobytes()[a - i0 * 8:b - i0 * 8]


def _kv_bytes(inode: Inode, store: PageStore, layout: Layout, is_v: bool, a: int, b: int,
              cache: dict) -> bytes:
    """Bytes [a, b) of the K (or V) tensor, viewed as L*N rows of row_bytes each."""
    n, rb, ps = len(inode.tokens), layout.row_bytes, layout.page_size
    if len(inode.pages) < -(-n // ps):
        raise FSError(errno.EIO, f"kv export: inode {inode.ino} has {len(inode.pages)} pages "
                      f"for {n} entries (pages not loaded?)")
    r0, r1 = a // rb, -(-b // rb)
    pieces = []
    for layer in range(r0 // n, (r1 - 1) // n + 1):
        lo, hi = max(r0 - layer * n, 0), min(r1 - layer * n, n)
        pieces.append(_layer_rows(inode, store, layout, is_v, layer, lo, hi, cache))
    return b"".join(pieces)[a - r0 * rb:b - r0 * rb]


def _layer_rows(inode: Inode, store: PageStore, layout: Layout, is_v: bool, layer: int,
                lo: int, hi: int, cache: dict) -> bytes:
    """Entries [lo, hi) of one layer's K or V: page contents, zeros where excluded."""
    # Assembled in numpy on integer views of the same width (numpy has no bf16): small torch
    # ops on the CPU fan out to OpenMP threads, which stall badly on a busy machine.
    ps, pool, bits = layout.page_size, store.pool, _BITS[layout.dtype]
    p0, p1 = lo // ps, (hi - 1) // ps + 1
    rows = np.zeros((p1 - p0, ps, layout.kv_heads, layout.head_dim), dtype=_NP_BITS[bits])
    pages = inode.pages[p0:p1]
    # Pool-resident pages are sliced straight out of the pool, one gather per tier, so a
    # chunk costs the bytes it covers rather than whole pages of every layer and both K and V.
    for tier in (DEVICE, HOST):
        at = [j for j, p in enumerate(pages) if p is not None and p.tier == tier]
        if at:
            got = pool.layer_pages(tier, is_v, layer, [pages[j].slot for j in at])
            rows[at] = got.view(bits).numpy()
    for j, p in enumerate(pages):
        if p is not None and p.tier not in (DEVICE, HOST):
            rows[j] = _read_page(store, p, cache)[is_v][layer].view(bits).numpy()
    flat = rows.reshape(-1, layout.kv_heads, layout.head_dim)[lo - p0 * ps:hi - p0 * ps]
    for start, end in overlapping(inode.excluded, lo, hi):
        flat[max(start, lo) - lo:min(end, hi) - lo] = 0
    return flat.tobytes()


def _read_page(store: PageStore, page: Page, cache: dict) -> tuple[torch.Tensor, torch.Tensor]:
    # A disk page is read whole; keep it for the other layers and tensor of the same call.
    key = id(page)
    if key not in cache:
        if page.tier != DISK:
            raise FSError(errno.EIO, f"kv export: page {page!r} in unknown tier")
        cache[key] = store.read(page)
    return cache[key]


# -- import -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Header(RawHeader):
    """A checked header (kv_header.RawHeader), with the file's layout in torch's terms."""

    layout: Layout  # as the file states it; page_size is the exporter's


@dataclass
class Meta:
    header: Header
    tokens: list[int]
    positions: list[int]
    excluded: list[tuple[int, int]]


@dataclass
class Imported:
    tokens: list[int]
    positions: list[int]
    excluded: list[tuple[int, int]]
    k: torch.Tensor  # [layers, N, kv_heads, head_dim]
    v: torch.Tensor


def parse_header(prefix: bytes, file_size: int | None, layout: Layout | None = None) -> Header:
    """kv_header.read_header's checks (with `layout`, the file must match it), the file's
    layout in torch's terms."""
    raw = read_header(prefix, file_size, None if layout is None else layout.shape)
    return Header(raw.shape, raw.length, raw.ranges, raw.offsets, raw.size,
                  Layout.of_shape(raw.shape))


def _values(h: Header, raw: dict[str, bytes], vocab_size: int | None
            ) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """Check and decode token ids, positions and excluded ranges."""
    tok, pos, exc = (np.frombuffer(raw[nm], dtype="<i8") for nm in INT_TENSORS)
    for name, arr in (("token id", tok), ("position", pos)):
        bad = np.flatnonzero(arr < 0)
        if bad.size:
            raise _bad(f"{name} {arr[bad[0]]} at entry {bad[0]} is negative")
    if vocab_size is not None:
        bad = np.flatnonzero(tok >= vocab_size)
        if bad.size:
            raise _bad(f"token id {tok[bad[0]]} at entry {bad[0]} is outside the vocabulary "
                       f"(size {vocab_size})")
    exc = exc.reshape(-1, 2)
    prev = 0
    for i, (start, end) in enumerate(exc.tolist()):
        if not 0 <= start < end <= h.length:
            raise _bad(f"excluded range {i} [{start}, {end}) is empty or outside "
                       f"[0, {h.length}]")
        if start < prev:
            raise _bad(f"excluded range {i} [{start}, {end}) is unsorted or overlaps the one "
                       f"before it (which ends at {prev})")
        prev = end
    return tok.tolist(), pos.tolist(), [tuple(x) for x in exc.tolist()]


def parse(data: bytes | bytearray | memoryview, layout: Layout,
          vocab_size: int | None = None) -> Imported:
    """A whole serialized KV file, checked in full; FSError(EINVAL) names the first problem.
    The K/V of a writable buffer are used in place, a read-only one's are copied."""
    buf = memoryview(data).cast("B")
    h = parse_header(buf, len(buf), layout)
    raw = {nm: buf[a:b] for nm, (a, b) in h.offsets.items()}
    tokens, positions, excluded = _values(h, raw, vocab_size)
    shape = (layout.layers, h.length, layout.kv_heads, layout.head_dim)
    kv = []
    for name in ("k", "v"):
        if h.length == 0:
            t = torch.zeros(shape, dtype=layout.dtype)  # frombuffer refuses empty buffers
        else:
            # torch tensors over a buffer may be written through, so it must be writable.
            src = bytearray(raw[name]) if raw[name].readonly else raw[name]
            t = torch.frombuffer(src, dtype=torch.uint8)
            t = t.view(layout.dtype).view(shape)
        bits = t.view(_BITS[layout.dtype])
        for start, end in excluded:
            if bits[:, start:end].any():
                raise _bad(f"{name} of excluded entries [{start}, {end}) is not all zero "
                           f"(not canonical)")
        kv.append(t)
    return Imported(tokens, positions, excluded, kv[0], kv[1])


class Incoming:
    """A serialized KV file arriving in pieces (an import stream), checked as it arrives: the
    header as soon as it is whole, then `admit` judges it before any room is made for the
    rest, and no more bytes are kept than the header declares. Until then `hold` is told
    how many bytes are kept (up to MAX_HEADER and a piece), and may refuse them."""

    def __init__(self, layout: Layout, admit: Callable[[Header], None],
                 hold: Callable[[int], None] = lambda kept: None):
        self.layout, self.admit, self.hold = layout, admit, hold
        self._head = bytearray()  # what came before the header was whole
        self._body: np.ndarray | None = None  # then the whole file, its declared size
        self._got = 0

    def feed(self, piece: bytes) -> None:
        if self._body is None:
            self._head += piece
            if len(self._head) < 8 or len(self._head) < 8 + header_length(self._head, None):
                self.hold(len(self._head))
                return
            header = parse_header(self._head, None, self.layout)
            self.admit(header)
            # Uninitialized: the buffer's memory is taken only as the bytes arrive.
            self._body = np.empty(header.size, dtype=np.uint8)
            piece, self._head = self._head, bytearray()
        if self._got + len(piece) > len(self._body):
            raise _bad(f"more than the {len(self._body)} bytes its header declares")
        self._body[self._got:self._got + len(piece)] = np.frombuffer(piece, dtype=np.uint8)
        self._got += len(piece)

    def data(self) -> memoryview:
        """What has arrived, for `parse` (which names what is missing, if anything)."""
        if self._body is None:
            return memoryview(self._head)
        return memoryview(self._body)[:self._got]


def read_meta(path: str | os.PathLike, layout: Layout | None = None,
              vocab_size: int | None = None) -> Meta:
    """Header, token ids, positions and excluded ranges of a file on disk, without its K/V
    (a restart loads those with `parse` when the file's pages are first used)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        first = f.read(8)
        n_head = header_length(first, size)
        h = parse_header(first + f.read(n_head), size, layout)
        raw = {}
        for name in INT_TENSORS:
            begin, end = h.offsets[name]
            f.seek(begin)
            raw[name] = f.read(end - begin)
            if len(raw[name]) != end - begin:
                raise _bad(f"truncated while reading {name}")
    return Meta(h, *_values(h, raw, vocab_size))
