"""The lifeline as a transport for pred (syscalls/wire.py), for each client.

Both take a serialized PredRequest and give back the serialized PredReply, so a pred
goes through the same conversions and checks whichever way it travels. Once no reply can
come, every call raises why: EPIPE when the kernel hung up, EPROTO when its bytes were not
frames (the client then hangs up too), or the reason the session gave to `end`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import socket
import threading

from syscalls import errors, wire

Why = tuple[int, str]  # errno and message of what calls get once no reply can come


def _gone(where: str, why: str) -> Why:
    """The kernel hung up: EPIPE naming the socket, as on gRPC."""
    return errno.EPIPE, f"{where}: kernel unreachable: {why}"


def _broken(where: str, e: wire.FrameError) -> Why:
    return errno.EPROTO, f"{where}: the lifeline is broken: {e}"


class Lifeline:
    """For the synchronous client: calls may come from any number of threads. One thread
    sends at a time; one waiting thread at a time reads, and hands each reply it reads to
    the thread that waits for it."""

    def __init__(self, sock: socket.socket, where: str):
        self.sock, self.where = sock, where
        self._ids = itertools.count(1)
        self._sending = threading.Lock()
        self._state = threading.Condition()
        self._frames = wire.Frames()
        self._replies: dict[int, bytes] = {}
        self._reading = False
        self._closed: Why | None = None

    def call(self, payload: bytes) -> bytes:
        if self._closed:
            raise errors.error(*self._closed)
        call = next(self._ids)
        data = wire.frame(wire.PRED, call, payload)
        try:
            with self._sending:
                self.sock.sendall(data)
        except OSError as e:
            raise errors.error(*_gone(self.where, e.strerror or str(e))) from e
        while True:
            with self._state:
                while self._reading and call not in self._replies and not self._closed:
                    self._state.wait()
                if call in self._replies:
                    return self._replies.pop(call)
                if self._closed:
                    raise errors.error(*self._closed)
                self._reading = True
            self._read()

    def end(self, code: int, message: str) -> None:
        """The session ends: calls waiting and later ones raise OSError(code, message). The
        owner closes the socket."""
        with self._state:
            self._closed = self._closed or (code, message)
            self._state.notify_all()

    def _read(self) -> None:
        try:
            data, why = self.sock.recv(1 << 16), _gone(self.where, "the lifeline closed")
        except OSError as e:
            data, why = b"", _gone(self.where, e.strerror or str(e))
        except BaseException:  # KeyboardInterrupt: another waiter must take over reading
            with self._state:
                self._reading = False
                self._state.notify_all()
            raise
        with self._state:
            self._reading = False
            frames = []
            if data:
                try:
                    frames = self._frames.feed(data)
                except wire.FrameError as e:
                    data, why = b"", _broken(self.where, e)
                    with contextlib.suppress(OSError):  # nothing more can be trusted: hang up
                        self.sock.shutdown(socket.SHUT_RDWR)
            if not data:
                self._closed = self._closed or why
            for kind, call, payload in frames:
                if kind == wire.REPLY:
                    self._replies[call] = payload
                # SHUTDOWN: the kernel is stopping; the replies of calls it cancels follow.
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

    async def call(self, payload: bytes) -> bytes:
        loop = asyncio.get_running_loop()
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
            self._transport.write(wire.frame(wire.PRED, call, payload))
            return await reply
        finally:
            self._waiting.pop(call, None)

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
