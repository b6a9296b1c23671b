"""The mount: the kernel's namespace as a FUSE file system (pyfuse3), plus a read-only /proc.

The mount is a client of the kernel like any LIP: every operation is a syscall, made for the
process behind the FUSE request (`acting_as` its uid and gid, which a root session may do),
so the kernel decides access. A KV file's bytes are its canonical serialized form
(docs/kv-format.md):

- reading opens the file, forks it (a copy-on-write snapshot, so a reader sees one version
  even while a LIP appends) and serves reads from an `export` stream of the snapshot,
  restarted at the new offset when a read jumps ahead;
- writing collects the bytes in a spool per open file and imports them, as the writer, when
  the file is closed (flush); the kernel checks the whole file, and a refused one leaves
  nothing. Over an existing file the import rewrites it in place: its inode, owner, group,
  mode and links stay, as a write on a disk leaves them.
- A new file exists only in the mount until then; creating it is refused at once when the
  import would be refused for want of write permission on its directory, or of an inode
  (the user's inodes in /proc/meminfo, less the new files it is writing already: EDQUOT).
  The checks the mount makes itself are for such a file: whoever reaches it (the kernel
  checks search permission on its directory) sees it, but only its writer, or root, may
  change or use it; removing or replacing its name (unlink, rename) follows the kernel's
  rules for a file it has, sticky directories included. Opened for writing again (by them),
  it shares its spool, as a disk shares a file; the close of the last open imports it.
- A file whose name is removed or replaced while it is being written is gone, as on a disk:
  its writer's fd keeps working, and its close imports nothing. While any fd is open on a
  file whose name is gone, fstat answers from it (its size as that fd sees it, no links).
- The spool is checked as it fills, as the kernel's import stream is: the header as soon
  as the spool holds it from byte 0 (in any order), or once it starts from the file's
  bytes (an open without O_TRUNC); a bad one fails that write and every later one, EINVAL,
  and so does one declaring more pages than the page quota of the owner the import charges
  (of the file it rewrites, or a new file's writer), EDQUOT. A header already whole is
  checked again at each write within it, one left bad for now kept (a header rewritten in
  small pieces); while it is bad, a write past it and the close fail. A write past the end
  of the file the header lays out is EINVAL and nothing of it is kept, also one that
  itself completes the header (FUSE hands writes of at most 1 MiB: of a larger write(2),
  the pieces before the one past the end are kept); the writes before it stay, and the
  close imports them if they make a whole file. ftruncate growing the file is the write of
  zeros from its end, checked as that write is. Nothing is spooled past the largest file
  the kernel's device pool could hold (EFBIG); nor, for a user other than root, more in
  all the files the user has open for writing than the largest file as many pages as its
  quota could hold (EDQUOT; the pool's while meminfo shows no quota for it), so what a
  user puts in root's memory and disk through it is bounded by its quota.
- Symbolic links, FIFOs, sockets and device files cannot be made (EPERM): the kernel holds
  KV files and directories only.

DIR/proc shows the kernel's /proc texts (`procfs`), read-only; PID/ and its files are owned
by that process's uid and gid, as its status says, as on Linux. statfs (df) shows the KV
pool, in blocks of a page. Entry and attribute caches
are off (timeout 0) and files are opened direct_io, bypassing the page cache, so changes
made through syscalls show at once. direct_io also keeps reads large (as the reader asks:
1 MiB for cp, by st_blksize) and spares a getattr (a stat) before each one, which the page
cache would send with attributes never cached; the price is that shared mmap is refused
(ENODEV; private mappings, as safetensors makes, work).

A request waits for the kernel `KERNEL_WAIT` seconds at most (`symphony mount --timeout`),
a streamed file's import or export that long for each chunk: a stopped or hung kernel fails
it with ETIMEDOUT, where FUSE would hold its caller unkillable for as long as the kernel is
stopped.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import os
import signal
import stat
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import pyfuse3
import trio

from kvfs.errors import FSError
from kvfs.kv_header import header_length, largest_file
from kvfs.kv_header import read_header as check_header
from syscalls import wire
from syscalls.client import Kernel
from syscalls.convert import CHUNK_BYTES, Stat, proc_fields
from syscalls.users import user_name

log = logging.getLogger("symphony.mount")

OPTIONS = frozenset({"allow_other", "fsname=symphony", "subtype=symphony"})
PROC = "/proc"
# Inodes the mount makes itself (/proc entries, files being written) sit above the
# kernel's, which count up from 1.
OWN_INODES = 1 << 62
SLACK = 4 << 20  # how far a read may land behind or ahead of the last and reuse the stream
BLKSIZE = 1 << 20  # st_blksize: tools size their buffers by it
TIERS = ("device", "host", "disk")  # the pool's, as /proc/meminfo names them
SPOOL_MEMORY = 8 << 20  # a file being written moves from memory to a temporary file past this
XATTR_PREFIX = b"user.symphony."
XATTRS = tuple(XATTR_PREFIX + n for n in (b"tokens", b"pages", b"text", b"model"))
XATTR_MAX = 1 << 16  # Linux's limit on an attribute value
KERNEL_WAIT = 60.0  # seconds a request waits for the kernel (`symphony mount --timeout`)


def fuse_error(e: OSError) -> pyfuse3.FUSEError:
    # EPIPE is the client's word for "no kernel there"; to a file's user that is an I/O error.
    code = e.errno or errno.EIO
    return pyfuse3.FUSEError(errno.EIO if code == errno.EPIPE else code)


def child(parent: str, name: bytes) -> str:
    return ("" if parent == "/" else parent) + "/" + os.fsdecode(name)


def parent_of(path: str) -> str:
    return path.rsplit("/", 1)[0] or "/"


def moved(path: str, old: str, new: str) -> str:
    """`path` once `old` is renamed `new`."""
    return new + path[len(old) :] if path == old or path.startswith(old + "/") else path


def in_proc(path: str) -> bool:
    return path == PROC or path.startswith(PROC + "/")


def entry(
    ino: int,
    mode: int,
    size: int = 0,
    nlink: int = 1,
    uid: int = 0,
    gid: int = 0,
    times: tuple[int, int, int] | None = None,
) -> pyfuse3.EntryAttributes:
    a = pyfuse3.EntryAttributes()
    a.st_ino, a.st_mode, a.st_nlink, a.st_uid, a.st_gid = ino, mode, nlink, uid, gid
    a.st_size, a.st_blksize, a.st_blocks = size, BLKSIZE, -(-size // 512)
    a.st_atime_ns, a.st_mtime_ns, a.st_ctime_ns = times or (time.time_ns(),) * 3
    a.entry_timeout = a.attr_timeout = 0
    return a


def refusal(path: str, e: OSError) -> int:
    """Log why a write to `path` is refused (FUSE carries only the errno); its errno."""
    log.info("write %s: %s", path, e)
    return e.errno or errno.EIO


def past_end(end: int, declared: int) -> FSError:
    return FSError(
        errno.EINVAL, f"kv file: {end} bytes, more than the {declared} its header declares"
    )


@dataclass(frozen=True)
class Bounds:
    """What the kernel could ever hold, which the mount checks a spool against."""

    fingerprint: str  # the model's: a file of another model is refused
    pages: int  # the device pool's: a file needing more is refused (EFBIG)
    page_size: int  # entries per page
    largest: int  # bytes of the largest file those pages could hold


def stat_entry(st: Stat, ino: int) -> pyfuse3.EntryAttributes:
    return entry(
        ino, st.mode, st.size, st.nlink, st.uid, st.gid, (st.atime_ns, st.mtime_ns, st.ctime_ns)
    )


class Wait:
    """One call's bound: it is over once `bound` seconds pass with no answer, nor a chunk
    of a streamed file (`beat`)."""

    def __init__(self, bound: float):
        self.bound = bound
        self.last = time.monotonic()
        self.over = False  # the request failed: the call's thread must not go on with it

    def beat(self) -> None:
        """A chunk went or came (in the call's thread); raises once the request gave up."""
        if self.over:
            raise TimeoutError(errno.ETIMEDOUT, "the mount stopped waiting for the kernel")
        self.last = time.monotonic()

    def beating(self, chunks: Iterator[bytes]) -> Iterator[bytes]:
        for chunk in chunks:
            self.beat()
            yield chunk

    async def watch(self, scope: trio.CancelScope) -> None:
        while (left := self.last + self.bound - time.monotonic()) > 0:
            await trio.sleep(left)
        self.over = True
        scope.cancel()


class Quota(NamedTuple):
    """A user's page quota, as meminfo shows it."""

    pages: int
    spool: int  # bytes of the largest file as many pages could hold: its spools' bound


def read_header(
    spool: Any, front: int, bounds: Bounds, quota: tuple[int, int] | None = None
) -> tuple[int, int] | None:
    """Check the header in a spool whose first `front` bytes are written, as the kernel's
    import does (kvfs.kv_header's checks, the model's fingerprint, the page quota of the
    file's owner if it has one, `quota` (uid, pages), room in the device pool): where the
    header ends and the file's size as it lays it out, or None if it is not all there yet.
    Raises the kernel's refusal (FSError)."""
    spool.seek(0)
    first = spool.read(8)
    n = header_length(first, None)
    if front < 8 + n:
        return None
    header = check_header(first + spool.read(n), None)
    if header.shape.fingerprint != bounds.fingerprint:
        raise FSError(
            errno.EINVAL,
            f"kv file: belongs to another model: its fingerprint is "
            f"{header.shape.fingerprint!r}, this model's is {bounds.fingerprint!r}",
        )
    pages = -(-header.length // bounds.page_size)
    if quota is not None and pages > quota[1]:
        raise FSError(
            errno.EDQUOT,
            f"kv file: {header.length} entries take up to {pages} pages, "
            f"over uid {quota[0]}'s quota of {quota[1]}",
        )
    if pages > bounds.pages:
        raise FSError(
            errno.EFBIG,
            f"kv file: {header.length} entries take up to {pages} "
            f"pages, more than the KV pool's {bounds.pages}",
        )
    return 8 + n, header.size


def header_extent(spool: Any) -> int:
    """Where the header in a spool ends, as its length field says; 8 if that field is bad."""
    spool.seek(0)
    try:
        return 8 + header_length(spool.read(8), None)
    except OSError:
        return 8


class Reader:
    """A KV file open for reading: the kernel fd of its snapshot, and one export stream of
    it that sequential reads consume. The bytes just behind the last read are kept (FUSE may
    send neighbouring reads out of order); older ones are dropped."""

    def __init__(self, kernel: Kernel, fd: int, st: Stat, ino: int):
        self.kernel, self.fd = kernel, fd
        self.st, self.ino = st, ino  # the file as it was at open; its FUSE inode
        self.stream: Iterator[bytes] | None = None
        self.start = self.end = 0  # the offsets `chunks` cover
        self.chunks: list[bytes] = []
        self.done = False  # the stream reached the end of the file
        self.lock = trio.Lock()

    def restart(self, off: int) -> None:
        self.close()
        self.stream = self.kernel.export_iter(self.fd, off)
        self.start = self.end = off
        self.chunks, self.done = [], False

    def close(self) -> None:
        stream, self.stream = self.stream, None
        if stream is not None:
            try:
                stream.close()  # cancels the call
            except ValueError:  # a thread the read stopped waiting for is in it: it ends
                pass  # with the kernel's answer, and nobody takes that chunk

    def add(self, chunk: bytes | None) -> None:
        """The stream's next chunk (`next`, in a worker thread), or None at its end."""
        if chunk is None:
            self.done = True
        else:
            self.chunks.append(chunk)
            self.end += len(chunk)

    def take(self, off: int, size: int) -> bytes:
        out, pos = [], self.start
        for chunk in self.chunks:
            a, b = max(off - pos, 0), min(off + size - pos, len(chunk))
            if a < b:
                out.append(chunk[a:b])
            pos += len(chunk)
        while self.chunks and self.start + len(self.chunks[0]) < off - SLACK:
            self.start += len(self.chunks.pop(0))
        return b"".join(out)


@dataclass
class Writer:
    """A KV file open for writing: its bytes so far, imported on close as `uid`:`gid`, its
    writer."""

    path: str
    ino: int
    uid: int
    gid: int
    mode: int  # for the file the import makes, if there is none at `path` by then
    # The kernel has a file at `path`: the import rewrites it in place, as a write on a disk
    # does (its inode, owner, group, mode and links stay).
    existed: bool
    base_size: int = 0  # that file's size, while its bytes are not yet in the spool
    unseeded: bool = False  # opened without O_TRUNC: the spool must start from its bytes
    dirty: bool = False  # written since its last import: the next close imports
    # Its last import failed, nothing written since: each close tries again (and says what
    # the kernel says), the release after the last one does not (nobody would hear it).
    failed: bool = False
    length: int = 0  # of the spool (not asked of the spool: an import may be reading it)
    front: int = 0  # the spool's bytes [0, front) are all written (no hole): the header is there
    pieces: list[tuple[int, int]] = field(default_factory=list)  # written past front, merged
    header_end: int | None = None  # where the checked header ends; None: not checked yet
    declared: int | None = None  # the file's size as its checked header lays it out
    refused: int = 0  # errno of a bad header: every later write and the close fail with it
    # A whole header rewritten in place in writes within it (dd bs=512 conv=notrunc): bad
    # for now (its errno), checked again at the next write into it; bytes past its end
    # (`bad_end`, as its length field says) are refused until then, and so is the close.
    bad: int = 0
    bad_end: int = 0
    opens: int = 1  # the FUSE opens sharing it: a new file opened again by its writer or root
    spooled: int = 0  # bytes its spool may reach, counted against its writer's spool limit
    detached: bool = False  # its name was removed or replaced: its close imports nothing
    owner: tuple[int, int] | None = None  # (uid, gid) root gave the new file, set once imported
    born_ns: int = field(default_factory=time.time_ns)
    st: Stat | None = None  # the kernel's file at open, if it had one
    spool: Any = field(default_factory=lambda: tempfile.SpooledTemporaryFile(SPOOL_MEMORY))
    lock: trio.Lock = field(default_factory=trio.Lock)

    def size(self) -> int:
        return self.base_size if self.unseeded else self.length

    def charged(self) -> int:
        """Whose page quota its import is held to, as the kernel's: the owner of the file it
        rewrites (as at open), or for a new file its writer (a chown by root comes after)."""
        return self.uid if self.st is None else self.st.uid

    def uid_now(self) -> int:
        """Its owner: its writer, unless root gave it another."""
        return (self.owner or (self.uid, self.gid))[0]

    def attributes(self) -> pyfuse3.EntryAttributes:
        """What the mount shows of a new file the kernel has not seen yet."""
        uid, gid = self.owner or (self.uid, self.gid)
        return entry(
            self.ino, stat.S_IFREG | self.mode, self.size(), 1, uid, gid, (self.born_ns,) * 3
        )

    def unlinked(self) -> pyfuse3.EntryAttributes:
        """What fstat shows once its name is gone: the file as this fd sees it, no links."""
        if self.st is None:
            a = self.attributes()
        else:
            a = stat_entry(self.st, self.ino)
            a.st_size, a.st_blocks = self.size(), -(-self.size() // 512)
        a.st_nlink = 0
        return a

    def wrote(self, off: int, end: int) -> None:
        """Bytes [off, end) are written: `front` moves over every piece it now reaches, also
        those written before it, past a hole this write fills."""
        merged: list[tuple[int, int]] = []
        for a, b in sorted([*self.pieces, (off, end)]):
            if a <= self.front:
                self.front = max(self.front, b)
            elif merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        self.pieces = merged

    def cut(self, size: int) -> None:
        """The spool now ends at `size`."""
        self.front = min(self.front, size)
        self.pieces = [(a, min(b, size)) for a, b in self.pieces if a < size]

    def chunks(self) -> Iterator[bytes]:
        self.spool.seek(0)
        return iter(functools.partial(self.spool.read, CHUNK_BYTES), b"")


@dataclass
class ProcText:
    """A /proc file open for reading: its text as it was at open."""

    data: bytes


@dataclass
class Listing:
    """An open directory: (name, attributes, path) per entry, as it was at opendir."""

    entries: list[tuple[bytes, pyfuse3.EntryAttributes, str]]


def _fails_alone(handler: Callable[..., Any]) -> Callable[..., Any]:
    """A request handler whose unexpected exception fails its request with EIO, logged:
    raised to pyfuse3 it would end the mount, for every user, on one user's request."""
    @functools.wraps(handler)
    async def run(self: KvFS, *args: Any) -> Any:
        try:
            return await handler(self, *args)
        except pyfuse3.FUSEError:
            raise
        except Exception:
            log.exception("%s%r failed", handler.__name__, args[:2])
            raise pyfuse3.FUSEError(errno.EIO) from None
    return run


def requests_fail_alone(cls: type) -> type:
    """Every pyfuse3 request handler of cls wrapped in _fails_alone."""
    for name, handler in list(vars(cls).items()):
        if name in vars(pyfuse3.Operations) and callable(handler):
            setattr(cls, name, _fails_alone(handler))
    return cls


@requests_fail_alone
class KvFS(pyfuse3.Operations):
    """The FUSE operations; one instance per mount."""

    def __init__(self, kernel: Kernel, wait: float = KERNEL_WAIT):
        super().__init__()
        self.kernel = kernel
        self.wait = wait  # seconds a request waits for the kernel (KERNEL_WAIT)
        self.dead = False  # the kernel died: everything fails with EIO until unmounted
        self.paths: dict[int, str] = {pyfuse3.ROOT_INODE: "/"}  # FUSE inode -> path
        self.lookups: Counter[int] = Counter()  # what FUSE remembers of each inode
        self.own: dict[str, int] = {}  # /proc path -> its inode
        self.inodes = itertools.count(OWN_INODES)
        self.handles: dict[int, Reader | Writer | ProcText | Listing] = {}
        self.fhs = itertools.count(1)
        self.writing: dict[str, Writer] = {}  # path -> the open file that will import there
        self.bounds: Bounds | None = None  # asked of the kernel at the first write
        self.spooled: Counter[int] = Counter()  # per uid: its open writers' spooled bytes
        self.quotas: dict[int, Quota | None] = {}  # per uid, once meminfo shows it (None: none)

    # -- plumbing -------------------------------------------------------------------------

    def who(self, uid: int, gid: int) -> Kernel:
        return self.kernel.acting_as(uid, gid)

    async def run(self, fn: Callable[..., Any], *args: Any, wait: Wait | None = None) -> Any:
        """A blocking client call in a worker thread, so a slow export or import does not
        hold up other requests (the sync gRPC channel is thread-safe). ETIMEDOUT once
        `wait` is over (by default self.wait seconds with no answer): the thread is left to
        end with the kernel's answer, which nobody takes."""
        if self.dead:
            raise pyfuse3.FUSEError(errno.EIO)
        wait = wait or Wait(self.wait)
        answer: list[Any] = []
        failed: OSError | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait.watch, nursery.cancel_scope)
            try:
                answer.append(await trio.to_thread.run_sync(
                    functools.partial(fn, *args), abandon_on_cancel=True))
            except OSError as e:
                failed = e
            nursery.cancel_scope.cancel()
        if failed is not None:
            raise pyfuse3.FUSEError(errno.EIO) if self.dead else fuse_error(failed)
        if not answer:
            log.error("%s: the kernel did not answer in %g s: ETIMEDOUT",
                      getattr(fn, "__name__", fn), wait.bound)
            raise pyfuse3.FUSEError(errno.ETIMEDOUT)
        return answer[0]

    def path_of(self, inode: int) -> str:
        try:
            return self.paths[inode]
        except KeyError:
            raise pyfuse3.FUSEError(errno.ENOENT) from None

    def remember(self, a: pyfuse3.EntryAttributes, path: str) -> pyfuse3.EntryAttributes:
        """FUSE now knows the inode (a lookup, by its rules): keep its path until forget."""
        self.paths[a.st_ino] = path
        self.lookups[a.st_ino] += 1
        return a

    def add(self, handle: Reader | Writer | ProcText | Listing) -> int:
        fh = next(self.fhs)
        self.handles[fh] = handle
        return fh

    def own_inode(self, path: str) -> int:
        if path not in self.own:
            self.own[path] = next(self.inodes)
        return self.own[path]

    def inodes_left(self, uid: int) -> int | None:
        """How many more inodes uid may own (/proc/meminfo's inodes_USER); None: no limit,
        or it owns none yet."""
        count = proc_fields(self.kernel.procfs("meminfo")).get(f"inodes_{user_name(uid)}")
        if count is None or count.endswith("-"):
            return None
        used, limit = count.split(" / ")
        return int(limit) - int(used)

    def pending(self, path: str) -> Writer | None:
        """The writer of a new file at `path` that the kernel has not seen yet, if any."""
        w = self.writing.get(path)
        return None if w is None or w.existed else w

    async def search(self, path: str, ctx: pyfuse3.RequestContext) -> None:
        """Have the kernel check the caller's search permission down to a file it has not
        seen yet, as its lookup would for a file it has."""
        await self.run(self.who(ctx.uid, ctx.gid).access, parent_of(path), os.X_OK)

    async def attrs(self, path: str, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if in_proc(path):
            return await self.proc_attrs(path, ctx)
        w = self.pending(path)
        if w is not None:
            await self.search(path, ctx)
            return w.attributes()
        w = self.writing.get(path)
        st = await self.run(self.who(ctx.uid, ctx.gid).stat, path)
        if path == "/":
            a = stat_entry(st, pyfuse3.ROOT_INODE)
            # A link more for the mount's /proc, unless it hides a directory the kernel has.
            there = await self.kernel_has(self.kernel, PROC)
            a.st_nlink += there is None or not there.is_dir
            return a
        a = stat_entry(st, st.ino)
        if w is not None:
            a.st_size = w.size()
        return a

    # -- /proc ----------------------------------------------------------------------------

    async def proc_text(self, path: str, ctx: pyfuse3.RequestContext) -> str:
        return await self.run(self.who(ctx.uid, ctx.gid).procfs, path)

    async def proc_owner(self, path: str, ctx: pyfuse3.RequestContext) -> tuple[int, int]:
        """Who owns a /proc entry: PID/ and its files, that process's uid and gid (its
        status says, to anyone), as on Linux; the rest, root."""
        pid = path.removeprefix(PROC + "/").split("/")[0]
        if path == PROC or not (pid.isascii() and pid.isdigit()):
            return 0, 0
        status = proc_fields(await self.proc_text(f"{PROC}/{pid}/status", ctx))
        return int(status["uid"]), int(status["gid"])

    async def proc_entry(
        self, path: str, is_dir: bool, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        uid, gid = await self.proc_owner(path, ctx)
        ino = self.own_inode(path)
        if is_dir:  # as on a disk: 2, and a link for each subdirectory (/proc's PID/)
            subdirs = 0
            if path == PROC:
                subdirs = sum(n.endswith("/") for n in (await self.proc_text(path, ctx)).split())
            return entry(ino, stat.S_IFDIR | 0o555, nlink=2 + subdirs, uid=uid, gid=gid)
        size = len((await self.proc_text(path, ctx)).encode())
        return entry(ino, stat.S_IFREG | 0o444, size, uid=uid, gid=gid)

    async def proc_attrs(self, path: str, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if path == PROC:
            return await self.proc_entry(path, True, ctx)
        parent, name = path.rsplit("/", 1)
        listing = (await self.proc_text(parent, ctx)).splitlines()
        if name + "/" in listing:
            return await self.proc_entry(path, True, ctx)
        if name in listing:
            return await self.proc_entry(path, False, ctx)
        raise pyfuse3.FUSEError(errno.ENOENT)

    # -- names ----------------------------------------------------------------------------

    async def lookup(
        self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        path = child(self.path_of(parent_inode), name)
        return self.remember(await self.attrs(path, ctx), path)

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for inode, n in inode_list:
            self.lookups[inode] -= n
            if self.lookups[inode] > 0 or inode == pyfuse3.ROOT_INODE:
                continue
            del self.lookups[inode]
            path = self.paths.pop(inode, None)
            if self.own.get(path) == inode:
                del self.own[path]

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        try:
            a = await self.attrs(self.path_of(inode), ctx)
        except pyfuse3.FUSEError as e:
            if e.errno != errno.ENOENT:
                raise
            return await self.unlinked(inode)
        if a.st_ino != inode:  # the name now holds another file; this one has none
            return await self.unlinked(inode)
        return a

    async def unlinked(self, inode: int) -> pyfuse3.EntryAttributes:
        """A file whose name is gone (removed, or another file's now): while it is open,
        fstat of its fd shows it as that fd sees it, with no links, as on a disk (pyfuse3
        does not say which fd; a writer's first). ENOENT once none is."""
        handles = sorted(
            (h for h in self.handles.values() if isinstance(h, Writer | Reader) and h.ino == inode),
            key=lambda h: not isinstance(h, Writer),
        )
        if not handles:
            raise pyfuse3.FUSEError(errno.ENOENT)
        h = handles[0]
        if isinstance(h, Writer):
            return h.unlinked()
        a = stat_entry(h.st, inode)
        a.st_size = (await self.run(self.kernel.stat, h.fd)).size  # its snapshot's
        a.st_blocks, a.st_nlink = -(-a.st_size // 512), 0
        return a

    async def setattr(
        self,
        inode: int,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        fh: int | None,
        ctx: pyfuse3.RequestContext,
    ) -> pyfuse3.EntryAttributes:
        path = self.path_of(inode)
        if in_proc(path):
            raise pyfuse3.FUSEError(errno.EROFS)
        h = self.handles.get(fh) if fh is not None else None
        mine = isinstance(h, Writer)  # the caller's own file open for writing (ftruncate)
        w = h if isinstance(h, Writer) else self.writing.get(path)
        if w is not None and not w.existed:
            await self.change_pending(w, attr, fields, ctx)
        else:
            await self.change(path, w, mine, attr, fields, ctx)
        return await self.getattr(inode, ctx)

    async def change(
        self,
        path: str,
        w: Writer | None,
        mine: bool,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        """setattr of a file the kernel has (`w`: a writer of it, whose spool a size change
        cuts): the kernel checks the caller as for any change of it."""
        k = self.who(ctx.uid, ctx.gid)
        if fields.update_size:
            if not mine:  # a path needs write permission; an fd open for writing has it
                await self.run(k.access, path, os.W_OK)
            await self.resize(w, path, attr.st_size, ctx)
        if fields.update_mode:
            await self.run(k.chmod, path, attr.st_mode & 0o7777)
        if fields.update_uid or fields.update_gid:
            uid = attr.st_uid if fields.update_uid else -1
            gid = attr.st_gid if fields.update_gid else -1
            await self.run(k.chown, path, uid, gid)
        if fields.update_atime or fields.update_mtime:
            # The kernel keeps its own times and has no call to set them; the caller must
            # still be allowed what touch(1) is (pyfuse3 does not say whether the times are
            # "now"): to own the file, or to write it.
            if ctx.uid != 0 and ctx.uid != (await self.run(k.stat, path)).uid:
                await self.run(k.access, path, os.W_OK)

    async def change_pending(
        self,
        w: Writer,
        attr: pyfuse3.EntryAttributes,
        fields: pyfuse3.SetattrFields,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        """setattr of a new file the kernel has not seen yet: the caller must reach it, and
        only its writer (or root) may change it, as only its owner could once it is there."""
        await self.search(w.path, ctx)
        if ctx.uid not in (0, w.uid):
            f = fields
            metadata = (f.update_mode, f.update_uid, f.update_gid, f.update_atime, f.update_mtime)
            raise pyfuse3.FUSEError(errno.EPERM if any(metadata) else errno.EACCES)
        if fields.update_size:
            await self.resize(w, w.path, attr.st_size, ctx)
        if fields.update_mode:
            w.mode = attr.st_mode & 0o7777
        if fields.update_uid or fields.update_gid:
            if ctx.uid != 0:  # the kernel's rule
                raise pyfuse3.FUSEError(errno.EPERM)
            was = w.owner or (w.uid, w.gid)
            w.owner = (
                attr.st_uid if fields.update_uid else was[0],
                attr.st_gid if fields.update_gid else was[1],
            )

    async def resize(
        self, w: Writer | None, path: str, size: int, ctx: pyfuse3.RequestContext
    ) -> None:
        """Only a file open for writing can change length: cutting a KV file's bytes
        anywhere else would leave a file that is no KV file."""
        if w is None:
            if (await self.attrs(path, ctx)).st_size != size:
                raise pyfuse3.FUSEError(errno.EINVAL)
            return
        if size > w.size():  # growing is writing zeros at the end, checked as that write
            await self.put(w, w.size(), size, None)
            return
        # A cut checks nothing and is always taken: what is left was accepted, or is checked
        # once whole again; a refused header it cuts into is no longer there to refuse.
        if size:
            await self.started(w)
        async with w.lock:  # a cut to nothing needs none of the old bytes
            if w.refused and size < header_extent(w.spool):
                w.refused = 0
            w.unseeded = False
            w.spool.truncate(size)
            w.length = size
            self.spool_less(w, size)
            w.cut(size)
            if w.header_end is not None and size < w.header_end:
                w.header_end = w.declared = None  # checked again once written again
            if w.bad and size < w.bad_end:
                w.bad = 0  # not all there: checked again once written again
        w.dirty = True
        self.track(w)

    async def mkdir(
        self, parent_inode: int, name: bytes, mode: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        path = child(self.path_of(parent_inode), name)
        if in_proc(path):
            raise pyfuse3.FUSEError(errno.EROFS)
        await self.run(self.who(ctx.uid, ctx.gid).mkdir, path, mode & ~ctx.umask & 0o7777)
        return self.remember(await self.attrs(path, ctx), path)

    async def unlink(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        path = child(self.path_of(parent_inode), name)
        if in_proc(path):
            raise pyfuse3.FUSEError(errno.EROFS)
        w = self.pending(path)
        if w is not None:
            await self.may_remove(w, path, ctx)
        else:
            await self.run(self.who(ctx.uid, ctx.gid).unlink, path)
        self.detach(path)

    async def may_remove(self, w: Writer, path: str, ctx: pyfuse3.RequestContext) -> None:
        """The kernel's rules for taking a name out of its directory (unlink, or a rename
        from or over it), for a file it has not seen yet: write and search permission on the
        directory, and in a sticky one (/tmp) to own the file or the directory, or be root."""
        k, parent = self.who(ctx.uid, ctx.gid), parent_of(path)
        await self.run(k.access, parent, os.W_OK | os.X_OK)
        d = await self.run(k.stat, parent)
        if d.mode & stat.S_ISVTX and ctx.uid not in (0, w.uid_now(), d.uid):
            log.info(
                "%s: uid %d may not remove another user's file from a sticky directory",
                path,
                ctx.uid,
            )
            raise pyfuse3.FUSEError(errno.EPERM)

    def detach(self, path: str) -> None:
        """Files being written at or under `path` lost their name (unlinked, or another file
        renamed over it): as on a disk, their writers' fds keep working and their bytes go
        nowhere. Their closes import nothing: neither a new file under a removed name nor
        over the file that now has it."""
        for h in self.handles.values():
            if isinstance(h, Writer) and (h.path == path or h.path.startswith(path + "/")):
                h.detached = True
        self.writing = {p: w for p, w in self.writing.items() if not w.detached}

    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        path = child(self.path_of(parent_inode), name)
        if in_proc(path):
            raise pyfuse3.FUSEError(errno.EROFS)
        await self.run(self.who(ctx.uid, ctx.gid).rmdir, path)

    async def rename(
        self,
        parent_inode_old: int,
        name_old: bytes,
        parent_inode_new: int,
        name_new: bytes,
        flags: int,
        ctx: pyfuse3.RequestContext,
    ) -> None:
        old = child(self.path_of(parent_inode_old), name_old)
        new = child(self.path_of(parent_inode_new), name_new)
        if in_proc(old) or in_proc(new):
            raise pyfuse3.FUSEError(errno.EROFS)
        if flags & pyfuse3.RENAME_EXCHANGE:
            raise pyfuse3.FUSEError(errno.EINVAL)
        k = self.who(ctx.uid, ctx.gid)
        src, dst = self.pending(old), self.pending(new)
        if flags & pyfuse3.RENAME_NOREPLACE:
            if dst is not None or await self.kernel_has(k, new):
                raise pyfuse3.FUSEError(errno.EEXIST)
        if old == new:
            if src is None:
                await self.run(k.rename, old, new)
            return
        if dst is not None:  # replacing a file being written: as if it were the kernel's
            if src is None and (await self.run(k.stat, old)).is_dir:
                raise pyfuse3.FUSEError(errno.ENOTDIR)
            await self.may_remove(dst, new, ctx)
        if src is not None:
            await self.move_pending(src, new, ctx)
        else:
            await self.run(k.rename, old, new)
        self.detach(new)  # what was written at `new` has lost its name
        for inode, path in list(self.paths.items()):
            self.paths[inode] = moved(path, old, new)
        # Files being written follow their names, so that they import where they now are
        # (a Writer that several opens share, once).
        for h in {id(h): h for h in self.handles.values() if isinstance(h, Writer)}.values():
            h.path = moved(h.path, old, new)
        self.writing = {w.path: w for w in self.writing.values()}

    async def kernel_has(self, k: Kernel, path: str) -> Stat | None:
        """The kernel's file at `path`, if it has one."""
        try:
            return await self.run(k.stat, path)
        except pyfuse3.FUSEError as e:
            if e.errno != errno.ENOENT:
                raise
            return None

    async def move_pending(self, w: Writer, new: str, ctx: pyfuse3.RequestContext) -> None:
        """rename of a file the kernel has not seen yet: only its name in the mount moves,
        checked as the kernel checks a rename (the old name removable, the new directory
        writable and searchable); a file the kernel has at `new` is unlinked by the caller
        (the kernel's checks), as the rename replaces it."""
        k = self.who(ctx.uid, ctx.gid)
        await self.may_remove(w, w.path, ctx)
        await self.run(k.access, parent_of(new), os.W_OK | os.X_OK)
        there = await self.kernel_has(k, new)
        if there is not None:
            if there.is_dir:
                raise pyfuse3.FUSEError(errno.EISDIR)
            await self.run(k.unlink, new)

    async def link(
        self, inode: int, new_parent_inode: int, new_name: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        src = self.path_of(inode)
        path = child(self.path_of(new_parent_inode), new_name)
        if in_proc(src) or in_proc(path):
            raise pyfuse3.FUSEError(errno.EROFS)
        k = self.who(ctx.uid, ctx.gid)

        def link() -> None:  # the kernel names open files: open the source, link, close
            try:
                f = k.open(src)
            except OSError as e:
                if e.errno != errno.EACCES:
                    raise
                owner_link()  # the caller may not read it
                return
            with f:
                f.link(path)

        def owner_link() -> None:
            """Link a file its caller may not read, as Linux's protected_hardlinks: only its
            owner may (EPERM, not the open's EACCES). The mount's own session opens it for
            its owner, after the kernel has checked the new name as the caller's link would."""
            st = k.stat(src)
            if st.uid != ctx.uid:
                raise FSError(errno.EPERM, f"link {path!r}: not the owner of {src!r}, and "
                              "no read and write permission on it")
            try:
                k.stat(path)  # search permission on its directories
            except OSError as e:
                if e.errno != errno.ENOENT:
                    raise
            else:
                raise FSError(errno.EEXIST, repr(path))
            k.access(parent_of(path), os.W_OK | os.X_OK)
            with self.kernel.open(src) as f:
                if f.stat().ino != st.ino:  # another file took the name since
                    raise FSError(errno.ENOENT, f"link {path!r}: {src!r} was replaced")
                f.link(path)

        await self.run(link)
        return self.remember(await self.attrs(path, ctx), path)

    async def symlink(
        self, parent_inode: int, name: bytes, target: bytes, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return await self.cannot_hold(parent_inode, name)

    async def mknod(
        self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: pyfuse3.RequestContext
    ) -> pyfuse3.EntryAttributes:
        return await self.cannot_hold(parent_inode, name)

    async def cannot_hold(self, parent_inode: int, name: bytes) -> pyfuse3.EntryAttributes:
        """Symbolic links, FIFOs, sockets and device files (`ln -s`, `mkfifo`, `mknod`): the
        kernel holds none, and a Linux file system that cannot hold a kind of file says
        EPERM (/proc, read-only: EROFS)."""
        read_only = in_proc(child(self.path_of(parent_inode), name))
        raise pyfuse3.FUSEError(errno.EROFS if read_only else errno.EPERM)

    async def access(self, inode: int, mode: int, ctx: pyfuse3.RequestContext) -> bool:
        path = self.path_of(inode)
        if in_proc(path):
            return not mode & os.W_OK
        w = self.pending(path)
        try:
            if w is not None:  # the kernel has not seen it yet: only its writer may use it
                await self.search(path, ctx)
                return ctx.uid in (0, w.uid)
            await self.run(self.who(ctx.uid, ctx.gid).access, path, mode)
        except pyfuse3.FUSEError as e:
            if e.errno == errno.EACCES:
                return False
            raise
        return True

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        """The KV pool as df shows it: its pages on every tier, and those free, in blocks
        of a page (/proc/meminfo)."""
        s = pyfuse3.StatvfsData()
        s.f_bsize = BLKSIZE
        s.f_namemax = 255
        fields = proc_fields(await self.proc_text("meminfo", ctx))
        s.f_frsize = int(fields["page_bytes"])
        s.f_blocks = sum(int(fields[f"{tier}_total"]) for tier in TIERS)
        s.f_bfree = s.f_bavail = sum(int(fields[f"{tier}_free"]) for tier in TIERS)
        return s

    # -- directories ----------------------------------------------------------------------

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        path = self.path_of(inode)
        # . and .. first, as a disk lists them (ls -a shows them); .. of the root is itself.
        entries = [
            (".", await self.attrs(path, ctx), path),
            ("..", await self.attrs(parent_of(path), ctx), parent_of(path)),
        ]
        if in_proc(path):
            for line in (await self.proc_text(path, ctx)).splitlines():
                name = line.rstrip("/")
                sub = child(path, name.encode())
                try:
                    a = await self.proc_entry(sub, line.endswith("/"), ctx)
                except pyfuse3.FUSEError as e:
                    if e.errno != errno.ENOENT:
                        raise
                    continue  # a process that exited since the listing
                entries.append((name, a, sub))
        else:
            for name, st in await self.run(self.who(ctx.uid, ctx.gid).readdir, path):
                if not (path == "/" and name == "proc"):  # the mount's /proc hides it
                    entries.append((name, stat_entry(st, st.ino), child(path, name.encode())))
            for p, w in self.writing.items():  # the kernel's readdir checked the caller
                if not w.existed and parent_of(p) == path:
                    entries.append((p.rsplit("/", 1)[1], w.attributes(), p))
            if path == "/":
                entries.append(("proc", await self.proc_attrs(PROC, ctx), PROC))
        return self.add(Listing([(os.fsencode(n), a, p) for n, a, p in entries]))

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        listing = self.handles[fh]
        assert isinstance(listing, Listing)
        for i in range(start_id, len(listing.entries)):
            name, a, path = listing.entries[i]
            if not pyfuse3.readdir_reply(token, name, a, i + 1):
                return
            if name not in (b".", b".."):  # FUSE counts no lookup for these (pyfuse3's rule)
                self.remember(a, path)

    async def releasedir(self, fh: int) -> None:
        del self.handles[fh]

    # -- files ----------------------------------------------------------------------------

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        path = self.path_of(inode)
        access = flags & os.O_ACCMODE
        if in_proc(path):
            if access != os.O_RDONLY:
                raise pyfuse3.FUSEError(errno.EACCES)
            text = await self.proc_text(path, ctx)
            # Sizes change between stat and read: direct_io reads to the end regardless.
            return pyfuse3.FileInfo(fh=self.add(ProcText(text.encode())), direct_io=True)
        w = self.pending(path)
        if w is not None and ctx.uid not in (0, w.uid):  # only its writer may use it yet
            raise pyfuse3.FUSEError(errno.EACCES)
        if w is not None and access != os.O_RDONLY:
            # Its writer (or root) opens it for writing again (`cat > f`, `cp` over it): the
            # open shares its spool, as a second open of a file on a disk shares the file;
            # O_TRUNC cuts it. The close of the last of them imports it.
            await self.search(path, ctx)
            if flags & os.O_TRUNC:
                await self.resize(w, path, 0, ctx)
            w.opens += 1
            return pyfuse3.FileInfo(fh=self.add(w), direct_io=True)
        k = self.who(ctx.uid, ctx.gid)
        if access == os.O_RDONLY:

            def snapshot() -> tuple[int, Stat]:
                f = k.open(path)  # the kernel checks access here
                st: Stat | None = None
                try:
                    st = f.stat()  # what fstat shows once the name is gone
                    return k.fork(f).fd, st  # one snapshot for every read of this open
                except OSError as e:
                    if e.errno != errno.EDQUOT or st is None:
                        raise
                    # At the reader's inode quota: the file itself, each export stream of
                    # it a snapshot of its own (export's is never refused), so reading works.
                    kept, f = f, None
                    return kept.fd, st
                finally:
                    if f is not None:
                        f.close()

            reader = Reader(self.kernel, *await self.run(snapshot), ino=inode)
            return pyfuse3.FileInfo(fh=self.add(reader), direct_io=True)

        def check() -> Stat:  # access checked now; the bytes import on close
            with k.open(path, access):
                return k.stat(path)

        st = await self.run(check)
        await self.learn_quota(ctx.uid)  # its spools' bound
        await self.learn_quota(st.uid)  # its owner's, which the import is held to
        trunc = bool(flags & os.O_TRUNC)
        w = Writer(
            path,
            inode,
            ctx.uid,
            ctx.gid,
            st.mode & 0o7777,
            existed=True,
            base_size=st.size,
            unseeded=not trunc,
            dirty=trunc,
            st=st,
        )
        if trunc:
            self.writing[path] = w
        return pyfuse3.FileInfo(fh=self.add(w), direct_io=True)

    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: pyfuse3.RequestContext
    ) -> tuple[pyfuse3.FileInfo, pyfuse3.EntryAttributes]:
        path = child(self.path_of(parent_inode), name)
        if in_proc(path):
            raise pyfuse3.FUSEError(errno.EROFS)
        # Refuse now what the import at close would refuse for want of permission, or of an
        # inode: cp would otherwise write the whole file, then fail to close it.
        await self.run(
            self.who(ctx.uid, ctx.gid).access, self.path_of(parent_inode), os.W_OK | os.X_OK
        )
        left = await self.run(self.inodes_left, ctx.uid)
        if left is not None and left <= sum(
            not w.existed and w.uid == ctx.uid for w in self.writing.values()
        ):
            raise pyfuse3.FUSEError(errno.EDQUOT)
        await self.learn_quota(ctx.uid)
        # Nothing in the kernel yet: the file shows in the mount only, until it imports.
        w = Writer(
            path,
            next(self.inodes),
            ctx.uid,
            ctx.gid,
            mode & ~ctx.umask & 0o7777,
            existed=False,
            dirty=True,
        )
        self.writing[path] = w
        fi = pyfuse3.FileInfo(fh=self.add(w), direct_io=True)
        return fi, self.remember(await self.attrs(path, ctx), path)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        h = self.handles[fh]
        if self.dead:
            raise pyfuse3.FUSEError(errno.EIO)
        if isinstance(h, ProcText):
            return h.data[off : off + size]
        if isinstance(h, Writer):
            await self.seed(h)
            async with h.lock:
                h.spool.seek(off)
                return h.spool.read(size)
        assert isinstance(h, Reader)
        async with h.lock:
            if h.stream is not None and off < h.start:  # a straggler: leave the stream be
                return await self.run(self.kernel.export, h.fd, off, size)
            if h.stream is None or off > h.end + SLACK:
                h.restart(off)
            try:
                while h.end < off + size and not h.done:
                    h.add(await self.run(next, h.stream, None))
            except pyfuse3.FUSEError:
                h.close()  # a broken stream must not look like the end of the file
                raise
            return h.take(off, size)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        w = self.handles[fh]
        if self.dead:
            raise pyfuse3.FUSEError(errno.EIO)
        assert isinstance(w, Writer)
        await self.put(w, off, off + len(buf), buf)
        return len(buf)

    async def put(self, w: Writer, off: int, end: int, buf: bytes | None) -> None:
        """Spool bytes [off, end): `buf`, or None for zeros past the spool's end (a file
        grown by ftruncate, checked as the write of those zeros would be; refused, it is not
        kept, and the file stays as it was: its size, and whether later writes are taken)."""
        if w.refused:
            raise pyfuse3.FUSEError(w.refused)
        await self.within(w, off, end, grow=buf is None)
        header = w.header_end is None or off < w.header_end  # it may write the header
        async with w.lock:  # not while an import reads the spool
            was = (w.length, w.front, w.pieces, w.header_end, w.declared, w.bad, w.bad_end)
            whole = w.header_end is not None or bool(w.bad)  # the header was all there
            # What the write covers, to put back if the header it completes or changes lays
            # out a file that ends before it.
            w.spool.seek(off)
            kept = w.spool.read(max(min(end, w.length) - off, 0)) if header else b""
            if buf is None:  # a spool still in memory does not grow by truncate
                w.spool.seek(end - 1)
                w.spool.write(b"\0")
            else:
                w.spool.seek(off)
                w.spool.write(buf)
            w.length = max(w.length, end)
            w.wrote(off, end)
        if header:
            try:
                await self.check_header(w, end if whole else None)
            except pyfuse3.FUSEError:
                if buf is None:  # a growth that makes the header bad: not kept
                    await self.undo(w, off, kept, was)
                    raise
                w.dirty = True  # a bad header written: refused, with every later write and
                self.track(w)  # the close, until a cut into it (ftruncate)
                raise
            if w.declared is not None and end > w.declared:
                declared = w.declared
                await self.undo(w, off, kept, was)
                raise pyfuse3.FUSEError(refusal(w.path, past_end(end, declared)))
        w.dirty = True
        self.track(w)

    async def undo(self, w: Writer, off: int, kept: bytes, was: tuple) -> None:
        """Put back a refused write at `off`: the bytes it covered (`kept`), the spool's
        length and what the writes before it had checked (`was`)."""
        async with w.lock:
            w.spool.truncate(was[0])
            w.spool.seek(off)
            w.spool.write(kept)
            w.length, w.front, w.pieces, w.header_end, w.declared, w.bad, w.bad_end = was
            w.refused = 0  # put refuses a write to a spool already refused
        self.spool_less(w, w.length)

    def track(self, w: Writer) -> None:
        """`w` is the open file that imports at its path, unless that name was taken from it;
        written again, it is no longer one whose import failed."""
        w.failed = False
        if not w.detached:
            self.writing[w.path] = w

    async def limits(self) -> Bounds:
        """The kernel's bounds on a file, asked once (its model and pool stay while it runs):
        the largest file is one of as many entries as the device pool has rows, each with an
        excluded range, and the largest header the format allows."""
        if self.bounds is None:

            def ask() -> Bounds:
                mem = proc_fields(self.kernel.procfs("meminfo"))
                pages, size = int(mem["device_total"]), int(mem["page_size_tokens"])
                largest = largest_file(pages, size, int(mem["page_bytes"]))
                return Bounds(self.kernel.model_info().fingerprint, pages, size, largest)

            self.bounds = await self.run(ask)
        return self.bounds

    async def within(self, w: Writer, off: int, end: int, grow: bool = False) -> None:
        """Refuse to spool bytes the kernel's import would refuse for their place alone:
        past the largest file it could hold (EFBIG), or past the end of the file a checked
        header lays out (EINVAL), unless the write changes that header. A spool that starts
        from the file's bytes (an open without O_TRUNC) is started first: their header is
        the one checked. A growth (ftruncate) refused past a header bad for now leaves the
        writes after it free to make it good."""
        bounds = await self.limits()
        if end > bounds.largest:
            raise pyfuse3.FUSEError(refusal(w.path, FSError(
                errno.EFBIG, f"{end} bytes, more than the largest file the KV pool's "
                f"{bounds.pages} pages could hold ({bounds.largest} bytes)")))
        if end:
            await self.started(w)
        if (w.declared is not None and w.header_end is not None and off >= w.header_end
                and end > w.declared):
            raise pyfuse3.FUSEError(refusal(w.path, past_end(end, w.declared)))
        if w.bad and off >= w.bad_end:  # past a header being rewritten that is bad for now
            if not grow:
                w.refused = w.bad
            raise pyfuse3.FUSEError(w.bad)
        self.spool_more(w, max(end, w.size()), await self.spool_limit(w.uid))

    async def started(self, w: Writer) -> None:
        """Start a spool that starts from the file's bytes (an open without O_TRUNC), once
        they are counted against its writer's limit."""
        if w.unseeded:
            self.spool_more(w, w.size(), await self.spool_limit(w.uid))
            await self.seed(w)

    async def learn_quota(self, uid: int) -> None:
        """Learn uid's page quota from meminfo's quota_USER line (the kernel's word, not
        the writer's), at each open for writing until it shows one: there is none for a
        user that has held no page since the kernel started. Root has no quota; a quota
        stays while the kernel runs."""
        if uid and uid not in self.quotas:
            mem = proc_fields(await self.run(self.kernel.procfs, "meminfo"))
            line = mem.get(f"quota_{user_name(uid)}")
            if line is not None:
                limit = line.split(" / ")[1]
                self.quotas[uid] = None if limit == "-" else Quota(int(limit), largest_file(
                    int(limit), int(mem["page_size_tokens"]), int(mem["page_bytes"])))

    async def spool_limit(self, uid: int) -> tuple[int, str]:
        """The most bytes uid's open writers may spool together, and what that is: the
        largest file as many pages as its quota could hold, or the device pool if that is
        fewer or uid has no quota known (root's spools are not bounded together)."""
        bounds = await self.limits()
        quota = self.quotas.get(uid)
        if quota is None or quota.pages >= bounds.pages:
            return bounds.largest, (
                f"the largest file the KV pool could hold ({bounds.largest} bytes)")
        return quota.spool, (f"the largest file uid {uid}'s quota of {quota.pages} pages "
                             f"could hold ({quota.spool} bytes)")

    def quota_of(self, uid: int) -> tuple[int, int] | None:
        """uid and its page quota, for read_header, if it has one known."""
        quota = self.quotas.get(uid)
        return None if quota is None else (uid, quota.pages)

    def spool_more(self, w: Writer, reach: int, limit: tuple[int, str]) -> None:
        """Count the bytes w's spool may reach (the seeded file's, or a write's end) against
        its writer's limit (`spool_limit`) before they are spooled: a user other than root
        may have at most that in all its open writers' spools together (EDQUOT)."""
        more = reach - w.spooled
        if more <= 0:
            return
        most, what = limit
        if w.uid and self.spooled[w.uid] + more > most:
            raise pyfuse3.FUSEError(refusal(w.path, FSError(
                errno.EDQUOT, f"{reach} bytes: the files uid {w.uid} is writing through the "
                f"mount would hold {self.spooled[w.uid] + more} bytes in all, more than "
                f"{what}")))
        self.spooled[w.uid] += more
        w.spooled = reach

    def spool_less(self, w: Writer, reach: int) -> None:
        """w's spool was cut to `reach` bytes, or is gone (0): its writer's limit gets back
        what it no longer holds."""
        if reach < w.spooled:
            self.spooled[w.uid] -= w.spooled - reach
            w.spooled = reach
            if not self.spooled[w.uid]:
                del self.spooled[w.uid]

    async def check_header(self, w: Writer, rewrite: int | None = None) -> None:
        """Check the header as soon as the spool holds it whole (written, no hole), with the
        kernel's own parser, as its import checks a stream as it arrives: a bad one fails
        this write and every later one, and the close (EINVAL); one declaring more pages
        than the page quota of the owner the import charges, EDQUOT; more than the device
        pool holds, EFBIG. Unless the header was whole before a write that ends at
        `rewrite`, within the header as its length field now says: a header being rewritten
        in pieces is bad for now (`w.bad`), and checked again at the next write."""
        bounds = await self.limits()
        quota = self.quota_of(w.charged())
        async with w.lock:
            w.bad = 0
            if w.front < 8:
                return
            try:
                got = await trio.to_thread.run_sync(read_header, w.spool, w.front, bounds, quota)
            except OSError as e:
                if rewrite is not None:
                    extent = header_extent(w.spool)
                    if rewrite <= extent:
                        log.info("write %s: header bad for now: %s", w.path, e)
                        w.bad, w.bad_end = e.errno or errno.EINVAL, extent
                        w.header_end = w.declared = None
                        return
                w.refused = refusal(w.path, e)
                raise pyfuse3.FUSEError(w.refused) from None
            # Not all there (a write changed its length): checked again once it is.
            w.header_end, w.declared = got or (None, None)

    async def seed(self, w: Writer) -> None:
        """Start the spool from the file's current bytes (an open without O_TRUNC). The
        mount's own session reads them: the opener may write but not read the file. Not
        once its name is gone: the path may hold another file by then."""
        bounds = await self.limits()
        quota = self.quota_of(w.charged())
        async with w.lock:
            if w.detached:
                w.unseeded = False
            if not w.unseeded:
                return

            wait = Wait(self.wait)

            def copy() -> tuple[int, tuple[int, int] | None]:
                length = 0
                for chunk in wait.beating(self.kernel.export_iter(w.path)):
                    w.spool.write(chunk)
                    length += len(chunk)
                # The file's header is the spool's: checked, so that a write past the end
                # it lays out is refused as one after a written header is.
                try:
                    return length, read_header(w.spool, length, bounds, quota)
                except OSError:  # refused by the import too: the next write finds it so
                    return length, None

            try:
                w.length, got = await self.run(copy, wait=wait)
                w.front, w.pieces = w.length, []
                w.header_end, w.declared = got or (None, None)
            except pyfuse3.FUSEError:
                w.spool.seek(0)  # start over next time
                w.spool.truncate()
                w.length = w.front = 0
                w.pieces = []
                w.header_end = w.declared = None
                raise
            w.unseeded = False

    async def publish(self, w: Writer) -> None:
        """Import what was written, as the writer; the kernel checks it whole. Nothing for a
        file whose name was taken from it, or whose header was refused as it was written."""
        if w.detached:
            w.dirty = False
            return
        await self.seed(w)
        if w.bad and not w.refused:  # a header rewritten in pieces left bad
            w.refused = w.bad
        # A refused import keeps the writes: the close of another descriptor of the file
        # (a dup, a child's copy) imports them again, once the quota has room, say.
        w.failed = True
        if w.refused:
            raise pyfuse3.FUSEError(w.refused)
        k = self.who(w.uid, w.gid)
        async with w.lock:  # no write meanwhile: what it imported is all there is
            wait = Wait(self.wait)
            await self.run(k.import_file, w.path, wait.beating(w.chunks()), w.mode, wait=wait)
            w.dirty = w.failed = False
        if self.writing.get(w.path) is w:
            del self.writing[w.path]  # imported: from now on the kernel answers
        if w.owner is not None:
            await self.run(k.chown, w.path, *w.owner)

    async def flush(self, fh: int) -> None:
        # close(2) returns what flush says: a refused import is cp's error. No bytes are no
        # KV file; the file stays open, as when a shell closes the fd it dup'ed to stdout.
        w = self.handles[fh]
        if isinstance(w, Writer) and w.dirty and w.opens == 1:  # the last open imports
            if not w.size() and not w.detached:
                raise pyfuse3.FUSEError(errno.EINVAL)
            await self.publish(w)

    async def fsync(self, fh: int, datasync: bool) -> None:
        await self.flush(fh)

    async def release(self, fh: int) -> None:
        h = self.handles.pop(fh)
        if isinstance(h, Reader):
            h.close()
            await self.run(self.kernel.close, h.fd)
        elif isinstance(h, Writer):
            h.opens -= 1
            if h.opens:  # another open shares it: its close imports
                return
            try:
                if h.dirty and h.size() and not h.failed:  # written after its last flush
                    await self.publish(h)
            finally:
                if self.writing.get(h.path) is h:
                    del self.writing[h.path]
                h.spool.close()
                self.spool_less(h, 0)

    # -- extended attributes --------------------------------------------------------------

    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        a = await self.getattr(inode, ctx)
        # The mount's own inodes are /proc's and files not imported yet: no KV files.
        return list(XATTRS) if stat.S_ISREG(a.st_mode) and inode < OWN_INODES else []

    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if name not in await self.listxattr(inode, ctx):
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        path, key = self.path_of(inode), name.removeprefix(XATTR_PREFIX)
        k = self.who(ctx.uid, ctx.gid)
        if key == b"model":
            info = await self.run(k.model_info)
            value = f"{info.name} {info.fingerprint}"
        elif key == b"text":

            def text() -> str:
                with k.open(path) as f:
                    return k.detokenize(f.read()[0])

            value = await self.run(text)
        else:
            value = str(getattr(await self.run(k.stat, path), key.decode()))
        data = value.encode()
        if len(data) > XATTR_MAX:
            raise pyfuse3.FUSEError(errno.E2BIG)
        return data

    async def setxattr(
        self, inode: int, name: bytes, value: bytes, ctx: pyfuse3.RequestContext
    ) -> None:
        raise pyfuse3.FUSEError(errno.ENOTSUP)

    async def removexattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        raise pyfuse3.FUSEError(errno.ENOTSUP)

    # -- life cycle -----------------------------------------------------------------------

    async def watch_kernel(self) -> None:
        """The lifeline says SHUTDOWN when the kernel stops cleanly: unmount. End of file
        without it means the kernel died: stay mounted, failing with EIO, until umount."""
        sock = self.kernel.lifeline()
        sock.setblocking(False)
        frames = wire.Frames()
        while True:
            await trio.lowlevel.wait_readable(sock)
            try:
                data = sock.recv(256)
                said = frames.feed(data)
            except (OSError, wire.FrameError):  # reset or garbage: as dead as end of file
                data, said = b"", []
            if any(kind == wire.SHUTDOWN for kind, _, _ in said):
                log.info("the kernel stopped: unmounting")
                pyfuse3.terminate()
                return
            if not data:
                log.error("the kernel died: every operation fails with EIO until umount")
                self.dead = True
                return

    async def serve(self, ready: Callable[[], None] | None = None) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.watch_kernel)
            nursery.start_soon(stop_on_signals)
            if ready is not None:
                ready()  # mounted: requests wait for main, which starts now
            await pyfuse3.main()
            nursery.cancel_scope.cancel()


async def stop_on_signals() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for _ in signals:
            pyfuse3.terminate()
            return


def mount(
    mountpoint: str,
    socket: str | None = None,
    ready: Callable[[], None] | None = None,
    wait: float | None = None,
) -> int:
    """Mount the kernel at `mountpoint` and serve until it is unmounted (umount, a signal,
    or the kernel stopping); `ready` is called once the mount is live; a request waits
    `wait` seconds for the kernel at most (None: KERNEL_WAIT). Must run as root."""
    kernel = Kernel.connect(socket, name="mount", argv=["symphony", "mount", mountpoint])
    try:
        if kernel.uid != 0:
            raise PermissionError(
                errno.EPERM,
                "the mount must run as root (it acts for each user, and mounts with allow_other)",
            )
        fs = KvFS(kernel, KERNEL_WAIT if wait is None else wait)
        pyfuse3.init(fs, mountpoint, OPTIONS)
        try:
            trio.run(fs.serve, ready)
        finally:
            pyfuse3.close(unmount=True)  # a no-op when umount already did it
    finally:
        kernel.close()
    return 0
