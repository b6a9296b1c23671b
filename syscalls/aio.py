"""The asyncio LIP-side library: syscalls.client's API on grpc.aio, every method awaitable.

    async with await AsyncKernel.connect() as k:
        f = await k.open()
        outs = await f.pred(await k.tokenize("def f", add_special=True))

Calls from many tasks run concurrently on one session; the kernel batches their preds.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio

from syscalls import convert, errors, rollbacks, session
from syscalls import symphony_pb2 as pb
from syscalls.client import CHANNEL_OPTIONS, OpenFile, Session
from syscalls.convert import Fd, KvPath, LogitControl, PredOutput, Sampling, Target
from syscalls.lifeline import AsyncLifeline
from syscalls.ring_line import AsyncRingLine
from syscalls.usys import AsyncFileCalls, AsyncKernelCalls

T = TypeVar("T")


async def _import_chunks(
    path: KvPath, mode: int, data: AsyncIterable[bytes]
) -> AsyncIterator[pb.ImportChunk]:
    chunks = convert.ImportChunks(path, mode)
    async for piece in data:
        for chunk in chunks.of(piece):
            yield chunk
    for chunk in chunks.end():
        yield chunk


class AsyncKernel(AsyncKernelCalls, Session):
    """A session with the kernel, as syscalls.client.Kernel, for asyncio."""

    LINE = AsyncLifeline
    RING_LINE = AsyncRingLine

    @classmethod
    async def connect(
        cls,
        socket: KvPath | None = None,
        name: str | None = None,
        argv: Sequence[str] | None = None,
        lifeline_pred: bool = True,
        rings: bool = True,
        hello_timeout: float = session.HELLO_TIMEOUT,
    ) -> AsyncKernel:
        """Kernel.connect's session for asyncio: the same arguments and errors."""
        sock = session.socket_path(socket)
        try:
            # The handshake is one short blocking exchange; a thread keeps the loop free.
            lifeline, token, shared = await asyncio.to_thread(
                session.open_session, sock, lifeline_pred and rings, hello_timeout)
        except OSError as e:
            raise convert.connect_error(e, sock) from e
        channel = grpc.aio.insecure_channel(session.grpc_target(sock), options=CHANNEL_OPTIONS)
        k = cls(sock, lifeline, token, channel, shared)
        if not lifeline_pred:
            k._line = None
        try:
            await k.attach(name, argv)
        except BaseException:
            await k.close()
            raise
        return k

    async def close(self, fd: Fd | None = None) -> None:
        """close(fd) is the close syscall; close() ends the session."""
        if fd is not None:
            await self._do(convert.close(fd))
            return
        self._end(errno.EBADF, "the session is closed")  # closes the lifeline if it has one
        await self._channel.close()
        if self._line is None:
            self._lifeline.close()
        self._close_rings()

    async def __aenter__(self) -> AsyncKernel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _do(self, call: convert.Call[T]) -> T:
        while True:
            try:
                reply = await self._send(call)
            except grpc.RpcError as e:
                raise self._failed(e) from e
            except asyncio.CancelledError:
                if call.rpc == "Pred":
                    self._rollbacks.cancelled([call.request.fd])
                task = asyncio.current_task()
                if self._ended and task is not None and not task.cancelling():
                    # Nobody cancelled the task: closing the session's channel ended the rpc.
                    raise errors.error(*self._ended[0]) from None
                raise
            if not self._rollbacks.again(call, reply):
                return call.result(self._checked(reply))
            await asyncio.sleep(rollbacks.RETRY_PAUSE)

    def _file(self, fd: int) -> AsyncFile:
        return AsyncFile(self, fd)

    async def attach(self, name: str | None = None, argv: Sequence[str] | None = None) -> None:
        self._identify(await self._do(convert.attach(name, argv)))

    async def exit(self, code: int = 0) -> None:
        call = convert.exit(code)
        self._leaving()
        try:
            try:
                reply = await self._send(call, ending=True)
            except grpc.RpcError as e:
                raise convert.transport_error(e, self.socket) from e
            call.result(errors.check(reply))
        finally:
            self._exited()
            await self.close()

    async def pred(
        self,
        fd: Fd,
        tokens: Iterable[int],
        positions: Iterable[int] | None = None,
        outputs: Iterable[int] | None = None,
        sampler: Sampling | None = None,
        *,
        no_outputs: bool = False,
        control: LogitControl | Sequence[LogitControl] | None = None,
        score_next: bool = False,
        parents: Sequence[int] | None = None,
        truncate: int | None = None,
        **sampling: Any,
    ) -> list[PredOutput]:
        s = convert.sampler(sampler, sampling)
        extras = convert.pred_extras(control, score_next, parents, truncate)
        if self._line is None:
            return await self._do(convert.pred(fd, tokens, positions, outputs, s, no_outputs,
                                               extras))
        request = convert.pred_request(fd, tokens, positions, outputs, s, no_outputs, extras)
        try:
            return convert.pred_outputs(await self._line.call(request))
        except asyncio.CancelledError:
            # Its CANCEL's reply may not have been waited for (cancelled again meanwhile).
            self._rollbacks.cancelled([convert.fd_number(fd)])
            raise
        except OSError:
            if self._ended or self._stopping():  # as Kernel._line_failure
                raise errors.error(*self._ended[0]) from None
            raise

    async def pred_many(self, calls: Iterable[Mapping[str, Any]], *,
                        return_exceptions: bool = False) -> list[list[PredOutput] | OSError]:
        """As Kernel.pred_many: every pred is submitted, in the order given, before any is
        awaited (through the rings, with one bell for them all)."""
        results = await asyncio.gather(*(self.pred(**c) for c in calls),
                                       return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException) and (not return_exceptions
                                                 or not isinstance(r, OSError)):
                raise r
        return results

    async def export_iter(
        self, target: Target, offset: int = 0, length: int = 0
    ) -> AsyncIterator[bytes]:
        call = convert.export(target, offset, length)
        try:
            async for chunk in self._send(call):
                yield call.result(errors.check(chunk))
        except grpc.RpcError as e:
            raise self._failed(e) from e

    async def export(self, target: Target, offset: int = 0, length: int = 0) -> bytes:
        return b"".join([chunk async for chunk in self.export_iter(target, offset, length)])

    async def import_file(
        self,
        path: KvPath,
        data: bytes | Iterable[bytes] | AsyncIterable[bytes],
        mode: int = 0o600,
    ) -> None:
        """As Kernel.import_file; `data` may also be an async iterable of chunks."""
        if isinstance(data, AsyncIterable):
            chunks = _import_chunks(path, mode, data)
        else:
            chunks = convert.import_chunks(path, mode, data)
        await self._do(convert.import_file(chunks))


class AsyncFile(AsyncFileCalls, OpenFile):
    """An open KV file of an AsyncKernel; `async with` closes it."""

    kernel: AsyncKernel

    async def close(self) -> None:
        if not self.closed:
            await self.kernel.close(self.fd)  # EBUSY while a pred runs: still open then
            self.closed = True

    async def __aenter__(self) -> AsyncFile:
        return self

    async def __aexit__(self, failed: type | None, *exc: object) -> None:
        if failed is None:
            await self.close()
            return
        with contextlib.suppress(OSError):  # the block's own error stands (File.__exit__)
            await self.close()

    async def pred(
        self,
        tokens: Iterable[int],
        positions: Iterable[int] | None = None,
        outputs: Iterable[int] | None = None,
        sampler: Sampling | None = None,
        **options: Any,
    ) -> list[PredOutput]:
        return await self.kernel.pred(self, tokens, positions, outputs, sampler, **options)
