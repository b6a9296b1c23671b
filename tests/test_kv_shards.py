"""The sharded KV pool (tensor parallelism): N shards of KV heads, one file system.

TINY has 2 KV heads: N = 2 gives each rank one, N = 4 replicates each head on two ranks.
Whatever N, a file's pages hold the same K/V, and its export is the same bytes.
"""

from __future__ import annotations

import os

import pytest
import torch
from kvfs_helpers import PAGE, TINY, append, assert_kv, make_fs

from kvfs.fs import FileSystem, Handle
from kvfs.pages import DISK, HOST
from kvfs.perm import ROOT
from kvfs.pool import DEVICE, KVPool, PageShape, pool_shard_shape, shard_heads
from kvfs.state import StateDir

RW_CREAT = os.O_RDWR | os.O_CREAT
SHAPE = PageShape(TINY.num_layers, TINY.num_kv_heads, TINY.head_dim, PAGE, torch.float32)


def test_kv_heads_split_in_blocks_or_are_replicated():
    assert [shard_heads(8, 2, r) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [shard_heads(2, 4, r) for r in range(4)] == [
        range(0, 1),
        range(0, 1),
        range(1, 2),
        range(1, 2),
    ]
    assert [shard_heads(4, 4, r) for r in range(4)] == [range(r, r + 1) for r in range(4)]
    for kv_heads, shards, words in (
        (3, 2, "3 KV heads do not split over 2"),
        (2, 3, "3 ranks do not share 2 KV heads"),
    ):
        with pytest.raises(ValueError, match=words):
            shard_heads(kv_heads, shards, 0)
    with pytest.raises(ValueError, match="rank 2 outside"):
        shard_heads(2, 2, 2)


def test_a_sharded_pool_checks_its_arrays():
    pool = KVPool(SHAPE, 8, shards=2)
    assert [tuple(t.shape) for t in pool.shard(1)] == [(2, 8, PAGE, 1, TINY.head_dim)] * 2
    assert pool.page_bytes == SHAPE.bytes
    with pytest.raises(ValueError, match="use shard"):
        _ = pool.k
    assert len(list(pool.key_layers())) == 2 * TINY.num_layers
    good = pool_shard_shape(SHAPE, 8, 2, 0)
    bad = (*good[:3], 2, good[4])
    with pytest.raises(ValueError, match="want K and V of"):
        KVPool(
            SHAPE,
            8,
            shards=2,
            arrays=[(torch.zeros(good), torch.zeros(good)), (torch.zeros(bad), torch.zeros(bad))],
        )
    with pytest.raises(ValueError, match="dtype torch.float32"):
        KVPool(SHAPE, 8, shards=2, arrays=[(torch.zeros(good, dtype=torch.float16),) * 2] * 2)


def canonical(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE.dims, generator=gen), torch.randn(SHAPE.dims, generator=gen)


def assert_shards_hold(pool: KVPool, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Every shard (replicas too) holds its heads of canonical k and v at device page slot."""
    for r in range(pool.shards):
        heads = slice(pool.heads(r).start, pool.heads(r).stop)
        sk, sv = pool.shard(r)
        assert torch.equal(sk[:, slot], k[:, :, heads]) and torch.equal(sv[:, slot], v[:, :, heads])


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_a_page_moves_down_gathered_and_up_scattered(shards):
    pool = KVPool(SHAPE, 4, host_pages=2, shards=shards)
    k, v = canonical(0)
    (page,) = pool.allocate(1)
    pool.write_page(page, k, v)
    assert_shards_hold(pool, page, k, v)
    (copy,) = pool.allocate(1)
    pool.copy_page(page, copy)
    assert_shards_hold(pool, copy, k, v)
    down = pool.move(page, DEVICE, HOST)
    assert torch.equal(pool.host_k[:, down], k) and torch.equal(pool.host_v[:, down], v)
    up = pool.move(down, HOST, DEVICE)
    assert_shards_hold(pool, up, k, v)
    got = pool.read_page(up)
    assert torch.equal(got[0], k) and torch.equal(got[1], v)
    rows = k[:, :2] + 1, v[:, :2] + 1
    pool.write_rows(up, 1, *rows)  # rows 1 and 2 of every shard
    k[:, 1:3], v[:, 1:3] = rows
    assert_shards_hold(pool, up, k, v)
    # A shard that disagrees with its replica is not read: the first holder of a head is.
    if shards == 4:
        pool.shard(1)[0][:, up] = -1
        assert torch.equal(pool.read_page(up)[0], k)
        assert torch.equal(pool.layer_pages(DEVICE, 0, 1, [up, copy])[0], k[1])


def shift_keys(fs: FileSystem):
    """An exact stand-in for rotating keys: adds delta to them, in every shard (as the engine
    process's rotate_keys turns them through pool.key_layers())."""

    def rotate(rows: torch.Tensor, delta: int) -> None:
        for k in fs.store.pool.key_layers():
            k.view(-1, *k.shape[2:])[rows] += delta

    return rotate


def scenario(fs: FileSystem) -> list[Handle]:
    """Every page operation kvfs has, on three files; pages end up on every tier."""
    a = fs.open(ROOT, "/a", RW_CREAT)
    append(fs, a, list(range(23)))
    b = fs.fork(a, ROOT)  # full pages shared, the last one copied
    append(fs, b, [50, 51, 52])  # into b's own last page
    c = fs.open(ROOT, "/c", RW_CREAT)
    append(fs, c, [7] * 5)
    fs.splice(a, 3, 13, c)  # rows copied from a's pages into c's
    fs.punch(a, 8, 12)  # a's page 2 freed
    fs.shift(b, 2, 10, 5, 1000, shift_keys(fs))  # b's first pages made its own, keys moved
    fs.keep(c, 2, [4, 6, 9, 12])  # rows moved within c's pages
    fs.store.move_down(a.inode.pages + c.inode.pages)  # 4 to the host, the rest to disk
    tiers = {p.tier for h in (a, c) for p in h.inode.pages if p is not None}
    assert tiers == {HOST, DISK}
    d = fs.fork(c, ROOT)  # a copy of a page on the host or on disk
    fs.splice(a, 0, 7, d)  # rows read from pages off the device
    fs.shift(a, 0, 3, 2, 1000, shift_keys(fs))  # a's first page brought up first
    fs.truncate(c, 3)
    return [a, b, c, d]


def exports(fs: FileSystem, handles: list[Handle]) -> list[bytes]:
    return [fs.export(h) for h in handles]


@pytest.mark.parametrize("shards", [2, 4])
def test_files_under_n_shards_are_the_files_at_one(tmp_path, shards):
    """Fork, splice, punch, shift, keep, truncate and the host and disk tiers: every file's
    export at N shards is the bytes it is at one."""
    files = []
    for n in (1, shards):
        (tmp_path / str(n)).mkdir()
        fs = make_fs(pages=32, host=4, disk=16, tmp_path=tmp_path / str(n), shards=n)
        handles = scenario(fs)
        files.append(exports(fs, handles))
    assert files[0] == files[1]
    assert len({len(e) for e in files[0]}) == 4  # four different files


@pytest.mark.parametrize(("written", "read"), [(2, 1), (1, 2), (4, 2), (2, 4)])
def test_an_export_imports_bit_exactly_at_another_shard_count(tmp_path, written, read):
    src = make_fs(shards=written)
    h = src.open(ROOT, "/f", RW_CREAT)
    append(src, h, [(i * 13) % 100 for i in range(30)])
    src.punch(h, 4, 8)  # a hole: page 1
    data = src.export(h)
    dst = make_fs(shards=read)
    dst.import_file(ROOT, "/g", data)
    g = dst.open(ROOT, "/g")
    assert dst.export(g) == data
    assert_kv(dst, g)  # the attended rows, read back from the shards, are what was written
    for i, page in enumerate(g.inode.pages):
        if page is not None:
            assert_shards_hold(dst.store.pool, page.slot, *src.store.read(h.inode.pages[i]))


def test_files_saved_at_two_shards_restore_at_one(tmp_path):
    fs = make_fs(shards=2)
    state = StateDir(tmp_path, fs)
    h = fs.open(ROOT, "/home/f", RW_CREAT)
    append(fs, h, list(range(19)))
    fs.punch(h, 2, 9)
    saved = fs.export(h)
    state.save_file(h.inode)
    state.save_namespace()
    for shards in (1, 4):
        again = make_fs(shards=shards)
        StateDir(tmp_path, again).restore()
        f = again.open(ROOT, "/home/f")
        assert again.export(f) == saved
        assert_kv(again, f)
