"""The asyncio LIP-side library: syscalls.client's API on grpc.aio, every method awaitable.

    async with await AsyncKernel.connect() as k:
        f = await k.open()
        outs = await f.pred(await k.tokenize("def f", add_special=True))

Calls from many tasks run concurrently on one session; the kernel batches their preds.
"""

from __future__ import annotations

import asyncio
import errno
import os
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import grpc
import grpc.aio

from syscalls import convert, errors, session
from syscalls import symphony_pb2 as pb
from syscalls.client import CHANNEL_OPTIONS, OpenFile, Session
from syscalls.convert import (
    Fd,
    KvPath,
    LogitControl,
    ModelInfo,
    PredOutput,
    ProcInfo,
    Sampling,
    Stat,
    Target,
    Vocabulary,
)
from syscalls.lifeline import AsyncLifeline

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


class AsyncKernel(Session):
    """A session with the kernel, as syscalls.client.Kernel, for asyncio."""

    LINE = AsyncLifeline

    @classmethod
    async def connect(
        cls,
        socket: KvPath | None = None,
        name: str | None = None,
        argv: Sequence[str] | None = None,
        lifeline_pred: bool = True,
    ) -> AsyncKernel:
        sock = session.socket_path(socket)
        try:
            # The handshake is one short blocking exchange; a thread keeps the loop free.
            lifeline, token = await asyncio.to_thread(session.hello, sock)
        except OSError as e:
            raise convert.connect_error(e, sock) from e
        channel = grpc.aio.insecure_channel(session.grpc_target(sock), options=CHANNEL_OPTIONS)
        k = cls(sock, lifeline, token, channel)
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

    async def __aenter__(self) -> AsyncKernel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _do(self, call: convert.Call[T]) -> T:
        try:
            reply = await self._send(call)
        except grpc.RpcError as e:
            raise self._failed(e) from e
        return call.result(errors.check(reply))

    # -- process ----------------------------------------------------------------------

    async def attach(self, name: str | None = None, argv: Sequence[str] | None = None) -> None:
        self._identify(await self._do(convert.attach(name, argv)))

    async def exit(self, code: int = 0) -> None:
        try:
            await self._do(convert.exit(code))
        finally:
            self._exited()
            await self.close()

    async def getpid(self) -> int:
        return await self._do(convert.getpid())

    async def ps(self) -> list[ProcInfo]:
        return await self._do(convert.ps())

    async def kill(self, pid: int) -> None:
        await self._do(convert.kill(pid))

    async def nice(self, increment: int) -> int:
        return await self._do(convert.nice(increment))

    # -- model ------------------------------------------------------------------------

    async def model_info(self) -> ModelInfo:
        return await self._do(convert.model_info())

    async def tokenize(
        self,
        text: str = "",
        messages: Iterable[Mapping[str, str]] | None = None,
        add_generation_prompt: bool = False,
        add_special: bool = False,
    ) -> list[int]:
        return await self._do(convert.tokenize(text, messages, add_generation_prompt, add_special))

    async def detokenize(self, ids: Iterable[int], keep_special: bool = False) -> str:
        return await self._do(convert.detokenize(ids, keep_special))

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
        return convert.pred_outputs(await self._line.call(request))

    async def vocab(self) -> Vocabulary:
        return await self._do(convert.vocab())

    # -- KV files ---------------------------------------------------------------------

    async def open(
        self, path: KvPath = "", flags: int = os.O_RDONLY, mode: int = 0o600
    ) -> AsyncFile:
        return AsyncFile(self, await self._do(convert.open(path, flags, mode)))

    async def fork(self, fd: Fd) -> AsyncFile:
        return AsyncFile(self, await self._do(convert.fork(fd)))

    async def link(self, fd: Fd, path: KvPath) -> None:
        await self._do(convert.link(fd, path))

    async def read(
        self, fd: Fd, start: int = 0, count: int | None = None
    ) -> tuple[list[int], list[int]]:
        return await self._do(convert.read(fd, start, count))

    async def splice(self, src: Fd, start: int, end: int, dst: Fd) -> None:
        await self._do(convert.splice(src, start, end, dst))

    async def truncate(self, fd: Fd, length: int) -> None:
        await self._do(convert.truncate(fd, length))

    async def punch(self, fd: Fd, start: int, end: int) -> None:
        await self._do(convert.punch(fd, start, end))

    async def keep(self, fd: Fd, start: int, entries: Iterable[int]) -> None:
        await self._do(convert.keep(fd, start, entries))

    async def shift(self, fd: Fd, start: int, end: int, delta: int) -> None:
        await self._do(convert.shift(fd, start, end, delta))

    async def stat(self, target: Target) -> Stat:
        return await self._do(convert.stat(target))

    async def readdir(self, path: KvPath) -> list[tuple[str, Stat]]:
        return await self._do(convert.readdir(path))

    async def mkdir(self, path: KvPath, mode: int = 0o755) -> None:
        await self._do(convert.mkdir(path, mode))

    async def rmdir(self, path: KvPath) -> None:
        await self._do(convert.rmdir(path))

    async def unlink(self, path: KvPath) -> None:
        await self._do(convert.unlink(path))

    async def rename(self, old: KvPath, new: KvPath) -> None:
        await self._do(convert.rename(old, new))

    async def access(self, path: KvPath, mode: int = os.F_OK) -> None:
        await self._do(convert.access(path, mode))

    async def chmod(self, path: KvPath, mode: int) -> None:
        await self._do(convert.chmod(path, mode))

    async def chown(self, path: KvPath, uid: int = -1, gid: int = -1) -> None:
        await self._do(convert.chown(path, uid, gid))

    async def fsync(self, fd: Fd) -> None:
        await self._do(convert.fsync(fd))

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

    # -- info -------------------------------------------------------------------------

    async def procfs(self, path: KvPath) -> str:
        return await self._do(convert.procfs(path))


class AsyncFile(OpenFile):
    """An open KV file of an AsyncKernel; `async with` closes it."""

    kernel: AsyncKernel

    async def close(self) -> None:
        if not self.closed:
            await self.kernel.close(self.fd)  # EBUSY while a pred runs: still open then
            self.closed = True

    async def __aenter__(self) -> AsyncFile:
        return self

    async def __aexit__(self, *exc: object) -> None:
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

    async def read(self, start: int = 0, count: int | None = None) -> tuple[list[int], list[int]]:
        return await self.kernel.read(self, start, count)

    async def fork(self) -> AsyncFile:
        return await self.kernel.fork(self)

    async def link(self, path: KvPath) -> None:
        await self.kernel.link(self, path)

    async def truncate(self, length: int) -> None:
        await self.kernel.truncate(self, length)

    async def punch(self, start: int, end: int) -> None:
        await self.kernel.punch(self, start, end)

    async def keep(self, start: int, entries: Iterable[int]) -> None:
        await self.kernel.keep(self, start, entries)

    async def shift(self, start: int, end: int, delta: int) -> None:
        await self.kernel.shift(self, start, end, delta)

    async def splice_from(self, src: Fd, start: int, end: int) -> None:
        await self.kernel.splice(src, start, end, self)

    async def stat(self) -> Stat:
        return await self.kernel.stat(self)

    async def fsync(self) -> None:
        await self.kernel.fsync(self)
