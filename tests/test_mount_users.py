"""Two real users writing through the mount: a file being written (not yet imported) is as
out of reach as one the kernel has, and writing another user's file keeps its inode, owner,
group, mode and links, as a write on a disk does."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from daemon import NEEDS_MOUNT, ROOT, as_user, errno_of, make, world_dir

from syscalls.convert import proc_fields

A, B = 60001, 60002

pytestmark = [pytest.mark.slow, NEEDS_MOUNT]

# Python becomes the user (argv[1]) only after starting: it may live where other users
# cannot read.
BECOME = """
import os, sys
os.setgroups([])
os.setgid(int(sys.argv[1]))
os.setuid(int(sys.argv[1]))
"""
# Write files through the mount and hold them open (so not yet imported) until stdin closes.
HOLD = """
os.umask(0o077)
fds = []
for path, source in zip(sys.argv[2::2], sys.argv[3::2]):
    with open(source, "rb") as f:
        data = f.read()
    fds.append(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666))
    assert os.write(fds[-1], data) == len(data)
print("written", flush=True)
sys.stdin.read()
for fd in fds:
    os.close(fd)
"""
# truncate(2) of a path (truncate(1) opens the file and cuts the fd instead): its errno.
TRUNCATE = """
try:
    os.truncate(sys.argv[2], 0)
except OSError as e:
    print(e.errno)
"""


def source(k, n: int, salt: int) -> tuple[Path, bytes]:
    """A KV file's canonical form in a file every user may read, and its bytes."""
    make(k, "/tmp/source.kv", n, salt=salt)
    data = k.export("/tmp/source.kv")
    k.unlink("/tmp/source.kv")
    path = world_dir() / "source.kv"
    path.write_bytes(data)
    path.chmod(0o644)
    return path, data


def two_sources(k) -> tuple[tuple[Path, bytes], tuple[Path, bytes]]:
    """Two different KV files as source() makes them: of 9 and of 7 entries."""
    return source(k, 9, salt=1), source(k, 7, salt=2)


def python_as(uid: int, code: str, *args: str | Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BECOME + code, str(uid), *map(str, args)],
                            cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def truncate_errno(uid: int, path: str) -> int:
    out, err = python_as(uid, TRUNCATE, path).communicate(timeout=60)
    assert not err, err
    return int(out or 0)


@contextlib.contextmanager
def held_open(uid: int, *writes: tuple[str, Path]):
    """uid's process writes each (file in the mount, source) and holds the files open until
    the block ends; then it closes them, which imports them."""
    hold = python_as(uid, HOLD, *(p for pair in writes for p in pair))
    try:
        assert hold.stdout.readline() == b"written\n", hold.stderr.read()
        yield
    finally:
        _, err = hold.communicate(timeout=60)
    assert hold.returncode == 0, err


def refused(uid: int, *cmd: str) -> bytes:
    """The error a tool run as uid fails with."""
    run = as_user(uid, *cmd)
    assert run.returncode != 0, cmd
    return run.stderr


def test_a_file_being_written_in_a_private_home_is_out_of_others_reach(k, mnt):
    k.mkdir("/home/a", 0o700)
    k.chown("/home/a", A, A)
    src, data = source(k, 9, salt=1)
    new = str(mnt / "home/a/new.kv")
    with held_open(A, (new, src)):
        assert as_user(A, "stat", "-c", "%a %u", new).stdout == b"600 60001\n"
        for cmd in (["stat"], ["chmod", "644"], ["truncate", "-s", "0"], ["touch", "-c"],
                    ["cat"], ["getfattr", "-d"]):
            assert b"Permission denied" in refused(B, *cmd, new), cmd
        assert truncate_errno(B, new) == errno.EACCES
        assert as_user(B, "test", "-e", new).returncode == 1
    st = k.stat("/home/a/new.kv")
    assert (st.uid, stat.S_IMODE(st.mode)) == (A, 0o600)
    assert k.export("/home/a/new.kv") == data


def test_in_a_shared_directory_only_its_writer_changes_a_file_being_written(k, mnt):
    make(k.acting_as(A, A), "/tmp/old.kv", 5)  # A's, 0644: others may read it, not write it
    ino = k.stat("/tmp/old.kv").ino
    src_new, data_new = source(k, 9, salt=1)
    src_old, data_old = source(k, 7, salt=2)
    new, old = str(mnt / "tmp/new.kv"), str(mnt / "tmp/old.kv")
    with held_open(A, (new, src_new), (old, src_old)):
        assert as_user(B, "stat", "-c", "%a %u", new).stdout == b"600 60001\n"  # /tmp: searchable
        for path in (new, old):
            assert b"Operation not permitted" in refused(B, "chmod", "666", path)
            assert truncate_errno(B, path) == errno.EACCES
            assert b"Permission denied" in refused(B, "truncate", "-s", "0", path)
            refused(B, "touch", "-c", path)
            assert as_user(B, "test", "-w", path).returncode == 1
        assert b"Permission denied" in refused(B, "cat", new)
        assert as_user(B, "cat", old).stdout == k.export("/tmp/old.kv")  # the kernel's version
        assert as_user(A, "chmod", "640", new).returncode == 0  # its writer may
        assert as_user(B, "stat", "-c", "%a", new).stdout == b"640\n"
    st = k.stat("/tmp/new.kv")
    assert (st.uid, stat.S_IMODE(st.mode)) == (A, 0o640)
    assert k.export("/tmp/new.kv") == data_new
    assert k.export("/tmp/old.kv") == data_old and k.stat("/tmp/old.kv").ino == ino


def test_writing_another_users_file_keeps_its_inode_owner_mode_and_links(k, mnt):
    owner = k.acting_as(A, A)
    owner.mkdir("/tmp/a", 0o755)  # B may not make files here: the writes must go in place
    src, data = source(k, 9, salt=1)
    for name, mode in (("w2.kv", 0o602), ("w6.kv", 0o666)):
        path = f"/tmp/a/{name}"
        make(owner, path, 5, mode)
        with owner.open(path) as f:
            f.link(path + ".link")
        ino = k.stat(path).ino
        cp = as_user(B, "cp", str(src), str(mnt / path[1:]))
        assert cp.returncode == 0, cp.stderr
        ks, ms = k.stat(path), os.stat(mnt / path[1:])
        assert (ks.ino, ks.uid, ks.gid, stat.S_IMODE(ks.mode)) == (ino, A, A, mode)
        assert (ms.st_ino, ms.st_uid, ms.st_gid, ms.st_mode) == (ks.ino, ks.uid, ks.gid, ks.mode)
        assert k.export(path) == k.export(path + ".link") == data
        assert b"Operation not permitted" in refused(B, "chmod", "666", str(mnt / path[1:]))
    w2 = str(mnt / "tmp/a/w2.kv")
    assert b"Permission denied" in refused(B, "cat", w2)
    # Without O_TRUNC, the writing starts from the file's bytes, which B may not read: they
    # go only back into the file.
    patched = data[:-4] + b"\x00\x00\x80\x3f"  # the last V value, 1.0f
    patch = src.with_name("patch")
    patch.write_bytes(patched[-4:])
    patch.chmod(0o644)
    dd = as_user(B, "dd", f"if={patch}", f"of={w2}", f"seek={len(data) - 4}", "oflag=seek_bytes",
                 "conv=notrunc", "status=none")
    assert dd.returncode == 0, dd.stderr
    assert k.export("/tmp/a/w2.kv") == patched
    st = k.stat("/tmp/a/w2.kv")
    assert (st.uid, stat.S_IMODE(st.mode)) == (A, 0o602)


def test_a_file_being_written_follows_a_rename(k, mnt):
    owner = k.acting_as(A, A)
    owner.mkdir("/tmp/d", 0o755)
    make(owner, "/tmp/d/old.kv", 5)
    ino = k.stat("/tmp/d/old.kv").ino
    src_new, data_new = source(k, 9, salt=1)
    src_old, data_old = source(k, 7, salt=2)
    with held_open(A, (str(mnt / "tmp/d/new.kv"), src_new), (str(mnt / "tmp/d/old.kv"), src_old)):
        os.rename(mnt / "tmp/d/old.kv", mnt / "tmp/d/moved.kv")
        os.rename(mnt / "tmp/d", mnt / "tmp/e")
    assert sorted(name for name, _ in k.readdir("/tmp/e")) == ["moved.kv", "new.kv"]
    assert k.export("/tmp/e/new.kv") == data_new
    assert k.export("/tmp/e/moved.kv") == data_old and k.stat("/tmp/e/moved.kv").ino == ino
    assert errno_of(k.stat, "/tmp/d") == errno.ENOENT


def test_in_sticky_tmp_another_user_may_not_replace_remove_or_move_a_file_being_written(k, mnt):
    (src_a, data_a), (src_b, _) = two_sources(k)
    tmp = mnt / "tmp"
    p, n, q = str(tmp / "p1.kv"), str(tmp / "n1.kv"), str(tmp / "q1.kv")
    with held_open(A, (p, src_a)):
        assert as_user(B, "cp", str(src_b), n).returncode == 0
        assert b"Operation not permitted" in refused(B, "mv", "-f", n, p)
        assert b"Operation not permitted" in refused(B, "rm", "-f", p)
        assert b"Operation not permitted" in refused(B, "mv", "-f", p, q)
        assert sorted(os.listdir(tmp)).count("p1.kv") == 1
    assert k.export("/tmp/p1.kv") == data_a and k.stat("/tmp/p1.kv").uid == A
    assert errno_of(k.stat, "/tmp/q1.kv") == errno.ENOENT


def test_a_file_renamed_over_a_file_being_written_replaces_it(k, mnt):
    (src_a, data_a), (src_b, data_b) = two_sources(k)
    tmp = mnt / "tmp"
    p, n, mine, q = (str(tmp / f) for f in ("p2.kv", "n2.kv", "mine2.kv", "q2.kv"))
    assert as_user(B, "cp", str(src_b), n).returncode == 0
    # By root, or by its writer: the file renamed over it has the name; the writer's fd
    # still works, and its close imports nothing.
    for mover, moved in ((0, n), (A, mine)):
        with held_open(A, (p, src_a)):
            if mover == A:
                assert as_user(A, "cp", str(src_b), mine).returncode == 0
            assert as_user(mover, "mv", "-f", moved, p).returncode == 0
            assert sorted(os.listdir(tmp)).count("p2.kv") == 1
            assert os.stat(p).st_uid == (B if mover == 0 else A)
        assert k.export("/tmp/p2.kv") == data_b, mover
        k.unlink("/tmp/p2.kv")
    # Moved by its writer: it imports under its new name, over the file that had it.
    make(k.acting_as(A, A), "/tmp/q2.kv", 5)
    with held_open(A, (p, src_a)):
        assert as_user(A, "mv", "-f", p, q).returncode == 0
        assert sorted(os.listdir(tmp)).count("q2.kv") == 1 and "p2.kv" not in os.listdir(tmp)
    assert k.export("/tmp/q2.kv") == data_a and errno_of(k.stat, "/tmp/p2.kv") == errno.ENOENT


def test_a_file_being_written_that_is_removed_is_gone_after_its_close(k, mnt):
    src_a, _ = source(k, 9, salt=1)
    p = str(mnt / "tmp/p3.kv")
    for remover in (A, 0):  # its writer, root
        with held_open(A, (p, src_a)):
            assert as_user(remover, "rm", "-f", p).returncode == 0
            assert "p3.kv" not in os.listdir(mnt / "tmp")
            assert errno_of(os.stat, p) == errno.ENOENT
        assert errno_of(k.stat, "/tmp/p3.kv") == errno.ENOENT, remover
    # A file the kernel has, being rewritten, then removed: its close does not bring it back.
    make(k.acting_as(A, A), "/tmp/p3.kv", 5)
    with held_open(A, (p, src_a)):
        os.unlink(p)
    assert errno_of(k.stat, "/tmp/p3.kv") == errno.ENOENT


# Two files spooled as far as `at` (one byte there, sparse), then closed, then a third.
SPOOL = """
at = int(sys.argv[2])
def spool(path):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.pwrite(fd, b"x", at)
        return fd, 0
    except OSError as e:
        return fd, e.errno
def close(fd):
    try:
        os.close(fd)
    except OSError as e:
        return e.errno
first, second = spool(sys.argv[3]), spool(sys.argv[4])
print(first[1], second[1], close(first[0]), close(second[0]))
third = spool(sys.argv[5])
print(third[1], close(third[0]))
"""


def test_a_user_spools_no_more_than_the_largest_file_in_all(k, mnt):
    """Each spool stays under the largest file the pool could hold, but two of one user's
    together do not: the second write is EDQUOT, and once the first is closed the user may
    spool again. Root has no such limit."""
    mem = proc_fields(k.procfs("meminfo"))
    size = int(mem["page_size_tokens"])
    largest = 8 + (1 << 20) + int(mem["device_total"]) * size * (int(mem["page_bytes"]) // size
                                                                   + 32)
    at = largest // 2 + 1
    paths = [mnt / f"tmp/spool{i}.kv" for i in range(3)]
    out, err = python_as(A, SPOOL, str(at), *paths).communicate(timeout=120)
    assert not err, err
    # Neither file is a KV file: each close refuses its import (EINVAL).
    assert out.decode().split("\n")[:2] == [
        f"0 {errno.EDQUOT} {errno.EINVAL} {errno.EINVAL}", f"0 {errno.EINVAL}"]
    assert not any(p.exists() for p in paths)
    fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) for p in paths[:2]]
    try:
        for fd in fds:
            assert os.pwrite(fd, b"x", at) == 1
    finally:
        for fd in fds:
            assert errno_of(os.close, fd) == errno.EINVAL


# A session of the user's own (argv[1]), a process in the kernel's table, until stdin closes.
SESSION = """
import os, sys
from syscalls.client import Kernel
os.setgroups([])
os.setgid(int(sys.argv[1]))
os.setuid(int(sys.argv[1]))
with Kernel.connect(name="owned") as k:
    print(k.pid, flush=True)
    sys.stdin.read()
"""


def test_proc_pid_belongs_to_the_processs_user(daemon, k, mnt):
    """As on Linux, /proc/PID and its files are owned by the process's uid and gid."""
    session = subprocess.Popen([sys.executable, "-c", SESSION, str(A)], env=daemon.env(),
                               cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE)
    try:
        pid = int(session.stdout.readline() or 0)
        assert pid, session.stderr.read()
        d = mnt / f"proc/{pid}"
        assert (os.stat(d).st_uid, os.stat(d).st_gid) == (A, A)
        assert sorted(os.listdir(d)) == ["fds", "status", "syscalls"]
        for name in os.listdir(d):
            assert (os.stat(d / name).st_uid, os.stat(d / name).st_gid) == (A, A), name
        ls = subprocess.run(["ls", "-ln", mnt / "proc"], capture_output=True, text=True,
                            check=True).stdout.splitlines()
        line = next(x for x in ls if x.endswith(f" {pid}"))
        assert line.split()[2:4] == [str(A), str(A)], line
        assert as_user(B, "stat", "-c", "%u %g", str(d / "status")).stdout == b"%d %d\n" % (A, A)
        assert os.stat(mnt / f"proc/{k.pid}").st_uid == 0
        assert os.stat(mnt / "proc/meminfo").st_uid == 0
    finally:
        session.communicate(timeout=60)
    assert session.returncode == 0


def test_ln_of_a_file_it_may_not_read_and_write_is_only_its_owners(k, mnt):
    # As Linux's protected_hardlinks: EPERM for another user's file, whether the caller may
    # read it (0644) or not (0600: the mount's open of it was refused first, EACCES).
    for mode in (0o600, 0o644):
        make(k, f"/tmp/ln-{mode:o}.kv", 4, mode)
        err = refused(A, "ln", str(mnt / f"tmp/ln-{mode:o}.kv"), str(mnt / "tmp/ln-new.kv"))
        assert b"Operation not permitted" in err, err
        assert errno_of(k.stat, "/tmp/ln-new.kv") == errno.ENOENT
    # Its owner may link a file it may not even read, where it may write.
    k.chown("/tmp/ln-600.kv", A, A)
    k.chmod("/tmp/ln-600.kv", 0)
    run = as_user(A, "ln", str(mnt / "tmp/ln-600.kv"), str(mnt / "tmp/ln-new.kv"))
    assert run.returncode == 0, run.stderr
    assert k.stat("/tmp/ln-new.kv").ino == k.stat("/tmp/ln-600.kv").ino
    assert k.stat("/tmp/ln-600.kv").nlink == 2
    err = refused(A, "ln", str(mnt / "tmp/ln-600.kv"), str(mnt / "tmp/ln-new.kv"))
    assert b"File exists" in err, err
    k.mkdir("/tmp/ln-dir", 0o755)  # root's: A may not add a name there
    err = refused(A, "ln", str(mnt / "tmp/ln-600.kv"), str(mnt / "tmp/ln-dir/x.kv"))
    assert b"Permission denied" in err, err
    assert errno_of(k.stat, "/tmp/ln-dir/x.kv") == errno.ENOENT
    assert k.stat("/tmp/ln-600.kv").nlink == 2
