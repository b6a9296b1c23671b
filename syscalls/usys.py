"""Made by `make stubs` (python -m syscalls.stubs) from its table of plain syscalls and
their builders in syscalls/convert.py: do not edit. Kernel, File, AsyncKernel and
AsyncFile take their plain syscalls' methods from these mixins."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from syscalls import convert
from syscalls.convert import Fd, KvPath, ModelInfo, ProcInfo, Stat, Target, Vocabulary

if TYPE_CHECKING:
    from syscalls.aio import AsyncFile
    from syscalls.client import File


class KernelCalls:
    """Kernel's plain syscalls (syscalls/stubs.py): each runs its builder's Call with `self._do`,
    and `self._file` makes an fd an open file."""

    def getpid(self) -> int:
        return self._do(convert.getpid())

    def ps(self) -> list[ProcInfo]:
        return self._do(convert.ps())

    def kill(self, pid: int) -> None:
        self._do(convert.kill(pid))

    def nice(self, increment: int) -> int:
        """Add to this process's nice value (lowering it needs root); the new value."""
        return self._do(convert.nice(increment))

    def model_info(self) -> ModelInfo:
        return self._do(convert.model_info())

    def tokenize(
        self,
        text: str = "",
        messages: Iterable[Mapping[str, str]] | None = None,
        add_generation_prompt: bool = False,
        add_special: bool = False,
    ) -> list[int]:
        """Token ids of `text`, or of `messages` (each a mapping with str "role" and "content"; its
        other keys are not sent) rendered by the chat template. add_special: BOS as the tokenizer
        itself would add it."""
        return self._do(convert.tokenize(text, messages, add_generation_prompt, add_special))

    def detokenize(self, ids: Iterable[int], keep_special: bool = False) -> str:
        return self._do(convert.detokenize(ids, keep_special))

    def vocab(self) -> Vocabulary:
        """Every token's bytes and which ids are special: what a grammar engine or a prefix trie is
        built from. It never changes while the kernel runs: call it once."""
        return self._do(convert.vocab())

    def open(self, path: KvPath = "", flags: int = os.O_RDONLY, mode: int = 0o600) -> File:
        """Open a KV file; path "" makes an anonymous one (always read-write)."""
        return self._file(self._do(convert.open(path, flags, mode)))

    def fork(self, fd: Fd) -> File:
        """A copy-on-write clone of the file, anonymous."""
        return self._file(self._do(convert.fork(fd)))

    def link(self, fd: Fd, path: KvPath) -> None:
        self._do(convert.link(fd, path))

    def read(self, fd: Fd, start: int = 0, count: int | None = None) -> tuple[list[int], list[int]]:
        """(token ids, positions) of entries [start, start + count), clipped to the end."""
        return self._do(convert.read(fd, start, count))

    def splice(self, src: Fd, start: int, end: int, dst: Fd) -> None:
        """Append entries [start, end) of src to dst, sharing pages, computing nothing."""
        self._do(convert.splice(src, start, end, dst))

    def truncate(self, fd: Fd, length: int) -> None:
        self._do(convert.truncate(fd, length))

    def punch(self, fd: Fd, start: int, end: int) -> None:
        """Drop entries [start, end) from attention, freeing their whole pages."""
        self._do(convert.punch(fd, start, end))

    def keep(self, fd: Fd, start: int, entries: Iterable[int]) -> None:
        """The file keeps entries [0, start) and then `entries` (increasing indices past start),
        their K/V moved, not recomputed: a tree pred's accepted branch."""
        self._do(convert.keep(fd, start, entries))

    def shift(self, fd: Fd, start: int, end: int, delta: int) -> None:
        """Move entries [start, end) by `delta` positions, their keys rotated to match."""
        self._do(convert.shift(fd, start, end, delta))

    def stat(self, target: Target) -> Stat:
        """Stat a path, or an open file (int or File)."""
        return self._do(convert.stat(target))

    def readdir(self, path: KvPath) -> list[tuple[str, Stat]]:
        return self._do(convert.readdir(path))

    def mkdir(self, path: KvPath, mode: int = 0o755) -> None:
        self._do(convert.mkdir(path, mode))

    def rmdir(self, path: KvPath) -> None:
        self._do(convert.rmdir(path))

    def unlink(self, path: KvPath) -> None:
        self._do(convert.unlink(path))

    def rename(self, old: KvPath, new: KvPath) -> None:
        self._do(convert.rename(old, new))

    def chmod(self, path: KvPath, mode: int) -> None:
        self._do(convert.chmod(path, mode))

    def access(self, path: KvPath, mode: int = os.F_OK) -> None:
        """Raise unless path exists and may be read/written/searched (os.R_OK|W_OK|X_OK)."""
        self._do(convert.access(path, mode))

    def chown(self, path: KvPath, uid: int = -1, gid: int = -1) -> None:
        self._do(convert.chown(path, uid, gid))

    def fsync(self, fd: Fd) -> None:
        self._do(convert.fsync(fd))

    def procfs(self, path: KvPath) -> str:
        """The text of a /proc entry: "meminfo", "sched", "PID/status"."""
        return self._do(convert.procfs(path))


class FileCalls:
    """File's plain syscalls: Kernel's on this file (`self.kernel`)."""

    def fork(self) -> File:
        """Kernel.fork on this file."""
        return self.kernel.fork(self)

    def link(self, path: KvPath) -> None:
        """Kernel.link on this file."""
        self.kernel.link(self, path)

    def read(self, start: int = 0, count: int | None = None) -> tuple[list[int], list[int]]:
        """Kernel.read on this file."""
        return self.kernel.read(self, start, count)

    def splice_from(self, src: Fd, start: int, end: int) -> None:
        """Kernel.splice with this file as `dst`."""
        self.kernel.splice(src, start, end, self)

    def truncate(self, length: int) -> None:
        """Kernel.truncate on this file."""
        self.kernel.truncate(self, length)

    def punch(self, start: int, end: int) -> None:
        """Kernel.punch on this file."""
        self.kernel.punch(self, start, end)

    def keep(self, start: int, entries: Iterable[int]) -> None:
        """Kernel.keep on this file."""
        self.kernel.keep(self, start, entries)

    def shift(self, start: int, end: int, delta: int) -> None:
        """Kernel.shift on this file."""
        self.kernel.shift(self, start, end, delta)

    def stat(self) -> Stat:
        """Kernel.stat on this file."""
        return self.kernel.stat(self)

    def fsync(self) -> None:
        """Kernel.fsync on this file."""
        self.kernel.fsync(self)


class AsyncKernelCalls:
    """AsyncKernel's plain syscalls (syscalls/stubs.py): each runs its builder's Call with
    `self._do`, and `self._file` makes an fd an open file."""

    async def getpid(self) -> int:
        return await self._do(convert.getpid())

    async def ps(self) -> list[ProcInfo]:
        return await self._do(convert.ps())

    async def kill(self, pid: int) -> None:
        await self._do(convert.kill(pid))

    async def nice(self, increment: int) -> int:
        """Add to this process's nice value (lowering it needs root); the new value."""
        return await self._do(convert.nice(increment))

    async def model_info(self) -> ModelInfo:
        return await self._do(convert.model_info())

    async def tokenize(
        self,
        text: str = "",
        messages: Iterable[Mapping[str, str]] | None = None,
        add_generation_prompt: bool = False,
        add_special: bool = False,
    ) -> list[int]:
        """Token ids of `text`, or of `messages` (each a mapping with str "role" and "content"; its
        other keys are not sent) rendered by the chat template. add_special: BOS as the tokenizer
        itself would add it."""
        return await self._do(convert.tokenize(text, messages, add_generation_prompt, add_special))

    async def detokenize(self, ids: Iterable[int], keep_special: bool = False) -> str:
        return await self._do(convert.detokenize(ids, keep_special))

    async def vocab(self) -> Vocabulary:
        """Every token's bytes and which ids are special: what a grammar engine or a prefix trie is
        built from. It never changes while the kernel runs: call it once."""
        return await self._do(convert.vocab())

    async def open(
        self,
        path: KvPath = "",
        flags: int = os.O_RDONLY,
        mode: int = 0o600,
    ) -> AsyncFile:
        """Open a KV file; path "" makes an anonymous one (always read-write)."""
        return self._file(await self._do(convert.open(path, flags, mode)))

    async def fork(self, fd: Fd) -> AsyncFile:
        """A copy-on-write clone of the file, anonymous."""
        return self._file(await self._do(convert.fork(fd)))

    async def link(self, fd: Fd, path: KvPath) -> None:
        await self._do(convert.link(fd, path))

    async def read(
        self,
        fd: Fd,
        start: int = 0,
        count: int | None = None,
    ) -> tuple[list[int], list[int]]:
        """(token ids, positions) of entries [start, start + count), clipped to the end."""
        return await self._do(convert.read(fd, start, count))

    async def splice(self, src: Fd, start: int, end: int, dst: Fd) -> None:
        """Append entries [start, end) of src to dst, sharing pages, computing nothing."""
        await self._do(convert.splice(src, start, end, dst))

    async def truncate(self, fd: Fd, length: int) -> None:
        await self._do(convert.truncate(fd, length))

    async def punch(self, fd: Fd, start: int, end: int) -> None:
        """Drop entries [start, end) from attention, freeing their whole pages."""
        await self._do(convert.punch(fd, start, end))

    async def keep(self, fd: Fd, start: int, entries: Iterable[int]) -> None:
        """The file keeps entries [0, start) and then `entries` (increasing indices past start),
        their K/V moved, not recomputed: a tree pred's accepted branch."""
        await self._do(convert.keep(fd, start, entries))

    async def shift(self, fd: Fd, start: int, end: int, delta: int) -> None:
        """Move entries [start, end) by `delta` positions, their keys rotated to match."""
        await self._do(convert.shift(fd, start, end, delta))

    async def stat(self, target: Target) -> Stat:
        """Stat a path, or an open file (int or File)."""
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

    async def chmod(self, path: KvPath, mode: int) -> None:
        await self._do(convert.chmod(path, mode))

    async def access(self, path: KvPath, mode: int = os.F_OK) -> None:
        """Raise unless path exists and may be read/written/searched (os.R_OK|W_OK|X_OK)."""
        await self._do(convert.access(path, mode))

    async def chown(self, path: KvPath, uid: int = -1, gid: int = -1) -> None:
        await self._do(convert.chown(path, uid, gid))

    async def fsync(self, fd: Fd) -> None:
        await self._do(convert.fsync(fd))

    async def procfs(self, path: KvPath) -> str:
        """The text of a /proc entry: "meminfo", "sched", "PID/status"."""
        return await self._do(convert.procfs(path))


class AsyncFileCalls:
    """AsyncFile's plain syscalls: AsyncKernel's on this file (`self.kernel`)."""

    async def fork(self) -> AsyncFile:
        """AsyncKernel.fork on this file."""
        return await self.kernel.fork(self)

    async def link(self, path: KvPath) -> None:
        """AsyncKernel.link on this file."""
        await self.kernel.link(self, path)

    async def read(self, start: int = 0, count: int | None = None) -> tuple[list[int], list[int]]:
        """AsyncKernel.read on this file."""
        return await self.kernel.read(self, start, count)

    async def splice_from(self, src: Fd, start: int, end: int) -> None:
        """AsyncKernel.splice with this file as `dst`."""
        await self.kernel.splice(src, start, end, self)

    async def truncate(self, length: int) -> None:
        """AsyncKernel.truncate on this file."""
        await self.kernel.truncate(self, length)

    async def punch(self, start: int, end: int) -> None:
        """AsyncKernel.punch on this file."""
        await self.kernel.punch(self, start, end)

    async def keep(self, start: int, entries: Iterable[int]) -> None:
        """AsyncKernel.keep on this file."""
        await self.kernel.keep(self, start, entries)

    async def shift(self, start: int, end: int, delta: int) -> None:
        """AsyncKernel.shift on this file."""
        await self.kernel.shift(self, start, end, delta)

    async def stat(self) -> Stat:
        """AsyncKernel.stat on this file."""
        return await self.kernel.stat(self)

    async def fsync(self) -> None:
        """AsyncKernel.fsync on this file."""
        await self.kernel.fsync(self)
