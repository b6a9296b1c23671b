"""Syscall rings (syscalls/ring.py): the records, a kernel end that copies before it checks,
and, on a real kernel daemon, preds through both clients, preds too large for the ring
keeping their place in line, cancellation, and processes that scribble on their ring, die
in the middle of a record or read no replies, which only they notice."""

from __future__ import annotations

import asyncio
import errno
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

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
    send_while_taken,
    settled,
    wait_for,
)

from syscalls import ring, session, wire
from syscalls import symphony_pb2 as pb
from syscalls.aio import AsyncKernel
from syscalls.client import Kernel

# -- the records, both ends in this process ----------------------------------------------


@pytest.fixture()
def ends():
    kernel = ring.KernelRing()
    mem = ring.RingMemory(os.dup(kernel.memfd))
    proc = ring.ProcessRing(mem, os.dup(kernel.kernel_bell), os.dup(kernel.process_bell))
    yield kernel, proc
    proc.close()
    kernel.close()


def test_records_go_around_the_ring_end_in_order(ends):
    kernel, proc = ends
    payloads = [bytes([i % 256]) * (1000 + 37 * (i % 50)) for i in range(400)]  # 3 laps
    got = []
    for i, payload in enumerate(payloads):
        if not proc.room(len(payload)):
            got += kernel.take()
        proc.submit(ring.PRED, i, payload)
    got += kernel.take()
    assert got == [(ring.PRED, i, p) for i, p in enumerate(payloads)]
    assert kernel.take() == []


def test_completions_go_around_and_a_full_ring_says_so(ends):
    kernel, proc = ends
    payload = b"x" * 5000
    n = 0
    while kernel.post(wire.REPLY, n, payload):
        n += 1
    assert n == ring.CQ_BYTES // ring.record_bytes(len(payload))
    assert len(proc.completions()) == n
    assert kernel.post(wire.REPLY, n, payload)  # room again, past the ring's end
    assert proc.completions() == [(wire.REPLY, n, payload)]


def test_the_kernel_checks_its_copy_not_the_shared_memory(ends):
    kernel, proc = ends
    proc.submit(ring.PRED, 1, b"abcdefgh")
    records = kernel.take()
    proc.mem.sq[ring.RECORD.size:ring.RECORD.size + 8] = b"XXXXXXXX"  # written after
    assert records == [(ring.PRED, 1, b"abcdefgh")]


@pytest.mark.parametrize("damage, says", [
    ("tail past the ring", "sq_tail 262160 with sq_head 0"),
    ("tail behind the head", "sq_tail 0 with sq_head 32"),
    ("payload past the tail", "record at byte 0: 1000 payload bytes, 48 left"),
    ("header cut short", "a record header cut short at byte 0"),
    ("reserved field set", "record at byte 0: its fourth field is 7, not 0")])
def test_a_ring_that_is_not_a_ring_is_refused(ends, damage, says):
    kernel, proc = ends
    mem = proc.mem
    if damage == "tail past the ring":
        mem.set(ring.SQ_TAIL, ring.SQ_BYTES + 16)
    elif damage == "tail behind the head":
        proc.submit(ring.PRED, 1, b"x")
        kernel.take()
        mem.set(ring.SQ_TAIL, 0)
    elif damage == "payload past the tail":
        mem.sq[:ring.RECORD.size] = ring.RECORD.pack(1000, 1, ring.PRED, 0)
        mem.set(ring.SQ_TAIL, 64)
    elif damage == "header cut short":
        mem.set(ring.SQ_TAIL, 8)
    else:
        mem.sq[:ring.RECORD.size] = ring.RECORD.pack(0, 1, ring.PRED, 7)
        mem.set(ring.SQ_TAIL, ring.RECORD.size)
    with pytest.raises(ring.RingError, match=says):
        kernel.take()


def test_a_completion_head_that_is_not_possible_is_refused(ends):
    kernel, proc = ends
    proc.mem.set(ring.CQ_HEAD, 1 << 40)
    with pytest.raises(ring.RingError):
        kernel.post(wire.REPLY, 1, b"")


def test_the_memory_cannot_be_shrunk_or_grown(ends):
    kernel, _ = ends
    for size in (0, ring.HEADER_BYTES, 1 << 30):
        with pytest.raises(PermissionError):
            os.ftruncate(kernel.memfd, size)


def test_bells_ring_only_when_the_other_side_asked(ends):
    kernel, proc = ends

    def rung(fd: int) -> bool:
        try:
            return os.eventfd_read(fd) > 0
        except BlockingIOError:
            return False

    proc.submit(ring.PRED, 1, b"")
    assert rung(kernel.kernel_bell)
    kernel.mem.set(ring.KERNEL_WAKE, 0)  # a kernel that will look anyway
    proc.submit(ring.PRED, 2, b"")
    assert not rung(kernel.kernel_bell)
    kernel.post(wire.REPLY, 1, b"")
    kernel.ring_process()
    assert not rung(kernel.process_bell)
    proc.sleeping(True)
    kernel.ring_process()
    assert rung(kernel.process_bell)


def test_a_signal_handler_raising_inside_the_fence_leaves_no_lock_held(ends):
    """A handler may raise at any call's return: raised the moment the fence's lock is
    taken, the next submit still goes (a lock shared by every fence stayed held, and the
    next one waited forever)."""
    kernel, proc = ends

    class Interrupt(Exception):
        pass

    def raise_once(frame, event, arg) -> None:
        if event == "c_return" and getattr(arg, "__name__", "") == "acquire":
            sys.setprofile(None)
            raise Interrupt

    sys.setprofile(raise_once)
    with pytest.raises(Interrupt):
        proc.submit(ring.PRED, 1, b"")
    sys.setprofile(None)
    second = threading.Thread(target=proc.submit, args=(ring.PRED, 2, b""), daemon=True)
    second.start()
    second.join(10)
    assert not second.is_alive(), "the second submit waits for the first one's fence"
    assert [call for _, call, _ in kernel.take()] == [1, 2]


# -- a real kernel --------------------------------------------------------------------------


def greedy(f, first: list[int], n: int) -> list[int]:
    out = [f.pred(first)[0].token]
    for _ in range(n - 1):
        out.append(f.pred([out[-1]])[0].token)
    return out


def test_both_clients_take_rings_and_answer_as_the_lifeline_and_grpc(daemon):
    answers = {}
    for transport, kwargs in (("ring", {}), ("lifeline", {"rings": False}),
                              ("grpc", {"lifeline_pred": False})):
        with Kernel.connect(daemon.socket, **kwargs) as k:
            assert k.transport() == transport
            with k.open("", os.O_RDWR) as f:
                answers[transport] = greedy(f, prompt(20), 12)

    async def sessions() -> list[list[int]]:
        k = await AsyncKernel.connect(daemon.socket)
        assert k.transport() == "ring"

        async def one() -> list[int]:
            f = await k.open("", os.O_RDWR)
            out = [(await f.pred(prompt(20)))[0].token]
            for _ in range(11):
                out.append((await f.pred([out[-1]]))[0].token)
            return out

        try:
            return await asyncio.gather(*(one() for _ in range(16)))
        finally:
            await k.close()

    assert answers["ring"] == answers["lifeline"] == answers["grpc"]
    assert asyncio.run(sessions()) == [answers["ring"]] * 16


def test_ring_errors_are_the_syscalls_errors(daemon):
    with Kernel.connect(daemon.socket) as k, k.open("", os.O_RDWR) as f:
        with pytest.raises(OSError) as e:
            k.pred(99, [1])
        assert e.value.errno == errno.EBADF
        with pytest.raises(OSError) as e:
            f.pred([1 << 20])
        assert e.value.errno == errno.EINVAL and "1048576" in str(e.value)
        assert len(f.pred(prompt(4))) == 1  # the session goes on


def test_preds_too_large_for_the_ring_keep_their_place_in_line(daemon, monkeypatch):
    """With the ring taking only small records, every other pred goes as a frame behind a
    FRAMED record; a file's preds must still be appended in the order they were made."""
    monkeypatch.setattr(ring, "MAX_RECORD", 16)
    tokens = prompt(64, salt=3)

    async def main() -> list[int]:
        k = await AsyncKernel.connect(daemon.socket)
        try:
            f = await k.open("", os.O_RDWR)
            # sizes alternate around the limit: 1 token fits, 9 tokens do not
            pieces, at = [], 0
            while at < len(tokens):
                n = 1 if len(pieces) % 2 == 0 else 9
                pieces.append(tokens[at:at + n])
                at += n
            await asyncio.gather(*(f.pred(p, no_outputs=True) for p in pieces))
            return (await f.read())[0]
        finally:
            await k.close()

    assert list(asyncio.run(main())) == tokens


def test_a_cancelled_ring_pred_leaves_its_file_as_it_was(daemon):
    async def main() -> None:
        k = await AsyncKernel.connect(daemon.socket)
        try:
            f = await k.open("", os.O_RDWR)
            await f.pred(prompt(8), no_outputs=True)
            task = asyncio.ensure_future(f.pred(prompt(900, salt=1)))
            await asyncio.sleep(0)  # submitted
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert (await f.stat()).tokens in (8, 908)  # taken back, or answered first
            await f.truncate(8)
            assert len(await f.pred(prompt(2))) == 1
        finally:
            await k.close()

    asyncio.run(main())


def rung_session(sock) -> tuple[socket.socket, str, ring.ProcessRing]:
    lifeline, token, rings = session.open_session(sock, True)
    assert rings is not None
    return lifeline, token, rings


def pred_payload(fd: int, tokens: list[int]) -> bytes:
    return pb.PredRequest(fd=fd, tokens=tokens).SerializeToString()


def test_a_process_that_scribbles_on_its_ring_is_dropped_and_nobody_else_notices(daemon):
    with Kernel.connect(daemon.socket, name="bystander") as k, k.open("", os.O_RDWR) as f:
        before = greedy(f, prompt(10), 4)
        free = meminfo(k)["device_free"]
        lifeline, _, rings = rung_session(daemon.socket)
        try:
            rings.mem.set(ring.SQ_TAIL, 1 << 50)  # garbage, then the bell
            os.eventfd_write(rings.kernel_bell, 1)
            lifeline.settimeout(30)
            assert lifeline.recv(1 << 16) == b""  # the kernel hung up on it
        finally:
            lifeline.close()
            rings.close()
        wait_for(lambda: meminfo(k)["device_free"] == free, what="its pages freed")
        f.truncate(0)
        assert greedy(f, prompt(10), 4) == before


def test_a_record_of_an_unknown_kind_gets_einval_and_the_ring_goes_on(daemon):
    lifeline, _, rings = rung_session(daemon.socket)
    try:
        rings.sleeping(True)  # before submitting: the answers may come at once
        rings.submit(9, 1, b"")
        rings.submit(ring.PRED, 2, b"\xff\xff\xff")  # not a PredRequest
        rings.submit(ring.PRED, 3, pred_payload(5, [1]))  # fd 5: not open
        got = {}
        while True:
            for _, call, payload in rings.completions():
                got[call] = pb.PredReply.FromString(payload).error.errno
            if len(got) == 3:
                break
            assert select.select([rings.process_bell], [], [], 30)[0], "no completion"
            os.eventfd_read(rings.process_bell)
    finally:
        lifeline.close()
        rings.close()
    assert got == {1: errno.EINVAL, 2: errno.EINVAL, 3: errno.EBADF}


def einval_completion(rings: ring.ProcessRing) -> int:
    """The errno of the one completion this ring waits for (a record of no known kind)."""
    while not rings.ready():
        assert select.select([rings.process_bell], [], [], 30)[0], "no completion"
        os.eventfd_read(rings.process_bell)
    (_, _, payload), = rings.completions()
    return pb.PredReply.FromString(payload).error.errno


def test_one_bell_drains_every_ring_of_its_process(daemon):
    """symphony/kernel_bell.py: the rings of one process share the kernel's bell, and it
    drains them all. A record left in one session's ring without ringing is taken when
    another session of the process rings."""
    (a_line, _, a), (b_line, _, b) = rung_session(daemon.socket), rung_session(daemon.socket)
    try:
        for rings in (a, b):
            rings.sleeping(True)
        b.submit(9, 1, b"", bell=False)
        a.submit(9, 1, b"")
        assert einval_completion(b) == errno.EINVAL  # taken on a's bell
        assert einval_completion(a) == errno.EINVAL
        a_line.close()  # one session ends: the bell stays for the other
        a.close()
        b.submit(9, 2, b"")
        assert einval_completion(b) == errno.EINVAL
    finally:
        b_line.close()
        b.close()


OTHER_PROCESS = """
import os, select, sys
from pathlib import Path
from syscalls import session
lifeline, _, rings = session.open_session(Path(sys.argv[1]), True)
rings.sleeping(True)
rings.submit(9, 1, b"", bell=False)
print("submitted", flush=True)
sys.stdin.readline()  # the test's own process rang its bell meanwhile
taken_before = bool(select.select([rings.process_bell], [], [], 0.5)[0]) or rings.ready()
rings.submit(9, 2, b"")  # its own bell: both records are taken now
got = set()
while len(got) < 2 and select.select([rings.process_bell], [], [], 30)[0]:
    os.eventfd_read(rings.process_bell)
    got |= {call for _, call, _ in rings.completions()}
print(taken_before, sorted(got), flush=True)
"""


def test_a_bell_drains_no_other_process_s_ring(daemon):
    child = subprocess.Popen([sys.executable, "-c", OTHER_PROCESS, str(daemon.socket)],
                             env=daemon.env(), cwd=ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    lifeline, _, rings = rung_session(daemon.socket)
    try:
        assert child.stdout.readline() == "submitted\n"
        rings.sleeping(True)
        rings.submit(9, 1, b"")
        assert einval_completion(rings) == errno.EINVAL  # our bell was drained
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "False [1, 2]\n"
    finally:
        lifeline.close()
        rings.close()
        child.kill()
        child.wait()


def test_preds_in_flight_when_the_process_exits_get_no_reply(daemon):
    """docs/syscalls.md: at exit, the lifeline and the rings close instead of answering the
    preds in flight there (EINTR is gRPC's): no reply comes that is not a pred's answer.
    The exit comes once the first answer is in, with some 20 steps' preds still to go."""
    lifeline, token, rings = rung_session(daemon.socket)
    calls = 0
    try:
        for fd in [raw_open(daemon.socket, token) for _ in range(8)]:
            for _ in range(3):  # in line on the file, each its whole prompt again
                calls += 1
                payload = pb.PredRequest(fd=fd, tokens=prompt(900, calls), truncate=0,
                                         no_outputs=True).SerializeToString()
                if calls % 2:
                    rings.submit(ring.PRED, calls, payload)
                else:
                    lifeline.sendall(wire.frame(wire.PRED, calls, payload))
        deadline, replies = time.monotonic() + 60, []
        while not replies and time.monotonic() < deadline:
            replies = [payload for _, _, payload in rings.completions()]
            time.sleep(0.001)
        assert replies, "no pred answered"
        with grpc.insecure_channel(session.grpc_target(daemon.socket)) as channel:
            channel.unary_unary("/symphony.Kernel/Exit",
                                request_serializer=pb.ExitRequest.SerializeToString,
                                response_deserializer=pb.Empty.FromString,
                                )(pb.ExitRequest(code=0), metadata=[(session.SESSION_KEY, token)])
        lifeline.settimeout(30)
        frames = wire.Frames()
        while data := lifeline.recv(1 << 16):
            replies += [payload for kind, _, payload in frames.feed(data) if kind == wire.REPLY]
        replies += [payload for _, _, payload in rings.completions()]
    finally:
        lifeline.close()
        rings.close()
    errors = [pb.PredReply.FromString(p).error.message for p in replies]
    assert [e for e in errors if e] == []
    assert len(replies) < calls  # the exit came while preds were in flight


def test_any_frame_takes_the_rings_records_first(daemon):
    """A record written without ringing the bell is taken when a frame of the process comes,
    whatever its kind: a CANCEL frame may name a pred still in the ring."""
    lifeline, _, rings = rung_session(daemon.socket)
    try:
        rings.sleeping(True)
        rings.submit(ring.PRED, 2, pred_payload(5, [1]), bell=False)  # fd 5: not open
        lifeline.sendall(wire.frame(9, 7))  # a kind that is no call: EINVAL
        got = {}
        deadline = time.monotonic() + 10
        while 2 not in got and time.monotonic() < deadline:
            for _, call, payload in rings.completions():
                got[call] = pb.PredReply.FromString(payload).error.errno
            if select.select([rings.process_bell], [], [], 0.1)[0]:
                os.eventfd_read(rings.process_bell)
    finally:
        lifeline.close()
        rings.close()
    assert got.get(2) == errno.EBADF, got


# 320 preds of 1000 tokens: about 640 KiB of records, more than twice the submission ring.
OVERFULL = [{"fd": 999, "tokens": [5] * 1000} for _ in range(320)]


def test_a_batch_larger_than_the_ring_waits_for_room_and_the_session_lives_on(daemon):
    """Each pred that finds no room goes as a frame behind a FRAMED record, and with no room
    even for that it waits: one FRAMED record per pred overran the ring (an OpenAI batch of
    2048 prompts x n=128 had the kernel drop the serving process)."""
    with Kernel.connect(daemon.socket) as k, k.open() as f:
        results = k.pred_many(OVERFULL, return_exceptions=True)
        assert {r.errno for r in results} == {errno.EBADF}, results[:3]
        assert len(f.pred(prompt(4))) == 1

    async def main() -> None:
        async with await AsyncKernel.connect(daemon.socket) as k:
            f = await k.open()
            results = await k.pred_many(OVERFULL, return_exceptions=True)
            assert {r.errno for r in results} == {errno.EBADF}, results[:3]
            assert len(await f.pred(prompt(4))) == 1

    asyncio.run(main())


def test_a_framed_record_whose_frame_never_comes_stalls_only_its_own_ring(daemon):
    with Kernel.connect(daemon.socket, name="bystander") as k, k.open("", os.O_RDWR) as f:
        lifeline, _, rings = rung_session(daemon.socket)
        try:
            rings.submit(ring.FRAMED, 1)
            rings.submit(ring.PRED, 2, pred_payload(0, [1]))
            assert len(greedy(f, prompt(6), 3)) == 3
        finally:
            lifeline.close()
            rings.close()


def test_records_behind_a_framed_record_whose_frame_never_comes_stay_in_the_ring(daemon):
    """While records the kernel copied out wait behind a FRAMED record, it copies out no
    more: the rest stay in the shared memory, and the process finds its ring full. (Copied
    out behind it, whatever a process kept writing grew the kernel's memory without bound,
    and the frame, when it came, held the loop for seconds.) The frame that comes lets the
    ring go on, to the last record waiting in it."""
    with Kernel.connect(daemon.socket, name="bystander") as k, k.open("", os.O_RDWR) as f:
        lifeline, token, rings = rung_session(daemon.socket)
        try:
            fd = raw_open(daemon.socket, token)
            rings.submit(ring.FRAMED, 1)
            wait_for(lambda: rings.mem.get(ring.SQ_HEAD) == rings.sq_tail,
                     what="the FRAMED record taken")
            head, calls = rings.sq_tail, range(2, ring.SQ_BYTES // ring.RECORD.size + 64)
            for call in calls:
                if not rings.room(0):
                    break
                rings.submit(ring.CANCEL, call)  # each rings the kernel's bell
            assert not rings.room(0), "the kernel copied out records behind the FRAMED one"
            assert settled(lambda: rings.mem.get(ring.SQ_HEAD), quiet=0.5) == head
            assert len(greedy(f, prompt(6), 3)) == 3  # nobody else notices
            # The frame comes: the pred is answered, and the CANCELs (of nothing) after it
            # are taken, to the last, with no reply.
            lifeline.sendall(wire.frame(wire.PRED, 1, pred_payload(fd, [5])))
            wait_for(lambda: rings.mem.get(ring.SQ_HEAD) == rings.sq_tail,
                     what="the records behind it taken")
            got: list = []
            wait_for(lambda: got.extend(rings.completions()) or got, what="the pred's reply")
            assert [(kind, call) for kind, call, _ in got] == [(wire.REPLY, 1)]
            assert not pb.PredReply.FromString(got[0][2]).HasField("error")
        finally:
            lifeline.close()
            rings.close()


DIES_MID_RECORD = """
import os, sys
from syscalls import ring, session, symphony_pb2 as pb
from syscalls.client import Kernel
k = Kernel.connect(sys.argv[1])
f = k.open("", os.O_RDWR)
f.pred(list(range(6, 70)), no_outputs=True)  # pages held
rings = k._rings
# half a record: its header, and a tail that says so, then death
rings.mem.sq[:ring.RECORD.size] = ring.RECORD.pack(500, 99, ring.PRED, 0)
rings.mem.set(ring.SQ_TAIL, rings.sq_tail + ring.RECORD.size)
os.eventfd_write(rings.kernel_bell, 1)
print(k.pid, flush=True)
sys.stdin.read()
"""


def test_a_process_killed_mid_record_is_reaped_and_its_pages_freed(daemon):
    with Kernel.connect(daemon.socket) as k:
        free = meminfo(k)["device_free"]
        lip = subprocess.Popen([sys.executable, "-c", DIES_MID_RECORD, str(daemon.socket)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               env=daemon.env())
        try:
            pid = int(lip.stdout.readline())
            lip.send_signal(signal.SIGKILL)
            lip.wait(30)
        finally:
            lip.kill()
        wait_for(lambda: pid not in {p.pid for p in k.ps()}, what="the process reaped")
        wait_for(lambda: meminfo(k)["device_free"] == free, what="its pages freed")


def test_threads_share_one_ring(daemon):
    with Kernel.connect(daemon.socket) as k:
        results: dict[int, list[int]] = {}

        def run(i: int) -> None:
            with k.open("", os.O_RDWR) as f:
                results[i] = greedy(f, prompt(12), 8)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 6 and all(r == results[0] for r in results.values())


RING_CHILD = """
import json, os, traceback
from syscalls.client import Kernel
with Kernel.connect() as k, k.open("", os.O_RDWR) as f:
    child = os.fork()
    if child == 0:
        try:
            f.pred([1])
            code = 0
        except PermissionError:
            code = 7
        except BaseException:
            traceback.print_exc()
            code = 1
        os._exit(code)
    status = os.waitpid(child, 0)[1]
    print(json.dumps({"child": os.waitstatus_to_exitcode(status), "outputs": len(f.pred([1]))}))
"""


def test_a_forked_child_may_not_use_its_parents_ring(daemon):
    """The fork happens in a process of its own: a fork here would run gRPC's at-fork
    handler in the suite's process (once hung the suite). The child exits 7 for the
    PermissionError its pred gets."""
    report = json.loads(run_script(daemon, RING_CHILD))
    assert report["child"] == 7
    assert report["outputs"] == 1


def _eventfds_counting(count: int) -> int:
    """How many of this process's descriptors are eventfds holding `count`."""
    n = 0
    for fd in os.listdir("/proc/self/fdinfo"):
        try:
            with open(f"/proc/self/fdinfo/{fd}") as f:
                info = f.read()
        except OSError:  # gone meanwhile (another thread's), or the listing's own
            continue
        field = info.partition("eventfd-count:")[2].split()
        n += bool(field) and int(field[0], 16) == count
    return n


@pytest.mark.parametrize("sent, raises", [
    (wire.HEADER.size + 2, TimeoutError),  # the frame breaks off: the wait times out
    (wire.HEADER.size + ring.GEOMETRY.size, OSError),  # whole, but its memory maps not
])
def test_a_ring_setup_that_fails_keeps_none_of_the_descriptors_it_got(sent, raises):
    """A kernel's RING frame cut short, or whole with descriptors that are no ring memory:
    ring_setup fails, closing the descriptors that came with the frame's first bytes."""
    ours, theirs = socket.socketpair()
    count = 0x5EC0DE  # marks the eventfds sent for descriptors, and their copies
    fds = [os.eventfd(count) for _ in range(3)]
    try:
        data = wire.frame(wire.RING, 0, ring.GEOMETRY.pack(ring.SQ_BYTES, ring.CQ_BYTES))
        socket.send_fds(theirs, [data[:sent]], fds)
        ours.settimeout(0.2)
        with pytest.raises(raises):
            session.ring_setup(ours)
        assert _eventfds_counting(count) == 3  # the ones sent, no copy
    finally:
        for fd in fds:
            os.close(fd)
        ours.close()
        theirs.close()


def test_submit_many_publishes_together_and_rings_once(ends):
    kernel, proc = ends
    records = [(ring.PRED, i, bytes([i]) * i) for i in range(1, 6)]
    proc.submit_many(records)
    assert os.eventfd_read(kernel.kernel_bell) == 1  # one bell for five records
    assert kernel.take() == records


def test_a_step_larger_than_the_engine_socket_s_buffer_goes_whole(daemon):
    """200 seeded preds in one step: each carries its generator's state (about 5 KB), 1 MB
    in all, several times the socket's buffer to the engine process. It went out with a
    sendall on a non-blocking socket, which failed part way, and the kernel took that for
    the engine's death and shut down. Each pred equals the same pred made alone."""
    with Kernel.connect(daemon.socket) as k:
        files = [k.open("", os.O_RDWR) for _ in range(201)]
        try:
            calls = [{"fd": f, "tokens": prompt(4, salt=7), "seed": s, "temperature": 1.0}
                     for s, f in enumerate(files[:200])]
            many = k.pred_many(calls)
            for s in (0, 123, 199):
                files[200].truncate(0)
                assert files[200].pred(prompt(4, salt=7), seed=s, temperature=1.0) == many[s]
        finally:
            for f in files:
                f.close()


@pytest.mark.parametrize("transport", ["ring", "lifeline", "grpc"])
def test_pred_many_answers_in_order_like_single_preds(daemon, transport):
    kwargs = {"ring": {}, "lifeline": {"rings": False}, "grpc": {"lifeline_pred": False}}
    with Kernel.connect(daemon.socket, **kwargs[transport]) as k:
        files = [k.open("", os.O_RDWR) for _ in range(6)]
        one = k.open("", os.O_RDWR)
        try:
            alone = []
            for i, f in enumerate(files):
                alone.append(f.pred(prompt(8, salt=i), top_logprobs=2))
                f.truncate(0)
            many = k.pred_many([{"fd": f, "tokens": prompt(8, salt=i), "top_logprobs": 2}
                                for i, f in enumerate(files)])
            assert many == alone
            # one file, several preds: appended in the order given
            pieces = [prompt(5, salt=s) for s in range(4)]
            k.pred_many([{"fd": one, "tokens": p, "no_outputs": True} for p in pieces])
            assert list(one.read()[0]) == [t for p in pieces for t in p]
            # an error takes its place, or is raised once all are answered
            calls = [{"fd": files[0], "tokens": [1]}, {"fd": 99, "tokens": [1]},
                     {"fd": files[1], "tokens": [2]}]
            got = k.pred_many(calls, return_exceptions=True)
            assert isinstance(got[1], OSError) and got[1].errno == errno.EBADF
            assert len(got[0]) == len(got[2]) == 1
            with pytest.raises(OSError) as e:
                k.pred_many(calls)
            assert e.value.errno == errno.EBADF
            assert files[0].stat().tokens == files[1].stat().tokens == 10  # both ran twice
            with pytest.raises(TypeError):
                k.pred_many([{"tokens": [1]}])
        finally:
            for f in (*files, one):
                f.close()


def test_async_pred_many(daemon):
    async def main() -> None:
        k = await AsyncKernel.connect(daemon.socket)
        try:
            files = [await k.open("", os.O_RDWR) for _ in range(4)]
            got = await k.pred_many([{"fd": f, "tokens": prompt(6)} for f in files]
                                    + [{"fd": 99, "tokens": [1]}], return_exceptions=True)
            assert isinstance(got[-1], OSError) and got[-1].errno == errno.EBADF
            assert all(g == got[0] for g in got[:4])
        finally:
            await k.close()

    asyncio.run(main())


def test_a_process_that_reads_no_replies_has_its_ring_drained_no_more(daemon):
    """Its replies, too large for the completion ring, back up on its lifeline: then the
    kernel takes no more of its ring's records (tests/test_lifeline.py has the same on the
    lifeline), and the process finds its submission ring full. Once it reads, the kernel
    drains the ring again, and every pred gets its one answer."""
    with daemon.connect("bystander") as k, k.open("", os.O_RDWR) as f:
        assert len(f.pred(**HOG)) == HOG_TOKENS  # the kernel's path for such a reply warm
        f.truncate(0)
        pids = {p.pid for p in k.ps()}
        lifeline, token, rings = rung_session(daemon.socket)
        try:
            (hog,) = {p.pid for p in k.ps()} - pids
            payload = hog_payload(raw_open(daemon.socket, token))
            calls = range(1, 101)  # each record about 1.3 KB: all fit the ring at once

            def submit(call: int) -> None:
                assert rings.room(len(payload))
                rings.submit(ring.PRED, call, payload)

            send_while_taken(k, hog, calls, submit)
            taken = settled(lambda: preds_answered(k, hog), quiet=1.0)
            assert len(greedy(f, prompt(6), 3)) == 3  # the bystander is answered meanwhile
            assert taken < len(calls) // 3, taken
            frames, replies = wire.Frames(), {}
            lifeline.settimeout(60)
            while len(replies) < len(calls):
                got = rings.completions()
                if not got:
                    got = frames.feed(lifeline.recv(1 << 20))
                for kind, call, data in got:
                    assert kind == wire.REPLY and call not in replies, (kind, call)
                    replies[call] = pb.PredReply.FromString(data)
            assert sorted(replies) == list(calls)
            assert {len(r.outputs) for r in replies.values()} == {HOG_TOKENS}
        finally:
            lifeline.close()
            rings.close()
