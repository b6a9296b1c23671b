"""import on a real daemon: a stream is checked as it arrives, so a file that will be refused
costs the kernel little, and an import over a file rewrites it in place, as a write does."""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path

import pytest
from daemon import ROOT, meminfo, prompt, run_script, sched, start_daemon, wait_for, world_dir

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


# Import streams held open, as uid argv[2] (root: 0): each sends its first bytes, then waits
# to be ended. Prints what each step got, as [errno, message].
IN_FLIGHT = """
import json, os, sys, threading, time
from syscalls.client import Kernel
what, uid, fit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
big, largest, small = (open(p, "rb").read() for p in sys.argv[4:7])
head = big[:8 + int.from_bytes(big[:8], "little")]
if uid:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
k = Kernel.connect(name=what)

def errno_of(fn):
    try:
        fn()
    except OSError as e:
        return [e.errno, str(e)]
    return [0, ""]

class Held:
    def __init__(self, path, first, rest=b""):
        self.path, self.first, self.rest = path, first, rest
        self.go, self.abandon, self.result = threading.Event(), False, None
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
    def chunks(self):
        yield self.first
        self.go.wait()
        if self.abandon:
            raise RuntimeError("the client goes mid-stream")
        yield self.rest
    def run(self):
        self.result = errno_of(lambda: k.import_file(self.path, self.chunks()))
        self.go.set()
    def end(self, abandon=False):
        self.abandon = abandon
        self.go.set()
        self.thread.join(30)
        return self.result

def probe(want, path, first, held=()):
    # `first` alone, then the stream's end: admitted, it is EINVAL (truncated). A held
    # stream refused while a probe held its bytes is opened again.
    deadline = time.monotonic() + 10
    while True:
        for i, h in enumerate(held):
            if not h.thread.is_alive():
                held[i] = Held(h.path, h.first, h.rest)
        got = errno_of(lambda: k.import_file(path, [first]))
        if got[0] == want or time.monotonic() > deadline:
            return got
        time.sleep(0.05)

out = {}
if what == "bound":
    # `fit` streams in flight: a small file that completes, and big headers
    cut = 8 + int.from_bytes(small[:8], "little")
    held = [Held("/tmp/flight-done", small[:cut], small[cut:])]
    held += [Held(f"/tmp/flight-{i}", head) for i in range(1, fit)]
    time.sleep(0.3)
    out["over"] = probe(122, "/tmp/flight-over", head, held)
    out["done"] = held[0].end()
    out["truncated"] = held[1].end()
    out["abandoned"] = [h.end(abandon=True)[0] for h in held[2:]]
    out["after"] = probe(22, "/tmp/flight-after", largest)
elif what == "gone":
    held = [Held(f"/tmp/flight-{i}", head) for i in range(fit - 1)]
    time.sleep(0.3)
    out["over"] = probe(122, "/tmp/flight-over", head, held)
    print(json.dumps(out), flush=True)
    os._exit(0)  # the client goes with its streams in flight
elif what == "after":
    out["after"] = probe(22, "/tmp/flight-after", largest)
elif what == "root":
    held = [Held(f"/tmp/flight-{i}", head) for i in range(fit + 2)]
    time.sleep(0.3)
    out["probe"] = probe(22, "/tmp/flight-probe", head)
    out["held"] = [h.end()[0] for h in held]
print(json.dumps(out))
"""


@pytest.fixture
def in_flight(daemon, src):
    """Runs IN_FLIGHT's steps with files that take the bound's measure: a big header (half
    the pool's rows, no excluded range), the header of the largest file the pool could
    hold (every row, each an excluded range: admitted only once no big stream's bytes are
    counted), and a small file; `fit` is how many streams fit in the bound, the small one
    and big ones. Nothing must be left behind: no file but the completed one, every page
    free once that is gone."""
    from kvfs.format import _plan, parse_header
    from kvfs.kv_header import largest_file

    with daemon.connect() as k:
        mem = meminfo(k)
        pages, size = int(mem["device_total"]), int(mem["page_size_tokens"])
        bound = largest_file(pages, size, int(mem["page_bytes"]))
        layout = parse_header(src, None).layout
        big, largest = _plan(pages * size // 2, 0, layout), _plan(pages * size, pages * size,
                                                                   layout)
        fit = 1 + (bound - len(src)) // big[1][-1][2]
        assert 3 <= fit <= 6
        assert largest[1][-1][2] + big[1][-1][2] > bound
        files = world_dir() / "in-flight"
        files.mkdir(exist_ok=True)
        for name, data in (("big", big[0]), ("largest", largest[0]), ("small", src)):
            (files / name).write_bytes(data)

        def run(what: str, uid: int) -> dict:
            return json.loads(run_script(daemon, IN_FLIGHT, what, str(uid), str(fit),
                                         *(str(files / n) for n in ("big", "largest", "small"))))

        yield run, bound
        with contextlib.suppress(FileNotFoundError):
            k.unlink("/tmp/flight-done")
        assert [n for n, _ in k.readdir("/tmp") if n.startswith("flight-")] == []
        wait_for(lambda: meminfo(k)["device_free"] == mem["device_free"], 10, "every page free")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_a_user_s_import_streams_in_flight_are_bounded_together(in_flight):
    """The stream past the bound is refused at its header (EDQUOT, naming its path and the
    bound), and nothing is made of it; the bytes of streams that end (completed, refused,
    abandoned by their client) are given back."""
    run, bound = in_flight
    out = run("bound", 60010)
    code, message = out["over"]
    assert code == errno.EDQUOT, message
    assert "import '/tmp/flight-over': " in message
    assert f"more than the largest file the KV pool could hold ({bound} bytes)" in message
    assert out["done"] == [0, ""]
    assert out["truncated"][0] == errno.EINVAL and "truncated" in out["truncated"][1]
    assert 0 not in out["abandoned"]
    assert out["after"][0] == errno.EINVAL, out["after"]


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_import_streams_of_a_client_that_goes_are_given_back(in_flight):
    """A client that exits with its streams in flight (refused one past them) gives their
    bytes back: the largest file's header, admitted only when none is counted, is then."""
    run, _ = in_flight
    assert run("gone", 60011)["over"][0] == errno.EDQUOT
    assert run("after", 60011)["after"][0] == errno.EINVAL


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_root_s_import_streams_in_flight_are_not_bounded(in_flight):
    """As on the mount: root's streams past the bound, all in flight, are all admitted (each
    ends truncated, EINVAL, never EDQUOT)."""
    run, _ = in_flight
    out = run("root", 0)
    assert out["probe"][0] == errno.EINVAL, out["probe"]
    assert out["held"] == [errno.EINVAL] * len(out["held"])


def test_exports_cancelled_mid_stream_leave_no_traceback_in_the_log(monkeypatch):
    """A client that stops reading an export ends its call while the kernel still writes
    it: gRPC logged a traceback for each such write (any user could fill the kernel's log
    with them, cancelling exports in a loop: 1686 in 10 s). The client here reads no
    further ahead than one chunk, so the kernel is still writing when it goes; models/tiny
    (20 KiB of K/V a token) makes an export of many chunks."""
    import syscalls.client as client

    monkeypatch.setattr(client, "CHANNEL_OPTIONS", [
        *client.CHANNEL_OPTIONS, ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", 65536)])
    d = start_daemon(ROOT / "models" / "tiny")
    try:
        with d.connect() as k:
            path = k.home + "/cancelled"
            with k.open(path, os.O_CREAT | os.O_RDWR) as f:
                f.pred(prompt(1000), no_outputs=True)
            for _ in range(20):
                it = k.export_iter(path)
                next(it)
                it.close()
            whole = k.export(path)  # after the cancelled ones, on the kernel's one loop
        assert len(whole) > 4 << 20
        log = d.log_text()
        assert "ExecuteBatchError" not in log and "Traceback" not in log, log[-3000:]
    finally:
        d.stop()
