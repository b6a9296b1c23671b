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
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from daemon import ROOT, meminfo, prompt, wait_for

from syscalls import lifeline, wire
from syscalls import symphony_pb2 as pb
from syscalls.aio import AsyncKernel
from syscalls.client import Kernel
from syscalls.lifeline import AsyncLifeline, Lifeline

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
    """The lifeline's socket, its first recv interrupted by Ctrl-C."""

    def __init__(self, sock: socket.socket):
        self.sock, self.recvs = sock, 0

    def __getattr__(self, name: str):
        return getattr(self.sock, name)

    def recv(self, n: int) -> bytes:
        self.recvs += 1
        if self.recvs == 1:
            raise KeyboardInterrupt
        return self.sock.recv(n)


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
