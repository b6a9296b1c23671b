"""The canonical KV file format: bit-exact round trips, byte ranges, and refusal of bad files."""

from __future__ import annotations

import errno
import json
import random
import stat
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch

from kvfs.errors import FSError
from kvfs.format import (
    Incoming,
    Layout,
    _plan,
    export_bytes,
    exported_size,
    parse,
    parse_header,
    read_meta,
    read_range,
)
from kvfs.inode import Inode
from kvfs.pages import Page, PageStore
from kvfs.pool import DEVICE, DISK, HOST, KVPool, PageShape
from kvfs.ranges import covered

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 8
FP = "test-model-1"
BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def setup(dtype=torch.float32, page_size=4, pages=64, host_pages=0, swap=None, shards=1,
          kv_heads=KV_HEADS):
    """A page store and its layout; the pool's device tier in `shards` shards."""
    pool = KVPool(PageShape(LAYERS, kv_heads, HEAD_DIM, page_size, dtype), pages, host_pages,
                  shards=shards)
    return PageStore(pool, swap, disk_pages=8 if swap else 0), Layout.of(pool, FP)


def make_file(store, layout, n, excluded=(), punched=(), seed=0) -> Inode:
    """A file of n entries with random K/V; `punched` pages become None (rows must be
    excluded)."""
    gen = torch.Generator().manual_seed(seed)
    ps = layout.page_size
    pages: list[Page | None] = list(store.new(-(-n // ps), owner=0))
    shape = (layout.layers, ps, layout.kv_heads, layout.head_dim)
    for p in pages:
        store.write(p, torch.randn(shape, generator=gen).to(layout.dtype),
                    torch.randn(shape, generator=gen).to(layout.dtype))
    for i in punched:
        store.unref([pages[i]], 0)
        pages[i] = None
    rng = random.Random(seed)
    return Inode(ino=1, mode=stat.S_IFREG | 0o600, uid=0, gid=0,
                 tokens=[rng.randrange(100) for _ in range(n)],
                 positions=[i + rng.randrange(3) for i in range(n)],
                 excluded=list(excluded), pages=pages, fingerprint=FP)


def import_into(store, layout, imp) -> Inode:
    pages, size, n = [], layout.page_size, len(imp.tokens)
    for start in range(0, n, size):
        end = min(start + size, n)
        if end - start == size and covered(imp.excluded, start, end):
            pages.append(None)  # the page punch frees
            continue
        (p,) = store.new(1, owner=0)
        k, v = (torch.zeros(t.shape[0], size, *t.shape[2:], dtype=t.dtype) for t in (imp.k, imp.v))
        k[:, :end - start], v[:, :end - start] = imp.k[:, start:end], imp.v[:, start:end]
        store.write(p, k, v)
        pages.append(p)
    return Inode(ino=2, mode=stat.S_IFREG | 0o600, uid=0, gid=0, tokens=imp.tokens,
                 positions=imp.positions, excluded=imp.excluded, pages=pages, fingerprint=FP)


def expected_kv(store, layout, inode):
    """K and V [layers, N, heads, dim] straight from the pages, excluded rows zeroed."""
    n, ps = inode.length, layout.page_size
    out = []
    for which in (0, 1):
        t = torch.zeros((layout.layers, n, layout.kv_heads, layout.head_dim), dtype=layout.dtype)
        for i, p in enumerate(inode.pages):
            if p is not None:
                rows = min(ps, n - i * ps)
                t[:, i * ps:i * ps + rows] = store.read(p)[which][:, :rows]
        for s, e in inode.excluded:
            t[:, s:e] = 0
        out.append(t)
    return out


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


EXCLUDED = [(1, 3), (8, 12), (20, 21)]  # with page_size 4, page 2 is wholly excluded


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_round_trip_bit_exact(dtype):
    store, layout = setup(dtype)
    f = make_file(store, layout, 23, EXCLUDED, punched=[2])  # partial last page, a hole
    data = export_bytes(store=store, inode=f, layout=layout)
    assert len(data) == exported_size(f, layout)
    imp = parse(data, layout, vocab_size=100)
    assert imp.tokens == f.tokens and imp.positions == f.positions
    assert imp.excluded == EXCLUDED
    k, v = expected_kv(store, layout, f)
    assert same_bits(imp.k, k) and same_bits(imp.v, v)
    # Rows outside excluded ranges really are the page contents, not zeros.
    assert imp.k[:, 0].abs().sum() > 0

    g = import_into(store, layout, imp)
    assert g.pages[2] is None
    assert export_bytes(g, store, layout) == data


def test_header_is_canonical_and_aligned():
    store, layout = setup()
    data = export_bytes(make_file(store, layout, 5, [(0, 1)]), store, layout)
    (n,) = struct.unpack("<Q", data[:8])
    assert n % 8 == 0
    head = data[8:8 + n]
    # Compact JSON, then spaces to the 8-byte boundary.
    assert head.rstrip(b" ") == json.dumps(json.loads(head), separators=(",", ":")).encode()
    keys = list(json.loads(head))
    assert keys == ["__metadata__", "token_ids", "positions", "excluded", "k", "v"]
    assert json.loads(head)["__metadata__"] == {
        "format": "symphony-kv", "version": "1", "fingerprint": FP, "dtype": "F32",
        "page_size": "4", "layers": "2", "kv_heads": "2", "head_dim": "8"}


def test_empty_file():
    store, layout = setup()
    f = make_file(store, layout, 0)
    data = export_bytes(f, store, layout)
    assert len(data) == exported_size(f, layout)
    imp = parse(data, layout)
    assert imp.tokens == [] and imp.excluded == [] and imp.k.shape == (2, 0, 2, 8)
    loaded = safetensors.torch.load(data)
    assert loaded["k"].shape == (2, 0, 2, 8) and loaded["excluded"].shape == (0, 2)
    assert export_bytes(import_into(store, layout, imp), store, layout) == data


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_safetensors_opens_it(dtype, tmp_path):
    store, layout = setup(dtype)
    f = make_file(store, layout, 23, EXCLUDED, punched=[2])
    data = export_bytes(f, store, layout)
    loaded = safetensors.torch.load(data)
    imp = parse(data, layout)
    assert loaded["token_ids"].tolist() == f.tokens
    assert loaded["positions"].tolist() == f.positions
    assert loaded["excluded"].tolist() == [list(r) for r in EXCLUDED]
    assert same_bits(loaded["k"], imp.k) and same_bits(loaded["v"], imp.v)
    path = tmp_path / "f.kv"
    path.write_bytes(data)
    with safetensors.safe_open(str(path), framework="pt") as sf:
        assert sf.metadata()["fingerprint"] == FP
        assert list(sf.keys()) == sorted(["token_ids", "positions", "excluded", "k", "v"])


def test_import_repages_into_another_page_size():
    store4, layout4 = setup(page_size=4)
    store16, layout16 = setup(page_size=16)
    f = make_file(store4, layout4, 37, [(3, 9), (30, 37)])
    imp = parse(export_bytes(f, store4, layout4), layout16)
    g = import_into(store16, layout16, imp)
    again = parse(export_bytes(g, store16, layout16), layout4)
    assert same_bits(again.k, imp.k) and same_bits(again.v, imp.v)
    assert again.tokens == f.tokens and again.excluded == f.excluded


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_range_matches_slices(dtype, tmp_path):
    store, layout = setup(dtype, host_pages=1, swap=tmp_path / "swap")
    f = make_file(store, layout, 23, EXCLUDED, punched=[2])
    data = export_bytes(f, store, layout)
    store.move_down([f.pages[0], f.pages[3], f.pages[5]])  # one to the host, two to disk
    assert [p and p.tier for p in f.pages] == [HOST, DEVICE, None, DISK, DEVICE, DISK]
    assert export_bytes(f, store, layout) == data
    total = len(data)
    head = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])
    base = 8 + len(data[8:8 + struct.unpack("<Q", data[:8])[0]])
    edges = [0, 8, base, total] + [base + o for e in head.values() if "data_offsets" in e
                                   for o in e["data_offsets"]]
    cases = [(e + d, s) for e in edges for d in (-3, -1, 0, 1, 5) for s in (0, 1, 7, 64, 300)]
    rng = random.Random(1)
    cases += [(rng.randrange(total + 10), rng.randrange(1, total)) for _ in range(300)]
    for off, size in cases:
        off = max(off, 0)
        assert read_range(f, store, layout, off, size) == data[off:off + size], (off, size)


def test_read_range_touches_only_needed_pages():
    store, layout = setup()
    f = make_file(store, layout, 40)
    data = export_bytes(f, store, layout)
    n_head = struct.unpack("<Q", data[:8])[0]
    k_start = 8 + n_head + 16 * 40  # token_ids, positions, then no excluded ranges
    rb = layout.row_bytes
    poison = Page("nowhere", -1, 0)  # reading it raises
    # Rows 9..14 of layer 1's K are in pages 2 and 3.
    off, size = k_start + (40 + 9) * rb + 3, 5 * rb
    g = Inode(ino=3, mode=f.mode, uid=0, gid=0, tokens=f.tokens, positions=f.positions,
              pages=[p if i in (2, 3) else poison for i, p in enumerate(f.pages)])
    assert read_range(g, store, layout, off, size) == data[off:off + size]
    with pytest.raises(FSError):
        read_range(g, store, layout, k_start, rb)
    g.pages = [poison] * len(f.pages)
    assert read_range(g, store, layout, 0, k_start) == data[:k_start]


def test_chunked_read_of_a_long_file_is_linear():
    store, layout = setup(page_size=16, pages=2048)
    f = make_file(store, layout, 32768, [(100, 5000), (30000, 30001)])
    t0 = time.perf_counter()
    whole = export_bytes(f, store, layout)
    t_whole = time.perf_counter() - t0
    t0 = time.perf_counter()
    chunks, off = [], 0
    while chunk := read_range(f, store, layout, off, 128 * 1024):
        chunks.append(chunk)
        off += len(chunk)
    t_chunked = time.perf_counter() - t0
    assert b"".join(chunks) == whole
    # Per-chunk work must be proportional to the chunk, not the file.
    assert t_chunked < 10 * t_whole + 1.0, (t_chunked, t_whole)


def test_read_meta_reads_the_small_tensors(tmp_path):
    store, layout = setup()
    f = make_file(store, layout, 23, EXCLUDED, punched=[2])
    path = tmp_path / "f.kv"
    path.write_bytes(export_bytes(f, store, layout))
    meta = read_meta(path, layout, vocab_size=100)
    assert (meta.tokens, meta.positions, meta.excluded) == (f.tokens, f.positions, EXCLUDED)
    assert meta.header.length == 23 and meta.header.layout.page_size == 4
    assert read_meta(path).header.layout == layout
    with pytest.raises(FSError, match="another model"):
        read_meta(path, Layout("other", torch.float32, 4, 2, 2, 8))
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(FSError, match="truncated"):
        read_meta(path)


# -- refusals -----------------------------------------------------------------------------


def good():
    store, layout = setup()
    f = make_file(store, layout, 23, EXCLUDED, punched=[2])
    return export_bytes(f, store, layout), layout


def split(data):
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def join(head, body, text=None):
    text = text if text is not None else json.dumps(head).encode()
    return struct.pack("<Q", len(text)) + text + body


def refused(data, layout, match, **kw):
    with pytest.raises(FSError, match=match) as e:
        parse(data, layout, **kw)
    assert e.value.errno == errno.EINVAL
    return e.value


def test_good_file_survives_reencoding():
    # Any valid safetensors encoding of the same content imports: key order, spacing, padding.
    data, layout = good()
    head, body = split(data)
    items = list(head.items())[::-1]
    text = json.dumps(dict(items), indent=1).encode()
    assert parse(join(None, body, text), layout).tokens == parse(data, layout).tokens


@pytest.mark.parametrize("cut", [0, 4, 7, 8, 20, -1, -100, -2000])
def test_truncated(cut):
    data, layout = good()
    n = struct.unpack("<Q", data[:8])[0]
    cut = {20: 8 + n - 1}.get(cut, cut)
    refused(data[:cut], layout, "truncated")


def test_trailing_garbage():
    data, layout = good()
    refused(data + b"\0", layout, "trailing")


@pytest.mark.parametrize("n", [0, 1, 2**63, 2**21])
def test_bad_header_length(n):
    data, layout = good()
    refused(struct.pack("<Q", n) + data[8:], layout, "header length")


def test_header_length_past_end():
    data, layout = good()
    refused(struct.pack("<Q", len(data)) + data[8:], layout, "truncated")


@pytest.mark.parametrize("text, match", [
    (b"{not json", "not valid JSON"),
    (b"\xff\xfe{}", "not UTF-8"),
    (b"[1, 2]", "not an object"),
    (b'{"a": 1, "a": 2}', "repeats a key"),
    (b'{"__metadata__": {"format": NaN}}', "constant"),
    (b"{}", "no __metadata__"),
])
def test_bad_json(text, match):
    data, layout = good()
    _, body = split(data)
    refused(join(None, body, text), layout, match)


def mutated(fn):
    data, layout = good()
    head, body = split(data)
    fn(head)
    return join(head, body), layout


@pytest.mark.parametrize("key, value, match", [
    ("format", "safetensors", "not a symphony KV file"),
    ("version", "2", "unsupported version"),
    ("dtype", "F16", "dtype F16 does not match"),
    ("dtype", "I8", "metadata dtype"),
    ("layers", "3", "layers 3 does not match"),
    ("kv_heads", "4", "kv_heads 4 does not match"),
    ("head_dim", "16", "head_dim 16 does not match"),
    ("page_size", "0", "page_size"),
    ("page_size", "04", "page_size"),
    ("page_size", "x", "page_size"),
    ("extra", "1", "unknown metadata key"),
])
def test_bad_metadata(key, value, match):
    refused(*mutated(lambda h: h["__metadata__"].__setitem__(key, value)), match)


@pytest.mark.parametrize("where", ["layers", "page_size", "shape", "offset"])
def test_an_integer_of_thousands_of_digits_is_einval(where):
    """Python converts at most 4300 digits to an int; past that its ValueError escaped the
    checks: EIO from the kernel, and a mount that died for every user."""
    digits = "9" * 5000
    if where in ("layers", "page_size"):
        data, layout = mutated(lambda h: h["__metadata__"].__setitem__(where, digits))
        refused(data, layout, f"metadata {where} '99999.*5000 characters.*not a positive")
        return
    data, layout = good()
    head, body = split(data)
    text = json.dumps(head).replace('"shape": [23]' if where == "shape"
                                    else '"data_offsets": [0,', {
        "shape": f'"shape": [{digits}]', "offset": f'"data_offsets": [{digits},'}[where], 1)
    assert digits in text
    refused(join(None, body, text.encode()), layout, "integer of 5000 characters")


def test_missing_metadata_key():
    refused(*mutated(lambda h: h["__metadata__"].pop("head_dim")), "no head_dim")


def test_metadata_value_not_string():
    refused(*mutated(lambda h: h["__metadata__"].__setitem__("layers", 2)), "not a string")


def test_foreign_model():
    data, _ = good()
    other = Layout("llama-3-8b-abc", torch.float32, 4, 2, 2, 8)
    err = refused(data, other, "belongs to another model")
    assert FP in str(err) and "llama-3-8b-abc" in str(err)


def test_page_size_may_differ():
    data, layout = good()
    parse(data, Layout(FP, torch.float32, 16, 2, 2, 8))


@pytest.mark.parametrize("fn, match", [
    (lambda h: h.pop("positions"), "missing tensor positions"),
    (lambda h: h.__setitem__("extra", h["k"]), "unexpected tensor"),
    (lambda h: h["token_ids"].__setitem__("dtype", "I32"), "token_ids dtype"),
    (lambda h: h["k"].__setitem__("dtype", "F16"), "k dtype"),
    (lambda h: h["k"].__setitem__("shape", [3, 23, 2, 8]), "k shape"),
    (lambda h: h["v"].__setitem__("shape", [2, 22, 2, 8]), "v shape"),
    (lambda h: h["positions"].__setitem__("shape", [22]), "positions shape"),
    (lambda h: h["token_ids"].__setitem__("shape", [23, 1]), "token_ids shape"),
    (lambda h: h["excluded"].__setitem__("shape", [3, 3]), "excluded shape"),
    (lambda h: h["excluded"].__setitem__("shape", [3, -2]), "excluded shape"),
    (lambda h: h["k"].pop("data_offsets"), "tensor k entry"),
    (lambda h: h["k"].__setitem__("data_offsets", [5]), "data_offsets"),
    (lambda h: h["k"].__setitem__("data_offsets", [0, -1]), "data_offsets"),
    (lambda h: h["k"].__setitem__("data_offsets", [1.5, 3]), "data_offsets"),
])
def test_bad_tensor_table(fn, match):
    refused(*mutated(fn), match)


def shift(name, by):
    def fn(h):
        a, b = h[name]["data_offsets"]
        h[name]["data_offsets"] = [a + by, b + by]
    return fn


def test_overlapping_offsets():
    refused(*mutated(shift("v", -8)), "overlap")


def test_gap_between_tensors():
    refused(*mutated(shift("positions", 8)), "gap|overlap")


def test_offsets_out_of_bounds():
    # Sizes must match shapes, so a tensor past the end shows as a gap or a short file.
    refused(*mutated(shift("v", 8)), "gap")
    data, layout = good()
    head, body = split(data)
    refused(join(head, body[:-8]), layout, "truncated")


def test_swapped_tensors_are_fine_when_they_tile():
    # Data order is free, as in safetensors; only the table must say where each tensor is.
    data, layout = good()
    head, body = split(data)
    a, b = head["token_ids"]["data_offsets"]
    c, d = head["positions"]["data_offsets"]
    body = body[c:d] + body[a:b] + body[d:]
    head["positions"]["data_offsets"], head["token_ids"]["data_offsets"] = [a, b], [b, d]
    imp = parse(join(head, body), layout)
    assert imp.tokens == parse(data, layout).tokens


def patch(data, name, values=None, raw=None, at=0):
    """Overwrite tensor `name`'s bytes from element `at` on."""
    head, body = split(data)
    start = len(data) - len(body) + head[name]["data_offsets"][0]
    new = raw if raw is not None else struct.pack(f"<{len(values)}q", *values)
    size = 8 if raw is None else len(raw)
    return data[:start + at * size] + new + data[start + at * size + len(new):]


def test_negative_position_and_token():
    data, layout = good()
    refused(patch(data, "positions", [-1], at=5), layout, "position -1 at entry 5")
    refused(patch(data, "token_ids", [-7], at=0), layout, "token id -7 at entry 0")


def test_token_outside_vocab():
    data, layout = good()
    bad = patch(data, "token_ids", [100], at=3)
    refused(bad, layout, "outside the vocabulary", vocab_size=100)
    parse(bad, layout)  # no bound given: only negatives are refused


@pytest.mark.parametrize("ranges, match", [
    ([8, 12, 1, 3, 20, 21], "unsorted"),
    ([1, 9, 8, 12, 20, 21], "overlaps"),
    ([1, 3, 8, 12, 20, 24], "outside"),
    ([1, 3, 8, 12, 21, 21], "empty"),
    ([-1, 3, 8, 12, 20, 21], "outside"),
])
def test_bad_excluded(ranges, match):
    data, layout = good()
    refused(patch(data, "excluded", ranges), layout, match)


@pytest.mark.parametrize("name", ["k", "v"])
def test_nonzero_excluded_rows(name):
    data, layout = good()
    row = layout.row_bytes // 4  # floats per (layer, entry)
    # Layer 1, entry 9 (inside excluded [8, 12)), one element: 1.0, then -0.0.
    at = (23 + 9) * row + 3
    refused(patch(data, name, raw=struct.pack("<f", 1.0), at=at), layout, "not all zero")
    refused(patch(data, name, raw=struct.pack("<f", -0.0), at=at), layout, "not all zero")


def test_file_written_by_safetensors_imports():
    store, layout = setup(torch.float16)
    f = make_file(store, layout, 23, EXCLUDED, punched=[2])
    data = export_bytes(f, store, layout)
    tensors = safetensors.torch.load(data)
    meta = split(data)[0]["__metadata__"]
    again = safetensors.torch.save(tensors, metadata=meta)
    assert again != data  # another encoding (key and data order) ...
    imp = parse(again, layout)  # ... of the same content
    assert export_bytes(import_into(store, layout, imp), store, layout) == data


@pytest.mark.parametrize("text", [b'{"a":' * 1000 + b"1" + b"}" * 1000,
                                  b"[" * 100_000 + b"]" * 100_000])
def test_deeply_nested_header(text):
    data, layout = good()
    refused(join(None, split(data)[1], text), layout, "nests too deep")


def test_more_excluded_ranges_than_entries():
    # Each range is non-empty and they are disjoint: R > N is refused at the header, so a
    # header's declared size grows with N alone.
    data, layout = good()
    prefix = _plan(23, 1 << 40, layout)[0]
    refused(prefix, layout, "ranges, more than the file's 23 entries")


def test_parse_uses_a_writable_buffer_in_place():
    data, layout = good()
    buf = np.frombuffer(bytearray(data), dtype=np.uint8)
    imp = parse(memoryview(buf), layout)
    start = buf.__array_interface__["data"][0]
    assert start <= imp.k.data_ptr() < imp.v.data_ptr() < start + len(data)


# -- an import stream (Incoming) ----------------------------------------------------------


@pytest.mark.parametrize("piece", [1, 7, 500, 1 << 20])
def test_incoming_takes_a_file_in_any_pieces(piece):
    data, layout = good()
    admitted = []
    incoming = Incoming(layout, admitted.append)
    for at in range(0, len(data), piece):
        incoming.feed(data[at:at + piece])
    assert [h.size for h in admitted] == [len(data)]
    assert bytes(incoming.data()) == data
    assert parse(incoming.data(), layout).tokens == parse(data, layout).tokens


def not_admitted(header):
    raise AssertionError(f"admitted {header}")


def test_incoming_refuses_a_bad_header_as_soon_as_it_arrives():
    data, layout = good()
    with pytest.raises(FSError, match="bad header length") as e:
        Incoming(layout, not_admitted).feed(b"\xff" * 8)
    assert e.value.errno == errno.EINVAL
    n = struct.unpack("<Q", data[:8])[0]
    other = Layout("another-model", torch.float32, 4, 2, 2, 8)
    with pytest.raises(FSError, match="another model"):
        Incoming(other, not_admitted).feed(data[:8 + n])  # the header alone
    with pytest.raises(FSError, match="ranges, more than"):
        Incoming(layout, not_admitted).feed(_plan(23, 1 << 40, layout)[0])


def test_incoming_stops_at_what_admit_refuses():
    data, layout = good()

    def admit(header):
        raise FSError(errno.EFBIG, f"{header.length} entries")

    with pytest.raises(FSError, match="23 entries"):
        Incoming(layout, admit).feed(data)


def test_incoming_refuses_more_than_the_header_declares():
    data, layout = good()
    incoming = Incoming(layout, lambda header: None)
    incoming.feed(data[:100])
    incoming.feed(data[100:])
    with pytest.raises(FSError, match=f"more than the {len(data)} bytes") as e:
        incoming.feed(b"\0")
    assert e.value.errno == errno.EINVAL
    with pytest.raises(FSError, match="more than"):
        Incoming(layout, lambda header: None).feed(data + b"\0")


@pytest.mark.parametrize("cut", [5, 100, -1])
def test_incoming_cut_short_is_refused_by_parse(cut):
    data, layout = good()
    incoming = Incoming(layout, lambda header: None)
    incoming.feed(data[:cut])
    refused(incoming.data(), layout, "truncated")


def test_the_mount_checks_a_header_without_torch(tmp_path):
    """The mount checks what is written to it with kvfs.kv_header alone: it never loads
    torch (seconds the first time; the first write to a mount waited for it)."""
    import subprocess
    import sys

    store, layout = setup(dtype=torch.bfloat16)
    data = export_bytes(make_file(store, layout, 9, excluded=[(2, 5)]), store, layout)
    (tmp_path / "f.kv").write_bytes(data)
    script = f"""
import io, sys
from kvfs.fuse import Bounds, read_header
data = open({str(tmp_path / "f.kv")!r}, "rb").read()
print(read_header(io.BytesIO(data), len(data), Bounds({FP!r}, 64, 4, 1 << 30)))
print("torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parent.parent).stdout.split("\n")
    header = parse_header(data, len(data))
    assert out[:2] == [str((header.offsets["token_ids"][0], len(data))), "False"]
