"""The lifeline as a transport for pred (syscalls/wire.py), for each client.

Both take a serialized PredRequest and give back the serialized PredReply, so a pred
goes through the same conversions and checks whichever way it travels.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import socket
import threading

from syscalls import errors, wire


def _gone(where: str, why: str) -> OSError:
    """What a call gets when no reply can come: EPIPE naming the socket, as on gRPC."""
    return errors.error(errno.EPIPE, f"{where}: kernel unreachable: {why}")


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
        self._closed: str | None = None  # why no more replies will come

    def call(self, payload: bytes) -> bytes:
        call = next(self._ids)
        try:
            with self._sending:
                self.sock.sendall(wire.frame(wire.PRED, call, payload))
        except OSError as e:
            raise _gone(self.where, e.strerror or str(e)) from e
        while True:
            with self._state:
                while self._reading and call not in self._replies and not self._closed:
                    self._state.wait()
                if call in self._replies:
                    return self._replies.pop(call)
                if self._closed:
                    raise _gone(self.where, self._closed)
                self._reading = True
            self._read()

    def _read(self) -> None:
        try:
            data, why = self.sock.recv(1 << 16), "the lifeline closed"
        except OSError as e:
            data, why = b"", e.strerror or str(e)
        except BaseException:  # KeyboardInterrupt: another waiter must take over reading
            with self._state:
                self._reading = False
                self._state.notify_all()
            raise
        with self._state:
            self._reading = False
            try:
                frames = self._frames.feed(data) if data else []
            except wire.FrameError as e:
                data, why = b"", str(e)
            if not data:
                self._closed = why
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
        self._closed: str | None = None

    async def call(self, payload: bytes) -> bytes:
        if self._closed:
            raise _gone(self.where, self._closed)
        loop = asyncio.get_running_loop()
        if self._transport is None:
            if self._joining is None:  # once, however many tasks call first
                self._joining = loop.create_task(
                    loop.create_unix_connection(lambda: self, sock=self.sock))
            await asyncio.shield(self._joining)
        call = next(self._ids)
        reply = self._waiting[call] = loop.create_future()
        try:
            self._transport.write(wire.frame(wire.PRED, call, payload))
            return await reply
        finally:
            self._waiting.pop(call, None)

    def close(self) -> None:
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
            self._transport.close()
            self._fail(str(e))
            return
        for kind, call, payload in frames:
            reply = self._waiting.get(call) if kind == wire.REPLY else None
            if reply is not None and not reply.done():
                reply.set_result(payload)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(str(exc) if exc else "the lifeline closed")

    def _fail(self, why: str) -> None:
        self._closed = self._closed or why
        for reply in self._waiting.values():
            if not reply.done():
                reply.set_exception(_gone(self.where, why))
