"""Inode quotas (kvfs/inodes.py): every inode a user owns counts, past the limit a call that
would make one fails with EDQUOT and changes nothing, and a freed inode is given back."""

from __future__ import annotations

import errno
import os

import pytest
from kvfs_helpers import append, make_fs

from kvfs.errors import FSError
from kvfs.fs import FileSystem
from kvfs.perm import ROOT, Cred
from kvfs.state import StateDir

ALICE, BOB = Cred(1000, 1000), Cred(1001, 1001)
RW_CREAT = os.O_RDWR | os.O_CREAT
LIMIT = 5


def raises(code: int, fn, *args, **kwargs) -> FSError:
    with pytest.raises(FSError) as info:
        fn(*args, **kwargs)
    assert info.value.errno == code, info.value
    return info.value


def owned(fs: FileSystem, *handles) -> dict[int, int]:
    """Inodes per uid, counted the long way: every inode of the namespace, and those of
    the open handles given (anonymous files, forks, unlinked open files)."""
    seen: dict[int, object] = {}
    stack = [fs.root]
    while stack:
        node = stack.pop()
        seen[node.ino] = node
        if node.is_dir:
            stack.extend(node.entries.values())
    for h in handles:
        if not h.closed:
            seen[h.inode.ino] = h.inode
    counts: dict[int, int] = {}
    for node in seen.values():
        counts[node.uid] = counts.get(node.uid, 0) + 1
    return counts


def state(fs: FileSystem):
    """Everything a refused call must leave as it was."""
    def walk(node, path):
        out = {path: (node.mode, node.uid, node.nlink, node.length)}
        if node.is_dir:
            for name, child in node.entries.items():
                out.update(walk(child, f"{path}/{name}"))
        return out

    return (walk(fs.root, ""), fs.next_ino, dict(fs.inodes.used), dict(fs.store.used),
            fs.store.pool.free_in("device"))


def exported(fs: FileSystem, n: int = 6) -> bytes:
    h = fs.open(ROOT, "")
    append(fs, h, list(range(n)))
    data = fs.export(h)
    fs.close(h)
    return data


@pytest.fixture
def fs():
    return make_fs(inode_quota=LIMIT)


def at_limit(fs: FileSystem) -> tuple[object, object]:
    """Alice holds LIMIT inodes: her home, a directory, a file, an open named file and an
    anonymous file. Returns the two open handles."""
    fs.home(ALICE, "alice")
    fs.mkdir(ALICE, "/home/alice/d")
    fs.close(fs.open(ALICE, "/home/alice/f", RW_CREAT))
    named = fs.open(ALICE, "/home/alice/g", RW_CREAT)
    append(fs, named, [1, 2, 3])
    anon = fs.open(ALICE, "")
    append(fs, anon, [4, 5, 6, 7, 8])
    assert fs.inodes.used[ALICE.uid] == LIMIT == owned(fs, named, anon)[ALICE.uid]
    return named, anon


def test_every_call_that_makes_an_inode_is_refused_at_the_limit(fs):
    named, anon = at_limit(fs)
    data = exported(fs)
    before = state(fs)
    for call in (lambda: fs.open(ALICE, "/home/alice/new", RW_CREAT),
                 lambda: fs.open(ALICE, "/tmp/new", RW_CREAT | os.O_EXCL),
                 lambda: fs.mkdir(ALICE, "/home/alice/dir"),
                 lambda: fs.open(ALICE, ""),
                 lambda: fs.fork(named, ALICE),
                 lambda: fs.fork(anon, ALICE),
                 lambda: fs.import_file(ALICE, "/home/alice/imported", data),
                 lambda: fs.receive(ALICE, "/home/alice/imported").__enter__()):
        e = raises(errno.EDQUOT, call)
        assert f"uid {ALICE.uid} inode quota {LIMIT}" in str(e), e
        assert state(fs) == before  # nothing changed: no name, no inode number, no page
    # What makes no inode still works: opening, importing over her file, linking.
    fs.close(fs.open(ALICE, "/home/alice/f", os.O_RDWR | os.O_CREAT))
    fs.import_file(ALICE, "/home/alice/f", data)
    fs.link(anon, "/home/alice/anon")
    assert fs.inodes.used[ALICE.uid] == LIMIT
    # Another user, and root, are not held back by her count.
    fs.home(BOB, "bob")
    fs.close(fs.open(BOB, "/home/bob/b", RW_CREAT))
    fs.mkdir(ROOT, "/home/alice/root-dir")
    fs.close(named)
    fs.close(anon)
    assert fs.inodes.used == owned(fs)


def test_an_export_snapshot_at_the_limit_is_taken_and_given_back(fs):
    """Reading needs no room for one more inode: export's snapshot counts while it lives
    but is not refused."""
    named, _ = at_limit(fs)
    snap = fs.fork(named, ALICE, snapshot=True)
    assert fs.inodes.used[ALICE.uid] == LIMIT + 1
    assert fs.export(snap) == fs.export(named)
    fs.close(snap)
    assert fs.inodes.used[ALICE.uid] == LIMIT


def test_a_freed_inode_makes_room_for_the_next(fs):
    named, anon = at_limit(fs)
    frees = [
        # (what frees one inode, what is tried next)
        lambda: fs.close(anon),  # an anonymous file dies at its last close
        lambda: fs.unlink(ALICE, "/home/alice/f"),  # a closed file dies with its last name
        lambda: fs.rmdir(ALICE, "/home/alice/d"),
    ]
    for i, free in enumerate(frees):
        raises(errno.EDQUOT, fs.open, ALICE, f"/tmp/x{i}", RW_CREAT)
        free()
        assert fs.inodes.used[ALICE.uid] == LIMIT - 1
        fs.close(fs.open(ALICE, f"/tmp/x{i}", RW_CREAT))
        assert fs.inodes.used[ALICE.uid] == LIMIT
        fs.unlink(ALICE, f"/tmp/x{i}")
        fs.close(fs.open(ALICE, f"/tmp/x{i}", RW_CREAT))  # once more: room was given back
    # An unlinked file still open keeps its inode until its last close.
    fs.unlink(ALICE, "/home/alice/g")
    raises(errno.EDQUOT, fs.mkdir, ALICE, "/home/alice/d2")
    fs.close(named)
    fs.mkdir(ALICE, "/home/alice/d2")
    raises(errno.EISDIR, fs.rename, ALICE, "/tmp/x0", "/home/alice/d2")  # nothing freed
    raises(errno.EDQUOT, fs.mkdir, ALICE, "/home/alice/d3")
    assert fs.inodes.used[ALICE.uid] == LIMIT == owned(fs)[ALICE.uid]


def test_rename_over_a_file_or_an_empty_directory_gives_its_inode_back(fs):
    fs.home(ALICE, "alice")
    for name in ("a", "b"):
        fs.close(fs.open(ALICE, f"/home/alice/{name}", RW_CREAT))
    fs.mkdir(ALICE, "/home/alice/d")
    fs.mkdir(ALICE, "/home/alice/e")
    assert fs.inodes.used[ALICE.uid] == 5
    fs.rename(ALICE, "/home/alice/a", "/home/alice/b")
    assert fs.inodes.used[ALICE.uid] == 4
    fs.rename(ALICE, "/home/alice/d", "/home/alice/e")
    assert fs.inodes.used[ALICE.uid] == 3 == owned(fs)[ALICE.uid]


def test_a_fork_counts_until_its_close(fs):
    fs.home(ALICE, "alice")
    h = fs.open(ALICE, "/home/alice/f", RW_CREAT)
    append(fs, h, list(range(7)))
    forks = [fs.fork(h, ALICE) for _ in range(LIMIT - 2)]
    assert fs.inodes.used[ALICE.uid] == LIMIT == owned(fs, h, *forks)[ALICE.uid]
    raises(errno.EDQUOT, fs.fork, h, ALICE)
    fs.close(forks.pop())
    fs.close(fs.fork(h, ALICE))
    # A fork of alice's file by bob is bob's inode.
    fs.home(BOB, "bob")
    fs.chmod(ALICE, "/home/alice/f", 0o644)
    theirs = fs.fork(fs.open(BOB, "/home/alice/f"), BOB)
    assert fs.inodes.used[BOB.uid] == 2 and fs.inodes.used[ALICE.uid] == LIMIT - 1
    fs.close(theirs)
    assert fs.inodes.used[BOB.uid] == 1  # his home


def test_a_failed_import_gives_its_inode_back():
    fs = make_fs(inode_quota=LIMIT, default_quota=1)
    fs.home(ALICE, "alice")
    data = exported(fs, 9)  # 3 pages: past her page quota
    raises(errno.EDQUOT, fs.import_file, ALICE, "/home/alice/big", data)
    assert fs.inodes.used[ALICE.uid] == 1 == owned(fs)[ALICE.uid]


def test_chown_moves_the_count_even_past_the_new_owners_limit(fs):
    named, anon = at_limit(fs)
    fs.home(BOB, "bob")
    fs.close(fs.open(BOB, "/home/bob/b", RW_CREAT))
    for i in range(LIMIT):
        fs.close(fs.open(ROOT, f"/home/bob/r{i}", RW_CREAT))
    for i in range(LIMIT):  # bob ends with 2 + LIMIT: as pages, chown is not refused
        fs.chown(ROOT, f"/home/bob/r{i}", BOB.uid, -1)
    fs.chown(ROOT, "/home/alice/f", BOB.uid, BOB.gid)
    fs.chown(ROOT, "/home/alice/d", -1, BOB.gid)  # the group alone moves nothing
    fs.chown(ROOT, "/home/alice/d", ALICE.uid, -1)  # nor the same owner
    assert fs.inodes.used[BOB.uid] == 2 + LIMIT + 1
    assert fs.inodes.used[ALICE.uid] == LIMIT - 1
    assert fs.inodes.used == owned(fs, named, anon)
    raises(errno.EDQUOT, fs.open, BOB, "/home/bob/one-more", RW_CREAT)
    fs.close(fs.open(ALICE, "/home/alice/one-more", RW_CREAT))  # room freed by the chown


def test_root_has_no_limit():
    fs = make_fs(inode_quota=2)
    for i in range(10):
        fs.mkdir(ROOT, f"/d{i}")
        fs.close(fs.open(ROOT, f"/d{i}/f", RW_CREAT))
    held = [fs.open(ROOT, "") for _ in range(5)]
    assert fs.inodes.limit(0) is None
    assert fs.inodes.used[0] == 3 + 20 + 5  # the skeleton (/, /home, /tmp) is root's
    for h in held:
        fs.close(h)
    assert fs.inodes.used == owned(fs)


def test_no_limit_when_none():
    fs = make_fs(inode_quota=None)
    fs.home(ALICE, "alice")
    for i in range(100):
        fs.close(fs.open(ALICE, f"/home/alice/{i}", RW_CREAT))
    assert fs.inodes.used[ALICE.uid] == 101


def test_a_user_at_its_limit_still_gets_its_home(fs):
    """The home is the kernel's doing at attach: made past the limit, and counted."""
    held = [fs.open(ALICE, f"/tmp/{i}", RW_CREAT) for i in range(LIMIT)]
    assert fs.home(ALICE, "alice") == "/home/alice"
    assert fs.lookup(ALICE, "/home/alice").uid == ALICE.uid
    assert fs.inodes.used[ALICE.uid] == LIMIT + 1 == owned(fs, *held)[ALICE.uid]
    assert fs.home(ALICE, "alice") == "/home/alice"  # once
    assert fs.inodes.used[ALICE.uid] == LIMIT + 1
    raises(errno.EDQUOT, fs.mkdir, ALICE, "/home/alice/d")


def boot(path, **kw) -> FileSystem:
    fs = make_fs(inode_quota=LIMIT, **kw)
    StateDir(path, fs).restore()
    return fs


def test_a_restart_keeps_the_counts(tmp_path):
    fs = boot(tmp_path)
    fs.home(ALICE, "alice")
    fs.mkdir(ALICE, "/home/alice/d")
    h = fs.open(ALICE, "/home/alice/d/f", RW_CREAT)
    append(fs, h, [1, 2, 3])
    fs.link(h, "/home/alice/f-link")  # two names, one inode
    fs.close(h)
    fs.close(fs.open(ALICE, "/home/alice/e", RW_CREAT))
    fs.close(fs.open(ALICE, "/tmp/lost", RW_CREAT))  # /tmp is not kept over a restart
    fs.home(BOB, "bob")
    fs.chown(ROOT, "/home/alice/e", BOB.uid, -1)
    assert fs.inodes.used[ALICE.uid] == 4 and fs.inodes.used[BOB.uid] == 2
    fs.close(fs.open(ALICE, "/home/alice/last", RW_CREAT))
    assert fs.inodes.used[ALICE.uid] == LIMIT

    again = boot(tmp_path)
    assert again.inodes.used[ALICE.uid] == 4  # home, d, d/f, last: /tmp/lost is gone
    assert again.inodes.used[BOB.uid] == 2
    assert again.inodes.used == owned(again)
    again.close(again.open(ALICE, "/home/alice/one", RW_CREAT))
    e = raises(errno.EDQUOT, again.open, ALICE, "/home/alice/two", RW_CREAT)
    assert f"inode quota {LIMIT}" in str(e)
    again.unlink(ALICE, "/home/alice/d/f")  # still named f-link: its inode stays
    raises(errno.EDQUOT, again.mkdir, ALICE, "/home/alice/two")
    again.unlink(ALICE, "/home/alice/f-link")
    again.mkdir(ALICE, "/home/alice/two")
    assert again.inodes.used == owned(again)


def test_a_restored_chowned_root_directory_counts_for_its_owner(tmp_path):
    fs = boot(tmp_path)
    fs.chown(ROOT, "/", ALICE.uid, -1)
    assert fs.inodes.used[ALICE.uid] == 1
    again = boot(tmp_path)
    assert again.inodes.used == owned(again)
    assert again.inodes.used[ALICE.uid] == 1
