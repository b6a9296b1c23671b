"""Persistence: the namespace and named files outside /tmp survive a restart, crash-safe."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
from kvfs_helpers import append, assert_kv, make_fs

import kvfs.journal
import kvfs.state
from kvfs.errors import FSError
from kvfs.fs import FileSystem
from kvfs.perm import ROOT, Cred
from kvfs.state import StateDir

ALICE = Cred(1000, 1000)
RW_CREAT = os.O_RDWR | os.O_CREAT


def boot(state, fingerprint: str | None = None, **kw) -> FileSystem:
    """A fresh kvfs (new pool, nothing in memory) over a state directory."""
    fs = make_fs(**kw)
    if fingerprint:
        fs = FileSystem(fs.store, fingerprint)
    StateDir(state, fs).restore()
    return fs


def populate(fs: FileSystem) -> dict[str, bytes]:
    fs.home(ALICE, "alice")
    fs.mkdir(ALICE, "/home/alice/docs", 0o750)
    exports = {}
    for path, n in (("/home/alice/docs/a", 37), ("/home/alice/b", 5), ("/tmp/scratch", 9)):
        h = fs.open(ALICE, path, RW_CREAT, 0o640)
        append(fs, h, [(i * 7) % 100 for i in range(n)])
        if path.endswith("/a"):
            fs.punch(h, 4, 20)
            fs.link(h, "/home/alice/docs/a-link")
        exports[path] = fs.export(h)
        fs.close(h)
    fs.chmod(ALICE, "/home/alice/b", 0o600)
    return exports


def test_restart_brings_back_names_metadata_and_contents(tmp_path):
    fs = boot(tmp_path)
    exports = populate(fs)
    before = {p: fs.stat(ROOT, p) for p in ("/home/alice/docs", "/home/alice/docs/a",
                                            "/home/alice/b")}
    fs2 = boot(tmp_path)
    for path, st in before.items():
        assert fs2.stat(ROOT, path) == st, path
    assert fs2.stat(ROOT, "/home/alice/docs/a-link").ino == before["/home/alice/docs/a"].ino
    assert fs2.stat(ROOT, "/home/alice/docs/a").nlink == 2
    raises = pytest.raises(FSError)
    with raises:
        fs2.stat(ROOT, "/tmp/scratch")  # /tmp is lost at restart
    # Pages load on first use, not at start.
    assert fs2.store.pool.free_in("device") == 64
    h = fs2.open(ALICE, "/home/alice/docs/a")
    assert fs2.store.pool.free_in("device") == 64 - 6
    assert fs2.export(h) == exports["/home/alice/docs/a"]
    assert_kv(fs2, h)
    # Permissions still hold after the restart.
    with pytest.raises(FSError) as e:
        fs2.open(Cred(1001, 1001), "/home/alice/b")
    assert e.value.errno == errno.EACCES
    # A new file gets a fresh inode number.
    assert fs2.open(ALICE, "/home/alice/new", RW_CREAT).inode.ino > max(
        st.ino for st in before.values())


def test_the_state_is_the_kernels_alone_whatever_the_umask(tmp_path):
    """A state directory others can enter hands them no entries: the data files and the
    namespace are 0600 and files/ is 0700, though the umask would make them 0644 and 0755."""
    old = os.umask(0o022)
    try:
        populate(boot(tmp_path))
    finally:
        os.umask(old)
    state = tmp_path
    assert (state / "files").stat().st_mode & 0o777 == 0o700
    written = [state / "namespace.json", *(state / "files").iterdir()]
    assert len(written) > 2 and {p.stat().st_mode & 0o777 for p in written} == {0o600}


def test_a_file_chowned_past_its_owners_quota_loads_after_a_restart(tmp_path):
    """Before the restart its pages stay charged to whoever made them; after it, loading
    charges them to the owner, past the quota: the entries were there already."""
    fs = boot(tmp_path, default_quota=2)
    fs.home(ALICE, "alice")
    h = fs.open(ROOT, "/home/alice/big", RW_CREAT)
    append(fs, h, list(range(40)))  # 5 pages of root's
    data = fs.export(h)
    fs.close(h)
    fs.chown(ROOT, "/home/alice/big", ALICE.uid, ALICE.gid)
    fs2 = boot(tmp_path, default_quota=2)
    for who in (ROOT, ALICE):
        h = fs2.open(who, "/home/alice/big")
        assert fs2.export(h) == data
        fs2.close(h)
    h = fs2.open(ALICE, "/home/alice/big", os.O_RDWR)
    with pytest.raises(FSError) as e:  # more is still past her quota
        append(fs2, h, [1] * 8)
    assert e.value.errno == errno.EDQUOT


def test_changes_after_restart_are_saved_again(tmp_path):
    fs = boot(tmp_path)
    populate(fs)
    fs2 = boot(tmp_path)
    h = fs2.open(ALICE, "/home/alice/b", os.O_RDWR)
    append(fs2, h, [1, 2, 3])
    fs2.fsync(h)
    fs2.rename(ALICE, "/home/alice/b", "/home/alice/docs/b2")
    fs2.unlink(ALICE, "/home/alice/docs/a")
    fs3 = boot(tmp_path)
    h3 = fs3.open(ALICE, "/home/alice/docs/b2")
    assert fs3.read(h3, 0, 99)[0] == [0, 7, 14, 21, 28, 1, 2, 3]
    assert [n for n, _ in fs3.readdir(ROOT, "/home/alice/docs")] == ["a-link", "b2"]
    fs3.close(h3)
    fs3.unlink(ALICE, "/home/alice/docs/a-link")
    boot(tmp_path)
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == [f"{h3.inode.ino}.kv"]


def test_file_of_another_model_is_listed_but_refused(tmp_path):
    populate(boot(tmp_path))
    other = boot(tmp_path, fingerprint="another-model")
    assert [n for n, _ in other.readdir(ROOT, "/home/alice")] == ["b", "docs"]
    assert other.stat(ROOT, "/home/alice/b").tokens == 5
    with pytest.raises(FSError) as e:
        other.open(ROOT, "/home/alice/b")
    assert e.value.errno == errno.EINVAL and "another model" in str(e.value)


@pytest.mark.parametrize("crash_at", ["write", "fsync", "replace"])
def test_crash_in_the_middle_of_a_save_keeps_old_or_new(tmp_path, monkeypatch, crash_at):
    fs = boot(tmp_path)
    fs.home(ALICE, "alice")
    h = fs.open(ALICE, "/home/alice/f", RW_CREAT)
    append(fs, h, list(range(10)))
    fs.fsync(h)
    old = fs.export(h)
    append(fs, h, list(range(10, 30)))
    new = fs.export(h)

    class Crash(Exception):
        pass

    def crash(*args, **kwargs):
        raise Crash(crash_at)

    if crash_at == "write":
        monkeypatch.setattr(kvfs.state, "open", lambda *a, **k: _TornFile(*a), raising=False)
    else:
        monkeypatch.setattr(kvfs.state.os, crash_at, crash)
    with pytest.raises((Crash, OSError)):
        fs.fsync(h)
    monkeypatch.undo()
    after = boot(tmp_path)
    got = after.export(after.open(ROOT, "/home/alice/f"))
    assert got == old  # the crash came before the rename: the old version is whole
    assert not list(tmp_path.rglob("*.tmp"))  # the torn temporary was swept at start
    # And with the save completed, the new version is what comes back.
    fs.fsync(h)
    final = boot(tmp_path)
    assert final.export(final.open(ROOT, "/home/alice/f")) == new


class _TornFile:
    """A file whose write stops halfway, as if the machine died mid-write."""

    def __init__(self, path, mode):
        self.f = open(path, mode)  # noqa: SIM115

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def write(self, data):
        self.f.write(data[: len(data) // 2])
        self.f.flush()
        raise OSError(errno.EIO, "machine died")


def test_import_replaces_whole_or_not_at_all(tmp_path):
    fs = boot(tmp_path)
    fs.home(ALICE, "alice")
    h = fs.open(ALICE, "/home/alice/src", RW_CREAT)
    append(fs, h, list(range(23)))
    fs.punch(h, 2, 9)
    data = fs.export(h)
    fs.close(h)
    inode = fs.import_file(ALICE, "/home/alice/copy", data)
    assert inode.ino != h.inode.ino
    c = fs.open(ALICE, "/home/alice/copy")
    assert fs.export(c) == data
    assert_kv(fs, c)
    fs.close(c)
    free = fs.store.pool.free_in("device")
    for bad in (data[:-1], data[:100], b"x" * 64, data.replace(b"tiny-model", b"tiny-mode!")):
        with pytest.raises(FSError) as e:
            fs.import_file(ALICE, "/home/alice/copy", bad)
        assert e.value.errno == errno.EINVAL
    assert fs.store.pool.free_in("device") == free
    c = fs.open(ALICE, "/home/alice/copy")
    assert fs.export(c) == data  # the old file is untouched
    fs.close(c)
    with pytest.raises(FSError) as e:
        fs.import_file(Cred(1001, 1001), "/home/alice/x", data)
    assert e.value.errno == errno.EACCES
    # Imported files persist like any other.
    again = boot(tmp_path)
    assert again.export(again.open(ROOT, "/home/alice/copy")) == data


def test_shutdown_saves_what_is_still_open(tmp_path):
    fs = make_fs()
    state = StateDir(tmp_path, fs)
    state.restore()
    fs.home(ALICE, "alice")
    h = fs.open(ALICE, "/home/alice/open", RW_CREAT)
    append(fs, h, list(range(12)))
    scratch = fs.open(ALICE, "/tmp/t", RW_CREAT)
    append(fs, scratch, [1])
    assert fs.fstat(h).tokens == 12
    state.shutdown()  # the kernel stops with the file still open
    after = boot(tmp_path)
    assert after.export(after.open(ROOT, "/home/alice/open")) == fs.export(h)
    assert [n for n, _ in after.readdir(ROOT, "/tmp")] == []


def contents(fs: FileSystem, path: str) -> bytes | None:
    """A file's canonical form, None where there is no such name."""
    try:
        h = fs.open(ROOT, path)
    except FSError as e:
        assert e.errno == errno.ENOENT, e
        return None
    try:
        return fs.export(h)
    finally:
        fs.close(h)


def test_a_crash_before_any_write_leaves_each_file_old_or_new(tmp_path, monkeypatch):
    """The state directory is copied as a crash would leave it before each of its writes,
    and at the end: every copy restores each file as it was before the calls or after."""
    state = tmp_path / "state"
    fs = boot(state)
    fs.home(ALICE, "alice")
    home = "/home/alice/"
    for name, n in (("a", 9), ("b", 13), ("d", 6), ("e", 3), ("f", 7), ("g", 5)):
        h = fs.open(ALICE, home + name, RW_CREAT)
        append(fs, h, [(i * 3 + n) % 100 for i in range(n)])
        fs.close(h)
    names = ("a", "b", "d", "e", "f", "g", "imported", "linked")
    old = {n: contents(fs, home + n) for n in names}
    snapshots = []
    write, append_line = kvfs.state.atomic_write, kvfs.journal.append

    def copy_then_write(path, chunks):
        snapshots.append(shutil.copytree(state, tmp_path / f"crash{len(snapshots)}"))
        write(path, chunks)

    def copy_then_append(path, ops, next_ino):
        snapshots.append(shutil.copytree(state, tmp_path / f"crash{len(snapshots)}"))
        append_line(path, ops, next_ino)

    monkeypatch.setattr(kvfs.state, "atomic_write", copy_then_write)
    monkeypatch.setattr(kvfs.journal, "append", copy_then_append)
    src = fs.open(ALICE, "/tmp/src", RW_CREAT)
    append(fs, src, list(range(50, 70)))
    fs.import_file(ALICE, home + "imported", fs.export(src))  # a new name
    anon = fs.open(ALICE, "")
    append(fs, anon, [7, 8, 9, 10, 11])
    fs.link(anon, home + "linked")  # an anonymous file with entries gets a name
    fs.close(src)
    fs.rename(ALICE, "/tmp/src", home + "a")  # from /tmp over a saved file
    fs.rename(ALICE, home + "b", home + "d")  # over a saved file
    fs.unlink(ALICE, home + "e")
    fs.import_file(ALICE, home + "f", old["g"])  # over a saved file
    g = fs.open(ALICE, home + "g", os.O_RDWR)
    append(fs, g, [1, 2])
    fs.fsync(g)
    fs.close(anon)
    snapshots.append(shutil.copytree(state, tmp_path / "done"))
    monkeypatch.undo()  # a restore writes a namespace too
    new = {n: contents(fs, home + n) for n in names}
    assert all(new[n] != old[n] for n in names)
    for snapshot in snapshots:
        after = boot(snapshot)
        for n in names:
            assert contents(after, home + n) in (old[n], new[n]), (snapshot.name, n)
    # Data files of the files that lost their names went once the namespace was saved.
    assert sorted(int(p.stem) for p in (state / "files").iterdir()) == sorted(
        fs.lookup(ROOT, home + n).ino for n in names if new[n] is not None)


def test_restore_tells_a_file_created_empty_from_lost_data(tmp_path):
    fs = boot(tmp_path)
    fs.home(ALICE, "alice")
    fs.close(fs.open(ALICE, "/home/alice/empty", RW_CREAT))
    h = fs.open(ALICE, "/home/alice/full", RW_CREAT)
    append(fs, h, [1, 2, 3])
    fs.close(h)
    assert boot(tmp_path).stat(ROOT, "/home/alice/empty").tokens == 0
    (tmp_path / "files" / f"{h.inode.ino}.kv").unlink()  # damage: its data is gone
    with pytest.raises(FSError) as e:
        boot(tmp_path)
    assert e.value.errno == errno.EIO and "/home/alice/full" in str(e.value)


def test_a_failed_save_fails_no_call_and_fsync_says_eio(tmp_path, monkeypatch):
    """The change stands in memory, the failure is logged and tried again: at the next
    save, at fsync (which alone reports it, EIO), and at stop."""
    fs = make_fs()
    state = StateDir(tmp_path, fs)
    state.restore()
    fs.home(ALICE, "alice")
    f = fs.open(ALICE, "/home/alice/f", RW_CREAT)
    append(fs, f, [1, 2, 3])
    fs.fsync(f)
    saved = fs.export(f)

    def disk_full(path, *what):
        raise OSError(errno.ENOSPC, f"{path}: no space left")

    monkeypatch.setattr(kvfs.state, "atomic_write", disk_full)
    monkeypatch.setattr(kvfs.journal, "append", disk_full)
    fs.mkdir(ALICE, "/home/alice/d")
    g = fs.open(ALICE, "/home/alice/d/g", RW_CREAT)
    append(fs, g, [4, 5])
    fs.close(g)
    append(fs, f, [6])
    with pytest.raises(FSError) as e:
        fs.fsync(f)
    assert e.value.errno == errno.EIO and "no space left" in str(e.value)
    latest = fs.export(f)
    fs.close(f)
    assert fs.stat(ALICE, "/home/alice/d/g").tokens == 2  # in memory, all stands
    with pytest.raises(FSError) as e:
        state.shutdown()
    assert e.value.errno == errno.EIO and "the namespace" in str(e.value)
    before = boot(tmp_path)
    assert contents(before, "/home/alice/f") == saved
    assert contents(before, "/home/alice/d/g") is None
    monkeypatch.undo()
    g = fs.open(ALICE, "/home/alice/d/g")
    fs.fsync(g)  # the namespace, stale, goes with it
    assert contents(boot(tmp_path), "/home/alice/d/g") == fs.export(g)
    state.shutdown()  # and f, whose save at close failed
    assert contents(boot(tmp_path), "/home/alice/f") == latest


def test_a_tree_deeper_than_the_stack_saves_and_restores(tmp_path):
    fs = make_fs()
    fs.home(ALICE, "alice")
    fs.mkdir(ALICE, "/home/alice/d")
    for _ in range(1999):  # built from the bottom up, so that every path stays short
        fs.mkdir(ALICE, "/home/alice/up")
        fs.rename(ALICE, "/home/alice/d", "/home/alice/up/d")
        fs.rename(ALICE, "/home/alice/up", "/home/alice/d")
    deep = "/home/alice" + "/d" * 2000  # 4011 bytes: inside PATH_MAX
    h = fs.open(ALICE, deep + "/f", RW_CREAT)
    append(fs, h, [1, 2, 3])
    state = StateDir(tmp_path, fs)
    state.restore()  # nothing on disk yet: saves the namespace
    fs.mkdir(ALICE, deep + "/e")
    state.shutdown()
    after = boot(tmp_path)
    assert contents(after, deep + "/f") == fs.export(h)
    assert after.stat(ROOT, deep).nlink == 3 and after.stat(ROOT, deep + "/e").nlink == 2


def test_import_over_a_saved_file_rewrites_its_data_in_place(tmp_path):
    fs = boot(tmp_path)
    fs.home(ALICE, "alice")
    h = fs.open(ALICE, "/home/alice/f", RW_CREAT, 0o640)
    append(fs, h, list(range(9)))
    fs.close(h)
    src = fs.open(ALICE, "", RW_CREAT)
    append(fs, src, [3, 4, 5])
    data = fs.export(src)
    again = boot(tmp_path)  # f restored, its pages not loaded: replaced all the same
    ino = again.stat(ROOT, "/home/alice/f").ino
    again.import_file(ALICE, "/home/alice/f", data)
    third = boot(tmp_path)
    st = third.stat(ROOT, "/home/alice/f")
    assert (st.ino, st.uid, st.mode & 0o7777, st.tokens) == (ino, 1000, 0o640, 3)
    assert third.export(third.open(ROOT, "/home/alice/f")) == data


def names(fs: FileSystem) -> dict[str, tuple]:
    """Every name outside /tmp: what it names (inode number, type and permission bits,
    owner, group, entries)."""
    out, stack = {}, [("", fs.root)]
    while stack:
        path, d = stack.pop()
        for name, child in d.entries.items():
            if d is fs.root and name == "tmp":
                continue
            out[f"{path}/{name}"] = (child.ino, child.mode, child.uid, child.gid, child.length)
            if child.is_dir:
                stack.append((f"{path}/{name}", child))
    return out


@pytest.mark.parametrize("journal_min", [1024, 3])
def test_the_journal_restores_every_change_of_names(tmp_path, monkeypatch, journal_min):
    """Random namespace calls (in and out of /tmp, over other names, hard links, whole trees
    moving): the named inodes kept change by change are those a walk finds, and a restart
    from the disk as it is after any call gives the names as they were; with a short
    journal, through namespaces written whole on the way."""
    import random

    monkeypatch.setattr(kvfs.state, "JOURNAL_MIN", journal_min)
    rng = random.Random(7)
    fs = make_fs(pages=256)
    state = StateDir(tmp_path / "state", fs)
    state.restore()
    fs.home(ALICE, "alice")
    dirs, files = ["/home/alice", "/tmp"], []

    def path_in(d: str) -> str:
        return f"{d}/n{rng.randrange(12)}"

    for step in range(300):
        op = rng.choice(["mkdir", "create", "unlink", "rename", "link", "rmdir", "chmod",
                         "import", "anon"])
        try:
            if op == "mkdir":
                p = path_in(rng.choice(dirs))
                fs.mkdir(ALICE, p)
                dirs.append(p)
            elif op == "create":
                p = path_in(rng.choice(dirs))
                h = fs.open(ALICE, p, RW_CREAT)
                append(fs, h, [step % 90 + 1] * rng.randrange(0, 9))
                fs.close(h)
                files.append(p)
            elif op == "unlink" and files:
                fs.unlink(ALICE, rng.choice(files))
            elif op == "rename":
                src = rng.choice(files + dirs[2:]) if files or dirs[2:] else None
                if src:
                    fs.rename(ALICE, src, path_in(rng.choice(dirs)))
            elif op == "link" and files:
                h = fs.open(ALICE, rng.choice(files))
                fs.link(h, path_in(rng.choice(dirs)))
                fs.close(h)
            elif op == "rmdir" and dirs[2:]:
                fs.rmdir(ALICE, rng.choice(dirs[2:]))
            elif op == "chmod" and files:
                fs.chmod(ALICE, rng.choice(files), rng.choice([0o600, 0o640, 0o644]))
            elif op == "import":
                src = fs.open(ALICE, "", RW_CREAT)
                append(fs, src, [3, 1, 4, 1, 5][: rng.randrange(1, 6)])
                fs.import_file(ALICE, path_in(rng.choice(dirs)), fs.export(src))
                fs.close(src)
            elif op == "anon":
                h = fs.open(ALICE, "", RW_CREAT)
                append(fs, h, [9] * rng.randrange(0, 12))
                fs.link(h, path_in(rng.choice(dirs)))
                fs.close(h)
        except FSError:
            pass  # a name taken, gone, or a directory not empty: nothing changed
        assert (state.named, state.refs) == state._walk(), (step, op)
        if step % 25 == 0 or step == 299:
            again = boot(shutil.copytree(tmp_path / "state", tmp_path / f"copy{step}"))
            assert names(again) == names(fs), step
    assert state.generation > 1 if journal_min == 3 else state.generation == 1


def test_a_change_of_names_writes_a_line_not_the_namespace(tmp_path):
    """With many names, a create appends a line to the journal and leaves namespace.json
    as it is: the change costs O(1), not O(names)."""
    fs = make_fs()
    state = StateDir(tmp_path, fs)
    state.restore()
    fs.home(ALICE, "alice")
    for i in range(200):
        fs.close(fs.open(ALICE, f"/home/alice/f{i}", RW_CREAT))
    index, log = tmp_path / "namespace.json", tmp_path / "namespace.log"
    before, lines = index.stat(), log.read_bytes().count(b"\n")
    fs.close(fs.open(ALICE, "/home/alice/one-more", RW_CREAT))
    assert index.stat().st_mtime_ns == before.st_mtime_ns and index.stat().st_ino == before.st_ino
    added = log.read_bytes().splitlines()[lines:]
    assert len(added) == 1 and len(added[0]) < 400
    assert "/home/alice/one-more" in names(boot(tmp_path))


def test_a_torn_last_line_is_dropped_and_a_stale_journal_ignored(tmp_path):
    fs = boot(tmp_path)
    fs.home(ALICE, "alice")
    fs.mkdir(ALICE, "/home/alice/kept")
    log = tmp_path / "namespace.log"
    whole = log.read_bytes()
    fs.mkdir(ALICE, "/home/alice/torn")
    torn = log.read_bytes()
    log.write_bytes(torn[: len(whole) + (len(torn) - len(whole)) // 2])  # died mid-line
    after = boot(tmp_path)
    assert "/home/alice/kept" in names(after) and "/home/alice/torn" not in names(after)
    # That restart wrote the namespace whole and began a clean journal: changes go on.
    after.mkdir(ALICE, "/home/alice/next")
    assert {"/home/alice/kept", "/home/alice/next"} <= set(names(boot(tmp_path)))
    # A journal of an older namespace.json (a crash between writing the two) is ignored.
    log.write_bytes(torn)
    assert "/home/alice/torn" not in names(boot(tmp_path))


def test_a_journal_line_that_is_not_one_is_an_unreadable_state(tmp_path):
    fs = boot(tmp_path)
    fs.home(ALICE, "alice")
    fs.mkdir(ALICE, "/home/alice/d")
    log = tmp_path / "namespace.log"
    head, *lines = log.read_bytes().splitlines(keepends=True)
    log.write_bytes(head + b'{"ops": [["unlink", 424242, "x"]], "next_ino": 9}\n'
                    + b"".join(lines))
    with pytest.raises(FSError) as e:
        boot(tmp_path)
    assert e.value.errno == errno.EINVAL and "namespace.log" in str(e.value)
