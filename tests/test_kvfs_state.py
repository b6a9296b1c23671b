"""Persistence: the namespace and named files outside /tmp survive a restart, crash-safe."""

from __future__ import annotations

import errno
import os

import pytest
from kvfs_helpers import append, assert_kv, make_fs

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
