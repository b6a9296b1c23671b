"""Isolation between users on a real kernel: a limit on processes per user and descriptors
kept for root, kill that signals only the process that said hello, link that cannot pin
another user's pages, /proc that keeps argv, fds and calls to their user, and the LIPs'
prompts kept off the command line."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon import AS_UID, ROOT, start_daemon, wait_for

from symphony.frame_hold import HOLD_LIMIT, FrameHold
from symphony.read_pause import REPLIES, ReadPause
from symphony.server import FD_RESERVE
from syscalls.convert import proc_fields

pytestmark = pytest.mark.slow
LIMIT = 3
DAEMON_FLAGS = ("--kv-pages", "512", "--max-procs-per-user", str(LIMIT))
NEEDS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become other users")

# Imports first: Python itself may live where the user cannot read. Then become the user.
AS_USER = """
import dataclasses, io, socket, time, contextlib
from syscalls.session import hello, socket_path
from symphony.cli import main as symphony
""" + AS_UID + """
def errno_of(fn):
    try:
        fn()
    except OSError as e:
        return e.errno
    return 0
def report(**values):
    print(json.dumps(values), flush=True)
"""


def as_user(daemon, uid: int, body: str, *args: str) -> subprocess.Popen:
    """`body` run by uid (AS_USER's helpers at hand, args in sys.argv[2:]), its stdin and
    stdout piped: it reports with JSON lines, and may wait for lines from the test."""
    return subprocess.Popen([sys.executable, "-c", AS_USER + body, str(uid), *args],
                            env=daemon.env(), cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def report(p: subprocess.Popen) -> dict:
    line = p.stdout.readline()
    assert line, p.communicate(timeout=60)[1]
    return json.loads(line)


def finish(p: subprocess.Popen, stdin: str | None = None) -> None:
    _, err = p.communicate(stdin, timeout=60)
    assert p.returncode == 0, err


def run_user(daemon, uid: int, body: str, *args: str) -> dict:
    p = as_user(daemon, uid, body, *args)
    out = report(p)
    finish(p)
    return out


# -- 5: processes per user, descriptors kept for root ----------------------------------

PAST_THE_LIMIT = f"""
ks = [Kernel.connect(name="s%d" % i) for i in range({LIMIT})]
f = ks[0].open(ks[0].home + "/kept.kv", os.O_CREAT | os.O_RDWR)
f.pred([5, 6, 7], no_outputs=True)
try:
    Kernel.connect(name="one too many")
    report(errno=0)
except OSError as e:
    report(errno=e.errno, message=str(e))
sys.stdin.readline()  # root connects meanwhile
fsync = errno_of(f.fsync)
ks[1].close()  # its place is free again once the kernel has reaped it
for _ in range(100):
    try:
        again = Kernel.connect(name="again")
        break
    except BlockingIOError:
        time.sleep(0.1)
report(fsync=fsync, again=again.pid)
"""


@NEEDS_ROOT
def test_a_user_past_the_process_limit_gets_eagain_and_others_go_on(daemon):
    user = as_user(daemon, 60011, PAST_THE_LIMIT)
    refused = report(user)
    assert refused["errno"] == errno.EAGAIN, refused
    assert f"{LIMIT} processes, the limit per user" in refused["message"]
    with daemon.connect("root") as k:  # root has no limit
        assert sum(p.uid == 60011 for p in k.ps()) == LIMIT  # the refused left nothing
        user.stdin.write("go\n")
        user.stdin.flush()
        assert report(user)["fsync"] == 0
    finish(user)


DESCRIPTOR_FLOOD = """
k = Kernel.connect(name="keeper")
f = k.open(k.home + "/kept.kv", os.O_CREAT | os.O_RDWR)
f.pred([5, 6, 7], no_outputs=True)
socket.setdefaulttimeout(10)  # a kernel out of descriptors may leave a connect hanging
lifelines, why = [], None
while why is None and len(lifelines) < 10000:
    try:
        lifelines.append(hello(socket_path()))
    except OSError as e:
        why = [e.errno, str(e)]
report(hello=why, fsync=errno_of(f.fsync))
sys.stdin.readline()  # root connects meanwhile
for life, _ in lifelines:
    life.close()
# Connections to the gRPC socket need no hello: they are capped, not counted per user.
flood = []
with contextlib.suppress(OSError):
    for _ in range(2 * int(sys.argv[2])):
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(socket_path()))
        flood.append(s)
time.sleep(2)  # the kernel accepts, or turns away, what is left of them
report(pred=errno_of(lambda: f.pred([8], no_outputs=True)), fsync=errno_of(f.fsync))
"""


@NEEDS_ROOT
def test_the_kernel_keeps_descriptors_for_root_and_running_sessions(model):
    """A kernel short of descriptors (512): hellos of a user with no process limit to speak
    of are refused before the last FD_RESERVE, and a flood of bare gRPC connections is
    capped, so root still connects and a running session still fsyncs and preds."""
    limit = 512
    d = start_daemon(model, None, "--kv-pages", "64", "--max-procs-per-user", "100000",
                     nofile=limit)
    try:
        assert resource.prlimit(d.process.pid, resource.RLIMIT_NOFILE) == (limit, limit)
        user = as_user(d, 60012, DESCRIPTOR_FLOOD, str(limit))
        first = report(user)
        assert first["hello"][0] == errno.EAGAIN, first
        assert f"the last {FD_RESERVE} are kept for root" in first["hello"][1]
        assert first["fsync"] == 0
        with d.connect("root") as k:
            assert k.ps()
            user.stdin.write("go\n")
            user.stdin.flush()
            assert report(user) == {"fsync": 0, "pred": 0}
        finish(user)
    finally:
        assert d.stop() == 0, d.log_text()


# -- 7: kill signals the process that said hello, or nothing ---------------------------

FORKER = """
import os, sys
from syscalls.session import hello, socket_path
life, _ = hello(socket_path())
if os.fork() == 0:  # the child keeps the lifeline; the process that said hello exits
    os.close(1)
    data = life.recv(1)
    Path = __import__("pathlib").Path
    Path(sys.argv[1]).write_text("hung up" if not data else repr(data))
    os._exit(0)
print(os.getpid(), flush=True)
"""
NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")


def take_pid(pid: int, uid: int) -> subprocess.Popen:
    """A sleeper of uid given exactly `pid` (through ns_last_pid; other forks on the machine
    may take it first, so it tries a few times)."""
    for _ in range(50):
        NS_LAST_PID.write_text(str(pid - 1))
        sleeper = subprocess.Popen(["setpriv", f"--reuid={uid}", "sleep", "300"])  # as_user
        if sleeper.pid == pid:
            return sleeper
        sleeper.kill()
        sleeper.wait()
    pytest.skip(f"could not get pid {pid} for the sleeper")


@NEEDS_ROOT
@pytest.mark.skipif(not os.access(NS_LAST_PID, os.W_OK), reason="needs ns_last_pid")
def test_kill_never_signals_a_process_that_got_the_pid_since(daemon, tmp_path):
    """The process that said hello exits; its child keeps the lifeline, and its pid goes
    to another user's sleeper. kill must not touch the sleeper: it ends the session, and
    the child learns it from the lifeline."""
    said = tmp_path / "child"
    forker = subprocess.Popen([sys.executable, "-c", FORKER, str(said)], env=daemon.env(),
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    os_pid = int(forker.stdout.readline())
    forker.wait(30)
    with daemon.connect("killer") as k:
        (proc,) = wait_for(lambda: [p for p in k.ps() if p.os_pid == os_pid],
                           what="the forker's process")
        sleeper = take_pid(os_pid, 60013)
        try:
            k.kill(proc.pid)
            time.sleep(0.5)
            assert sleeper.poll() is None, "kill signalled the process that took the pid"
        finally:
            sleeper.kill()
            sleeper.wait()
        assert all(p.pid != proc.pid for p in k.ps())
    assert wait_for(lambda: said.exists() and said.read_text(), what="the child") == "hung up"


# -- 10: link needs ownership, or read and write access --------------------------------

LINK_OWNER = """
k = Kernel.connect(name="owner")
for name, mode in (("pinned.kv", 0o644), ("shared.kv", 0o666)):
    with k.open(f"{k.home}/{name}", os.O_CREAT | os.O_RDWR, mode) as f:
        f.pred([5, 6, 7, 8], no_outputs=True)
        k.chmod(f"{k.home}/{name}", mode)
with k.open(f"{k.home}/pinned.kv") as f:
    report(own=errno_of(lambda: f.link(f"{k.home}/again.kv")), home=k.home)
"""
LINK_OTHER = """
k = Kernel.connect(name="other")
home = sys.argv[2]
r = {}
with k.open(f"{home}/pinned.kv") as f:  # 0644: it may read it, not write it
    r["into home"] = errno_of(lambda: f.link(f"{k.home}/pin.kv"))
    r["into /tmp"] = errno_of(lambda: f.link("/tmp/pin.kv"))
    with f.fork() as copy:  # a copy is its own
        r["its copy"] = errno_of(lambda: copy.link(f"{k.home}/copy.kv"))
with k.open(f"{home}/shared.kv") as f:  # 0666: it may read and write it
    r["read-write"] = errno_of(lambda: f.link(f"{k.home}/shared.kv"))
with k.open("", os.O_RDWR) as f:
    r["anonymous"] = errno_of(lambda: f.link(f"{k.home}/anon.kv"))
report(**r)
"""


@NEEDS_ROOT
def test_link_of_another_users_file_needs_read_and_write_access(daemon):
    owner = run_user(daemon, 60014, LINK_OWNER)
    assert owner["own"] == 0
    assert run_user(daemon, 60015, LINK_OTHER, owner["home"]) == {
        "into home": errno.EPERM, "into /tmp": errno.EPERM, "its copy": 0,
        "read-write": 0, "anonymous": 0,
    }
    with daemon.connect("root") as k:
        assert k.stat(f"{owner['home']}/pinned.kv").nlink == 2  # its own name and again.kv
        with k.open(f"{owner['home']}/pinned.kv") as f:  # root may
            f.link("/tmp/root-pin.kv")
        k.unlink("/tmp/root-pin.kv")


# -- 11: /proc and ps keep a process's argv, fds and calls to its user -----------------

SECRET = "the prompt nobody else may read"
SECRETIVE = f"""
k = Kernel.connect(name="secretive", argv=["complete.py", "--prompt", {SECRET!r}])
f = k.open("", os.O_RDWR)
report(pid=k.pid)
sys.stdin.readline()
"""
PRYING = """
k = Kernel.connect(name="prying", argv=["prying.py", "--mine"])
pid = sys.argv[2]
top = io.StringIO()
with contextlib.redirect_stdout(top):
    status = symphony(["top", "--once", "--interval", "0.1"])
report(
    fds=errno_of(lambda: k.procfs(f"{pid}/fds")),
    syscalls=errno_of(lambda: k.procfs(f"/proc/{pid}/syscalls")),
    listing=k.procfs(pid).split(),
    status=k.procfs(f"{pid}/status"),
    ps=[dataclasses.asdict(p) for p in k.ps() if str(p.pid) == pid],
    own_fds=errno_of(lambda: k.procfs(f"{k.pid}/fds")),
    own_argv=[p.argv for p in k.ps() if p.pid == k.pid],
    own_status=k.procfs(f"{k.pid}/status"),
    top=[status, top.getvalue()],
)
"""


@NEEDS_ROOT
def test_proc_and_ps_keep_argv_fds_and_calls_to_their_user(daemon):
    secretive = as_user(daemon, 60016, SECRETIVE)
    try:
        pid = str(report(secretive)["pid"])
        seen = run_user(daemon, 60017, PRYING, pid)
        assert seen["fds"] == seen["syscalls"] == errno.EACCES
        assert seen["listing"] == ["status"]
        status = proc_fields(seen["status"])
        assert status["argv"] == "" and status["name"] == "secretive"
        assert status["user"] == "uid60016" and status["fds"] == "1"
        (ps,) = seen["ps"]
        assert ps["argv"] == [] and ps["name"] == "secretive" and ps["state"] == "sleeping"
        assert SECRET not in json.dumps(seen)
        assert seen["own_fds"] == 0 and seen["own_argv"] == [["prying.py", "--mine"]]
        assert proc_fields(seen["own_status"])["argv"] == "prying.py --mine"
        code, frame = seen["top"]
        assert code == 0 and any(line.split()[-1:] == ["secretive"]
                                 for line in frame.splitlines())
        with daemon.connect("root") as k:  # root sees everything
            assert SECRET in proc_fields(k.procfs(f"{pid}/status"))["argv"]
            assert k.procfs(f"{pid}/fds").count("\n") == 2
            assert k.procfs(pid).split() == ["fds", "status", "syscalls"]
            (p,) = [p for p in k.ps() if str(p.pid) == pid]
            assert SECRET in p.argv
    finally:
        finish(secretive, "done\n")


# -- 12: /proc names that are no pid ----------------------------------------------------


def test_proc_names_that_are_no_pid_are_enoent(daemon):
    with daemon.connect("names") as k:
        arabic = str(k.pid).translate(str.maketrans("0123456789", "٠١٢٣٤٥٦٧٨٩"))
        for path in ("²", "/proc/²/status", f"{arabic}/status", f"0{k.pid}/status",
                     "9" * 5000, f"{'9' * 5000}/status", f"{k.pid}/status/x", f"{k.pid}/nope",
                     "../meminfo", "/proc/proc/meminfo", "0"):
            with pytest.raises(FileNotFoundError, match="/proc/"):
                k.procfs(path)
        assert proc_fields(k.procfs(f"/proc//{k.pid}/status"))["pid"] == str(k.pid)


# -- the LIPs take prompts from stdin or a file ----------------------------------------


def test_lips_take_prompts_from_stdin_or_a_file(daemon, tmp_path):
    text = "def fibonacci(n):\n    "
    (tmp_path / "prompt.txt").write_text(text)
    (tmp_path / "q.txt").write_text("What is it?")
    (tmp_path / "doc.txt").write_text("A short document about the Fibonacci numbers.")

    def lip(*args: str, stdin: str = "") -> dict:
        out = subprocess.run([sys.executable, *args, "--max-new-tokens", "6"], input=stdin,
                             env=daemon.env(), cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    complete = "lips/complete.py", "--json"
    given = lip(*complete, "--prompt", text)
    assert lip(*complete, "--prompt", "-", stdin=text) == given
    assert lip(*complete, "--prompt-file", str(tmp_path / "prompt.txt")) == given
    best = "lips/best_of_n.py", "--json", "--n", "2", "--seed", "1"
    assert (lip(*best, "--prompt-file", str(tmp_path / "prompt.txt"))
            == lip(*best, "--prompt", "-", stdin=text))
    cache = "lips/prompt_cache.py", "--json", "--document", str(tmp_path / "doc.txt"), \
        "--cache", "/tmp/lips-doc.kv"
    by_file = lip(*cache, "--question-file", str(tmp_path / "q.txt"))["answers"]
    by_stdin = lip(*cache, "--question", "-", stdin="What is it?")["answers"]
    assert [a["output_ids"] for a in by_file] == [a["output_ids"] for a in by_stdin]
    chat = subprocess.run(
        [sys.executable, "lips/chat.py", "--system-file", str(tmp_path / "q.txt"),
         "--message", "-", "--max-new-tokens", "4"], input="hi\nthere",
        env=daemon.env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert chat.returncode == 0 and chat.stdout.strip(), chat.stderr
    for name in ("complete", "best_of_n"):
        help_text = subprocess.run([sys.executable, f"lips/{name}.py", "--help"], cwd=ROOT,
                                   capture_output=True, text=True).stdout
        assert "--prompt-file PATH" in help_text and "standard input" in help_text
    missing = subprocess.run([sys.executable, "lips/complete.py", "--prompt-file", "/nope"],
                             env=daemon.env(), cwd=ROOT, capture_output=True, text=True)
    assert missing.returncode == 2 and "/nope" in missing.stderr


# Three lifelines, each a frame header announcing 64 MiB (a PRED), then as much of it as the
# kernel reads within a few seconds (at most SEND_MB MiB each, never the whole frame).
HOLD = """
import select, struct
SEND_MB = 60
lines = []
for _ in range(3):
    s = socket.socket(socket.AF_UNIX)
    s.connect(str(socket_path()) + ".hello")
    assert s.recv(128).endswith(b"\\n")
    s.sendall(struct.pack("<IIB", 64 << 20, 1, 1))
    s.setblocking(False)
    lines.append(s)
sent = [0, 0, 0]
chunk = bytes(1 << 16)
def send_for(seconds, but=None):  # on each lifeline but `but`, what the kernel reads
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        wanting = [s for i, s in enumerate(lines) if i != but and sent[i] < SEND_MB << 20]
        _, writable, _ = select.select([], wanting, [], 0.5)
        for s in writable:
            try:
                sent[lines.index(s)] += s.send(chunk)
            except BlockingIOError:
                pass
send_for(10)
report(mb=[n >> 20 for n in sent])
# The first finishes its frame (zeros: no PredRequest, so its reply is an error): the
# others are read again.
first = max(range(3), key=sent.__getitem__)
lines[first].setblocking(True)
lines[first].sendall(bytes((64 << 20) - sent[first]))
reply = lines[first].recv(9)
before = list(sent)
send_for(5, but=first)
report(reply=len(reply), more_mb=sum(a - b for a, b in zip(sent, before)) >> 20)
sys.stdin.readline()
"""


@NEEDS_ROOT
def test_a_user_s_partial_lifeline_frames_are_held_to_one_frame_s_worth(daemon):
    """Past 64 MiB of frames not yet whole, a user's lifelines but the first to start one
    are not read: of three lifelines sending 60 MiB each of 64 MiB frames, the first gets
    all its 60 read, and the other two together what took the user to 64 MiB (and what
    socket buffers hold), where the kernel read 180 MiB before. Once the first frame is
    whole (and answered), the others are read again. The kernel goes on answering."""
    user = as_user(daemon, 60011, HOLD)
    try:
        first, second, third = sorted(report(user)["mb"], reverse=True)
        assert first == 60
        assert second + third <= 64 + 4, (first, second, third)
        after = report(user)
        assert after["reply"] == 9 and after["more_mb"] >= 8, after
        with daemon.connect() as k:
            assert k.getpid()
    finally:
        user.communicate("\n", timeout=60)


def test_a_lifeline_is_read_only_when_neither_frames_nor_replies_hold_it():
    """A lifeline held both by FrameHold (its user's partial frames) and by its own replies
    backed up (symphony/read_pause.py) is read again only once both let go, in either
    order: one letting go used to resume reading that the other still held."""

    async def main() -> None:
        got: list[bytes] = []

        class Reader(asyncio.Protocol):
            def data_received(self, data: bytes) -> None:
                got.append(data)

        loop = asyncio.get_running_loop()
        ends = [socket.socketpair() for _ in range(2)]
        first, line = [ReadPause((await loop.connect_accepted_socket(Reader, ours))[0])
                       for ours, _ in ends]
        peer = ends[1][1]
        hold, uid = FrameHold(), 60011

        async def read() -> bool:
            """Whether the lifeline is read: what its peer sends arrives."""
            got.clear()
            peer.send(b"x")
            await asyncio.sleep(0.2)
            return bool(got)

        assert await read()
        hold.update(uid, first, 0, HOLD_LIMIT)  # the first holder: always read
        for frames_first in (True, False):
            hold.update(uid, line, 0, 1)  # past the limit: FrameHold pauses it
            assert not await read()
            line.pause(REPLIES)
            if frames_first:
                hold.update(uid, line, 1, 0)  # FrameHold lets go; the replies still hold
                assert not await read()
                line.resume(REPLIES)
            else:
                line.resume(REPLIES)  # the replies let go; FrameHold still holds
                assert not await read()
                hold.update(uid, line, 1, 0)
            assert await read()
        for reads, (_, theirs) in zip((first, line), ends, strict=True):
            reads.transport.close()
            theirs.close()

    asyncio.run(main())
