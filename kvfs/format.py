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
from kvfs.pages import Page, PageStore
from kvfs.pool import DEVICE, DISK, HOST, KVPool
from kvfs.ranges import overlapping

MAGIC = "symphony-kv"
VERSION = "1"
# Our header is a few hundred bytes whatever N is (tokens live in tensors, not the JSON);
# the bound only stops a hostile length from making us read or parse megabytes.
MAX_HEADER = 1 << 20
# Bytes of a file's entry besides its K and V: token id, position, and at most one excluded
# range (16 bytes) per entry, since ranges are non-empty and disjoint.
ENTRY_EXTRA = 32

DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
_DTYPES = {name: dt for dt, name in DTYPE_NAMES.items()}
# Integer views of the same width: excluded rows must be zero *bits* (-0.0 == 0.0 but would
# make two byte streams for one file).
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
_NP_BITS = {torch.int32: np.dtype("<i4"), torch.int16: np.dtype("<i2")}
INT_TENSORS = ("token_ids", "positions", "excluded")
TENSORS = (*INT_TENSORS, "k", "v")
META_KEYS = ("format", "version", "fingerprint", "dtype", "page_size", "layers", "kv_heads",
             "head_dim")
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


def largest_file(pages: int, page_size: int, page_bytes: int) -> int:
    """Bytes of the largest file `pages` pages of `page_bytes` bytes could hold: an entry
    for every row, each with an excluded range, and the largest header the format allows."""
    return 8 + MAX_HEADER + pages * page_size * (page_bytes // page_size + ENTRY_EXTRA)


def _bad(message: str) -> FSError:
    return FSError(errno.EINVAL, f"kv file: {message}")


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

    def metadata(self) -> dict[str, str]:
        return {"format": MAGIC, "version": VERSION, "fingerprint": self.fingerprint,
                "dtype": DTYPE_NAMES[self.dtype], "page_size": str(self.page_size),
                "layers": str(self.layers), "kv_heads": str(self.kv_heads),
                "head_dim": str(self.head_dim)}


# -- export -------------------------------------------------------------------------------


def _shapes(n: int, r: int, layout: Layout) -> dict[str, tuple[str, list[int]]]:
    kv = (DTYPE_NAMES[layout.dtype], [layout.layers, n, layout.kv_heads, layout.head_dim])
    return {"token_ids": ("I64", [n]), "positions": ("I64", [n]), "excluded": ("I64", [r, 2]),
            "k": kv, "v": kv}


def _plan(n: int, r: int, layout: Layout) -> tuple[bytes, list[tuple[str, int, int]]]:
    """The 8-byte length and padded JSON header, and each region's absolute [start, end)."""
    head: dict = {"__metadata__": layout.metadata()}
    spans, off = [], 0
    for name, (dtype, shape) in _shapes(n, r, layout).items():
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
class Header:
    """A checked header: the file's own layout and where each tensor's bytes lie."""

    layout: Layout  # as the file states it; page_size is the exporter's
    length: int  # entries, N
    ranges: int  # excluded ranges, R
    offsets: dict[str, tuple[int, int]]  # tensor -> absolute [begin, end) in the file
    size: int  # bytes of the whole file, as the header lays it out


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


def header_length(first8: bytes, file_size: int | None) -> int:
    """The JSON header's length from the file's first 8 bytes, checked against the file's
    size when it is known (None: an import stream, whose size is known only at its end)."""
    size = len(first8) if file_size is None else file_size
    if size < 8 or len(first8) < 8:
        raise _bad(f"truncated: {size} bytes, fewer than the 8-byte header length")
    (n,) = struct.unpack("<Q", bytes(first8[:8]))
    if n < 2 or n > MAX_HEADER:
        raise _bad(f"bad header length {n} (must be 2..{MAX_HEADER})")
    if file_size is not None and 8 + n > file_size:
        raise _bad(f"truncated: header length {n} runs past the end of the {file_size}-byte file")
    return n


def _no_duplicates(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise _bad(f"header JSON repeats a key among {sorted(keys)}")
    return dict(pairs)


def _no_constant(name: str):
    raise _bad(f"header JSON has non-standard constant {name}")


def _count(meta: dict, key: str) -> int:
    value = meta[key]
    if not (value.isascii() and value.isdigit()) or str(int(value)) != value or int(value) < 1:
        raise _bad(f"metadata {key} {value!r} is not a positive integer")
    return int(value)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_header(prefix: bytes, file_size: int | None, layout: Layout | None = None) -> Header:
    """Check the header of a `file_size`-byte file whose first bytes are `prefix` (at least
    8 + header_length of them): structure, metadata, tensor table, and that the tensors tile
    the rest of the file exactly (when its size is known). With `layout`, the file must also
    match it."""
    n_head = header_length(prefix, file_size)
    if len(prefix) < 8 + n_head:
        raise _bad(f"truncated: header needs {8 + n_head} bytes, got {len(prefix)}")
    try:
        head = json.loads(bytes(prefix[8:8 + n_head]).decode("utf-8"),
                          object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except UnicodeDecodeError as e:
        raise _bad(f"header is not UTF-8 ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise _bad(f"header is not valid JSON ({e.msg} at {e.pos})") from None
    except RecursionError:  # json's decoder recurses once per level of nesting
        raise _bad("header JSON nests too deep") from None
    if not isinstance(head, dict):
        raise _bad(f"header JSON is a {type(head).__name__}, not an object")

    meta = head.pop("__metadata__", None)
    if not isinstance(meta, dict):
        raise _bad("header has no __metadata__ object")
    for key, value in meta.items():
        if not isinstance(value, str):
            raise _bad(f"metadata {key} is not a string")
    if meta.get("format") != MAGIC:
        raise _bad(f"not a symphony KV file (metadata format {meta.get('format')!r}, "
                   f"expected {MAGIC!r})")
    if meta.get("version") != VERSION:
        raise _bad(f"unsupported version {meta.get('version')!r} (this kernel reads {VERSION!r})")
    for key in META_KEYS:
        if key not in meta:
            raise _bad(f"metadata has no {key}")
    for key in meta:
        if key not in META_KEYS:
            raise _bad(f"unknown metadata key {key!r}")
    if layout is not None and meta["fingerprint"] != layout.fingerprint:
        raise _bad(f"file belongs to another model: its fingerprint is "
                   f"{meta['fingerprint']!r}, this model's is {layout.fingerprint!r}")
    if meta["dtype"] not in _DTYPES:
        raise _bad(f"metadata dtype {meta['dtype']!r} is not one of {sorted(_DTYPES)}")
    own = Layout(meta["fingerprint"], _DTYPES[meta["dtype"]], _count(meta, "page_size"),
                 _count(meta, "layers"), _count(meta, "kv_heads"), _count(meta, "head_dim"))
    if layout is not None:
        if own.dtype != layout.dtype:
            raise _bad(f"dtype {meta['dtype']} does not match the pool's "
                       f"{DTYPE_NAMES[layout.dtype]}")
        # page_size is not compared: entries are stored flat and import re-pages them.
        for key in ("layers", "kv_heads", "head_dim"):
            if getattr(own, key) != getattr(layout, key):
                raise _bad(f"{key} {getattr(own, key)} does not match the model's "
                           f"{getattr(layout, key)}")

    for name in TENSORS:
        if name not in head:
            raise _bad(f"missing tensor {name}")
    for name in head:
        if name not in TENSORS:
            raise _bad(f"unexpected tensor {name!r}")
    entries = {}
    for name in TENSORS:
        e = head[name]
        if not isinstance(e, dict) or set(e) != _ENTRY_KEYS:
            raise _bad(f"tensor {name} entry must have exactly {sorted(_ENTRY_KEYS)}")
        shape, offs = e["shape"], e["data_offsets"]
        if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
            raise _bad(f"tensor {name} shape {shape!r} is not a list of sizes")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise _bad(f"tensor {name} data_offsets {offs!r} are not [begin, end]")
        entries[name] = (e["dtype"], shape, offs)

    n = entries["token_ids"][1][0] if len(entries["token_ids"][1]) == 1 else -1
    r = entries["excluded"][1][0] if len(entries["excluded"][1]) == 2 else -1
    want = _shapes(n, r, own)
    for name, (dtype, shape, (begin, end)) in entries.items():
        if dtype != want[name][0]:
            raise _bad(f"tensor {name} dtype {dtype!r}, expected {want[name][0]}")
        if shape != want[name][1]:
            raise _bad(f"tensor {name} shape {shape}, expected {_shape_rule(name, own)}")
        size = prod(shape) * (8 if dtype == "I64" else own.dtype.itemsize)
        if end - begin != size:
            raise _bad(f"tensor {name} data_offsets [{begin}, {end}] hold {end - begin} bytes, "
                       f"its shape needs {size}")
    # Ranges are non-empty and disjoint, so at most N: the file's size is bounded by N alone.
    if r > n:
        raise _bad(f"tensor excluded has {r} ranges, more than the file's {n} entries allow")

    # The tensors must tile the data section: no gaps, no overlap, nothing after.
    data_start, pos = 8 + n_head, 0
    for name, (_, _, (begin, end)) in sorted(entries.items(), key=lambda x: tuple(x[1][2])):
        if begin < pos:
            raise _bad(f"tensor {name} data_offsets [{begin}, {end}] overlap the tensor "
                       f"before it (which ends at {pos})")
        if begin > pos:
            raise _bad(f"gap of {begin - pos} bytes before tensor {name}")
        pos = end
    size = data_start + pos
    if file_size is not None and size > file_size:
        raise _bad(f"truncated: tensors need {size} bytes, file has {file_size}")
    if file_size is not None and size < file_size:
        raise _bad(f"{file_size - size} bytes of trailing data after the tensors")
    offsets = {nm: (data_start + e[2][0], data_start + e[2][1]) for nm, e in entries.items()}
    return Header(own, n, r, offsets, size)


def _shape_rule(name: str, own: Layout) -> str:
    if name in ("token_ids", "positions"):
        return "[N] (the same N for token_ids, positions, k and v)"
    if name == "excluded":
        return "[R, 2]"
    return f"[{own.layers}, N, {own.kv_heads}, {own.head_dim}]"


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
    rest, and no more bytes are kept than the header declares."""

    def __init__(self, layout: Layout, admit: Callable[[Header], None]):
        self.layout, self.admit = layout, admit
        self._head = bytearray()  # what came before the header was whole
        self._body: np.ndarray | None = None  # then the whole file, its declared size
        self._got = 0

    def feed(self, piece: bytes) -> None:
        if self._body is None:
            self._head += piece
            if len(self._head) < 8 or len(self._head) < 8 + header_length(self._head, None):
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
