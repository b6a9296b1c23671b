"""The header of a KV file's canonical form (docs/kv-format.md), read and checked without
torch: the mount checks what is written to it with this alone, and so never loads torch
(seconds, the first time), while kvfs.format builds on it to read and write whole files.
"""

from __future__ import annotations

import errno
import json
import struct
from dataclasses import dataclass
from math import prod

from kvfs.errors import FSError

MAGIC = "symphony-kv"
VERSION = "1"
# Our header is a few hundred bytes whatever N is (tokens live in tensors, not the JSON);
# the bound only stops a hostile length from making us read or parse megabytes.
MAX_HEADER = 1 << 20
# Bytes of a file's entry besides its K and V: token id, position, and at most one excluded
# range (16 bytes) per entry, since ranges are non-empty and disjoint.
ENTRY_EXTRA = 32
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2}  # the K/V dtypes, by their names in headers
INT_TENSORS = ("token_ids", "positions", "excluded")
TENSORS = (*INT_TENSORS, "k", "v")
META_KEYS = ("format", "version", "fingerprint", "dtype", "page_size", "layers", "kv_heads",
             "head_dim")
_ENTRY_KEYS = {"dtype", "shape", "data_offsets"}


def largest_file(pages: int, page_size: int, page_bytes: int) -> int:
    """Bytes of the largest file `pages` pages of `page_bytes` bytes could hold: an entry
    for every row, each with an excluded range, and the largest header the format allows."""
    return 8 + MAX_HEADER + pages * page_size * (page_bytes // page_size + ENTRY_EXTRA)


def bad(message: str) -> FSError:
    return FSError(errno.EINVAL, f"kv file: {message}")


@dataclass(frozen=True)
class Shape:
    """A file's layout as its header names it: the model, the K/V dtype's name, the page
    shape."""

    fingerprint: str
    dtype: str  # a key of DTYPE_BYTES
    page_size: int
    layers: int
    kv_heads: int
    head_dim: int

    def metadata(self) -> dict[str, str]:
        return {"format": MAGIC, "version": VERSION, "fingerprint": self.fingerprint,
                "dtype": self.dtype, "page_size": str(self.page_size),
                "layers": str(self.layers), "kv_heads": str(self.kv_heads),
                "head_dim": str(self.head_dim)}


@dataclass(frozen=True)
class RawHeader:
    """A checked header, by names: the file's own layout and where each tensor's bytes lie."""

    shape: Shape  # as the file states it; page_size is the exporter's
    length: int  # entries, N
    ranges: int  # excluded ranges, R
    offsets: dict[str, tuple[int, int]]  # tensor -> absolute [begin, end) in the file
    size: int  # bytes of the whole file, as the header lays it out


def tensor_shapes(n: int, r: int, shape: Shape) -> dict[str, tuple[str, list[int]]]:
    """Each tensor's dtype name and shape, for N entries and R excluded ranges."""
    kv = (shape.dtype, [shape.layers, n, shape.kv_heads, shape.head_dim])
    return {"token_ids": ("I64", [n]), "positions": ("I64", [n]), "excluded": ("I64", [r, 2]),
            "k": kv, "v": kv}


def header_length(first8: bytes, file_size: int | None) -> int:
    """The JSON header's length from the file's first 8 bytes, checked against the file's
    size when it is known (None: an import stream, whose size is known only at its end)."""
    size = len(first8) if file_size is None else file_size
    if size < 8 or len(first8) < 8:
        raise bad(f"truncated: {size} bytes, fewer than the 8-byte header length")
    (n,) = struct.unpack("<Q", bytes(first8[:8]))
    if n < 2 or n > MAX_HEADER:
        raise bad(f"bad header length {n} (must be 2..{MAX_HEADER})")
    if file_size is not None and 8 + n > file_size:
        raise bad(f"truncated: header length {n} runs past the end of the {file_size}-byte file")
    return n


def _no_duplicates(pairs: list) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise bad(f"header JSON repeats a key among {sorted(keys)}")
    return dict(pairs)


def _no_constant(name: str):
    raise bad(f"header JSON has non-standard constant {name}")


# Digits of an integer the header may hold: an int64's. Python refuses to convert more
# than 4300 digits (ValueError), which would otherwise escape the checks.
MAX_DIGITS = 19


def _json_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise bad(f"header JSON has an integer of {len(text)} characters, past an int64")
    return int(text)


def _count(meta: dict, key: str) -> int:
    value = meta[key]
    if (not (value.isascii() and value.isdigit()) or len(value) > MAX_DIGITS
            or str(int(value)) != value or int(value) < 1):
        shown = value if len(value) <= 40 else f"{value[:20]}... ({len(value)} characters)"
        raise bad(f"metadata {key} {shown!r} is not a positive integer")
    return int(value)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_header(prefix: bytes, file_size: int | None, want: Shape | None = None) -> RawHeader:
    """Check the header of a `file_size`-byte file whose first bytes are `prefix` (at least
    8 + header_length of them): structure, metadata, tensor table, and that the tensors tile
    the rest of the file exactly (when its size is known). With `want`, the file must also
    match it (but for page_size: entries are stored flat, and an import re-pages them)."""
    n_head = header_length(prefix, file_size)
    if len(prefix) < 8 + n_head:
        raise bad(f"truncated: header needs {8 + n_head} bytes, got {len(prefix)}")
    try:
        head = json.loads(bytes(prefix[8:8 + n_head]).decode("utf-8"),
                          object_pairs_hook=_no_duplicates, parse_constant=_no_constant,
                          parse_int=_json_int)
    except UnicodeDecodeError as e:
        raise bad(f"header is not UTF-8 ({e.reason})") from None
    except json.JSONDecodeError as e:
        raise bad(f"header is not valid JSON ({e.msg} at {e.pos})") from None
    except RecursionError:  # json's decoder recurses once per level of nesting
        raise bad("header JSON nests too deep") from None
    if not isinstance(head, dict):
        raise bad(f"header JSON is a {type(head).__name__}, not an object")
    own = _metadata(head.pop("__metadata__", None), want)
    entries = _tensor_table(head)
    n = entries["token_ids"][1][0] if len(entries["token_ids"][1]) == 1 else -1
    r = entries["excluded"][1][0] if len(entries["excluded"][1]) == 2 else -1
    expected = tensor_shapes(n, r, own)
    for name, (dtype, shape, (begin, end)) in entries.items():
        if dtype != expected[name][0]:
            raise bad(f"tensor {name} dtype {dtype!r}, expected {expected[name][0]}")
        if shape != expected[name][1]:
            raise bad(f"tensor {name} shape {shape}, expected {_shape_rule(name, own)}")
        size = prod(shape) * (8 if dtype == "I64" else DTYPE_BYTES[own.dtype])
        if end - begin != size:
            raise bad(f"tensor {name} data_offsets [{begin}, {end}] hold {end - begin} bytes, "
                      f"its shape needs {size}")
    # Ranges are non-empty and disjoint, so at most N: the file's size is bounded by N alone.
    if r > n:
        raise bad(f"tensor excluded has {r} ranges, more than the file's {n} entries allow")

    # The tensors must tile the data section: no gaps, no overlap, nothing after.
    data_start, pos = 8 + n_head, 0
    for name, (_, _, (begin, end)) in sorted(entries.items(), key=lambda x: tuple(x[1][2])):
        if begin < pos:
            raise bad(f"tensor {name} data_offsets [{begin}, {end}] overlap the tensor "
                      f"before it (which ends at {pos})")
        if begin > pos:
            raise bad(f"gap of {begin - pos} bytes before tensor {name}")
        pos = end
    size = data_start + pos
    if file_size is not None and size > file_size:
        raise bad(f"truncated: tensors need {size} bytes, file has {file_size}")
    if file_size is not None and size < file_size:
        raise bad(f"{file_size - size} bytes of trailing data after the tensors")
    offsets = {nm: (data_start + e[2][0], data_start + e[2][1]) for nm, e in entries.items()}
    return RawHeader(own, n, r, offsets, size)


def _metadata(meta: object, want: Shape | None) -> Shape:
    """The file's layout from its __metadata__, checked (and against `want`)."""
    if not isinstance(meta, dict):
        raise bad("header has no __metadata__ object")
    for key, value in meta.items():
        if not isinstance(value, str):
            raise bad(f"metadata {key} is not a string")
    if meta.get("format") != MAGIC:
        raise bad(f"not a symphony KV file (metadata format {meta.get('format')!r}, "
                  f"expected {MAGIC!r})")
    if meta.get("version") != VERSION:
        raise bad(f"unsupported version {meta.get('version')!r} (this kernel reads {VERSION!r})")
    for key in META_KEYS:
        if key not in meta:
            raise bad(f"metadata has no {key}")
    for key in meta:
        if key not in META_KEYS:
            raise bad(f"unknown metadata key {key!r}")
    if want is not None and meta["fingerprint"] != want.fingerprint:
        raise bad(f"file belongs to another model: its fingerprint is "
                  f"{meta['fingerprint']!r}, this model's is {want.fingerprint!r}")
    if meta["dtype"] not in DTYPE_BYTES:
        raise bad(f"metadata dtype {meta['dtype']!r} is not one of {sorted(DTYPE_BYTES)}")
    own = Shape(meta["fingerprint"], meta["dtype"], _count(meta, "page_size"),
                _count(meta, "layers"), _count(meta, "kv_heads"), _count(meta, "head_dim"))
    if want is not None:
        if own.dtype != want.dtype:
            raise bad(f"dtype {meta['dtype']} does not match the pool's {want.dtype}")
        for key in ("layers", "kv_heads", "head_dim"):
            if getattr(own, key) != getattr(want, key):
                raise bad(f"{key} {getattr(own, key)} does not match the model's "
                          f"{getattr(want, key)}")
    return own


def _tensor_table(head: dict) -> dict[str, tuple]:
    """Each tensor's (dtype, shape, data_offsets), checked for form."""
    for name in TENSORS:
        if name not in head:
            raise bad(f"missing tensor {name}")
    for name in head:
        if name not in TENSORS:
            raise bad(f"unexpected tensor {name!r}")
    entries = {}
    for name in TENSORS:
        e = head[name]
        if not isinstance(e, dict) or set(e) != _ENTRY_KEYS:
            raise bad(f"tensor {name} entry must have exactly {sorted(_ENTRY_KEYS)}")
        shape, offs = e["shape"], e["data_offsets"]
        if not (isinstance(shape, list) and all(_is_int(d) and d >= 0 for d in shape)):
            raise bad(f"tensor {name} shape {shape!r} is not a list of sizes")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)
                and 0 <= offs[0] <= offs[1]):
            raise bad(f"tensor {name} data_offsets {offs!r} are not [begin, end]")
        entries[name] = (e["dtype"], shape, offs)
    return entries


def _shape_rule(name: str, own: Shape) -> str:
    if name in ("token_ids", "positions"):
        return "[N] (the same N for token_ids, positions, k and v)"
    if name == "excluded":
        return "[R, 2]"
    return f"[{own.layers}, N, {own.kv_heads}, {own.head_dim}]"
