"""`symphony mount` for real: a FUSE mount of a kernel daemon, used with the shell's tools
and checked against the syscalls; other users through it; the kernel stopped or killed
under it."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import stat
import struct
import subprocess
import sys

import pyfuse3
import pytest
import trio
from daemon import (
    NEEDS_MOUNT,
    ROOT,
    SYMPHONY,
    alive,
    as_user,
    errno_of,
    make,
    mounted,
    mounted_at,
    prompt,
    start_daemon,
    wait_for,
)

from kvfs.fuse import SLACK, KvFS, requests_fail_alone
from syscalls.convert import proc_fields

OWNER, OTHER = 60001, 60002

pytestmark = [pytest.mark.slow, NEEDS_MOUNT]


def test_ls_and_stat_show_the_kernels_files(k, mnt):
    make(k, "/tmp/ls.kv", 40, 0o640)
    st, ks = os.stat(mnt / "tmp/ls.kv"), k.stat("/tmp/ls.kv")
    assert (st.st_ino, st.st_mode, st.st_nlink, st.st_uid, st.st_gid, st.st_size) == (
        ks.ino,
        ks.mode,
        ks.nlink,
        ks.uid,
        ks.gid,
        ks.size,
    )
    assert (st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns) == (
        ks.atime_ns,
        ks.mtime_ns,
        ks.ctime_ns,
    )
    assert {"home", "tmp", "proc"} <= set(os.listdir(mnt))
    assert "ls.kv" in os.listdir(mnt / "tmp")
    ls = subprocess.run(["ls", "-ln", mnt / "tmp"], capture_output=True, text=True, check=True)
    line = next(x for x in ls.stdout.splitlines() if x.endswith(" ls.kv"))
    assert line.split()[:5] == ["-rw-r-----", "1", "0", "0", str(ks.size)]


def test_df_shows_the_kv_pool(k, mnt):
    """statfs: the pool's pages on every tier, and those free, in blocks of a page (df
    showed a size of 0)."""
    fields = proc_fields(k.procfs("meminfo"))
    total = sum(int(fields[f"{tier}_total"]) for tier in ("device", "host", "disk"))
    st = os.statvfs(mnt)
    assert st.f_frsize == int(fields["page_bytes"]) and st.f_blocks == total > 0
    assert 0 < st.f_bfree == st.f_bavail <= total
    df = subprocess.run(["df", "-B1", str(mnt)], capture_output=True, text=True)
    assert df.returncode == 0 and str(total * st.f_frsize) in df.stdout, df.stdout


def test_cat_and_cp_out_give_the_export(daemon, k, mnt, tmp_path):
    # Longer than the read stream's slack, so that reads reuse, restart and bypass it.
    with k.open("", os.O_RDWR) as block, k.open("/tmp/big.kv", os.O_CREAT | os.O_RDWR) as f:
        block.pred(prompt(1024), no_outputs=True)
        while f.stat().size < 2 * SLACK:
            f.splice_from(block, 0, 1024)
    blob = k.export("/tmp/big.kv")
    subprocess.run(["cp", mnt / "tmp/big.kv", tmp_path / "out.kv"], check=True)
    assert (tmp_path / "out.kv").read_bytes() == blob
    cat = subprocess.run(["cat", mnt / "tmp/big.kv"], capture_output=True, check=True)
    kv_cat = subprocess.run(
        [*SYMPHONY, "kv", "cat", "--socket", str(daemon.socket), "/tmp/big.kv"],
        capture_output=True,
        check=True,
        cwd=ROOT,
    )
    assert cat.stdout == kv_cat.stdout == blob
    fd = os.open(mnt / "tmp/big.kv", os.O_RDONLY)
    try:
        for off in (0, 3, len(blob) // 2, 100, len(blob) - 10, 3 * SLACK, 7):
            assert os.pread(fd, 5000, off) == blob[off : off + 5000], off
    finally:
        os.close(fd)


def test_a_reader_sees_one_version_while_a_lip_appends(k, mnt):
    make(k, "/tmp/growing.kv", 20)
    with k.open("/tmp/growing.kv", os.O_RDWR) as f, open(mnt / "tmp/growing.kv", "rb") as r:
        before = k.export(f)
        f.pred(prompt(50, salt=1), no_outputs=True)
        assert r.read() == before  # opened before the change: that version, whole
        with open(mnt / "tmp/growing.kv", "rb") as again:
            assert again.read() == k.export(f)


def test_lip_changes_show_in_the_mount_at_once(k, mnt):
    with k.open("/tmp/live.kv", os.O_CREAT | os.O_RDWR) as f:
        for n in (3, 17, 1):
            f.pred(prompt(n, salt=n), no_outputs=True)
            assert os.stat(mnt / "tmp/live.kv").st_size == k.stat(f).size
            assert (mnt / "tmp/live.kv").read_bytes() == k.export(f)
    k.rename("/tmp/live.kv", "/tmp/moved.kv")
    assert not (mnt / "tmp/live.kv").exists() and (mnt / "tmp/moved.kv").exists()
    k.unlink("/tmp/moved.kv")
    assert "moved.kv" not in os.listdir(mnt / "tmp")


def test_cp_in_imports_and_a_bad_file_leaves_nothing(k, mnt, tmp_path):
    make(k, "/tmp/src.kv", 30)
    good = k.export("/tmp/src.kv")
    (tmp_path / "good.kv").write_bytes(good)
    subprocess.run(["cp", tmp_path / "good.kv", mnt / "tmp/in.kv"], check=True)
    assert k.export("/tmp/in.kv") == good
    assert stat.S_IMODE(k.stat("/tmp/in.kv").mode) == 0o644 & ~current_umask()
    fingerprint = k.model_info().fingerprint.encode()
    (n,) = struct.unpack("<Q", good[:8])
    head = json.loads(good[8:8 + n])
    head["__metadata__"]["layers"] = "9" * 5000  # past what Python converts to an int
    text = json.dumps(head).encode()
    bad = {
        "garbage": b"not a kv file at all",
        "truncated": good[:-8],
        "foreign": good.replace(fingerprint, b"0" * len(fingerprint), 1),
        "empty": b"",
        "digits": struct.pack("<Q", len(text)) + text + good[8 + n:],
    }
    assert errno_of(k.import_file, "/tmp/digits.kv", bad["digits"]) == errno.EINVAL
    for name, data in bad.items():
        (tmp_path / name).write_bytes(data)
        cp = subprocess.run(
            ["cp", tmp_path / name, mnt / f"tmp/{name}.kv"], capture_output=True, text=True
        )
        assert cp.returncode != 0 and "Invalid argument" in cp.stderr, (name, cp.stderr)
        assert not (mnt / f"tmp/{name}.kv").exists(), name
        assert errno_of(k.stat, f"/tmp/{name}.kv") == errno.ENOENT, name
        # Over an existing file: refused whole, the old one stays.
        cp = subprocess.run(["cp", tmp_path / name, mnt / "tmp/in.kv"], capture_output=True)
        assert cp.returncode != 0 and k.export("/tmp/in.kv") == good, name
    make(k, "/tmp/other.kv", 5, salt=2)
    other = k.export("/tmp/other.kv")
    (tmp_path / "other.kv").write_bytes(other)
    subprocess.run(["cp", tmp_path / "other.kv", mnt / "tmp/in.kv"], check=True)
    assert (mnt / "tmp/in.kv").read_bytes() == k.export("/tmp/in.kv") == other


def test_writing_into_a_file_changes_those_bytes(k, mnt):
    make(k, "/tmp/patch.kv", 8)
    blob = bytearray(k.export("/tmp/patch.kv"))
    off = len(blob) - 4  # the last V value of the last entry
    blob[off:] = b"\x00\x00\x80\x3f"  # 1.0f
    fd = os.open(mnt / "tmp/patch.kv", os.O_WRONLY)  # no O_TRUNC: starts from the file
    try:
        assert os.pwrite(fd, bytes(blob[off:]), off) == 4
    finally:
        os.close(fd)
    assert k.export("/tmp/patch.kv") == blob
    fd = os.open(mnt / "tmp/patch.kv", os.O_WRONLY)
    # Into the whole header: kept, bad for now; a write past it is refused at once, so is
    # every later one and the close, which imports nothing.
    assert os.pwrite(fd, b"X", 8) == 1
    assert errno_of(os.pwrite, fd, blob[-4:], off) == errno.EINVAL
    assert errno_of(os.pwrite, fd, b"{", 8) == errno.EINVAL  # from then on
    assert errno_of(os.close, fd) == errno.EINVAL
    assert k.export("/tmp/patch.kv") == blob
    fd = os.open(mnt / "tmp/patch.kv", os.O_WRONLY)
    assert os.pwrite(fd, b"X", 8) == 1
    assert errno_of(os.close, fd) == errno.EINVAL  # a header left bad: nothing imported
    assert k.export("/tmp/patch.kv") == blob
    fd = os.open(mnt / "tmp/patch.kv", os.O_WRONLY)
    try:
        assert os.pwrite(fd, b"X", 8) == 1
        assert os.pwrite(fd, b"{", 8) == 1  # put back: checked again, and good
        assert os.pwrite(fd, blob[-4:], off) == 4
    finally:
        os.close(fd)
    assert k.export("/tmp/patch.kv") == blob


def test_a_header_rewritten_in_place_in_small_writes_is_checked_again(k, mnt, tmp_path):
    # dd bs=512 conv=notrunc over a file with another header: each write of a part of the
    # header leaves a mix of old and new, bad until the last part is written.
    make(k, "/tmp/dd.kv", 5)
    make(k, "/tmp/dd-new.kv", 9, salt=3)
    new = k.export("/tmp/dd-new.kv")
    (length,) = struct.unpack("<Q", new[:8])
    assert 8 + length > 512
    (tmp_path / "new.kv").write_bytes(new)
    dd = subprocess.run(["dd", f"if={tmp_path / 'new.kv'}", f"of={mnt / 'tmp/dd.kv'}",
                         "bs=512", "conv=notrunc"], capture_output=True, text=True)
    assert dd.returncode == 0, dd.stderr
    assert k.export("/tmp/dd.kv") == new
    # In 100-byte pieces, then cut to nothing and written whole: what counts is the last.
    make(k, "/tmp/dd2.kv", 5)
    fd = os.open(mnt / "tmp/dd2.kv", os.O_WRONLY)
    try:
        for i in range(0, 8 + length, 100):
            assert os.pwrite(fd, new[i : i + 100], i) == len(new[i : i + 100])
        os.ftruncate(fd, 0)
        assert os.pwrite(fd, new, 0) == len(new)
    finally:
        os.close(fd)
    assert k.export("/tmp/dd2.kv") == new


ITEM_BYTES = {"I64": 8, "F32": 4, "F16": 2, "BF16": 2}


def declaring(blob: bytes, n: int) -> bytes:
    """The header of the KV file `blob` changed to declare n entries (no body after it)."""
    (length,) = struct.unpack("<Q", blob[:8])
    head = json.loads(blob[8 : 8 + length])
    off = 0
    for name in ("token_ids", "positions", "excluded", "k", "v"):  # the exporter's order
        t = head[name]
        if name in ("token_ids", "positions"):
            t["shape"] = [n]
        elif name != "excluded":
            t["shape"][1] = n
        size = ITEM_BYTES[t["dtype"]]
        for d in t["shape"]:
            size *= d
        t["data_offsets"] = [off, off + size]
        off += size
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def test_a_bad_header_is_refused_as_it_is_written(k, mnt):
    # A header of length 0 is refused at its 8th byte: dd's first block is already refused,
    # nothing more is spooled, and nothing is left.
    dd = subprocess.run(["dd", "if=/dev/zero", f"of={mnt / 'tmp/zeros.kv'}", "bs=1M",
                         "count=64"], capture_output=True, text=True)
    assert dd.returncode != 0 and "Invalid argument" in dd.stderr, dd.stderr
    assert "error writing" in dd.stderr, dd.stderr  # not only at close
    assert not (mnt / "tmp/zeros.kv").exists()


def test_the_spool_takes_no_more_than_the_kernel_could_hold(k, mnt):
    make(k, "/tmp/small.kv", 3)
    blob = k.export("/tmp/small.kv")
    mem = proc_fields(k.procfs("meminfo"))
    rows, page_size = int(mem["device_total"]) * int(mem["page_size_tokens"]), int(
        mem["page_size_tokens"])
    # A header declaring more entries than the device pool holds: EFBIG at once, and at close.
    fd = os.open(mnt / "tmp/too-long.kv", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    assert errno_of(os.write, fd, declaring(blob, rows + 1)) == errno.EFBIG
    assert errno_of(os.close, fd) == errno.EFBIG
    assert errno_of(k.stat, "/tmp/too-long.kv") == errno.ENOENT
    # Past the largest file the pool could hold (every row an entry with an excluded range,
    # and the largest header): EFBIG, with nothing spooled; the file stays as it was.
    largest = 8 + (1 << 20) + rows * (int(mem["page_bytes"]) // page_size + 32)
    fd = os.open(mnt / "tmp/small.kv", os.O_WRONLY | os.O_TRUNC)
    try:
        assert os.write(fd, blob) == len(blob)
        assert errno_of(os.pwrite, fd, b"x", largest) == errno.EFBIG
        # Past the end of the file its header lays out: the import would refuse it. Growing
        # the file there with ftruncate is the same (zeros written at its end).
        assert errno_of(os.write, fd, b"trailing") == errno.EINVAL
        assert errno_of(os.ftruncate, fd, len(blob) + 10) == errno.EINVAL
        assert os.fstat(fd).st_size == len(blob)
    finally:
        os.close(fd)  # neither refused write was kept: the file imports
    assert k.export("/tmp/small.kv") == blob
    # A cut and a growth back: the bytes grown are zeros, as on a disk, and they import.
    fd = os.open(mnt / "tmp/small.kv", os.O_WRONLY | os.O_TRUNC)
    try:
        assert os.write(fd, blob) == len(blob)
        os.ftruncate(fd, len(blob) - 4)
        os.ftruncate(fd, len(blob))
    finally:
        os.close(fd)
    assert k.export("/tmp/small.kv") == blob[:-4] + bytes(4)


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_mv_rm_mkdir_rmdir_chmod_ln_as_on_a_disk(k, mnt):
    d = mnt / "tmp/dir"
    os.mkdir(d, 0o750)
    assert k.stat("/tmp/dir").is_dir and stat.S_IMODE(k.stat("/tmp/dir").mode) == 0o750
    make(k, "/tmp/f.kv", 10)
    subprocess.run(["mv", mnt / "tmp/f.kv", d / "g.kv"], check=True)
    assert errno_of(k.stat, "/tmp/f.kv") == errno.ENOENT and k.stat("/tmp/dir/g.kv").tokens == 10
    os.chmod(d / "g.kv", 0o600)
    assert stat.S_IMODE(k.stat("/tmp/dir/g.kv").mode) == 0o600
    subprocess.run(["ln", d / "g.kv", d / "h.kv"], check=True)
    assert k.stat("/tmp/dir/h.kv").ino == k.stat("/tmp/dir/g.kv").ino
    assert os.stat(d / "h.kv").st_nlink == 2 == k.stat("/tmp/dir/g.kv").nlink
    assert (d / "h.kv").read_bytes() == k.export("/tmp/dir/g.kv")
    assert errno_of(os.rmdir, d) == errno.ENOTEMPTY
    assert errno_of(os.mkdir, d) == errno.EEXIST
    assert errno_of(os.rename, mnt / "tmp/nope", d / "x") == errno.ENOENT
    assert errno_of(os.unlink, d) == errno.EISDIR
    assert errno_of(os.rename, d, d / "inside") == errno.EINVAL
    assert errno_of(os.link, d / "g.kv", d / "h.kv") == errno.EEXIST
    assert errno_of(os.truncate, d / "g.kv", 100) == errno.EINVAL  # no KV file would be left
    subprocess.run(["rm", d / "g.kv", d / "h.kv"], check=True)
    os.rmdir(d)
    assert errno_of(k.stat, "/tmp/dir") == errno.ENOENT


def test_extended_attributes(k, mnt):
    ids = k.tokenize("The quick brown fox")
    with k.open("/tmp/x.kv", os.O_CREAT | os.O_RDWR) as f:
        f.pred(ids, no_outputs=True)
    path, info, st = mnt / "tmp/x.kv", k.model_info(), k.stat("/tmp/x.kv")
    assert sorted(os.listxattr(path)) == [
        f"user.symphony.{n}" for n in ("model", "pages", "text", "tokens")
    ]
    assert os.getxattr(path, "user.symphony.tokens") == str(len(ids)).encode()
    assert os.getxattr(path, "user.symphony.pages") == str(st.pages).encode()
    assert os.getxattr(path, "user.symphony.text").decode() == k.detokenize(ids)
    assert os.getxattr(path, "user.symphony.model").decode() == f"{info.name} {info.fingerprint}"
    assert errno_of(os.getxattr, path, "user.other") == errno.ENODATA
    assert errno_of(os.setxattr, path, "user.symphony.tokens", b"1") == errno.ENOTSUP
    assert os.listxattr(mnt / "tmp") == []
    # What the README tells users to run.
    shown = subprocess.run(["getfattr", "--absolute-names", "-d", "-m", "user.symphony", path],
                           capture_output=True, text=True, check=True).stdout
    assert f'user.symphony.tokens="{len(ids)}"' in shown.splitlines()
    assert f'user.symphony.model="{info.name} {info.fingerprint}"' in shown.splitlines()


def test_the_kernel_decides_access_for_each_user(daemon, k, mnt):
    owner = k.acting_as(OWNER, OWNER)
    owner.mkdir("/tmp/u1", 0o755)
    with owner.open("/tmp/u1/secret", os.O_CREAT | os.O_RDWR, 0o600) as f:
        f.pred(prompt(12), no_outputs=True)
    secret = str(mnt / "tmp/u1/secret")
    denied = as_user(OTHER, "cat", secret)
    assert denied.returncode != 0 and b"Permission denied" in denied.stderr
    assert as_user(OWNER, "cat", secret).stdout == k.export("/tmp/u1/secret")
    # access(2) asks the kernel too.
    assert as_user(OTHER, "test", "-r", secret).returncode == 1
    assert as_user(OWNER, "test", "-r", secret).returncode == 0
    assert as_user(OWNER, "test", "-w", str(mnt / "proc/meminfo")).returncode == 1
    ls = as_user(OTHER, "ls", "-ln", secret)  # stat needs no read permission
    assert ls.stdout.split()[:4] == [b"-rw-------", b"1", b"%d" % OWNER, b"%d" % OWNER]
    rm = as_user(OTHER, "rm", "-f", secret)
    assert rm.returncode != 0 and b"Permission denied" in rm.stderr
    good = daemon.socket.parent / "good.kv"  # where the other user can read it
    good.write_bytes(k.export("/tmp/u1/secret"))
    good.chmod(0o644)
    cp = as_user(OTHER, "cp", str(good), str(mnt / "tmp/u1/mine.kv"))
    # Refused at create, as on a disk, not only when the import at close is refused.
    assert cp.returncode != 0 and b"cannot create regular file" in cp.stderr
    assert b"Permission denied" in cp.stderr
    assert errno_of(k.stat, "/tmp/u1/mine.kv") == errno.ENOENT
    assert as_user(OWNER, "cp", str(good), str(mnt / "tmp/u1/mine.kv")).returncode == 0
    assert k.stat("/tmp/u1/mine.kv").uid == OWNER
    # Root writes over it: rewritten in place, still its owner's.
    subprocess.run(["cp", good, mnt / "tmp/u1/mine.kv"], check=True)
    st = k.stat("/tmp/u1/mine.kv")
    assert (st.uid, st.gid, stat.S_IMODE(st.mode)) == (OWNER, OWNER, 0o644 & ~current_umask())


def test_proc_agrees_with_the_kernel(k, mnt):
    proc = mnt / "proc"
    assert {"meminfo", "sched", "kv", str(k.pid)} <= set(os.listdir(proc))
    assert sorted(os.listdir(proc / str(k.pid))) == ["fds", "status", "syscalls"]
    assert stat.S_ISDIR(os.stat(proc / str(k.pid)).st_mode)
    with k.open("", os.O_RDWR) as f, f.fork():
        f.pred(prompt(40), no_outputs=True)
        assert (proc / f"{k.pid}/fds").read_text() == k.procfs(f"{k.pid}/fds")
        assert (proc / "kv").read_text() == k.procfs("kv")
        # Equal once the snapshots of readers of earlier tests are closed (FUSE releases a
        # file after close(2) returns).
        wait_for(lambda: (proc / "meminfo").read_text() == k.procfs("meminfo"), what="meminfo")
        assert os.stat(proc / "meminfo").st_size == len(k.procfs("meminfo"))
    status = proc_fields((proc / f"{k.pid}/status").read_text())
    assert status["name"] == "test" and status["tokens"] == "40"
    calls = (proc / f"{k.pid}/syscalls").read_text()
    assert calls.startswith("call\tcount") and "\nPred\t1\t" in calls
    sched = subprocess.run(["cat", proc / "sched"], capture_output=True, text=True, check=True)
    assert "run_queue" in proc_fields(sched.stdout)
    mount_pid = next(p.pid for p in k.ps() if p.name == "mount")
    assert proc_fields((proc / f"{mount_pid}/status").read_text())["name"] == "mount"
    assert errno_of(open, proc / "meminfo", "w") == errno.EACCES
    assert errno_of(open, proc / "new", "w") == errno.EROFS
    assert errno_of(os.mkdir, proc / "d") == errno.EROFS
    assert errno_of(os.unlink, proc / "meminfo") == errno.EROFS
    assert errno_of(os.chmod, proc / "meminfo", 0o666) == errno.EROFS
    assert errno_of(os.stat, proc / "99999") == errno.ENOENT


def test_a_kernel_that_stops_unmounts_the_mount(model):
    d = start_daemon(model)
    try:
        with mounted(d) as (target, process):
            assert d.stop() == 0, d.log_text()
            assert process.wait(30) == 0
            assert not mounted_at(target)
    finally:
        d.stop()


def test_a_killed_kernel_leaves_eio_and_umount_works(model):
    d = start_daemon(model)
    try:
        with mounted(d, foreground=False) as (target, _):  # `symphony mount` forks
            with d.connect() as k:
                pid = next(p.os_pid for p in k.ps() if p.name == "mount")
                make(k, "/tmp/kept.kv", 5)
            d.process.send_signal(signal.SIGKILL)
            d.process.wait()
            wait_for(lambda: errno_of(os.listdir, target) == errno.EIO, what="EIO")
            assert errno_of(os.stat, target / "tmp/kept.kv") == errno.EIO
            assert errno_of(open, target / "tmp/new.kv", "wb") == errno.EIO
            umount = subprocess.run([*SYMPHONY, "umount", str(target)], cwd=ROOT)
            assert umount.returncode == 0 and not mounted_at(target)
            wait_for(lambda: not alive(pid), what="the mount process to exit")
    finally:
        d.stop()


def test_a_file_renamed_over_one_being_rewritten_is_left_alone(k, mnt):
    make(k, "/tmp/r1.kv", 4)
    make(k, "/tmp/r2.kv", 6, salt=1)
    moved = k.export("/tmp/r2.kv")
    fd = os.open(mnt / "tmp/r1.kv", os.O_RDWR)  # no O_TRUNC: would start from r1's bytes
    try:
        os.rename(mnt / "tmp/r2.kv", mnt / "tmp/r1.kv")
        # The old file lost its name: its fd never reads, nor writes into, the one there now.
        assert os.read(fd, 1 << 20) != moved
        assert os.write(fd, b"x") == 1
    finally:
        os.close(fd)  # imports nothing
    assert k.export("/tmp/r1.kv") == moved


def test_a_write_past_the_end_is_refused_without_o_trunc(k, mnt):
    # The spool starts from the file's bytes, whose header is checked as a written one is:
    # a write past the end it lays out is EINVAL at once, and nothing of it is kept.
    make(k, "/tmp/ap.kv", 5)
    blob = k.export("/tmp/ap.kv")
    path = mnt / "tmp/ap.kv"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        assert errno_of(os.write, fd, b"abcdefgh") == errno.EINVAL
    finally:
        os.close(fd)  # nothing was kept: nothing to import
    fd = os.open(path, os.O_WRONLY)
    try:
        assert errno_of(os.pwrite, fd, b"x" * 16, len(blob)) == errno.EINVAL
        assert errno_of(os.ftruncate, fd, len(blob) + 10) == errno.EINVAL
        assert os.fstat(fd).st_size == len(blob)
        assert os.pwrite(fd, blob[-4:], len(blob) - 4) == 4  # inside the file: kept
    finally:
        os.close(fd)
    assert k.export("/tmp/ap.kv") == blob
    # bash ignores an error on close, not one on write.
    echo = subprocess.run(["bash", "-c", f"echo x >> {path}"], capture_output=True, text=True)
    assert echo.returncode != 0 and "Invalid argument" in echo.stderr, echo.stderr
    assert k.export("/tmp/ap.kv") == blob


def test_one_write_of_a_header_and_bytes_past_its_end_is_refused_whole(k, mnt, tmp_path):
    make(k, "/tmp/dbl-src.kv", 7)
    blob = k.export("/tmp/dbl-src.kv")
    mem = proc_fields(k.procfs("meminfo"))
    rows, page_size = int(mem["device_total"]) * int(mem["page_size_tokens"]), int(
        mem["page_size_tokens"])
    largest = 8 + (1 << 20) + rows * (int(mem["page_bytes"]) // page_size + 32)
    (tmp_path / "dbl.kv").write_bytes(blob + blob)
    cp = subprocess.run(["cp", tmp_path / "dbl.kv", mnt / "tmp/dbl.kv"], capture_output=True,
                        text=True)
    assert cp.returncode != 0 and "error writing" in cp.stderr, cp.stderr  # not only at close
    assert "Invalid argument" in cp.stderr, cp.stderr
    assert errno_of(k.stat, "/tmp/dbl.kv") == errno.ENOENT
    fd = os.open(mnt / "tmp/dbl.kv", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        assert errno_of(os.write, fd, blob + blob) == errno.EINVAL
        # Larger than one FUSE write: its first part is refused, not a short write.
        more = min(3 << 20, largest - len(blob))
        assert errno_of(os.write, fd, blob + bytes(more)) == errno.EINVAL
        assert os.fstat(fd).st_size == 0  # nothing of them was kept
        assert os.write(fd, blob) == len(blob)
    finally:
        os.close(fd)
    assert k.export("/tmp/dbl.kv") == blob


def test_a_header_written_out_of_order_is_checked_once_whole(k, mnt):
    make(k, "/tmp/ooo-src.kv", 6)
    blob = k.export("/tmp/ooo-src.kv")
    n = 8 + struct.unpack("<Q", blob[:8])[0]
    fd = os.open(mnt / "tmp/ooo.kv", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        assert os.pwrite(fd, blob[8:n], 8) == n - 8
        assert os.pwrite(fd, blob[:8], 0) == 8  # fills the hole: the header is whole
        assert errno_of(os.pwrite, fd, b"x", len(blob)) == errno.EINVAL
        assert os.pwrite(fd, blob[n:], n) == len(blob) - n
    finally:
        os.close(fd)
    assert k.export("/tmp/ooo.kv") == blob
    # A bad header written body first: refused at the write that makes it whole, and the
    # body after it is never spooled.
    fingerprint = k.model_info().fingerprint.encode()
    bad = blob.replace(fingerprint, b"0" * len(fingerprint), 1)
    fd = os.open(mnt / "tmp/ooo-bad.kv", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    assert os.pwrite(fd, bad[8:n], 8) == n - 8
    assert errno_of(os.pwrite, fd, bad[:8], 0) == errno.EINVAL
    assert errno_of(os.pwrite, fd, bytes(1 << 20), n) == errno.EINVAL
    assert errno_of(os.close, fd) == errno.EINVAL
    assert errno_of(k.stat, "/tmp/ooo-bad.kv") == errno.ENOENT


HOLD_NEW = """
import os, sys
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
with open(sys.argv[2], "rb") as f:
    os.write(fd, f.read(100))
print("open", flush=True)
sys.stdin.readline()
os.close(fd)
"""


def test_a_new_file_being_written_opens_again_for_writing_by_its_writer(k, mnt, tmp_path):
    # The opens share one spool, as on a disk; the close of the last imports it.
    make(k, "/tmp/busy-src.kv", 6)
    blob = k.export("/tmp/busy-src.kv")
    (tmp_path / "busy.kv").write_bytes(blob)
    path = mnt / "tmp/busy.kv"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        assert os.write(fd, blob[:100]) == 100
        for flags in (os.O_WRONLY, os.O_WRONLY | os.O_CREAT, os.O_RDWR,
                      os.O_WRONLY | os.O_APPEND):
            os.close(os.open(path, flags))  # not the last close: nothing imported
        assert errno_of(os.open, path, os.O_RDONLY) == errno.ENOENT  # not in the kernel
        fd2 = os.open(path, os.O_RDWR)
        assert os.pread(fd2, 200, 0) == blob[:100]
        assert os.pwrite(fd2, blob[100:], 100) == len(blob) - 100
        os.close(fd2)
        assert errno_of(k.stat, "/tmp/busy.kv") == errno.ENOENT
        assert os.fstat(fd).st_size == len(blob)
    finally:
        os.close(fd)
    assert k.export("/tmp/busy.kv") == blob
    # cp and a shell's > over a new file another process of the writer holds open.
    hold = subprocess.Popen([sys.executable, "-c", HOLD_NEW, mnt / "tmp/busy2.kv",
                             tmp_path / "busy.kv"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert hold.stdout.readline() == b"open\n"
        for cmd in (f"cp {tmp_path / 'busy.kv'} {mnt / 'tmp/busy2.kv'}",
                    f"cat {tmp_path / 'busy.kv'} > {mnt / 'tmp/busy2.kv'}"):
            run = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True)
            assert run.returncode == 0, (cmd, run.stderr)
            assert errno_of(k.stat, "/tmp/busy2.kv") == errno.ENOENT, cmd
    finally:
        _, err = hold.communicate(b"\n", timeout=60)
    assert hold.returncode == 0, err
    assert k.export("/tmp/busy2.kv") == blob


def test_fstat_of_a_file_whose_name_is_gone_answers_from_its_fd(k, mnt):
    make(k, "/tmp/gone.kv", 6)
    blob, ino = k.export("/tmp/gone.kv"), k.stat("/tmp/gone.kv").ino
    path = mnt / "tmp/gone.kv"
    r = os.open(path, os.O_RDONLY)
    try:
        os.unlink(path)
        st = os.fstat(r)
        assert (st.st_ino, st.st_size, st.st_nlink, st.st_mode) == (
            ino, len(blob), 0, stat.S_IFREG | 0o644)
        assert os.read(r, len(blob) + 1) == blob
    finally:
        os.close(r)
    make(k, "/tmp/gone.kv", 6)
    ino = k.stat("/tmp/gone.kv").ino
    w = os.open(path, os.O_WRONLY | os.O_TRUNC)
    try:
        assert os.write(w, blob[:100]) == 100
        os.unlink(path)
        st = os.fstat(w)
        assert (st.st_ino, st.st_size, st.st_nlink) == (ino, 100, 0)
        assert os.write(w, blob[100:]) == len(blob) - 100
        assert os.fstat(w).st_size == len(blob)
    finally:
        os.close(w)  # imports nothing
    # A new file, never imported.
    w = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        assert os.write(w, blob[:50]) == 50
        os.unlink(path)
        st = os.fstat(w)
        assert (st.st_size, st.st_nlink, stat.S_IMODE(st.st_mode)) == (50, 0, 0o600)
    finally:
        os.close(w)
    assert errno_of(os.stat, path) == errno.ENOENT
    assert errno_of(k.stat, "/tmp/gone.kv") == errno.ENOENT


def test_symlinks_fifos_and_device_files_are_eperm(k, mnt):
    assert errno_of(os.symlink, "target", mnt / "tmp/link") == errno.EPERM
    assert errno_of(os.mkfifo, mnt / "tmp/fifo") == errno.EPERM
    assert errno_of(os.mknod, mnt / "tmp/null", stat.S_IFCHR | 0o666, os.makedev(1, 3)) == (
        errno.EPERM)
    ln = subprocess.run(["ln", "-s", "target", mnt / "tmp/link"], capture_output=True, text=True)
    assert ln.returncode != 0 and "Operation not permitted" in ln.stderr, ln.stderr
    assert errno_of(os.symlink, "target", mnt / "proc/link") == errno.EROFS
    assert not {"link", "fifo", "null"} & set(os.listdir(mnt / "tmp"))


def test_mount_over_a_dead_mount_says_to_umount_it(model):
    d = start_daemon(model)
    try:
        with mounted(d, foreground=False) as (target, _):
            with d.connect() as k:
                pid = next(p.os_pid for p in k.ps() if p.name == "mount")
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: errno_of(os.stat, target) == errno.ENOTCONN, what="ENOTCONN")
            again = subprocess.run([*SYMPHONY, "mount", str(target), "--socket", str(d.socket)],
                                   cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert again.returncode == 1, again.stderr
            assert "dead mount" in again.stderr and f"symphony umount {target}" in again.stderr
            umount = subprocess.run([*SYMPHONY, "umount", str(target)], cwd=ROOT)
            assert umount.returncode == 0 and not mounted_at(target)
            subprocess.run([*SYMPHONY, "mount", str(target), "--socket", str(d.socket)],
                           cwd=ROOT, check=True, timeout=60)
            assert mounted_at(target) and "tmp" in os.listdir(target)
    finally:
        d.stop()


def test_an_unexpected_error_fails_its_request_alone():
    """Raised to pyfuse3 it would end the mount for every user: its request gets EIO."""
    @requests_fail_alone
    class Broken(pyfuse3.Operations):
        async def getattr(self, inode, ctx=None):
            raise ValueError("a bug")

    with pytest.raises(pyfuse3.FUSEError) as e:
        trio.run(Broken().getattr, 1)
    assert e.value.errno == errno.EIO
    assert all(hasattr(getattr(KvFS, name), "__wrapped__") for name in ("write", "release"))


def test_ftruncate_growing_a_file_is_checked_as_the_write_of_its_zeros(k, mnt):
    # The header cut mid-way, then grown back with zeros: the zeros complete a bad header,
    # as the same zeros written would, so the growth fails, and is not kept: the file keeps
    # its size, and the rest written imports.
    make(k, "/tmp/grow-src.kv", 8)
    blob = k.export("/tmp/grow-src.kv")
    (n,) = struct.unpack("<Q", blob[:8])
    fd = os.open(mnt / "tmp/grow.kv", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        assert os.write(fd, blob[: 8 + n + 100]) == 8 + n + 100
        os.ftruncate(fd, n)  # within the header: not all there, nothing checked
        assert errno_of(os.ftruncate, fd, len(blob)) == errno.EINVAL
        assert os.fstat(fd).st_size == n
        assert os.pwrite(fd, blob[n:], n) == len(blob) - n
    finally:
        os.close(fd)
    assert k.export("/tmp/grow.kv") == blob
    # A header left whole: growing to the end it lays out is accepted, zeros past it not.
    fd = os.open(mnt / "tmp/grow.kv", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.write(fd, blob[: 8 + n])
        os.ftruncate(fd, len(blob))
        assert errno_of(os.ftruncate, fd, len(blob) + 1) == errno.EINVAL
        assert os.fstat(fd).st_size == len(blob)
        os.pwrite(fd, blob[8 + n :], 8 + n)
    finally:
        os.close(fd)
    assert k.export("/tmp/grow.kv") == blob


def test_each_write_past_the_end_fails_alone_and_what_was_written_stays(k, mnt, tmp_path):
    # cat writes each copy with writes of its own: the second copy's fail, cat exits 1, and
    # the close imports the first copy, whole.
    make(k, "/tmp/cat-src.kv", 7)
    blob = k.export("/tmp/cat-src.kv")
    src = tmp_path / "a.kv"
    src.write_bytes(blob)
    cat = subprocess.run(["bash", "-c", f"cat {src} {src} > {mnt / 'tmp/cat2.kv'}"],
                         capture_output=True, text=True)
    assert cat.returncode == 1 and "Invalid argument" in cat.stderr, cat.stderr
    assert k.export("/tmp/cat2.kv") == blob
    # One write(2) of the two copies is refused whole: nothing was written, and a close
    # with nothing written fails too. An existing file keeps its bytes.
    (tmp_path / "aa.kv").write_bytes(blob + blob)
    for name in ("cp2.kv", "cat2.kv"):
        cp = subprocess.run(["cp", tmp_path / "aa.kv", mnt / "tmp" / name],
                            capture_output=True, text=True)
        assert cp.returncode == 1 and "error writing" in cp.stderr, cp.stderr
        assert "failed to close" in cp.stderr, cp.stderr
    assert errno_of(k.stat, "/tmp/cp2.kv") == errno.ENOENT
    assert k.export("/tmp/cat2.kv") == blob


def test_the_root_and_proc_count_a_link_for_each_subdirectory(k, mnt):
    def subdirs(d) -> int:
        return sum(stat.S_ISDIR(os.lstat(d / name).st_mode) for name in os.listdir(d))

    assert "proc" in os.listdir(mnt)
    assert os.stat(mnt).st_nlink == 2 + subdirs(mnt)
    assert os.stat(mnt / "proc").st_nlink == 2 + subdirs(mnt / "proc") > 2  # k's PID/
    assert os.stat(mnt / f"proc/{k.pid}").st_nlink == 2



def test_a_refused_growth_is_not_kept(k, mnt):
    # A new file grown with zeros: a header of length 0, refused. The file keeps its size
    # (it was left at the refused one) and stays writable (every call after it was EINVAL).
    make(k, "/tmp/cut-src.kv", 6)
    blob = k.export("/tmp/cut-src.kv")
    fd = os.open(mnt / "tmp/cut.kv", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        assert errno_of(os.ftruncate, fd, 4096) == errno.EINVAL
        assert os.fstat(fd).st_size == 0
        os.ftruncate(fd, 0)
        assert os.write(fd, blob) == len(blob)
    finally:
        os.close(fd)
    assert k.export("/tmp/cut.kv") == blob
    # A header being rewritten in place, bad for now: a growth past it is refused alone,
    # and the write that makes it good again goes on (it was refused, and the close).
    size = len(blob)
    fd = os.open(mnt / "tmp/cut.kv", os.O_WRONLY)
    try:
        assert os.pwrite(fd, b"!", 8) == 1  # the JSON's "{"
        assert errno_of(os.ftruncate, fd, size + 1) == errno.EINVAL
        assert os.fstat(fd).st_size == size
        assert os.pwrite(fd, b"{", 8) == 1
    finally:
        os.close(fd)
    assert k.export("/tmp/cut.kv") == blob


def test_a_cut_is_always_taken_and_lifts_a_refused_header_it_cuts_into(k, mnt):
    # A bad header written is refused, with every later write, while it is whole: a cut
    # that leaves it whole is taken, and it is still refused; one into it is taken, and the
    # header is checked again once whole (a cut was refused as the writes were).
    make(k, "/tmp/cut-src.kv", 6)
    blob = k.export("/tmp/cut-src.kv")
    (n,) = struct.unpack("<Q", blob[:8])
    fd = os.open(mnt / "tmp/cut2.kv", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        assert errno_of(os.write, fd, blob[:8] + b"!" + blob[9:]) == errno.EINVAL
        os.ftruncate(fd, 8 + n)
        assert os.fstat(fd).st_size == 8 + n
        assert errno_of(os.pwrite, fd, blob[8 + n :], 8 + n) == errno.EINVAL
        os.ftruncate(fd, 8 + n - 1)
        assert os.pwrite(fd, blob, 0) == len(blob)
    finally:
        os.close(fd)
    assert k.export("/tmp/cut2.kv") == blob


class Dirent(ctypes.Structure):
    """glibc's struct dirent on a 64-bit Linux."""

    _fields_ = [
        ("d_ino", ctypes.c_uint64),
        ("d_off", ctypes.c_int64),
        ("d_reclen", ctypes.c_ushort),
        ("d_type", ctypes.c_ubyte),
        ("d_name", ctypes.c_char * 256),
    ]


LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.opendir.restype = ctypes.c_void_p
LIBC.opendir.argtypes = [ctypes.c_char_p]
LIBC.readdir.restype = ctypes.POINTER(Dirent)
LIBC.readdir.argtypes = [ctypes.c_void_p]
LIBC.seekdir.argtypes = [ctypes.c_void_p, ctypes.c_long]
LIBC.closedir.argtypes = [ctypes.c_void_p]
DT_DIR = 4


def dirents(path, start: int = 0) -> list[tuple[bytes, int, int, int]]:
    """(name, d_ino, d_type, d_off) of each entry readdir(3) gives, from offset `start`
    (seekdir(3)): what `ls -a` reads, . and .. included, unlike os.listdir and scandir."""
    d = LIBC.opendir(os.fsencode(path))
    assert d, os.strerror(ctypes.get_errno())
    try:
        if start:
            LIBC.seekdir(d, start)
        out = []
        while e := LIBC.readdir(d):
            out.append((e[0].d_name, e[0].d_ino, e[0].d_type, e[0].d_off))
        return out
    finally:
        LIBC.closedir(d)


def test_ls_a_lists_dot_and_dotdot_with_their_inodes(k, mnt):
    """readdir gives . and .. (.. of the root is the root), as a disk's does; a directory
    of more entries than one FUSE readdir reply holds, and one read again from each
    offset, gives each entry once (ls -a showed neither . nor ..)."""
    k.mkdir("/tmp/many")
    names = [f"entry-with-a-longish-name-{i:03}" for i in range(80)]
    for name in names:
        k.mkdir(f"/tmp/many/{name}")
    ls = subprocess.run(["ls", "-a", mnt / "tmp"], capture_output=True, text=True, check=True)
    assert {".", "..", "many"} <= set(ls.stdout.splitlines()), ls.stdout
    for d, parent in (
        (mnt, mnt),
        (mnt / "tmp", mnt),
        (mnt / "proc", mnt),
        (mnt / f"proc/{k.pid}", mnt / "proc"),
        (mnt / "tmp/many", mnt / "tmp"),
    ):
        listed = dirents(d)
        assert [(n, ino, t) for n, ino, t, _ in listed[:2]] == [
            (b".", os.stat(d).st_ino, DT_DIR),
            (b"..", os.stat(parent).st_ino, DT_DIR),
        ], d
        rest = [n for n, *_ in listed[2:]]
        assert sorted(os.fsencode(n) for n in os.listdir(d)) == sorted(rest), d
    listed = dirents(mnt / "tmp/many")
    assert sorted(n for n, *_ in listed) == sorted([b".", b"..", *map(os.fsencode, names)])
    for i, (_, _, _, off) in enumerate(listed[:-1]):
        assert dirents(mnt / "tmp/many", off) == listed[i + 1 :], i
    for name in names:
        k.rmdir(f"/tmp/many/{name}")
    k.rmdir("/tmp/many")
