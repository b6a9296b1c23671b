"""Cancellation: a LIP takes back a pred it no longer waits for (Ctrl-C, its asyncio task
cancelled), on the lifeline (a CANCEL frame) or over gRPC (the rpc's own cancellation).
The pred is dropped if queued, rolled back after the running step if it is in it, and the
file is as before the pred, so that a truncate right after works. The first tests play the
kernel's end of a socket pair; the rest run a real kernel daemon, its token budget small so
that a long prefill takes many steps."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import json
import operator
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import pytest
from daemon import ROOT, meminfo, prompt, run_script, wait_for

from syscalls import lifeline, pred_rpc, ring, wire
from syscalls import symphony_pb2 as pb
from syscalls.aio import AsyncKernel
from syscalls.client import Kernel
from syscalls.lifeline import AsyncLifeline, Lifeline
from syscalls.ring_line import RingLine

REQUEST = pb.PredRequest(fd=3, tokens=[1]).SerializeToString()
CANCELED = pb.PredReply(error=pb.Error(errno=errno.ECANCELED)).SerializeToString()

# -- the client's end, against a scripted kernel end --------------------------------------


def pair() -> tuple[socket.socket, socket.socket]:
    """The client's end and the scripted kernel's, which gives up waiting after a while."""
    ours, peer = socket.socketpair()
    peer.settimeout(10)
    return ours, peer


def read_frames(peer: socket.socket, n: int, frames: wire.Frames) -> list:
    got: list = []
    while len(got) < n:
        got += frames.feed(peer.recv(4096))
    return got


def next_reply(line: Lifeline) -> bytes | None:
    """The reply to one more call, or None if it hangs (in a thread: a hang fails the test)."""
    got = []
    caller = threading.Thread(target=lambda: got.append(line.call(REQUEST)), daemon=True)
    caller.start()
    caller.join(10)
    return got[0] if got else None


class Interrupted:
    """The lifeline's socket, the client's first wait on it interrupted by Ctrl-C (the wait
    is a select, which asks for the socket's fileno)."""

    def __init__(self, sock: socket.socket):
        self.sock, self.waits = sock, 0

    def __getattr__(self, name: str):
        return getattr(self.sock, name)

    def fileno(self) -> int:
        self.waits += 1
        if self.waits == 1:
            raise KeyboardInterrupt
        return self.sock.fileno()


def test_an_interrupted_call_takes_its_pred_back_before_the_interrupt_goes_on():
    ours, peer = pair()
    line = Lifeline(ours, "k.sock")
    line.sock = Interrupted(ours)
    sent, replied = [], threading.Event()

    def kernel() -> None:
        frames = wire.Frames()
        sent.extend(read_frames(peer, 2, frames))
        time.sleep(0.2)  # the pred is rolled back when the running step ends
        replied.set()
        peer.sendall(wire.frame(wire.REPLY, 1, CANCELED))
        (_, call, _), = read_frames(peer, 1, frames)
        peer.sendall(wire.frame(wire.REPLY, call, b""))

    answering = threading.Thread(target=kernel, daemon=True)
    answering.start()
    with pytest.raises(KeyboardInterrupt):
        line.call(REQUEST)
    assert replied.is_set(), "the interrupt went on before the kernel answered the CANCEL"
    assert [(kind, call) for kind, call, _ in sent] == [(wire.PRED, 1), (wire.CANCEL, 1)]
    assert next_reply(line) == b""  # the session goes on: the next call has its reply
    answering.join(10)
    assert line._calls == {}


def test_the_wait_for_a_cancelled_pred_is_bounded_and_its_late_reply_dropped(monkeypatch):
    monkeypatch.setattr(lifeline, "CANCEL_WAIT", 0.3)
    ours, peer = pair()
    line = Lifeline(ours, "k.sock")
    line.sock = Interrupted(ours)
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        line.call(REQUEST)
    assert 0.3 <= time.monotonic() - start < 5
    frames = wire.Frames()
    assert [kind for kind, _, _ in read_frames(peer, 2, frames)] == [wire.PRED, wire.CANCEL]
    peer.sendall(wire.frame(wire.REPLY, 1, CANCELED))  # late: nobody waits for it

    def kernel() -> None:
        (_, call, _), = read_frames(peer, 1, frames)
        peer.sendall(wire.frame(wire.REPLY, call, b"second"))

    answering = threading.Thread(target=kernel, daemon=True)
    answering.start()
    assert next_reply(line) == b"second"
    answering.join(10)
    assert line._calls == {}


# A signal handler raises at the first check the interpreter makes once the signal came:
# when a C function called from Python returns, or when a Python function starts. A profile
# hook raising there (sys.setprofile's "c_return" and "call" events) lands an interruption
# exactly where one can land, at the first such point after the moment `ready` names.


@contextlib.contextmanager
def interrupted_once(ready):
    """KeyboardInterrupt at the first point a signal handler could raise once ready()."""
    fired = threading.Event()

    def hook(frame, event, arg) -> None:
        if event in ("c_return", "call") and not fired.is_set() and ready():
            fired.set()
            sys.setprofile(None)
            raise KeyboardInterrupt

    sys.setprofile(hook)
    try:
        yield fired
    finally:
        sys.setprofile(None)


def readable(sock) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def test_a_pred_interrupted_the_moment_its_frame_went_is_taken_back():
    """The interruption lands as sendall returns (the kernel's wake-up took the CPU): the
    kernel has the pred, so CANCEL goes and its reply comes before the interruption goes
    on."""
    ours, peer = pair()
    line = Lifeline(ours, "k.sock")
    sent, replied = [], threading.Event()

    def kernel(fired: threading.Event) -> None:
        fired.wait(10)  # the frame stays in the socket until the interruption has landed
        frames = wire.Frames()
        with contextlib.suppress(TimeoutError):
            sent.extend(read_frames(peer, 2, frames))
        time.sleep(0.1)
        replied.set()
        peer.sendall(wire.frame(wire.REPLY, 1, CANCELED))  # whatever came: nobody hangs

    with interrupted_once(lambda: readable(peer)) as fired:
        answering = threading.Thread(target=kernel, args=(fired,), daemon=True)
        answering.start()
        with pytest.raises(KeyboardInterrupt):
            line.call(REQUEST)
    assert fired.is_set()
    assert [(kind, call) for kind, call, _ in sent] == [(wire.PRED, 1), (wire.CANCEL, 1)]
    assert replied.is_set(), "the interrupt went on before the kernel answered the CANCEL"
    answering.join(10)
    assert line._calls == {}


def test_an_answer_read_the_moment_the_interruption_lands_is_not_lost(monkeypatch):
    """The interruption lands as recv returns with the answer: the answer stands (the pred
    is answered), no CANCEL goes and nothing waits for one."""
    monkeypatch.setattr(lifeline, "CANCEL_WAIT", 5)
    ours, peer = pair()
    line = Lifeline(ours, "k.sock")
    frames = wire.Frames()
    answered = threading.Event()

    def kernel() -> None:
        read_frames(peer, 1, frames)
        time.sleep(0.2)  # the caller waits in recv meanwhile
        answered.set()
        peer.sendall(wire.frame(wire.REPLY, 1, b"answer"))

    answering = threading.Thread(target=kernel, daemon=True)
    answering.start()
    start = time.monotonic()
    # Once the answer was sent and is no longer there to read: as recv returns it.
    with interrupted_once(lambda: answered.is_set() and not readable(ours)) as fired, \
            pytest.raises(KeyboardInterrupt):
        line.call(REQUEST)
    assert fired.is_set() and time.monotonic() - start < 3
    answering.join(10)
    peer.settimeout(0.2)
    with pytest.raises(TimeoutError):
        peer.recv(1)  # no CANCEL
    assert line._calls == {}
    peer.settimeout(10)

    def next_answer() -> None:
        (_, call, _), = read_frames(peer, 1, frames)
        peer.sendall(wire.frame(wire.REPLY, call, b"next"))

    answering = threading.Thread(target=next_answer, daemon=True)
    answering.start()
    assert next_reply(line) == b"next"  # the lifeline is still frames


@pytest.fixture()
def ring_line():
    """A RingLine and the kernel's ends of its rings and lifeline, in this process."""
    kernel_ring = ring.KernelRing()
    mem = ring.RingMemory(os.dup(kernel_ring.memfd))
    rings = ring.ProcessRing(mem, os.dup(kernel_ring.kernel_bell),
                             os.dup(kernel_ring.process_bell))
    ours, peer = pair()
    line = RingLine(ours, "k.sock", rings)
    yield line, kernel_ring, peer
    line.end(errno.EBADF, "k.sock: the session is closed")
    ours.close()
    peer.close()
    rings.close()
    kernel_ring.close()


def take(kernel_ring, n: int) -> list:
    got: list = []
    deadline = time.monotonic() + 10
    while len(got) < n and time.monotonic() < deadline:
        got += kernel_ring.take()
        time.sleep(0.001)
    return got


@pytest.mark.parametrize("moment", ["published", "rung"])
def test_a_pred_interrupted_the_moment_its_record_went_is_taken_back(ring_line, moment):
    """The interruption lands once the ring's tail is published (before the kernel's bell)
    or once the bell rang: the kernel has the pred, so it is taken back."""
    line, kernel_ring, _ = ring_line
    sent, replied = [], threading.Event()

    def went() -> bool:
        if moment == "published":
            return kernel_ring.mem.get(ring.SQ_TAIL) != 0
        return readable(kernel_ring.kernel_bell)

    def kernel() -> None:
        sent.extend(take(kernel_ring, 2))
        time.sleep(0.1)
        replied.set()
        kernel_ring.post(wire.REPLY, 1, CANCELED)
        kernel_ring.ring_process()

    answering = threading.Thread(target=kernel, daemon=True)
    answering.start()
    with interrupted_once(went) as fired, pytest.raises(KeyboardInterrupt):
        line.call(REQUEST)
    assert fired.is_set()
    assert [(kind, call) for kind, call, _ in sent] == [(wire.PRED, 1), (wire.CANCEL, 1)]
    assert replied.is_set(), "the interrupt went on before the kernel answered the CANCEL"
    assert line._calls == {}


def test_a_pred_interrupted_before_its_record_went_is_not_waited_for(ring_line):
    """Interrupted with its record written but not published: the kernel never sees it
    (the next record takes its place), and nothing waits for a reply."""
    line, kernel_ring, _ = ring_line

    def written() -> bool:  # the process's tail moved, the one the kernel reads not yet
        return line.rings.sq_tail != 0 and kernel_ring.mem.get(ring.SQ_TAIL) == 0

    start = time.monotonic()
    with interrupted_once(written), pytest.raises(KeyboardInterrupt):
        line.call(REQUEST)
    assert time.monotonic() - start < 2 and line._calls == {}
    assert kernel_ring.take() == []

    def kernel() -> None:
        ((kind, call, _),) = take(kernel_ring, 1)
        kernel_ring.post(wire.REPLY, call, b"next")
        kernel_ring.ring_process()

    answering = threading.Thread(target=kernel, daemon=True)
    answering.start()
    assert next_reply(line) == b"next"


def test_a_completion_taken_the_moment_the_interruption_lands_is_not_lost(ring_line,
                                                                           monkeypatch):
    monkeypatch.setattr(lifeline, "CANCEL_WAIT", 5)
    line, kernel_ring, _ = ring_line

    def kernel() -> None:
        take(kernel_ring, 1)
        kernel_ring.post(wire.REPLY, 1, b"answer")
        kernel_ring.ring_process()

    answering = threading.Thread(target=kernel, daemon=True)
    answering.start()
    start = time.monotonic()
    with interrupted_once(lambda: line.rings.cq_head != 0) as fired, \
            pytest.raises(KeyboardInterrupt):
        line.call(REQUEST)
    assert fired.is_set() and time.monotonic() - start < 2  # no CANCEL waited for
    answering.join(10)
    assert kernel_ring.take() == [] and line._calls == {}


def test_a_cancelled_task_takes_its_pred_back_before_its_cancellation_goes_on():
    async def calls() -> None:
        ours, peer = pair()
        line = AsyncLifeline(ours, "k.sock")
        frames = wire.Frames()
        task = asyncio.create_task(line.call(REQUEST))
        sent = await asyncio.to_thread(read_frames, peer, 1, frames)
        task.cancel()
        sent += await asyncio.to_thread(read_frames, peer, 1, frames)
        assert [(kind, call) for kind, call, _ in sent] == [(wire.PRED, 1), (wire.CANCEL, 1)]
        await asyncio.sleep(0.1)
        assert not task.done(), "the cancellation went on before the kernel answered"
        peer.sendall(wire.frame(wire.REPLY, 1, CANCELED))
        with pytest.raises(asyncio.CancelledError):
            await task
        assert line._waiting == {}
        line.end(errno.EBADF, "k.sock: the session is closed")

    asyncio.run(calls())


# -- against a real kernel ----------------------------------------------------------------

# 4 tokens a step: a pred of LONG tokens takes 250 steps, long enough to be caught running
# however fast a step is. 300 pages of 16 tokens, no host tier: while another process's pred
# of BLOCK tokens runs, a pred of LONG tokens waits for memory.
DAEMON_FLAGS = ("--kv-pages", "300", "--host-pages", "0", "--token-budget", "4")
PREFIX, LONG, BLOCK, CUT = 24, 1000, 4000, 20  # CUT: the truncate keeps the prefix's 2 pages

VICTIM = f"""
import json, os, sys
from syscalls.client import Kernel
from syscalls.convert import proc_fields

def state(f):
    return {{"tokens": f.stat().tokens, "pages": f.stat().pages, "read": f.read()}}

ids = [(7 * i) % 290 + 6 for i in range({LONG})]
lifeline = sys.argv[1] != "grpc"  # the ring or frames on the lifeline: CANCEL has a reply
with Kernel.connect(name="victim", lifeline_pred=lifeline, rings=sys.argv[1] == "ring") as k, \
        k.open() as f:
    f.pred(ids[:{PREFIX}], no_outputs=True)
    before = state(f)
    used = proc_fields(k.procfs("meminfo"))["device_used"]
    print(json.dumps({{"pid": k.pid, "used": used}}), flush=True)
    sys.stdin.readline()
    try:
        f.pred(ids, no_outputs=True)
        sys.exit("the pred was answered before the interrupt")
    except KeyboardInterrupt:
        # On the lifeline the CANCEL's reply came first: the file is as before already.
        # Over gRPC, whose cancellation has no reply, the truncate waits for the rollback.
        after = state(f) if lifeline else before
        f.truncate({CUT})
    print(json.dumps({{"before": before, "after": after, "cut": state(f)}}), flush=True)
    sys.stdin.readline()  # the file stays open until the parent has looked
"""


def proc(k, pid: int):
    (p,) = [p for p in k.ps() if p.pid == pid]
    return p


@contextlib.contextmanager
def blocking(daemon):
    """Another process's long pred runs meanwhile, holding most of the device pool, until
    it is taken back at the end (raw frames on its lifeline)."""
    with Kernel.connect(daemon.socket, "blocker", rings=False) as b, b.open() as f:
        life = b.lifeline()
        request = pb.PredRequest(fd=f.fd, tokens=prompt(BLOCK, salt=1), no_outputs=True)
        life.sendall(wire.frame(wire.PRED, 1, request.SerializeToString()))
        wait_for(lambda: proc(b, b.pid).tokens > 0, what="the blocker to run")
        yield
        life.sendall(wire.frame(wire.CANCEL, 1))
        life.settimeout(60)
        ((kind, call, reply),) = read_frames(life, 1, wire.Frames())
        assert (kind, call) == (wire.REPLY, 1)
        assert pb.PredReply.FromString(reply).error.errno == errno.ECANCELED, "it ran out"


def started(k, pid: int, when: str) -> None:
    """Until the process's pred is queued behind the blocker, or running (some chunks
    computed, more to go)."""
    if when == "queued":
        wait_for(lambda: proc(k, pid).state == "waiting", what="the pred to wait")
    else:
        wait_for(lambda: proc(k, pid).tokens >= PREFIX + 16, what="the pred to run")
        assert proc(k, pid).state == "running", "it ran out"


@pytest.mark.parametrize("when", ["queued", "running"])
@pytest.mark.parametrize("transport", ["ring", "lifeline", "grpc"])
def test_a_lip_interrupted_mid_pred_finds_its_file_as_before(daemon, transport, when):
    """Ctrl-C (a real SIGINT) to a sync LIP in a long pred: it catches KeyboardInterrupt
    and truncates at once; the file, its pages and the pool are as before the pred."""
    with daemon.connect() as k:
        lip = subprocess.Popen([sys.executable, "-c", VICTIM, transport], env=daemon.env(),
                               cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
        try:
            started_with = json.loads(lip.stdout.readline())
            pid = started_with["pid"]
            with blocking(daemon) if when == "queued" else contextlib.nullcontext():
                lip.stdin.write("go\n")
                lip.stdin.flush()
                started(k, pid, when)
                lip.send_signal(signal.SIGINT)
                line = lip.stdout.readline()
                assert line, "the LIP failed"
                report = json.loads(line)
                assert proc(k, pid).state == "sleeping"  # no pred of it is left
            assert meminfo(k)["device_used"] == started_with["used"]
            lip.stdin.write("done\n")
            lip.stdin.flush()
            assert lip.wait(60) == 0
        finally:
            if lip.poll() is None:
                lip.kill()
                lip.wait()
    before = report["before"]
    assert report["after"] == before
    tokens, positions = before["read"]
    assert report["cut"] == {**before, "tokens": CUT, "read": [tokens[:CUT], positions[:CUT]]}


@pytest.mark.parametrize("when", ["queued", "running"])
@pytest.mark.parametrize("transport", ["ring", "lifeline", "grpc"])
def test_a_cancelled_task_finds_its_file_as_before(daemon, transport, when):
    async def state(f) -> tuple:
        stat = await f.stat()
        return stat.tokens, stat.pages, await f.read()

    async def run(k: AsyncKernel) -> None:
        f = await k.open()
        await f.pred(prompt(PREFIX), no_outputs=True)
        before, used = await state(f), meminfo(probe)["device_used"]
        with blocking(daemon) if when == "queued" else contextlib.nullcontext():
            task = asyncio.create_task(f.pred(prompt(LONG, salt=2), no_outputs=True))
            await asyncio.to_thread(started, probe, k.pid, when)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            if transport != "grpc":  # the CANCEL's reply came: nothing is left already
                assert await state(f) == before
            await f.truncate(CUT)  # over gRPC, after the kernel has rolled the pred back
            assert proc(probe, k.pid).state == "sleeping"
        tokens, pages, (ids, positions) = before
        assert await state(f) == (CUT, pages, (ids[:CUT], positions[:CUT]))
        assert meminfo(probe)["device_used"] == used  # the blocker is done
        await f.close()

    async def main() -> None:
        async with await AsyncKernel.connect(daemon.socket, lifeline_pred=transport != "grpc",
                                             rings=transport == "ring") as k:
            await run(k)

    with daemon.connect() as probe:
        asyncio.run(main())


class Alarm(Exception):
    """What the SIGALRM handler raises: a timeout, as a LIP's own would."""


def alarm(signum, frame) -> None:
    raise Alarm


# 30 timings from 0.25 to 80 ms, geometrically spaced: many land around the moment the pred
# is sent (a millisecond or less in), the rest while it is queued or computed (4 tokens a
# step: the pred of LONG tokens takes 250 steps, far longer than 80 ms).
SWEEP = [0.25e-3 * (80 / 0.25) ** (i / 29) for i in range(30)]


@pytest.mark.parametrize("transport", ["ring", "lifeline", "grpc"])
def test_an_interruption_at_any_moment_of_a_pred_takes_it_back(daemon, transport):
    """A SIGALRM handler raises out of a long pred after 0.25 to 80 ms: when the except
    clause runs, the pred has been taken back (the file as before, on the ring and the
    lifeline at once), so a truncate there and leaving `with` succeed; over gRPC the
    interruption reaches the caller at once, not at grpc's next look at signals."""
    late = []
    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        with Kernel.connect(daemon.socket, lifeline_pred=transport != "grpc",
                            rings=transport == "ring") as k:
            assert k.transport() == transport
            used = meminfo(k)["device_used"]
            for i, seconds in enumerate(SWEEP):
                with k.open() as f:
                    f.pred(prompt(8, salt=i), no_outputs=True)
                    before = f.read()
                    signal.setitimer(signal.ITIMER_REAL, seconds)
                    start = time.monotonic()
                    try:
                        f.pred(prompt(LONG, salt=i), no_outputs=True)
                        signal.setitimer(signal.ITIMER_REAL, 0)
                        pytest.fail(f"the pred was answered before the alarm ({seconds} s)")
                    except Alarm:
                        late.append(time.monotonic() - start - seconds)
                        if transport != "grpc":  # the CANCEL's reply came: as before
                            assert f.read() == before, f"interrupted after {seconds} s"
                        # over gRPC the kernel may see the truncate before the cancellation:
                        # the client makes it again until the rollback is done
                        f.truncate(4)
                    assert f.read() == tuple(t[:4] for t in before), f"after {seconds} s"
            assert meminfo(k)["device_used"] == used
            assert proc(k, k.pid).state == "sleeping"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    # A blocking gRPC call looks at signals every 200 ms: the alarm came that late. (On the
    # ring and the lifeline the wait includes the CANCEL's reply: the step's end.)
    if transport == "grpc":
        assert sorted(late)[len(late) // 2] < 0.1, late


# The asynchronous signals a LIP may handle, left to its main thread.
LEFT_TO_MAIN = ("SIGALRM", "SIGCHLD", "SIGHUP", "SIGINT", "SIGQUIT", "SIGTERM", "SIGUSR1",
                "SIGUSR2", "SIGWINCH")
THREADS = f"""
import json, os, signal, threading
from syscalls.client import Kernel

with Kernel.connect() as k, Kernel.connect(lifeline_pred=False) as g:
    for s in (k, g):  # g's pred from the main thread starts its Rpcs thread
        with s.open() as f:
            f.pred([6, 7, 8], no_outputs=True)
    threads = {{}}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{{tid}}/status") as st:
            status = dict(line.split(":\\t", 1) for line in st.read().splitlines())
        blocked = int(status["SigBlk"], 16)
        name = "main" if int(tid) == threading.get_native_id() else tid + " " + status["Name"]
        threads[name] = [sig for sig in {LEFT_TO_MAIN!r}
                         if not blocked >> (signal.Signals[sig] - 1) & 1]
    print(json.dumps(threads))
"""


def test_the_clients_threads_leave_the_signals_a_lip_handles_to_its_main_thread(daemon):
    """A signal sent to the process goes to any thread that does not block it (often the
    one running); Python runs the handler in the main thread only, when it next runs Python
    code: a signal taken by a thread of grpc's (or the Rpcs thread) left the main thread
    asleep until the pred's reply came, too late to take it back. In a LIP that starts no
    threads, every thread but the main one (gRPC's, the Rpcs thread) blocks them."""
    threads = json.loads(run_script(daemon, THREADS))
    assert threads.pop("main") == list(LEFT_TO_MAIN)  # the main thread blocks none
    assert threads, "gRPC started no thread"
    assert {name: open_to for name, open_to in threads.items() if open_to} == {}


def signalled_first(wait):
    """`wait` (a system call), made to signal this thread just before it starts, as a
    signal can land after Python's last look at signals: in one C call chain, so that
    Python does not run the handler before the wait (it runs it when the wait returns)."""
    me = threading.main_thread().ident

    def waits(*args):
        return list(map(operator.call, (functools.partial(signal.pthread_kill, me,
                                                          signal.SIGALRM),
                                        functools.partial(wait, *args))))[1]
    return waits


@pytest.mark.parametrize("transport", ["ring", "lifeline", "grpc"])
def test_a_signal_that_lands_just_before_the_wait_still_interrupts_it(daemon, transport,
                                                                        monkeypatch):
    """The main thread waits in slices (lifeline.MAIN_WAIT_SLICE): the handler runs within
    one, and the pred (waiting behind the blocker, never answered) is taken back. Without
    them the wait would end only when a second signal came, 10 s later."""
    previous = {s: signal.signal(s, alarm if s == signal.SIGALRM else lambda *_: None)
                for s in (signal.SIGALRM, signal.SIGUSR2)}
    nudge = threading.Timer(10, signal.pthread_kill,
                            (threading.main_thread().ident, signal.SIGUSR2))
    try:
        with blocking(daemon), Kernel.connect(daemon.socket, lifeline_pred=transport != "grpc",
                                              rings=transport == "ring") as k, k.open() as f:
            f.pred(prompt(8), no_outputs=True)
            before = f.read()
            if transport == "ring":
                poll = k._line._poll
                monkeypatch.setattr(k._line, "_poll", types.SimpleNamespace(
                    poll=signalled_first(poll.poll)))
            else:
                module = lifeline if transport == "lifeline" else pred_rpc
                monkeypatch.setattr(module, "select", types.SimpleNamespace(
                    select=signalled_first(select.select)))
            nudge.start()
            start = time.monotonic()
            with pytest.raises(Alarm):
                f.pred(prompt(LONG), no_outputs=True)
            assert time.monotonic() - start < 5, "the handler ran only after another signal"
            monkeypatch.undo()
            if transport != "grpc":
                assert f.read() == before
            wait_for(lambda: proc(k, k.pid).state == "sleeping", what="the pred taken back")
    finally:
        nudge.cancel()
        for s, handler in previous.items():
            signal.signal(s, handler)


def test_closing_the_session_ends_a_grpc_pred_the_main_thread_waits_for(daemon):
    """The main thread's rpcs are made by a thread of the session's: closing the session
    (here from another thread) still ends the wait, with EBADF."""
    with blocking(daemon), daemon.connect() as watcher:
        k = Kernel.connect(daemon.socket, lifeline_pred=False)
        f = k.open()

        def close_once_waiting() -> None:  # the pred waits for the blocker's memory
            started(watcher, k.pid, "queued")
            k.close()

        closing = threading.Thread(target=close_once_waiting)
        closing.start()
        previous = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, 60)  # the pred would wait for the blocker
        try:
            with pytest.raises(OSError) as e:
                f.pred(prompt(LONG), no_outputs=True)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
        closing.join()
    assert e.value.errno == errno.EBADF


def test_a_cancel_that_crosses_the_answer_or_names_no_pred_changes_nothing(daemon):
    """Raw frames: a CANCEL after the reply, or naming no call, gets no reply and undoes
    nothing; a CANCEL right behind its PRED drops it, with one reply: ECANCELED."""
    with Kernel.connect(daemon.socket, rings=False) as k, k.open() as f:
        life = k.lifeline()  # k itself sends no pred: the frames here are the only ones
        life.settimeout(60)
        frames = wire.Frames()

        def pred(call: int, tokens: list[int]) -> bytes:
            request = pb.PredRequest(fd=f.fd, tokens=tokens, no_outputs=True)
            return wire.frame(wire.PRED, call, request.SerializeToString())

        def replies(n: int) -> dict[int, int]:
            got = read_frames(life, n, frames)
            assert all(kind == wire.REPLY for kind, _, _ in got)
            return {call: pb.PredReply.FromString(data).error.errno for _, call, data in got}

        life.sendall(pred(1, prompt(20)))
        assert replies(1) == {1: 0}
        life.sendall(wire.frame(wire.CANCEL, 1) + wire.frame(wire.CANCEL, 99) + pred(2, [5]))
        assert replies(1) == {2: 0}
        assert f.stat().tokens == 21
        life.sendall(pred(3, prompt(LONG)) + wire.frame(wire.CANCEL, 3) + pred(4, [6]))
        assert replies(2) == {3: errno.ECANCELED, 4: 0}
        assert f.read() == ([*prompt(20), 5, 6], list(range(22)))
        life.settimeout(0.5)
        with pytest.raises(TimeoutError):
            life.recv(1)  # and nothing more
        life.settimeout(None)
