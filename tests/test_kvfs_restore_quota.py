"""A restart never lets a user hold more than its page quota: a restored file's pages count
against its owner from the restart on, before they load (they load on first open)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import pytest
from daemon import AS_UID, meminfo, start_daemon, world_dir
from daemon import ROOT as REPO
from kvfs_helpers import PAGE, append
from test_kvfs_restore_sharing import PATHS, USED, boot, make_forks

import kvfs.state
from kvfs.errors import FSError
from kvfs.format import read_meta
from kvfs.fs import FileSystem
from kvfs.perm import ROOT, Cred

ALICE, BOB = Cred(1000, 1000), Cred(1001, 1001)
RW_CREAT = os.O_RDWR | os.O_CREAT
QUOTA = 6


def charged(fs: FileSystem, cred: Cred) -> int:
    """What meminfo's quota_USER shows and the quota checks."""
    return fs.store.charged(cred.uid)


def alices_files(fs: FileSystem) -> None:
    """/home/alice/a: 3 full pages and one with 2 entries; /home/alice/b: 3 pages, the
    middle one a hole (punched): QUOTA pages in all."""
    fs.home(ALICE, "alice")
    h = fs.open(ALICE, "/home/alice/b", RW_CREAT)
    append(fs, h, [7] * (3 * PAGE))
    fs.punch(h, PAGE, 2 * PAGE)
    fs.close(h)
    h = fs.open(ALICE, "/home/alice/a", RW_CREAT)
    append(fs, h, list(range(3 * PAGE + 2)))
    fs.close(h)


def edquot(call) -> FSError:
    with pytest.raises(FSError) as e:
        call()
    assert e.value.errno == errno.EDQUOT, e.value
    return e.value


def test_a_restart_keeps_a_user_at_its_quota_before_its_files_load(tmp_path):
    """The tester's finding: after a restart Alice's files charged nothing until opened,
    so she could pred a new file up to her quota, then open the old ones past it (and
    again after each restart)."""
    fs, _ = boot(tmp_path, default_quota=QUOTA)
    alices_files(fs)
    assert charged(fs, ALICE) == QUOTA
    fs2, _ = boot(tmp_path, default_quota=QUOTA)
    assert charged(fs2, ALICE) == QUOTA  # nothing loaded yet
    assert fs2.store.used.get(ALICE.uid, 0) == 0
    h = fs2.open(ALICE, "/home/alice/new", RW_CREAT)
    e = edquot(lambda: append(fs2, h, [1]))
    assert e.message == (f"uid {ALICE.uid} page quota {QUOTA} ({QUOTA} used, {QUOTA} of them "
                         "by files restored and not opened since, 1 more wanted)")
    assert h.inode.pages == []  # refused before anything was taken
    for path in ("/home/alice/a", "/home/alice/b"):
        old = fs2.open(ALICE, path)
        assert charged(fs2, ALICE) == QUOTA  # a load puts its pages in place of the count
        fs2.close(old)
    assert fs2.store.used[ALICE.uid] == QUOTA
    edquot(lambda: append(fs2, h, [1]))
    # A restart of a restart: the same again, never more.
    fs2.close(h)
    fs3, _ = boot(tmp_path, default_quota=QUOTA)
    assert charged(fs3, ALICE) == QUOTA
    for path in ("/home/alice/a", "/home/alice/b", "/home/alice/new"):
        fs3.close(fs3.open(ALICE, path))
    assert (charged(fs3, ALICE), fs3.store.used[ALICE.uid]) == (QUOTA, QUOTA)


def test_an_unloaded_file_freed_gives_its_pages_back(tmp_path):
    """Unlinked, or renamed over, before it ever loaded: its count goes with it."""
    fs, _ = boot(tmp_path, default_quota=QUOTA)
    alices_files(fs)
    fs2, _ = boot(tmp_path, default_quota=QUOTA)
    fs2.unlink(ALICE, "/home/alice/a")
    assert charged(fs2, ALICE) == 2  # b's pages, its hole not counted
    h = fs2.open(ALICE, "/home/alice/c", RW_CREAT)
    append(fs2, h, [3] * (4 * PAGE))  # a's four pages, taken again
    edquot(lambda: append(fs2, h, [3]))
    fs2.close(h)
    fs2.rename(ALICE, "/home/alice/c", "/home/alice/b")
    assert charged(fs2, ALICE) == 4
    assert fs2.store.pending == {}


def test_an_import_over_an_unloaded_file_charges_what_it_holds(tmp_path):
    fs, _ = boot(tmp_path, default_quota=QUOTA)
    alices_files(fs)
    h = fs.open(ALICE, "/home/alice/b")
    data = fs.export(h)  # 3 pages, one a hole: 2
    fs.close(h)
    fs2, _ = boot(tmp_path)
    fs2.import_file(ALICE, "/home/alice/a", data)  # in place of a's 4 pages: b's 2
    assert (charged(fs2, ALICE), fs2.store.pending) == (4, {ALICE.uid: 2})
    assert fs2.store.used[ALICE.uid] == 2


def test_chown_of_an_unloaded_file_moves_its_count(tmp_path):
    """As chown moves a loaded file's holds: the new owner is charged, even past its quota,
    and the old one no more; the file then loads as the new owner's."""
    fs, _ = boot(tmp_path, default_quota=QUOTA)
    alices_files(fs)
    fs2, _ = boot(tmp_path, default_quota=QUOTA)
    fs2.home(BOB, "bob")
    fs2.chown(ROOT, "/home/alice/a", BOB.uid, BOB.gid)
    assert (charged(fs2, ALICE), charged(fs2, BOB)) == (2, 4)
    h = fs2.open(BOB, "/home/bob/mine", RW_CREAT)
    append(fs2, h, [1] * (2 * PAGE))
    edquot(lambda: append(fs2, h, [1]))
    a = fs2.open(BOB, "/home/alice/a")
    assert (charged(fs2, ALICE), charged(fs2, BOB)) == (2, QUOTA)
    assert fs2.store.used[BOB.uid] == QUOTA and a.inode.pages[0].uid == BOB.uid
    # Back to Alice, loaded this time: its holds move as before.
    fs2.chown(ROOT, "/home/alice/a", ALICE.uid, ALICE.gid)
    assert (charged(fs2, ALICE), charged(fs2, BOB)) == (QUOTA, 2)


def test_shared_pages_count_unshared_until_they_load(tmp_path):
    """Before its files load, which of their pages are shared is not known (it is found by
    comparing their K/V as they load): a user is charged every file's pages as if
    unshared, and gets the difference back as they load."""
    fs, _ = boot(tmp_path)
    make_forks(fs)
    assert charged(fs, ALICE) == USED
    fs2, _ = boot(tmp_path, pages=256)
    unshared = sum(fs2.stat(ALICE, p).pages for p in PATHS)
    assert unshared == 83 and charged(fs2, ALICE) == unshared
    before = charged(fs2, ALICE)
    handles = []
    for path in PATHS:
        handles.append(fs2.open(ALICE, path))
        now = charged(fs2, ALICE)
        assert now <= before, path  # a load never takes more than was counted
        before = now
    assert (charged(fs2, ALICE), fs2.store.used[ALICE.uid]) == (USED, USED)
    assert fs2.store.pending == {}


def test_root_is_counted_as_well(tmp_path):
    """Root has no quota; its count is kept all the same."""
    fs, _ = boot(tmp_path)
    h = fs.open(ROOT, "/rootfile", RW_CREAT)
    append(fs, h, list(range(2 * PAGE + 1)))
    fs.close(h)
    fs2, _ = boot(tmp_path)
    assert charged(fs2, ROOT) == 3
    fs2.close(fs2.open(ROOT, "/rootfile"))
    assert (charged(fs2, ROOT), fs2.store.used[ROOT.uid]) == (3, 3)


def test_an_export_refused_after_the_load_leaves_the_charge(tmp_path):
    """export opens the file (it loads) and streams from a snapshot whose copy of a partly
    filled last page is refused at the quota: the charge is as it was before."""
    fs, _ = boot(tmp_path, default_quota=QUOTA)
    alices_files(fs)
    fs2, _ = boot(tmp_path, default_quota=QUOTA)
    h = fs2.open(ALICE, "/home/alice/new", RW_CREAT)
    with pytest.raises(FSError):  # as many pages as the quota lets her have: none
        for _ in range(QUOTA + 1):
            append(fs2, h, [1] * PAGE)
    before = charged(fs2, ALICE)
    src = fs2.open(ALICE, "/home/alice/a")  # what sys_export does: open, then a snapshot
    edquot(lambda: fs2.fork(src, ALICE, snapshot=True))
    fs2.close(src)
    assert charged(fs2, ALICE) == before == QUOTA


def changed(fs: FileSystem, path: str, cred: Cred = ALICE) -> str:
    """Opening path is EIO (again and again) and changes no count: its message."""
    inode = fs.lookup(cred, path)
    counts = (charged(fs, cred), fs.store.used.get(cred.uid, 0), fs.page_count(inode))
    for _ in range(2):
        with pytest.raises(FSError) as e:
            fs.open(cred, path)
        assert e.value.errno == errno.EIO
        assert (charged(fs, cred), fs.store.used.get(cred.uid, 0),
                fs.page_count(inode)) == counts
    return e.value.message


def flip_kv(data) -> None:
    """One byte of a data file's K/V flipped in place, near its end: its size and entries
    stay (the last byte of V: docs/kv-format.md)."""
    end = read_meta(data).header.offsets["v"][1]
    with open(data, "r+b") as f:
        f.seek(end - 1)
        byte = f.read(1)[0]
        f.seek(end - 1)
        f.write(bytes([byte ^ 1]))


CHANGED = "its data file changed on disk since the restart"


def test_a_data_file_rewritten_since_the_restart_is_not_loaded(tmp_path):
    """Its owner was charged for the entries the restart read: a data file that holds
    others now (written behind the kernel's back) could take more pages. EIO naming the
    file as its owner knows it (where root keeps its data is root's), and the charge
    stays."""
    fs, _ = boot(tmp_path, default_quota=QUOTA)
    alices_files(fs)
    fs2, _ = boot(tmp_path, default_quota=QUOTA)
    a, b = (fs2.stat(ALICE, f"/home/alice/{n}").ino for n in "ab")
    (tmp_path / "files" / f"{b}.kv").write_bytes((tmp_path / "files" / f"{a}.kv").read_bytes())
    assert changed(fs2, "/home/alice/b") == f"open '/home/alice/b': {CHANGED}"
    assert (charged(fs2, ALICE), fs2.store.used.get(ALICE.uid, 0)) == (QUOTA, 0)


def test_a_kv_byte_changed_since_the_restart_is_not_loaded(tmp_path):
    """The tester's finding: a byte of K/V flipped in place (size and entries as they were)
    was loaded and served. EIO naming the file as opened; the file not changed loads as
    before."""
    fs, _ = boot(tmp_path, default_quota=QUOTA)
    alices_files(fs)
    h = fs.open(ALICE, "/home/alice/a")
    fs.link(h, "/home/alice/a2")
    fs.close(h)
    h = fs.open(ALICE, "/home/alice/b")
    b = fs.export(h)
    fs.close(h)
    fs2, _ = boot(tmp_path, default_quota=QUOTA)
    flip_kv(tmp_path / "files" / f"{fs2.stat(ALICE, '/home/alice/a').ino}.kv")
    assert changed(fs2, "/home/alice/a2") == f"open '/home/alice/a2': {CHANGED}"
    assert (charged(fs2, ALICE), fs2.store.used.get(ALICE.uid, 0)) == (QUOTA, 0)
    h = fs2.open(ALICE, "/home/alice/b")
    assert fs2.export(h) == b
    fs2.close(h)


def test_a_change_the_stat_misses_is_caught_by_the_entries(tmp_path):
    """A token id changed within the clock's tick of the restart's look (its identity
    the same): the entries read at the load are not those restored. EIO as above."""
    fs, _ = boot(tmp_path, default_quota=QUOTA)
    alices_files(fs)
    fs2, sd = boot(tmp_path, default_quota=QUOTA)
    inode = fs2.lookup(ALICE, "/home/alice/a")
    data = tmp_path / "files" / f"{inode.ino}.kv"
    start = read_meta(data).header.offsets["token_ids"][0]
    with open(data, "r+b") as f:
        f.seek(start)
        f.write((5).to_bytes(8, "little"))  # token 0 was 0 (alices_files)
    sd.seen[inode] = kvfs.state._identity(os.stat(data))
    assert changed(fs2, "/home/alice/a") == f"open '/home/alice/a': {CHANGED}"


# As the user: make the 3-page file argv[2] (after the restart: "new", then open the old
# ones); what was refused, and meminfo.
BODY = AS_UID + """
k = Kernel.connect(name="restore-quota")
size = k.model_info().page_size
salt = sum(map(ord, sys.argv[2]))  # files of other entries: no page of theirs is shared
def fill(f, pages):
    f.pred([(7 * i + salt) % 50 + 10 for i in range(pages * size)], no_outputs=True)
out = {}
with k.open(k.home + "/" + sys.argv[2], os.O_CREAT | os.O_RDWR) as f:
    out["pred"] = refusal(lambda: fill(f, 3))
if sys.argv[2] == "new":
    for name in ("old0", "old1"):
        with k.open(k.home + "/" + name) as f:
            pass
out["meminfo"] = proc_fields(k.procfs("meminfo"))
print(json.dumps(out))
"""
KERNEL_USER = 60041


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_a_restarted_kernel_keeps_a_user_at_its_quota(model):
    """The tester's scenario on a real kernel (--quota 6): after the restart meminfo shows
    the user's 6 pages before any of its files loads, a new file's pred is refused, and
    opening the old files leaves the charge at 6 (it read 0 / 6, the pred passed, and the
    opened files took it to 9 / 6)."""
    root = world_dir()

    def user(step: str, env: dict) -> dict:
        out = subprocess.run([sys.executable, "-c", BODY, str(KERNEL_USER), step], env=env,
                             cwd=REPO, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def line(mem: dict) -> str:
        return next(v for key, v in mem.items()
                    if key.startswith("quota_") and key != "quota_root")

    flags = ("--kv-pages", "64", "--quota", str(QUOTA))
    d = start_daemon(model, root, *flags)
    try:
        for name in ("old0", "old1"):
            assert user(name, d.env())["pred"] is None
    finally:
        assert d.stop() == 0, d.log_text()
    d = start_daemon(model, root, *flags)
    try:
        with d.connect() as k:
            assert line(meminfo(k)) == f"{QUOTA} / {QUOTA}"
        out = user("new", d.env())
        assert out["pred"] is not None and out["pred"][0] == errno.EDQUOT, out
        assert "of them by files restored and not opened since" in out["pred"][1]
        assert line(out["meminfo"]) == f"{QUOTA} / {QUOTA}"
    finally:
        assert d.stop() == 0, d.log_text()


def test_a_restored_file_moved_to_tmp_before_it_loads_keeps_its_contents(tmp_path):
    """A file not opened since the restart, renamed into /tmp (its only name there): its
    data file, its only copy of its K/V, was removed as it left the saved names, and the
    open failed. It loads there as it would have; moved back before loading, it is saved
    as before; and once loaded (or gone) under /tmp, its data file goes."""
    fs, _ = boot(tmp_path, default_quota=QUOTA)
    alices_files(fs)
    want = {}
    for name in "ab":
        h = fs.open(ALICE, f"/home/alice/{name}")
        want[name] = fs.export(h)
        fs.close(h)
    fs2, sd = boot(tmp_path, default_quota=QUOTA)
    a, b = (fs2.stat(ALICE, f"/home/alice/{n}").ino for n in "ab")
    fs2.rename(ALICE, "/home/alice/a", "/tmp/a")
    fs2.rename(ALICE, "/home/alice/b", "/tmp/b")
    sd.save_namespace()  # the data files no name needs go now: not these
    h = fs2.open(ALICE, "/tmp/a")
    assert fs2.export(h) == want["a"]
    fs2.close(h)
    assert not (tmp_path / "files" / f"{a}.kv").exists()  # loaded: no longer needed
    fs2.rename(ALICE, "/tmp/b", "/home/alice/b2")  # back before it loaded
    fs3, _ = boot(tmp_path, default_quota=QUOTA)
    h = fs3.open(ALICE, "/home/alice/b2")
    assert fs3.export(h) == want["b"]
    fs3.close(h)
    with pytest.raises(FSError) as e:  # /tmp is not saved
        fs3.lookup(ALICE, "/tmp/a")
    assert e.value.errno == errno.ENOENT
    assert {int(p.stem) for p in (tmp_path / "files").glob("*.kv")} == {b}
