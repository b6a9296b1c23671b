"""import on a real daemon: a stream is checked as it arrives, so a file that will be refused
costs the kernel little, and an import over a file rewrites it in place, as a write does."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from daemon import prompt, run_script, sched

pytestmark = pytest.mark.slow

MIB = 1 << 20
JUNK_CHUNKS = 256  # 256 MiB: the kernel used to hold all of it (twice) before looking


def junk(first: bytes, taken: list[int]):
    """`first`, then JUNK_CHUNKS MiB of junk; `taken` counts the junk chunks gRPC took."""
    yield first
    for i in range(JUNK_CHUNKS):
        taken.append(i)
        yield bytes(MIB)


def rss_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS")


def refused_early(daemon, k, path: str, first: bytes) -> OSError:
    """Import `first` and a flood of junk after it: the kernel must answer without taking
    the junk in (a few chunks may be in flight) or growing by it."""
    k.import_file("/tmp/warm-up", k.export("/tmp/src"))  # the import path, loaded once
    before, taken = rss_mib(daemon.process.pid), []
    with pytest.raises(OSError) as e:
        k.import_file(path, junk(first, taken))
    assert len(taken) < JUNK_CHUNKS // 4, f"the kernel read {len(taken)} MiB of junk"
    assert rss_mib(daemon.process.pid) - before < 64
    with pytest.raises(FileNotFoundError):
        k.stat(path)
    return e.value


@pytest.fixture
def src(daemon):
    """/tmp/src: a small KV file; its canonical form."""
    with daemon.connect() as k:
        with k.open("/tmp/src", os.O_CREAT | os.O_RDWR | os.O_TRUNC) as f:
            f.pred(prompt(20), no_outputs=True)
        return k.export("/tmp/src")


def test_a_bad_header_is_refused_before_the_body_is_taken(daemon, src):
    with daemon.connect() as k:
        e = refused_early(daemon, k, "/tmp/bad", b"\xff" * 8)
        assert e.errno == errno.EINVAL and "import '/tmp/bad': " in str(e)
        assert "header length" in str(e)


def test_more_bytes_than_the_header_declares_are_refused_at_once(daemon, src):
    with daemon.connect() as k:
        e = refused_early(daemon, k, "/tmp/long", src)
        assert e.errno == errno.EINVAL
        assert f"more than the {len(src)} bytes its header declares" in str(e)


def test_import_over_a_file_being_decoded_drops_the_guess_first(daemon, src):
    """A guess of the next pred holds a reservation on the file: import waits it out (no
    EBUSY), and the open file then holds the imported contents."""
    with daemon.connect() as k, k.open("/tmp/decoded", os.O_CREAT | os.O_RDWR) as f:
        (o,) = f.pred(prompt(10, salt=5))
        made = int(sched(k)["ahead_guesses"])
        (o,) = f.pred([o.token])
        assert int(sched(k)["ahead_guesses"]) > made
        k.import_file("/tmp/decoded", src)
        assert f.read()[0] == prompt(20)


AS_USER = """
import json, os, sys
from syscalls.client import Kernel
# Become the user only now: Python itself may live where other users cannot read.
role, uid = sys.argv[1], int(sys.argv[2])
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
k = Kernel.connect(name=role)
def errno_of(fn):
    try:
        fn()
    except OSError as e:
        return e.errno
    return 0
if role == "owner":
    for path, mode in (("/home/uid60001/f", 0o602), ("/tmp/shared", 0o666)):
        with k.open(path, os.O_CREAT | os.O_RDWR, mode) as f:
            f.pred([7, 8, 9, 10], no_outputs=True)
else:
    with k.open("", os.O_RDWR) as f:
        f.pred([11, 12, 13, 14, 15, 16], no_outputs=True)
        data = k.export(f)
    taken = []
    def junk():
        for i in range(256):
            taken.append(i)
            yield bytes(1 << 20)
    print(json.dumps({
        "import f": errno_of(lambda: k.import_file("/home/uid60001/f", data, 0o666)),
        "import shared": errno_of(lambda: k.import_file("/tmp/shared", data, 0o600)),
        "chmod f": errno_of(lambda: k.chmod("/home/uid60001/f", 0o666)),
        "chmod shared": errno_of(lambda: k.chmod("/tmp/shared", 0o600)),
        "export f": errno_of(lambda: k.export("/home/uid60001/f")),
        "import new": errno_of(lambda: k.import_file("/home/uid60001/new", junk())),
        "junk taken": len(taken) < 64,
    }))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become two users")
def test_import_over_another_user_s_file_keeps_its_owner_and_mode(daemon):
    """60002 may write 60001's files (0602 in 60001's home, 0666 in sticky /tmp), so it may
    import over them: the contents change in place; the inode, owner and mode do not, and
    60002 gains nothing else. Creating a file needs the directory's write permission, and
    is refused before the body is taken."""
    run_script(daemon, AS_USER, "owner", "60001")
    with daemon.connect() as k:
        before = {p: k.stat(p) for p in ("/home/uid60001/f", "/tmp/shared")}
    assert json.loads(run_script(daemon, AS_USER, "other", "60002")) == {
        "import f": 0, "import shared": 0, "chmod f": errno.EPERM, "chmod shared": errno.EPERM,
        "export f": errno.EACCES, "import new": errno.EACCES, "junk taken": True,
    }
    with daemon.connect() as k:
        for path, old in before.items():
            st = k.stat(path)
            assert (st.ino, st.uid, st.gid, st.mode, st.nlink) == \
                (old.ino, 60001, 60001, old.mode, 1), path
            with k.open(path) as f:
                assert f.read()[0] == [11, 12, 13, 14, 15, 16]
        assert before["/home/uid60001/f"].mode & 0o7777 == 0o602
        with pytest.raises(FileNotFoundError):
            k.stat("/home/uid60001/new")
