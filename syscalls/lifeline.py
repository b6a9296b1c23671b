"""The lifeline as a transport for pred (syscalls/wire.py), for each client.

Both take a serialized PredRequest and give back the serialized PredReply, so a pred
goes through the same conversions and checks whichever way it travels. Once no reply can
come, every call raises why: EPIPE when the kernel hung up, EPROTO when its bytes were not
frames (the client then hangs up too), or the reason the session gave to `end`.

A call interrupted while it waits (Ctrl-C, a signal handler's timeout, its asyncio task
cancelled) takes its pred back: it sends CANCEL and waits for the pred's one reply, so that
when the interruption goes on the kernel has dropped the pred and its file is as before (or
has answered it first: then its entries stand). A LIP that catches the interruption can
truncate or close the file at once.

In the synchronous client a signal handler may raise anywhere: at any function call's
return in the main thread, the moment a frame has left (the kernel's wake-up often
preempts the sender right there) or the moment bytes were read. So nothing the kernel has,
or has sent, is known by a return value alone: bytes sent and read are kept by C code
(list.extend over socket.send and socket.recv), a ring record is published by one store
that the sender checks, and each step keeps its input until its output is stored, so that
an interrupted step loses nothing (at worst a reply is handed out twice, which changes
nothing). Whoever reads next hands out what an interrupted reader left.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import select
import socket
import threading
import time

from syscalls import errors, wire

Why = tuple[int, str]  # errno and message of what calls get once no reply can come
# How long an interrupted call waits for the kernel to take its pred back: a pred in the
# running step is rolled back when the step ends. Interrupting it again ends the wait.
CANCEL_WAIT = 10.0
# A sender the lifeline takes nothing from looks this often whether it may read the
# replies (the thread reading them may have stopped).
BLOCKED_SEND_WAIT = 0.05


def _gone(where: str, why: str) -> Why:
    """The kernel hung up: EPIPE naming the socket, as on gRPC."""
    return errno.EPIPE, f"{where}: kernel unreachable: {why}"


def _broken(where: str, e: wire.FrameError) -> Why:
    return errno.EPROTO, f"{where}: the lifeline is broken: {e}"


def _left(deadline: float | None) -> float | None:
    """Seconds until a time.monotonic() deadline (None: no deadline), at least 0."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())


# The main thread waits for a reply in slices of at most this many seconds. Python runs a
# signal's handler at its next look at signals: a signal that lands after the last look
# and before the wait's system call interrupts nothing, and without slices its handler (a
# timeout, Ctrl-C) would run only once the reply came, too late to take the pred back.
MAIN_WAIT_SLICE = 0.05


def wait_slice(left: float | None) -> float | None:
    """How long this thread waits before it looks at signals again: `left` (None: no end),
    cut to MAIN_WAIT_SLICE in the main thread, the only one that runs handlers."""
    if threading.current_thread() is not threading.main_thread():
        return left
    return MAIN_WAIT_SLICE if left is None else min(left, MAIN_WAIT_SLICE)


class Sending:
    """A pred's frame on its way: whether the kernel has it (went()), known whatever
    interrupts the sender. On the lifeline, `progress` counts the bytes of the data being
    sent that went, and the frame went once they reach `end`; a ring record's sender sets
    `published` (RingLine). Until a reply replaces it, it is its call's entry in _calls."""

    __slots__ = ("end", "progress", "published")

    def __init__(self) -> None:
        self.end, self.progress, self.published = 0, None, False

    def on(self, progress: list[int], end: int) -> None:
        self.end = end  # first: progress set with end 0 would say it went
        self.progress = progress

    def went(self) -> bool:
        return self.published or (self.progress is not None and sum(self.progress) >= self.end)


class Lifeline:
    """For the synchronous client: calls may come from any number of threads. One thread
    sends at a time; one waiting thread at a time reads, and hands each reply it reads to
    the thread that waits for it."""

    def __init__(self, sock: socket.socket, where: str):
        self.sock, self.where = sock, where
        self._ids = itertools.count(1)
        self._sending = threading.Lock()
        # Held as `with self._lock`, not `with self._state` (the same lock): a Condition's
        # __enter__ is Python, and a pred takes the lock three times. Reentrant, as a
        # Condition's own: a signal handler may end the session while its thread holds it.
        self._lock = threading.RLock()
        self._state = threading.Condition(self._lock)
        self._frames = wire.Frames()
        # The calls in flight, each with its reply once read (its Sending until then). A
        # reply to a call not here (its caller gave up waiting) is dropped.
        self._calls: dict[int, bytes | Sending] = {}
        self._rx: list[bytes] = []  # what the lifeline's recv returned, not cut into frames
        self._inbox: list[tuple[int, int, bytes]] = []  # frames and completions to hand out
        self._reader: int | None = None  # the thread that reads now
        self._closed: Why | None = None
        self.stopping = False  # the kernel said it is stopping cleanly (SHUTDOWN)

    def call(self, payload: bytes) -> bytes:
        if self._closed:
            raise errors.error(*self._closed)
        call = next(self._ids)
        sending = self._calls[call] = Sending()  # before sending: replies to no call drop
        try:
            self._send_pred(call, payload, sending)
            return self._wait(call, None)
        except BaseException:  # interrupted, or failed: take back what the kernel has
            self._take_back([call])
            raise

    def call_many(self, payloads: list[bytes]) -> list[bytes]:
        """Several preds sent together, their replies in their order. Interrupted while it
        waits, it takes back every pred not answered yet."""
        if self._closed:
            raise errors.error(*self._closed)
        calls = [next(self._ids) for _ in payloads]
        sendings = [Sending() for _ in calls]
        self._calls.update(zip(calls, sendings, strict=True))
        replies: list[bytes] = []
        try:
            self._send_many([wire.frame(wire.PRED, c, p) for c, p in zip(calls, payloads,
                                                                           strict=True)],
                            sendings)
            for call in calls:
                replies.append(self._wait(call, None))
        except BaseException:
            self._take_back(calls[len(replies):])
            raise
        return replies

    def _send_many(self, frames: list[bytes], sendings: list[Sending]) -> None:
        progress: list[int] = []
        end = 0
        for data, sending in zip(frames, sendings, strict=True):
            end += len(data)
            sending.on(progress, end)
        with self._sending:
            self._push(b"".join(frames), progress)

    def _send_pred(self, call: int, payload: bytes, sending: Sending) -> None:
        self._send(wire.frame(wire.PRED, call, payload), sending)

    def _send(self, data: bytes, sending: Sending | None = None) -> None:
        """One frame: a PRED, its Sending saying whether it went, or a CANCEL."""
        progress: list[int] = []
        if sending is not None:
            sending.on(progress, len(data))
        with self._sending:
            self._push(data, progress)

    def _push(self, data: bytes, progress: list[int], committed: bool = False) -> None:
        """sock.sendall(data), `progress` counting the bytes that went, whatever interrupts
        it: once some went (or `committed`: a FRAMED record promised the frame), the rest
        goes before the interruption goes on, or the lifeline would not be frames any more.
        Holds _sending."""
        view = memoryview(data)
        try:
            try:
                while sum(progress) < len(data):
                    # list.extend calls send from C: the count is kept even when an
                    # interruption lands the moment send returns.
                    try:
                        progress.extend(map(self.sock.send, (view[sum(progress):],),
                                            (socket.MSG_DONTWAIT,)))
                    except BlockingIOError:
                        self._read_while_blocked()
            except OSError:
                raise
            except BaseException:
                if committed or sum(progress):
                    self._finish(view, progress)
                raise
        except OSError as e:
            raise errors.error(*_gone(self.where, e.strerror or str(e))) from e

    def _read_while_blocked(self) -> None:
        """The lifeline takes nothing now: the kernel takes no more preds of a process
        while its replies wait unread (docs/syscalls.md), so this sender reads them, unless
        another thread does; back when the lifeline may take more, or BLOCKED_SEND_WAIT."""
        reading = self._become_reader()
        why = None
        poll = select.poll()
        poll.register(self.sock, select.POLLOUT | (select.POLLIN if reading else 0))
        try:
            if any(ev & (select.POLLIN | select.POLLHUP)
                   for _, ev in poll.poll(BLOCKED_SEND_WAIT * 1e3)) and reading:
                self._recv()
        except OSError as e:
            why = _gone(self.where, e.strerror or str(e))
        finally:
            if reading:
                with self._lock:
                    self._reader = None
                    self._hand_out(why)

    def _finish(self, view: memoryview, progress: list[int]) -> None:
        """The rest of a frame cut short by an interruption. Interrupted again, it is cut
        for good: the session hangs up (the kernel would take what follows for garbage)."""
        try:
            while sum(progress) < len(view):
                progress.extend(map(self.sock.send, (view[sum(progress):],)))
        except BaseException:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.end(errno.EPROTO, f"{self.where}: the lifeline is broken: a frame was "
                     "cut short by an interruption")
            raise

    def _wait(self, call: int, deadline: float | None) -> bytes | None:
        """The reply to `call`, read by this thread or handed over by the one reading; None
        when the deadline (time.monotonic) passes first."""
        me = threading.get_ident()
        while True:
            try:
                with self._lock:
                    while (self._reader is not None and type(self._calls[call]) is Sending
                           and not self._closed):
                        if not self._state.wait(_left(deadline)):
                            return None
                    if self._rx or self._inbox:  # left by a reader interrupted meanwhile
                        self._hand_out()
                    if type(self._calls[call]) is not Sending:
                        return self._calls.pop(call)
                    if self._closed:
                        raise errors.error(*self._closed)
                    if deadline is not None and _left(deadline) == 0:
                        return None
                    self._reader = me
                self._read(deadline)
            except BaseException:  # KeyboardInterrupt: another waiter must take over reading
                self._stop_reading()
                raise

    def stopped(self, timeout: float) -> bool:
        """Whether the kernel said it is stopping (SHUTDOWN), reading what the lifeline has
        until it ends, `timeout` seconds at most: a pred that the stopping kernel cancelled
        may be answered on the rings, and a gRPC call refused, before the SHUTDOWN on the
        lifeline is read."""
        deadline = time.monotonic() + timeout
        while not (self.stopping or self._closed):
            if self._become_reader():
                try:
                    self._read(deadline)  # once at least: past the deadline, without waiting
                except BaseException:  # as in _wait
                    self._stop_reading()
                    raise
            else:
                with self._lock:
                    if self._reader is not None:
                        self._state.wait(_left(deadline))
            if _left(deadline) == 0:
                break
        return self.stopping

    def _become_reader(self) -> bool:
        """Make this thread the reader if no thread reads now; whether it is."""
        with self._lock:
            if self._reader is None and not self._closed:
                self._reader = threading.get_ident()
                return True
            return False

    def _stop_reading(self) -> None:
        """This thread, interrupted, reads no more: another waiter takes over."""
        with self._lock:
            if self._reader == threading.get_ident():
                self._reader = None
                self._state.notify_all()

    def _take_back(self, calls: list[int]) -> None:
        """Their caller stopped waiting for `calls`: for each not answered that reached the
        kernel (while a reply can still come), send CANCEL, every one before waiting for
        any, then wait for their replies (ECANCELED, or the answer if the frames crossed),
        CANCEL_WAIT at most in all: one by one, a pred of the same step would be answered
        while the one before it is rolled back. Replies that come later are dropped."""
        try:
            with contextlib.suppress(OSError):  # the session ended: the kernel drops them
                with self._lock:
                    self._hand_out()  # their answers may have been read, not handed out
                went = [c for c in calls
                        if type(s := self._calls.get(c)) is Sending and s.went()]
                if went and not self._closed:
                    for call in went:
                        self._send(wire.frame(wire.CANCEL, call))
                    deadline = time.monotonic() + CANCEL_WAIT
                    for call in went:
                        if self._wait(call, deadline) is None:
                            break
        finally:
            for call in calls:
                self._calls.pop(call, None)

    def end(self, code: int, message: str) -> None:
        """The session ends: calls waiting and later ones raise OSError(code, message). The
        owner closes the socket."""
        with self._lock:
            self._closed = self._closed or (code, message)
            self._state.notify_all()

    def _read(self, deadline: float | None) -> None:
        """Read what has come (waiting until the deadline at most) and hand out the
        replies; then another waiter may read. The reader's (_wait made this thread it)."""
        why = None
        wait = wait_slice(_left(deadline))
        try:
            if wait is None or select.select([self.sock], [], [], wait)[0]:
                self._recv()
        except OSError as e:
            why = _gone(self.where, e.strerror or str(e))
        with self._lock:
            self._reader = None
            self._hand_out(why)

    def _recv(self) -> None:
        # list.extend calls recv from C: what it read is kept even when an interruption
        # lands the moment recv returns.
        self._rx.extend(map(self.sock.recv, (1 << 16,)))

    def _hand_out(self, why: Why | None = None) -> None:
        """Hand out the replies in what was read (the lifeline's bytes, cut into frames, and
        what a subclass put in the inbox), ending the session when the lifeline ended (end
        of file, `why`, or bytes that are not frames); wake the waiters. Holds the lock."""
        ended = not all(self._rx)  # recv returned b"": end of file
        try:
            self._frames.absorb(self._rx, self._inbox)
        except wire.FrameError as e:
            why = why or _broken(self.where, e)
            with contextlib.suppress(OSError):  # nothing more can be trusted: hang up
                self.sock.shutdown(socket.SHUT_RDWR)
        if ended or why:
            self._closed = self._closed or why or _gone(self.where, "the lifeline closed")
        n = len(self._inbox)  # a reader may append meanwhile: it is not this thread
        for kind, call, payload in self._inbox[:n]:
            if kind == wire.REPLY and call in self._calls:
                self._calls[call] = payload
            elif kind == wire.SHUTDOWN:  # the replies of calls it cancels follow
                self.stopping = True
        del self._inbox[:n]
        self._state.notify_all()


class AsyncLifeline(asyncio.Protocol):
    """For the asyncio client: calls from many tasks, their replies matched by call id.
    The socket joins the running loop at the first call."""

    def __init__(self, sock: socket.socket, where: str):
        self.sock, self.where = sock, where
        self._ids = itertools.count(1)
        self._frames = wire.Frames()
        self._waiting: dict[int, asyncio.Future] = {}
        self._transport: asyncio.Transport | None = None
        self._joining: asyncio.Task | None = None
        self._closed: Why | None = None
        self.stopping = False  # the kernel said it is stopping cleanly (SHUTDOWN)
        # The loop of the first call, which the socket joins: kept, as asking for it is a
        # system call in Python 3.11 (get_running_loop checks the pid), once a pred.
        self._loop: asyncio.AbstractEventLoop | None = None

    async def call(self, payload: bytes) -> bytes:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        if self._transport is None and not self._closed:
            if self._joining is None:  # once, however many tasks call first
                self._joining = loop.create_task(
                    loop.create_unix_connection(lambda: self, sock=self.sock))
            await asyncio.shield(self._joining)
        if self._closed:  # checked after joining too: the session may have ended meanwhile
            raise errors.error(*self._closed)
        call = next(self._ids)
        reply = self._waiting[call] = loop.create_future()
        try:
            self._write(wire.PRED, call, payload)
            return await reply
        except asyncio.CancelledError:
            # Cancelling the task cancelled `reply`, unless the answer had come (it stands).
            if reply.cancelled() and not self._closed:
                await self._take_back(call)
            raise
        finally:
            self._waiting.pop(call, None)

    async def _take_back(self, call: int) -> None:
        """As Lifeline's: CANCEL, then the pred's reply, CANCEL_WAIT at most; cancelling the
        task again ends the wait."""
        reply = self._waiting[call] = asyncio.get_running_loop().create_future()
        self._write(wire.CANCEL, call, b"")
        with contextlib.suppress(OSError):  # TimeoutError; or the session ended meanwhile
            await asyncio.wait_for(reply, CANCEL_WAIT)

    def _write(self, kind: int, call: int, payload: bytes) -> None:
        self._transport.write(wire.frame(kind, call, payload))

    def stopped(self, timeout: float) -> bool:
        """Lifeline.stopped, as far as the loop has read: a call cannot wait here for the
        loop to read more (`timeout` is not used)."""
        return self.stopping

    def end(self, code: int, message: str) -> None:
        """The session ends: close the socket, or the transport that has taken it over;
        calls waiting and later ones raise OSError(code, message)."""
        self._fail((code, message))
        if self._transport is not None:
            self._transport.close()
        else:
            self.sock.close()

    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            frames = self._frames.feed(data)
        except wire.FrameError as e:
            self._fail(_broken(self.where, e))
            self._transport.close()  # nothing more can be trusted: hang up
            return
        for kind, call, payload in frames:
            self.stopping = self.stopping or kind == wire.SHUTDOWN
            reply = self._waiting.get(call) if kind == wire.REPLY else None
            if reply is not None and not reply.done():
                reply.set_result(payload)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(_gone(self.where, str(exc) if exc else "the lifeline closed"))

    def _fail(self, why: Why) -> None:
        self._closed = self._closed or why
        for reply in self._waiting.values():
            if not reply.done():
                reply.set_exception(errors.error(*self._closed))
