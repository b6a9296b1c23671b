"""pred's fast path on the lifeline (syscalls/wire.py): the same answers, errors and
accounting as the Pred rpc, many callers on one session, and what bad frames, a vanished
kernel or a process that reads no replies do. The first tests play the kernel's end of a
socket pair; the rest run a real kernel daemon."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import socket
import threading
import time
from pathlib import Path

import grpc
import pytest
from daemon import (
    HOG,
    HOG_TOKENS,
    ROOT,
    hog_payload,
    meminfo,
    preds_answered,
    prompt,
    raw_open,
    run_script,
    sched,
    send_while_taken,
    settled,
    vm_rss_kib,
    wait_for,
)

from syscalls import lifeline, session, wire
from syscalls import symphony_pb2 as pb
from syscalls.aio import AsyncKernel
from syscalls.client import Kernel
from syscalls.lifeline import AsyncLifeline, Lifeline

# -- the client's end, against a scripted kernel end --------------------------------------


def reply_frames(peer: socket.socket, n: int, order) -> None:
    """Read n PRED frames, then answer them in `order` (a function of the call ids), each
    reply naming the fd its request had."""
    frames, got = wire.Frames(), []
    while len(got) < n:
        got += frames.feed(peer.recv(4096))
    for kind, call, payload in order(got):
        assert kind == wire.PRED
        fd = pb.PredRequest.FromString(payload).fd
        peer.sendall(wire.frame(wire.REPLY, call, pb.PredReply(
            outputs=[pb.PredOutput(row=0, token=fd)]).SerializeToString()))


def test_threads_on_one_lifeline_each_get_their_own_reply():
    ours, peer = socket.socketpair()
    line = Lifeline(ours, "k.sock")
    kernel = threading.Thread(target=reply_frames, args=(peer, 8, lambda got: got[::-1]))
    kernel.start()
    answers: dict[int, int] = {}

    def caller(fd: int) -> None:
        reply = pb.PredReply.FromString(line.call(pb.PredRequest(fd=fd).SerializeToString()))
        answers[fd] = reply.outputs[0].token

    callers = [threading.Thread(target=caller, args=(fd,)) for fd in range(3, 11)]
    for t in callers:
        t.start()
    for t in (*callers, kernel):
        t.join(10)
    assert answers == {fd: fd for fd in range(3, 11)}  # replies came back reversed


def test_tasks_on_one_async_lifeline_each_get_their_own_reply():
    ours, peer = socket.socketpair()

    async def calls() -> list[int]:
        line = AsyncLifeline(ours, "k.sock")
        kernel = asyncio.create_task(asyncio.to_thread(
            reply_frames, peer, 8, lambda got: got[::-1]))

        async def one(fd: int) -> int:
            payload = await line.call(pb.PredRequest(fd=fd).SerializeToString())
            return pb.PredReply.FromString(payload).outputs[0].token

        got = await asyncio.gather(*(one(fd) for fd in range(3, 11)))
        await kernel
        line.end(errno.EBADF, "k.sock: the session is closed")
        return got

    assert asyncio.run(calls()) == list(range(3, 11))


def test_a_pred_whose_kernel_is_gone_raises_broken_pipe(tmp_path):
    sock = tmp_path / "k.sock"
    lifeline, peer = socket.socketpair()
    channel = grpc.insecure_channel(session.grpc_target(sock))
    with Kernel(sock, lifeline, "token", channel) as k:
        peer.close()
        with pytest.raises(BrokenPipeError, match=f"{sock}: kernel unreachable"):
            k.pred(3, [1, 2])

    async def async_pred() -> None:
        lifeline, peer = socket.socketpair()
        channel = grpc.aio.insecure_channel(session.grpc_target(sock))
        async with AsyncKernel(sock, lifeline, "token", channel) as k:
            pending = asyncio.create_task(k.pred(3, [1, 2]))
            await asyncio.sleep(0.05)  # sent, waiting for its reply
            peer.close()
            with pytest.raises(BrokenPipeError, match=f"{sock}: kernel unreachable"):
                await pending

    asyncio.run(async_pred())


def test_frames_are_cut_where_their_headers_say():
    frames = wire.Frames()
    stream = wire.frame(wire.PRED, 1, b"abc") + wire.frame(wire.SHUTDOWN, 0) + wire.frame(
        wire.REPLY, 7, b"x" * 100)
    got = [f for i in range(len(stream)) for f in frames.feed(stream[i:i + 1])]
    assert got == [(wire.PRED, 1, b"abc"), (wire.SHUTDOWN, 0, b""), (wire.REPLY, 7, b"x" * 100)]
    with pytest.raises(wire.FrameError):
        frames.feed(wire.HEADER.pack(wire.MAX_PAYLOAD + 1, 1, wire.PRED))


def sent_frames(peer: socket.socket) -> list:
    """Every frame the client sent, once it has hung up."""
    frames, got = wire.Frames(), []
    while data := peer.recv(1 << 16):
        got += frames.feed(data)
    return got


def test_bytes_from_the_kernel_that_are_not_frames_fail_every_call_with_eproto():
    """As a reply over wire.MAX_PAYLOAD would: each caller gets EPROTO naming the socket
    (the sync client once died of an UnboundLocalError), and the client hangs up."""
    not_a_frame = wire.HEADER.pack(wire.MAX_PAYLOAD + 1, 1, wire.REPLY)
    request = pb.PredRequest(fd=3).SerializeToString()
    ours, peer = socket.socketpair()
    line = Lifeline(ours, "k.sock")
    peer.sendall(not_a_frame)
    for _ in range(2):  # the first read it; the next is refused unsent
        with pytest.raises(OSError, match="k.sock: the lifeline is broken") as e:
            line.call(request)
        assert e.value.errno == errno.EPROTO
    assert [kind for kind, _, _ in sent_frames(peer)] == [wire.PRED]

    async def calls() -> None:
        ours, peer = socket.socketpair()
        line = AsyncLifeline(ours, "k.sock")
        pending = asyncio.create_task(line.call(request))
        await asyncio.sleep(0.05)  # sent, waiting for its reply
        peer.sendall(not_a_frame)
        for call in (pending, line.call(request)):
            with pytest.raises(OSError, match="k.sock: the lifeline is broken") as e:
                await call
            assert e.value.errno == errno.EPROTO
        assert [kind for kind, _, _ in await asyncio.to_thread(sent_frames, peer)] == [wire.PRED]

    asyncio.run(calls())


def test_a_pred_too_long_for_a_frame_gets_emsgsize_unsent():
    ours, peer = socket.socketpair()
    ours.settimeout(5)  # sending it would block: nothing reads the other end
    line = Lifeline(ours, "k.sock")
    too_long = bytes(wire.MAX_PAYLOAD + 1)
    with pytest.raises(OSError, match="over the 64 MiB limit") as e:
        line.call(too_long)
    assert e.value.errno == errno.EMSGSIZE

    async def call() -> None:
        with pytest.raises(OSError, match="over the 64 MiB limit") as e:
            await AsyncLifeline(ours, "k.sock").call(too_long)
        assert e.value.errno == errno.EMSGSIZE

    asyncio.run(call())
    ours.close()
    assert sent_frames(peer) == []


# -- against a real kernel ----------------------------------------------------------------


DAEMON_FLAGS = ("--kv-pages", "256")


PROMPT = [(5 * i) % 300 + 6 for i in range(40)]


def session_preds(k: Kernel) -> list:
    """A spread of preds and their answers, or errnos and messages for the bad ones."""
    results = []
    with k.open("", os.O_RDWR) as f:
        results.append(f.pred(PROMPT, outputs=[0, 17, 39], top_logprobs=4))
        results.append(f.pred([9], positions=[60]))  # a gap
        for _ in range(5):
            results.append(f.pred([results[-1][-1].token], temperature=0.8, top_p=0.9,
                                  seed=11, top_logprobs=2))
        for bad in (lambda: f.pred([1, 400]), lambda: f.pred([1], positions=[10**6]),
                    lambda: k.pred(999, [1]), lambda: f.pred([1, 2], outputs=[5])):
            with pytest.raises(OSError) as e:
                bad()
            results.append((e.value.errno, str(e.value).replace(f"process {k.pid}", "PID")))
        results.append(k.read(f))
    return results


def test_pred_on_the_lifeline_answers_as_the_rpc_does(daemon):
    with Kernel.connect(daemon.socket, name="line") as line, \
            Kernel.connect(daemon.socket, name="rpc", lifeline_pred=False) as rpc:
        assert line._line is not None and rpc._line is None
        assert session_preds(line) == session_preds(rpc)
        counts = {}
        for k in (line, rpc):
            rows = [r.split("\t") for r in k.procfs(f"{k.pid}/syscalls").splitlines()]
            counts[k] = {r[0]: int(r[1]) for r in rows[1:]}
        assert counts[line]["Pred"] == counts[rpc]["Pred"] == 11  # accounted alike


def decode(f, n: int) -> list[int]:
    (out,) = f.pred(PROMPT)
    got = [out.token]
    for _ in range(n - 1):
        (out,) = f.pred([got[-1]])
        got.append(out.token)
    return got


def test_threads_and_tasks_share_one_session(daemon):
    with daemon.connect() as k, k.open("", os.O_RDWR) as f:
        alone = decode(f, 12)
    with daemon.connect() as k:
        files = [k.open("", os.O_RDWR) for _ in range(4)]
        got: list = [None] * 4

        def run(i: int) -> None:
            got[i] = decode(files[i], 12)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert got == [alone] * 4

    async def tasks() -> list[list[int]]:
        async with await AsyncKernel.connect(daemon.socket) as k:
            async def run() -> list[int]:
                f = await k.open("", os.O_RDWR)
                (out,) = await f.pred(PROMPT)
                toks = [out.token]
                for _ in range(11):
                    (out,) = await f.pred([toks[-1]])
                    toks.append(out.token)
                return toks

            return await asyncio.gather(*(run() for _ in range(4)))

    assert asyncio.run(tasks()) == [alone] * 4


def raw_call(life: socket.socket, frames: wire.Frames, kind: int, payload: bytes) -> pb.PredReply:
    life.sendall(wire.frame(kind, 42, payload))
    while not (got := frames.feed(life.recv(4096))):
        pass
    ((reply_kind, call, data),) = got
    assert (reply_kind, call) == (wire.REPLY, 42)
    return pb.PredReply.FromString(data)


def test_bad_frames_get_einval_and_garbage_ends_the_process(daemon):
    with daemon.connect() as k:
        # Sessions of earlier tests may still be reaped, freeing pages: count from after. A
        # process leaves ps before its files are closed, so wait for the count to settle too.
        wait_for(lambda: [p.pid for p in k.ps()] == [k.pid], what="earlier sessions reaped")
        free = settled(lambda: meminfo(k)["device_free"])
        life, token = session.hello(daemon.socket)
        channel = grpc.insecure_channel(session.grpc_target(daemon.socket))
        meta = [(session.SESSION_KEY, token)]
        open_ = channel.unary_unary("/symphony.Kernel/Open",
                                    request_serializer=pb.OpenRequest.SerializeToString,
                                    response_deserializer=pb.FdReply.FromString)
        fd = open_(pb.OpenRequest(path="", flags=os.O_RDWR), metadata=meta).fd
        frames = wire.Frames()
        ok = raw_call(life, frames, wire.PRED, pb.PredRequest(fd=fd, tokens=PROMPT)
                      .SerializeToString())
        assert not ok.HasField("error") and len(ok.outputs) == 1
        assert meminfo(k)["device_free"] != free  # the file holds pages now
        for kind, payload in ((wire.PRED, b"\x0a\xff\xff\xff"), (wire.REPLY, b"")):
            reply = raw_call(life, frames, kind, payload)
            assert reply.error.errno == errno.EINVAL, reply
        pid = max(p.pid for p in k.ps() if p.os_pid == os.getpid())  # the newest session
        life.sendall(wire.HEADER.pack(wire.MAX_PAYLOAD + 1, 1, wire.PRED))  # not a frame
        assert life.recv(16) == b""  # the kernel hung up...
        wait_for(lambda: pid not in {p.pid for p in k.ps()}, what="the process reaped")
        wait_for(lambda: meminfo(k)["device_free"] == free, what="its pages freed")
        life.close()
        channel.close()


def test_a_call_id_in_flight_used_again_gets_einval_and_the_first_pred_goes_on(daemon):
    """Both replies would carry one call id, and a CANCEL would name either."""
    life, token = session.hello(daemon.socket)
    try:
        fd = raw_open(daemon.socket, token)
        request = pb.PredRequest(fd=fd, tokens=prompt(200), no_outputs=True)
        life.sendall(wire.frame(wire.PRED, 7, request.SerializeToString()) * 2)
        life.settimeout(60)
        frames, got = wire.Frames(), []
        while len(got) < 2:
            got += frames.feed(life.recv(4096))
        assert [(kind, call) for kind, call, _ in got] == [(wire.REPLY, 7)] * 2
        again, first = (pb.PredReply.FromString(payload) for _, _, payload in got)
        assert again.error.errno == errno.EINVAL
        assert "call id 7 has a pred in flight" in again.error.message
        assert not first.HasField("error")
        # Answered: the id is free again.
        assert not raw_call(life, frames, wire.PRED, pb.PredRequest(
            fd=fd, tokens=[5]).SerializeToString()).HasField("error")
    finally:
        life.close()


def test_a_cancelled_pred_keeps_its_call_id_until_its_reply(daemon):
    """A call id may be used again once its reply has come: a PRED that reuses it right
    after a CANCEL, before the ECANCELED, is EINVAL, and the CANCEL gets exactly one reply
    (the id was freed at the CANCEL, so the second PRED went on and two replies of one call
    id came, ECANCELED and an answer)."""
    life, token = session.hello(daemon.socket)
    try:
        fd = raw_open(daemon.socket, token)
        long = pb.PredRequest(fd=fd, tokens=prompt(300), no_outputs=True).SerializeToString()
        short = pb.PredRequest(fd=fd, tokens=[5]).SerializeToString()
        life.sendall(wire.frame(wire.PRED, 3, long) + wire.frame(wire.CANCEL, 3, b"")
                     + wire.frame(wire.PRED, 3, short))
        life.settimeout(60)
        frames, got = wire.Frames(), []
        while len(got) < 2:
            got += frames.feed(life.recv(4096))
        replies = [pb.PredReply.FromString(payload) for _, _, payload in got]
        assert [(kind, call) for kind, call, _ in got] == [(wire.REPLY, 3)] * 2
        assert sorted(r.error.errno for r in replies) == sorted([errno.EINVAL,
                                                                 errno.ECANCELED])
        einval = next(r for r in replies if r.error.errno == errno.EINVAL)
        assert "call id 3 has a pred in flight" in einval.error.message
        life.settimeout(0.5)  # and no third reply
        with pytest.raises(TimeoutError):
            frames.feed(life.recv(4096))
        life.settimeout(60)
        # Answered: the id is free again, and the file is as before the cancelled pred.
        assert not raw_call(life, frames, wire.PRED, short).HasField("error")
    finally:
        life.close()


def test_a_ring_setup_other_than_call_id_0_and_no_payload_is_einval(daemon):
    life, _ = session.hello(daemon.socket)
    try:
        life.settimeout(60)
        frames = wire.Frames()
        for call, payload, why in ((5, b"", "its call id is 5, not 0"),
                                   (0, b"xyz", "it has 3 bytes of payload, not none")):
            life.sendall(wire.frame(wire.RING_SETUP, call, payload))
            while not (got := frames.feed(life.recv(4096))):
                pass
            ((kind, call_id, data),) = got
            error = pb.PredReply.FromString(data).error
            assert (kind, call_id, error.errno) == (wire.REPLY, 0, errno.EINVAL)
            assert error.message == f"ring setup: {why}"
    finally:
        life.close()


CLOSING_CHILD = """
import json, os, sys, traceback
from syscalls.client import Kernel
with Kernel.connect(name="test") as k:
    child = os.fork()
    if child == 0:
        try:
            k.close()
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    status = os.waitpid(child, 0)[1]
    with k.open("", os.O_RDWR) as f:  # the session lives: pred and gRPC both answer
        print(json.dumps({"child": status, "outputs": len(f.pred(json.loads(sys.argv[1])))}))
"""


def test_a_forked_child_closing_the_session_leaves_the_parent_attached(daemon):
    """The fork happens in a process of its own: a fork here would run gRPC's at-fork
    handler in the suite's process (once hung the suite)."""
    report = json.loads(run_script(daemon, CLOSING_CHILD, json.dumps(PROMPT)))
    assert report["child"] == 0
    assert report["outputs"] == 1


def test_a_reader_interrupted_in_its_wait_hands_reading_to_another_waiter(monkeypatch):
    monkeypatch.setattr(lifeline, "CANCEL_WAIT", 0.1)  # no kernel answers the CANCEL yet
    ours, peer = socket.socketpair()
    line = Lifeline(ours, "k.sock")
    calls = []

    class Interrupted(BaseException):
        pass

    class Sock:  # the first wait (a select: it asks for the fileno) is interrupted, as by
        def __getattr__(self, name):  # KeyboardInterrupt; the rest are real
            return getattr(ours, name)

        def fileno(self):
            calls.append(1)
            if len(calls) == 1:
                raise Interrupted
            return ours.fileno()

    line.sock = Sock()
    with pytest.raises(Interrupted):
        line.call(pb.PredRequest(fd=3).SerializeToString())
    kernel = threading.Thread(target=reply_frames, args=(peer, 3, lambda got: got[2:]),
                              daemon=True)  # PRED 1, CANCEL 1, then the PRED answered
    kernel.start()
    got: list[int] = []
    caller = threading.Thread(target=lambda: got.append(pb.PredReply.FromString(
        line.call(pb.PredRequest(fd=4).SerializeToString())).outputs[0].token), daemon=True)
    caller.start()
    caller.join(10)
    assert got == [4], "the next caller waited for a reader that was gone"


# -- a process that does not read its lifeline ---------------------------------------------

HOG_PREDS = 100  # about 70 MB of replies, read by no one


def test_a_process_that_does_not_read_its_lifeline_gets_no_more_preds_taken(daemon):
    """Its replies back up in the kernel's write buffer to a few MiB (symphony/server.py,
    REPLIES_HIGH); then the kernel takes no more of its preds, so the kernel's memory does
    not grow with the preds it keeps sending (it grew by every reply: 70 MB here). Another
    process is answered meanwhile as ever. Once it reads, every pred gets its one answer."""
    with daemon.connect("bystander") as k, k.open("", os.O_RDWR) as f:
        # The kernel's path for such a reply warm, before its memory is measured.
        assert len(f.pred(**HOG)) == HOG_TOKENS
        pids = {p.pid for p in k.ps()}
        life, token = session.hello(daemon.socket)
        try:
            (hog,) = {p.pid for p in k.ps()} - pids
            payload = hog_payload(raw_open(daemon.socket, token))
            rss = vm_rss_kib(daemon.process.pid)
            life.setblocking(False)
            unsent = b""

            def send(call: int) -> None:
                nonlocal unsent
                unsent += wire.frame(wire.PRED, call, payload)
                with contextlib.suppress(BlockingIOError):
                    unsent = unsent[life.send(unsent):]

            send_while_taken(k, hog, range(1, HOG_PREDS + 1), send)
            taken = settled(lambda: preds_answered(k, hog), quiet=1.0)
            grown = vm_rss_kib(daemon.process.pid) - rss
            start = time.monotonic()
            assert len(decode(f, 4)) == 4  # the bystander is answered, without delay
            assert time.monotonic() - start < 5
            assert taken < HOG_PREDS // 3, taken
            assert grown < 40 << 10, f"the kernel grew by {grown >> 10} MiB"
            # Now it reads: the kernel takes the rest, and every pred is answered once.
            life.settimeout(60)
            rest = threading.Thread(target=life.sendall, args=(unsent,), daemon=True)
            rest.start()
            frames, replies = wire.Frames(), {}
            while len(replies) < HOG_PREDS:
                for kind, call, data in frames.feed(life.recv(1 << 20)):
                    assert kind == wire.REPLY and call not in replies, (kind, call)
                    replies[call] = pb.PredReply.FromString(data)
            assert sorted(replies) == list(range(1, HOG_PREDS + 1))
            assert {len(r.outputs) for r in replies.values()} == {HOG_TOKENS}, \
                next(r.error for r in replies.values() if r.HasField("error"))
            assert preds_answered(k, hog) == HOG_PREDS
            rest.join(10)
        finally:
            life.close()


def test_preds_sent_in_one_burst_owe_the_kernel_at_most_owed_max(daemon):
    """100 preds whose replies may take 1 MB each, sent at once and never read: the kernel
    takes them until their replies could take OWED_MAX (64 MiB) in all, not every one it
    has read before the first reply backs up; once the process reads, all are answered."""
    from symphony.owed import OWED_MAX
    from symphony.syscall_table import reply_bound

    with daemon.connect("bystander") as k, k.open("", os.O_RDWR) as f:
        life, token = session.hello(daemon.socket)
        try:
            (hog,) = {p.pid for p in k.ps()} - {k.getpid()}
            payload = hog_payload(raw_open(daemon.socket, token))
            bound = reply_bound(pb.PredRequest.FromString(payload))
            life.settimeout(60)
            sender = threading.Thread(target=life.sendall, args=(b"".join(
                wire.frame(wire.PRED, call, payload) for call in range(1, HOG_PREDS + 1)),),
                daemon=True)
            sender.start()
            taken = settled(lambda: preds_answered(k, hog), quiet=1.5)
            assert taken <= OWED_MAX // bound + 1 < HOG_PREDS, taken
            assert len(decode(f, 4)) == 4  # the bystander is answered meanwhile
            frames, replies = wire.Frames(), set()
            while len(replies) < HOG_PREDS:
                for kind, call, _ in frames.feed(life.recv(1 << 20)):
                    assert kind == wire.REPLY and call not in replies, (kind, call)
                    replies.add(call)
            sender.join(10)
        finally:
            life.close()


LIFELINE_HOG = """
import os, sys, time
sys.path.insert(0, "tests")
from daemon import hog_payload, raw_open
from syscalls import session, wire
os.setgroups([]); os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[2]))
sock = session.socket_path(None)
life, token = session.hello(sock)
payload = hog_payload(raw_open(sock, token))
print(os.getpid(), flush=True)
life.sendall(b"".join(wire.frame(wire.PRED, call, payload)
                      for call in range(1, int(sys.argv[1]) + 1)))
time.sleep(600)  # reads nothing
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_a_users_lifelines_back_up_together(daemon):
    """Processes of one user send preds with large replies and read none. Once
    BACKED_UP_MAX of its lifelines have backed up, the kernel takes no pred of another
    process of the user (each would keep its replies in flight too: a user's 256
    processes could make it keep 16 GiB), and goes on with root's; when one of them ends,
    the other's preds are taken."""
    import subprocess
    import sys

    from symphony.owed import BACKED_UP_MAX

    uid, hogs = 60079, []

    def hog() -> int:
        hogs.append(subprocess.Popen([sys.executable, "-c", LIFELINE_HOG, str(HOG_PREDS),
                                      str(uid)], env=daemon.env(), cwd=ROOT,
                                     stdout=subprocess.PIPE, text=True))
        os_pid = int(hogs[-1].stdout.readline())
        return wait_for(lambda: next((p.pid for p in k.ps() if p.os_pid == os_pid), None),
                        what=f"process {os_pid} in ps")

    with daemon.connect("bystander") as k, k.open("", os.O_RDWR) as f:
        try:
            backed = [hog() for _ in range(BACKED_UP_MAX)]
            answered = settled(lambda: [preds_answered(k, pid) for pid in backed], quiet=1.5)
            assert all(0 < n < HOG_PREDS for n in answered), answered
            late = hog()
            assert settled(lambda: preds_answered(k, late), quiet=1.5) == 0
            assert len(decode(f, 4)) == 4  # root's bystander is answered meanwhile
            hogs[0].kill()
            hogs[0].wait()
            wait_for(lambda: preds_answered(k, late) > 0, what="the late process's preds taken")
        finally:
            for h in hogs:
                h.kill()
                h.wait()


GRPC_HOG = """
import os, signal, sys, time
import grpc
sys.path.insert(0, "tests")
from daemon import hog_payload
from syscalls import session
from syscalls import symphony_pb2 as pb
from syscalls.client import CHANNEL_OPTIONS
if len(sys.argv) > 2:  # as this user
    os.setgroups([]); os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[2]))
sock = session.socket_path(None)
life, token = session.hello(sock)
channel = grpc.insecure_channel(session.grpc_target(sock), options=CHANNEL_OPTIONS)
meta = [(session.SESSION_KEY, token)]
fd = channel.unary_unary("/symphony.Kernel/Open",
                         request_serializer=pb.OpenRequest.SerializeToString,
                         response_deserializer=pb.FdReply.FromString)(
    pb.OpenRequest(path="", flags=os.O_RDWR), metadata=meta).fd
pred = channel.unary_unary("/symphony.Kernel/Pred",
                           request_serializer=lambda b: b, response_deserializer=lambda b: b)
calls = [pred.future(hog_payload(fd), metadata=meta) for _ in range(int(sys.argv[1]))]
print(os.getpid(), flush=True)
time.sleep(1)
os.kill(os.getpid(), signal.SIGSTOP)  # reads nothing from now on
"""


def test_pred_rpcs_whose_replies_are_not_read_hold_the_kernel_to_a_budget(daemon):
    """A process issues 300 Pred rpcs with ~0.7 MB replies, reads their replies for a
    second, then stops reading: from then on the kernel answers only while what their
    replies could take stays within the process's budget (reply_budget.py), not the rest
    of the 300 (400 such had the kernel hold 1.7 GB)."""
    import subprocess
    import sys

    from symphony.reply_budget import LIMIT
    from symphony.syscall_table import reply_bound

    rpcs = 300
    with daemon.connect("bystander") as k, k.open("", os.O_RDWR) as f:
        hog = subprocess.Popen([sys.executable, "-c", GRPC_HOG, str(rpcs)], env=daemon.env(),
                               cwd=ROOT, stdout=subprocess.PIPE, text=True)
        try:
            hog_os_pid = int(hog.stdout.readline())
            (pid,) = [p.pid for p in k.ps() if p.os_pid == hog_os_pid]
            wait_for(lambda: "T (stopped)" in Path(f"/proc/{hog_os_pid}/status").read_text(),
                     what="the hog stopped")
            when_stopped = preds_answered(k, pid)
            answered = settled(lambda: preds_answered(k, pid), quiet=2.0)
            bound = reply_bound(pb.PredRequest.FromString(hog_payload(3)))
            # The budget's worth, and what gRPC's flow-control windows and the socket take
            # before the stopped client's side is full (a few replies): not the other 200.
            assert answered - when_stopped <= 2 * (LIMIT // bound) + 8, (when_stopped, answered)
            assert answered < rpcs
            assert len(decode(f, 4)) == 4  # the bystander is answered meanwhile
        finally:
            hog.kill()
            hog.wait()


ONE_GRPC_PRED = """
import os, sys
sys.path.insert(0, "tests")
from daemon import HOG
from syscalls.client import Kernel
os.setgroups([]); os.setgid(int(sys.argv[1])); os.setuid(int(sys.argv[1]))
with Kernel.connect(lifeline_pred=False) as k, k.open("", os.O_RDWR) as f:
    print(len(f.pred(**HOG)), flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_a_users_pred_rpcs_share_one_budget(daemon):
    """The budget is the user's, all its processes together: while one process of a user
    holds it full, another process of the same user waits for its Pred rpc, and gets its
    answer once the first is gone; root's processes are not held back by it."""
    import subprocess
    import sys

    uid = 60078
    with daemon.connect("bystander") as k, k.open("", os.O_RDWR) as f:
        hog = subprocess.Popen([sys.executable, "-c", GRPC_HOG, "300", str(uid)],
                               env=daemon.env(), cwd=ROOT, stdout=subprocess.PIPE, text=True)
        other = None
        try:
            hog_os_pid = int(hog.stdout.readline())
            wait_for(lambda: "T (stopped)" in Path(f"/proc/{hog_os_pid}/status").read_text(),
                     what="the hog stopped")
            other = subprocess.Popen([sys.executable, "-c", ONE_GRPC_PRED, str(uid)],
                                     env=daemon.env(), cwd=ROOT, stdout=subprocess.PIPE,
                                     text=True)
            with pytest.raises(subprocess.TimeoutExpired):
                other.wait(4)  # its rpc waits for the user's budget
            assert len(f.pred(**HOG)) == HOG_TOKENS  # root's are not held back
            hog.kill()
            hog.wait()
            assert other.communicate(timeout=60)[0] == f"{HOG_TOKENS}\n"
        finally:
            for p in (hog, other):
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait()


@pytest.mark.parametrize("rings", [False, True])
def test_a_sender_reads_the_replies_while_the_kernel_takes_no_more(daemon, rings):
    """Ten preds sent and not waited for yet (their ~7 MB of replies wait unread, so the
    kernel takes no more of the process's preds), then a batch of 30 MB (600 preds of
    50 KB, refused at once: a bad fd) that fills the lifeline's socket or the ring: the
    sender reads the replies while it cannot send, and all are answered. Before, the
    sender and the kernel waited for each other for ever."""
    with daemon.connect("batch", rings=rings) as k, daemon.connect("watcher") as w, \
            k.open("", os.O_RDWR) as f:
        line = k._line
        early = [next(line._ids) for _ in range(10)]
        sendings = [lifeline.Sending() for _ in early]
        line._calls.update(zip(early, sendings, strict=True))
        line._send_many([wire.frame(wire.PRED, c, hog_payload(f.fd)) for c in early], sendings)
        wait_for(lambda: preds_answered(w, k.getpid()) == len(early), what="the ten answered")
        got = []
        sender = threading.Thread(target=lambda: got.append(k.pred_many(
            [{"fd": 999, "tokens": [300] * 25000}] * 600, return_exceptions=True)),
            daemon=True)
        sender.start()
        sender.join(120)
        assert not sender.is_alive(), "the batch waits for the kernel, which waits for it"
        assert {e.errno for e in got[0]} == {errno.EBADF} and len(got[0]) == 600
        replies = [pb.PredReply.FromString(line._wait(c, None)) for c in early]
        assert [len(r.outputs) for r in replies] == [HOG_TOKENS] * len(early)


def test_a_process_has_at_most_in_flight_max_preds_taken(daemon):
    """A process that writes small preds faster than steps answer them: the kernel takes
    IN_FLIGHT_MAX of them at most (its run queue stays under it), the rest wait in the
    socket, and every one is answered once. Before, the run queue took them all."""
    from symphony.server import IN_FLIGHT_MAX

    preds = IN_FLIGHT_MAX + 2000
    with daemon.connect("watcher") as w:
        life, token = session.hello(daemon.socket)
        try:
            fds = [raw_open(daemon.socket, token) for _ in range(8)]
            frames = b"".join(
                wire.frame(wire.PRED, call, pb.PredRequest(
                    fd=fds[call % len(fds)], tokens=[5], truncate=0).SerializeToString())
                for call in range(1, preds + 1))
            sender = threading.Thread(target=life.sendall, args=(frames,), daemon=True)
            queued, replies, got = [], set(), wire.Frames()
            life.settimeout(60)
            sender.start()
            while len(replies) < preds:
                queued.append(int(sched(w)["run_queue"]))
                for kind, call, data in got.feed(life.recv(1 << 20)):
                    assert kind == wire.REPLY and call not in replies, (kind, call)
                    assert not pb.PredReply.FromString(data).HasField("error")
                    replies.add(call)
            sender.join(10)
            assert max(queued) <= IN_FLIGHT_MAX, max(queued)
            assert max(queued) > IN_FLIGHT_MAX // 2  # the sender did outpace the steps
        finally:
            life.close()
