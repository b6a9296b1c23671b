"""A restart keeps the pages an owner's files shared: identical full pages load shared."""

from __future__ import annotations

import errno
import gc
import os

import pytest
import torch
from kvfs_helpers import PAGE, append, assert_kv, make_fs, write_kv

from kvfs.errors import FSError
from kvfs.fs import FileSystem, Handle
from kvfs.perm import ROOT, Cred
from kvfs.state import StateDir

ALICE, BOB = Cred(1000, 1000), Cred(1001, 1001)
RW_CREAT = os.O_RDWR | os.O_CREAT
FORKS = 5
BASE = 10 * PAGE + 2  # ten full pages and a partly filled one
USED = 11 + FORKS + 2 + 5  # what make_forks leaves charged to Alice, and in use


def boot(state, **kw) -> tuple[FileSystem, StateDir]:
    """A fresh kvfs (new pool, nothing in memory) over a state directory."""
    fs = make_fs(**kw)
    sd = StateDir(state, fs)
    sd.restore()
    return fs, sd


def in_use(fs: FileSystem) -> int:
    return fs.store.pool.capacity("device") - fs.store.pool.free_in("device")


def make_forks(fs: FileSystem) -> None:
    """/home/alice/base and FORKS forks of it, named; then the files of the other ways
    pages come to be shared: an aligned splice, a file spliced into itself, a fork of a
    file with a hole and a partly punched page."""
    fs.home(ALICE, "alice")
    h = fs.open(ALICE, "/home/alice/base", RW_CREAT)
    append(fs, h, [(i * 7) % 100 for i in range(BASE)])
    for n in range(FORKS):
        f = fs.fork(h, ALICE)
        fs.link(f, f"/home/alice/fork{n}")
        fs.close(f)
    s = fs.open(ALICE, "/home/alice/spliced", RW_CREAT)
    fs.splice(h, 0, 3 * PAGE, s)  # three pages of base's
    fs.splice(s, 0, 2 * PAGE, s)  # and two of its own, again
    fs.close(s)
    fs.close(h)
    s = fs.open(ALICE, "/home/alice/self", RW_CREAT)
    append(fs, s, [(i * 5) % 100 for i in range(2 * PAGE)])
    fs.splice(s, 0, 2 * PAGE, s)  # pages no other file has
    fs.close(s)
    holed = fs.open(ALICE, "/home/alice/holed", RW_CREAT)
    append(fs, holed, [(i * 3) % 100 for i in range(4 * PAGE + 1)])
    fs.punch(holed, PAGE, 2 * PAGE)  # a hole
    fs.punch(holed, 2 * PAGE + 1, 2 * PAGE + 3)  # entries out of a page that stays
    f = fs.fork(holed, ALICE)
    fs.link(f, "/home/alice/holed-fork")
    fs.close(f)
    fs.close(holed)


PATHS = ["/home/alice/base", *(f"/home/alice/fork{n}" for n in range(FORKS)),
         "/home/alice/spliced", "/home/alice/self", "/home/alice/holed", "/home/alice/holed-fork"]


def places_of(sd: StateDir, h: Handle) -> list[int]:
    """The page indices of h's file that the restore's index names."""
    return sorted(j for places in sd.loaded.values() for ref, j in places if ref() is h.inode)


def exports(fs: FileSystem) -> dict[str, bytes]:
    out = {}
    for path in PATHS:
        h = fs.open(ALICE, path)
        out[path] = fs.export(h)
        fs.close(h)
    return out


@pytest.mark.parametrize("shards", [1, 2, 4])  # 4: each KV head on two ranks
def test_forks_splices_and_holes_load_shared_as_before(tmp_path, shards):
    fs, _ = boot(tmp_path, shards=shards)
    make_forks(fs)
    before = exports(fs)
    used, pages = fs.store.used[ALICE.uid], in_use(fs)
    # 11 + a last page per fork, the splices' pages are base's, 2 for self, 4 + 1 for
    # the holed pair
    assert (used, pages) == (USED, USED)
    fs2, sd = boot(tmp_path, shards=shards)  # unshared, 83 pages of 64: ENOSPC
    handles = {p: fs2.open(ALICE, p) for p in PATHS}
    assert (fs2.store.used[ALICE.uid], in_use(fs2)) == (used, pages)
    for path, h in handles.items():
        assert fs2.export(h) == before[path], path
        assert_kv(fs2, h)
    base = handles["/home/alice/base"].inode.pages
    for n in range(FORKS):
        fork = handles[f"/home/alice/fork{n}"].inode.pages
        assert fork[:10] == base[:10]
        assert fork[10] is not base[10]  # a partly filled last page is each file's own
    spliced = handles["/home/alice/spliced"].inode.pages
    assert spliced == base[:3] + base[:2]
    own = handles["/home/alice/self"].inode.pages
    assert own[:2] == own[2:] and own[0] is not own[1]
    holed, holed_fork = (handles[p].inode.pages for p in ("/home/alice/holed",
                                                         "/home/alice/holed-fork"))
    assert holed[1] is None and holed_fork[1] is None  # a hole stays a hole
    assert 1 not in places_of(sd, handles["/home/alice/holed-fork"])  # nor in the index
    assert holed[:4] == holed_fork[:4] and holed[4] is not holed_fork[4]
    assert {p.refs for p in base[:2]} == {1 + FORKS + 2}  # base, forks, spliced twice


def test_a_write_after_the_restart_copies_and_leaves_the_others(tmp_path):
    fs, _ = boot(tmp_path)
    make_forks(fs)
    before = exports(fs)
    fs2, _ = boot(tmp_path)
    handles = {p: fs2.open(ALICE, p, os.O_RDWR) for p in PATHS}
    used = fs2.store.used[ALICE.uid]
    f0, f1 = handles["/home/alice/fork0"], handles["/home/alice/fork1"]
    append(fs2, f0, [5, 6])  # into its own last page: nothing copied
    assert fs2.store.used[ALICE.uid] == used
    fs2.truncate(f1, 3 * PAGE + 1)  # into a shared page: copied, the rest let go
    assert f1.inode.pages[3] is not handles["/home/alice/base"].inode.pages[3]
    append(fs2, f1, [9] * (PAGE + 1))
    assert fs2.store.used[ALICE.uid] == used + 1 + 1 - 1  # the copy, a new page, f1's last
    for path, h in handles.items():
        assert_kv(fs2, h)
        if path not in ("/home/alice/fork0", "/home/alice/fork1"):
            assert fs2.export(h) == before[path], path
    assert fs2.read(f0, 0, BASE + 2)[0] == fs2.read(handles["/home/alice/base"], 0,
                                                    BASE)[0] + [5, 6]


def test_a_user_at_its_quota_is_at_it_after_a_restart(tmp_path):
    fs, _ = boot(tmp_path, default_quota=USED)
    make_forks(fs)
    assert fs.store.used[ALICE.uid] == USED
    fs2, _ = boot(tmp_path, pages=256, default_quota=USED)  # room for unshared pages
    handles = {p: fs2.open(ALICE, p, os.O_RDWR) for p in PATHS}
    assert fs2.store.used[ALICE.uid] == USED
    fs2.fork(handles["/home/alice/spliced"], ALICE)  # full pages: costs nothing more
    with pytest.raises(FSError) as e:  # one page more is past the quota, as before
        append(fs2, handles["/home/alice/fork1"], [1] * PAGE)
    assert e.value.errno == errno.EDQUOT


def test_sharing_between_users_is_not_made_again(tmp_path):
    """Bob's fork of Alice's file shared her pages; after the restart each loads its own:
    the restore compares a file's pages with its owner's only."""
    fs, _ = boot(tmp_path)
    fs.home(ALICE, "alice")
    fs.home(BOB, "bob")
    h = fs.open(ALICE, "/home/alice/base", RW_CREAT, 0o644)
    append(fs, h, list(range(2 * PAGE)))
    f = fs.fork(h, BOB)
    fs.link(f, "/home/bob/mine")
    fs.close(f)
    fs.close(h)
    assert (fs.store.used[ALICE.uid], fs.store.used[BOB.uid], in_use(fs)) == (2, 2, 2)
    fs2, _ = boot(tmp_path)
    a, b = fs2.open(ALICE, "/home/alice/base"), fs2.open(BOB, "/home/bob/mine")
    assert fs2.export(a) == fs2.export(b)
    assert (fs2.store.used[ALICE.uid], fs2.store.used[BOB.uid], in_use(fs2)) == (2, 2, 4)
    assert not set(a.inode.pages) & set(b.inode.pages)
    # Nor with a file loaded as the owner's and given away since.
    f = fs2.fork(a, ALICE)
    fs2.link(f, "/home/alice/copy")
    for h in (f, a, b):
        fs2.close(h)
    fs3, _ = boot(tmp_path)
    a = fs3.open(ALICE, "/home/alice/base")
    fs3.chown(ROOT, "/home/alice/base", BOB.uid, BOB.gid)
    c = fs3.open(ALICE, "/home/alice/copy")
    assert fs3.export(c) == fs3.export(a)
    assert not set(a.inode.pages) & set(c.inode.pages)
    assert (fs3.store.used[ALICE.uid], fs3.store.used[BOB.uid], in_use(fs3)) == (2, 2, 4)


def test_pages_with_the_same_entries_and_other_kv_stay_apart(tmp_path):
    """Two files of the same token ids at the same positions, and K/V that differ in one
    row (a different context would make them so): the digest does not tell them apart,
    the bytes do."""
    fs, _ = boot(tmp_path)
    fs.home(ALICE, "alice")
    for path in ("/home/alice/a", "/home/alice/b"):
        h = fs.open(ALICE, path, RW_CREAT)
        append(fs, h, list(range(PAGE)))
        if path.endswith("b"):
            k, v = fs.store.read(h.inode.pages[0])
            k[1, 0] += 1  # layer 1, entry 0: not the last entry, the digest's
            fs.store.write(h.inode.pages[0], k, v)
        fs.close(h)
    # The same in one file: its two pages of the same entries, the second's K/V changed.
    h = fs.open(ALICE, "/home/alice/c", RW_CREAT)
    for _ in range(2):
        append(fs, h, list(range(PAGE)), list(range(PAGE)))
    k, v = fs.store.read(h.inode.pages[1])
    k[1, 0] += 2  # not b's either
    fs.store.write(h.inode.pages[1], k, v)
    fs.close(h)
    fs2, _ = boot(tmp_path)
    a, b = fs2.open(ALICE, "/home/alice/a"), fs2.open(ALICE, "/home/alice/b")
    assert a.inode.pages[0] is not b.inode.pages[0]
    assert fs2.store.used[ALICE.uid] == 2
    assert fs2.export(a) != fs2.export(b)
    assert_kv(fs2, a)
    fs2.close(a)
    fs2.unlink(ALICE, "/home/alice/a")
    c = fs2.open(ALICE, "/home/alice/c")
    assert c.inode.pages[0] is not c.inode.pages[1]
    assert fs2.store.used[ALICE.uid] == 3  # b's page, c's two


def test_a_page_written_or_let_go_since_its_load_is_not_shared(tmp_path):
    """The index names where a page was loaded; what is there now is checked: a page
    rewritten in place, or no longer full (a truncate into it, then a forward pass that
    has not written it yet), is not shared; a file gone leaves no place behind."""
    fs, _ = boot(tmp_path)
    make_forks(fs)
    before = exports(fs)
    fs2, sd = boot(tmp_path)
    base = fs2.open(ALICE, "/home/alice/base", os.O_RDWR)
    p0 = base.inode.pages[0]
    k, v = fs2.store.read(p0)
    fs2.store.write(p0, k + 1, v)  # as a `shift` of entries 0-3 would, but positions stay
    fs2.truncate(base, 2 * PAGE + 1)  # page 2 is its last page now, private, rows intact
    res = fs2.reserve(base, PAGE)  # a forward pass on its way to rows 9-12
    f0 = fs2.open(ALICE, "/home/alice/fork0")
    assert f0.inode.pages[0] is not p0 and f0.inode.pages[2] is not base.inode.pages[2]
    assert f0.inode.pages[1] is base.inode.pages[1]
    assert places_of(sd, base) == [0, 1]  # the pages it no longer has full are let go
    write_kv(fs2, res, [1] * PAGE, list(range(2 * PAGE + 1, 3 * PAGE + 1)))
    fs2.commit(res, [1] * PAGE, list(range(2 * PAGE + 1, 3 * PAGE + 1)))
    assert fs2.export(f0) == before["/home/alice/fork0"]
    # f0 took base's place: fork1 shares what f0 loaded.
    f1 = fs2.open(ALICE, "/home/alice/fork1")
    assert f1.inode.pages[:3] == f0.inode.pages[:3]
    for h in (base, f0, f1):
        fs2.close(h)
    for n in range(FORKS):
        fs2.unlink(ALICE, f"/home/alice/fork{n}")
    fs2.unlink(ALICE, "/home/alice/base")
    del base, f0, f1, h, res
    gc.collect()
    assert sd.loaded == {} and in_use(fs2) == 0


def test_nan_and_signed_zero_pages_are_compared_by_their_bytes(tmp_path):
    """-0.0 == 0.0 and NaN != NaN as floats: sharing goes by the bytes."""
    fs, _ = boot(tmp_path)
    fs.home(ALICE, "alice")
    pages = {}
    for path, value in (("/home/alice/zero", 0.0), ("/home/alice/minus", -0.0),
                        ("/home/alice/nan", float("nan")), ("/home/alice/nan2", float("nan"))):
        h = fs.open(ALICE, path, RW_CREAT)
        append(fs, h, list(range(PAGE)))
        k, v = fs.store.read(h.inode.pages[0])
        k[0, 0, 0, 0] = value
        fs.store.write(h.inode.pages[0], k, v)
        fs.close(h)
    fs2, _ = boot(tmp_path)
    for path in ("/home/alice/zero", "/home/alice/minus", "/home/alice/nan",
                 "/home/alice/nan2"):
        pages[path] = fs2.open(ALICE, path).inode.pages[0]
    assert pages["/home/alice/zero"] is not pages["/home/alice/minus"]
    assert pages["/home/alice/nan"] is pages["/home/alice/nan2"]
    assert torch.isnan(fs2.store.read(pages["/home/alice/nan"])[0][0, 0, 0, 0])
    assert fs2.store.used[ALICE.uid] == 3
