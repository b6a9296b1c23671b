"""The KV file system: namespace, open files, and the operations on KV files.

Every operation checks everything first and changes state only once nothing can fail, so
a refused call leaves files, pages and counts as they were. The pred hook (reserve, then
commit or rollback) is in reservation.py; FileSystem offers it as methods.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvfs import reservation
from kvfs.errors import FSError, NoRoom, enoent
from kvfs.format import (
    Header,
    Imported,
    Incoming,
    Layout,
    export_bytes,
    parse,
    read_range,
)
from kvfs.inflight import ImportsInFlight
from kvfs.inode import Inode, now_ns
from kvfs.inodes import DEFAULT_INODE_QUOTA, InodeQuota
from kvfs.kv_header import largest_file
from kvfs.pages import Page, PageStore
from kvfs.perm import ROOT, Cred, R, W, X, allowed, check, check_ids, check_sticky
from kvfs.ranges import covered, merge_ranges
from kvfs.reservation import Reservation  # what reserve returns: importable from here too

O_ACCMODE = os.O_ACCMODE
NAME_MAX = 255
PATH_MAX = 4096


@dataclass(eq=False)
class Handle:
    """An open KV file (what an fd points at)."""

    inode: Inode
    readable: bool
    writable: bool
    cred: Cred
    closed: bool = False


@dataclass
class StatResult:
    ino: int
    mode: int
    uid: int
    gid: int
    nlink: int
    tokens: int
    pages: int
    atime: int
    mtime: int
    ctime: int


def _bytes(name: str) -> int:
    """Its length as the OS counts NAME_MAX and PATH_MAX: UTF-8 bytes (a name the mount
    passed with bytes that are not UTF-8 keeps them as surrogates)."""
    return len(name.encode("utf-8", "surrogateescape"))


def split(path: str) -> list[str]:
    if not path.startswith("/"):
        raise FSError(errno.EINVAL, f"{path!r}: paths are absolute")
    if len(path) * 4 > PATH_MAX and _bytes(path) > PATH_MAX:  # UTF-8: 4 bytes a char at most
        raise FSError(errno.ENAMETOOLONG, f"{path[:64]!r}...: over PATH_MAX ({PATH_MAX} bytes)")
    parts = [p for p in path.split("/") if p]
    for p in parts:
        if len(p) * 4 > NAME_MAX and _bytes(p) > NAME_MAX:
            raise FSError(errno.ENAMETOOLONG, f"{path!r}: a name is over {NAME_MAX} bytes")
        if "\0" in p:
            raise FSError(errno.EINVAL, f"{path!r}: NUL in a name")
    return parts


@dataclass(frozen=True)
class NameChanges:
    """What a namespace call changed, for the state directory to save: each name of a
    directory that now names another inode, or none (`old` and `new` None where there was
    or is no such name), and the inodes whose attributes changed."""

    names: list[tuple[Inode, str, Inode | None, Inode | None]]  # (directory, name, old, new)
    touched: list[Inode]


class FileSystem:
    def __init__(self, store: PageStore, fingerprint: str, vocab_size: int | None = None,
                 inode_quota: int | None = DEFAULT_INODE_QUOTA):
        self.store, self.fingerprint, self.vocab_size = store, fingerprint, vocab_size
        # Inodes each user owns, and its limit (kvfs/inodes.py; None: no limit).
        self.inodes = InodeQuota(inode_quota)
        self.page_size = store.pool.page_size
        self.layout = Layout.of(store.pool, fingerprint)
        self.next_ino = 1
        self.root = self._new_inode(stat.S_IFDIR | 0o755, ROOT)
        self.root.nlink, self.root.parent = 2, None
        self.root.parent = self.root
        self._mkdir_in(self.root, "home", 0o755, ROOT)
        self._mkdir_in(self.root, "tmp", 0o1777, ROOT)
        # Hooks of the state directory: save a changed file, save a change of the namespace
        # (neither fails the call: a failed save is logged and tried again), make a file
        # durable for fsync (raises EIO when it cannot), and load the pages of a file
        # restored from disk on its first open.
        self.on_change: Callable[[Inode], None] = lambda inode: None
        self.on_namespace_change: Callable[[NameChanges], None] = lambda change: None
        self.on_sync: Callable[[Inode], None] = lambda inode: None
        self.on_load: Callable[[Inode, str], None] = lambda inode, path: None
        self.importing = ImportsInFlight()
        # Restored files whose pages have not loaded yet, and the pages each will take at
        # most: counted against its owner meanwhile (store.pending), so that a restart
        # never makes room for more than the quota (restored).
        self.unloaded: dict[Inode, int] = {}

    # -- inodes and paths ---------------------------------------------------------------

    def _new_inode(self, mode: int, cred: Cred) -> Inode:
        """A new inode, counted against cred's inode quota: the caller checked that quota
        (self.inodes.check) before changing anything."""
        inode = Inode(ino=self.next_ino, mode=mode, uid=cred.uid, gid=cred.gid)
        self.next_ino += 1
        self.inodes.add(inode.uid)
        if inode.is_dir:
            inode.entries = {}
        else:
            inode.fingerprint = self.fingerprint
        return inode

    def _walk(self, cred: Cred, parts: list[str], path: str) -> Inode:
        node = self.root
        for name in parts:
            if not node.is_dir:
                raise FSError(errno.ENOTDIR, f"{path!r}: a component is not a directory")
            check(cred, node, X, f"{path!r}: search permission denied")
            if name == ".":
                continue
            node = node.parent if name == ".." else node.entries.get(name)
            if node is None:
                raise enoent(repr(path))
        return node

    def lookup(self, cred: Cred, path: str) -> Inode:
        inode = self._walk(cred, split(path), path)
        self._names_a_directory(path, inode, False)
        return inode

    def _parent(self, cred: Cred, path: str) -> tuple[Inode, str]:
        """The directory a path's last name lives in, checked for search, and that name."""
        parts = split(path)
        if not parts or parts[-1] in (".", ".."):
            raise FSError(errno.EINVAL, f"{path!r}: names no entry")
        parent = self._walk(cred, parts[:-1], path)
        if not parent.is_dir:
            raise FSError(errno.ENOTDIR, f"{path!r}: parent is not a directory")
        check(cred, parent, X, f"{path!r}: search permission denied")
        return parent, parts[-1]

    @staticmethod
    def _names_a_directory(path: str, inode: Inode | None, making: bool) -> None:
        """As POSIX: a path that ends in / names a directory: ENOTDIR for a file there,
        EISDIR for a file a call would make there (`making`)."""
        if path.endswith("/") and (inode is None or not inode.is_dir):
            if inode is not None:
                raise FSError(errno.ENOTDIR, f"{path!r}: not a directory")
            if making:
                raise FSError(errno.EISDIR, f"{path!r}: a KV file's name cannot end in /")

    def _writable_dir(self, cred: Cred, parent: Inode, path: str) -> None:
        check(cred, parent, W | X, f"{path!r}: write permission denied on the directory")

    def files(self) -> Iterator[Inode]:
        """Every named KV file, once each (hard links included once)."""
        seen: set[int] = set()
        stack = [self.root]
        while stack:
            for child in stack.pop().entries.values():
                if child.is_dir:
                    stack.append(child)
                elif child.ino not in seen:
                    seen.add(child.ino)
                    yield child

    # -- directories --------------------------------------------------------------------

    def _mkdir_in(self, parent: Inode, name: str, mode: int, cred: Cred) -> Inode:
        d = self._new_inode(stat.S_IFDIR | (mode & 0o7777), cred)
        d.nlink, d.parent = 2, parent
        parent.entries[name] = d
        parent.nlink += 1
        parent.touch()
        return d

    def mkdir(self, cred: Cred, path: str, mode: int = 0o755) -> Inode:
        parent, name = self._parent(cred, path)
        if name in parent.entries:
            raise FSError(errno.EEXIST, repr(path))
        self._writable_dir(cred, parent, path)
        self.inodes.check(cred.uid, f"mkdir {path!r}")
        d = self._mkdir_in(parent, name, mode, cred)
        self.on_namespace_change(NameChanges([(parent, name, None, d)], [parent]))
        return d

    def rmdir(self, cred: Cred, path: str) -> None:
        parent, name = self._parent(cred, path)
        d = parent.entries.get(name)
        if d is None:
            raise enoent(repr(path))
        # Permission first, as Linux's may_delete: ENOTEMPTY to a caller who may not remove
        # the directory would tell what it holds though it may not be read.
        self._writable_dir(cred, parent, path)
        check_sticky(cred, parent, d, repr(path))
        if not d.is_dir:
            raise FSError(errno.ENOTDIR, repr(path))
        self._not_skeleton(d, path)  # full or empty, as rmdir of a mount point is
        if d.entries:
            raise FSError(errno.ENOTEMPTY, repr(path))
        del parent.entries[name]
        parent.nlink -= 1
        parent.touch()
        self.inodes.drop(d.uid)
        self.on_namespace_change(NameChanges([(parent, name, d, None)], [parent]))

    def _not_skeleton(self, inode: Inode | None, path: str) -> None:
        """EBUSY for /home and /tmp: they stay where they are (homes are made in /home, and
        saving skips /tmp), as a mount point does."""
        if inode is not None and inode in (self.root.entries["home"], self.root.entries["tmp"]):
            raise FSError(errno.EBUSY, f"{path!r} is part of the namespace's skeleton")

    def readdir(self, cred: Cred, path: str) -> list[tuple[str, Inode]]:
        d = self.lookup(cred, path)
        if not d.is_dir:
            raise FSError(errno.ENOTDIR, repr(path))
        check(cred, d, R, f"{path!r}: read permission denied")
        return sorted(d.entries.items())

    def home(self, cred: Cred, user: str) -> str:
        """/home/<user>, made on first use, owned by the user. It counts against the
        user's inode quota but is made even past it (the kernel's doing, not the user's, as
        a chown by root is), so a user at its limit can still attach."""
        if "/" in user or user in ("", ".", ".."):
            raise FSError(errno.EINVAL, f"{user!r} is not a user name")
        home = self.root.entries["home"]
        if user not in home.entries:
            d = self._mkdir_in(home, user, 0o755, Cred(cred.uid, cred.gid))
            self.on_namespace_change(NameChanges([(home, user, None, d)], [home]))
        return f"/home/{user}"

    # -- metadata -----------------------------------------------------------------------

    def _holes(self, length: int, excluded: list[tuple[int, int]]) -> list[bool]:
        """For each page of a file: are its entries, up to the file's length, all out of
        attention (a hole: no page)? A partly filled last page too, as a truncate into a
        punched page leaves it (an append re-fills it fresh, `_needs_private_tail`)."""
        size = self.page_size
        return [covered(excluded, i * size, min((i + 1) * size, length))
                for i in range(self._pages_for(length))]

    def page_count(self, inode: Inode) -> int:
        """Pages a file holds: its pages that are not holes, up to its length (pages reserved
        past it are a pred's). A restored file whose pages have not loaded yet: those its
        load will take (`_holes`). Counted once loaded: a page whose entries were punched
        in parts stays held, though `_holes` would leave it out."""
        if not inode.excluded:  # no holes (a hole's entries are excluded): stays O(1)
            return self._pages_for(inode.length)
        if inode.length and not inode.pages:  # restored, not loaded (as `open` tells)
            return self._holes(inode.length, inode.excluded).count(False)
        pages = inode.pages[: self._pages_for(inode.length)]
        return len(pages) - pages.count(None)

    def restored(self, inode: Inode) -> None:
        """A file restored with its entries and no pages yet: the pages its load will take,
        at most (fewer where they are shared with pages its owner holds then), count against
        its owner from now on, even past its quota (they were its pages before the restart),
        until it loads, is replaced or freed."""
        n = self.page_count(inode)
        if n:
            self.unloaded[inode] = n
            self.store.promise(inode.uid, n)

    def _settle(self, inode: Inode) -> None:
        """The file's pages are loaded, replaced or freed: its owner is charged what it
        holds, no longer what it would take at most."""
        n = self.unloaded.pop(inode, 0)
        if n:
            self.store.promise(inode.uid, -n)

    def stat_inode(self, inode: Inode) -> StatResult:
        return StatResult(
            ino=inode.ino, mode=inode.mode, uid=inode.uid, gid=inode.gid, nlink=inode.nlink,
            tokens=inode.length, pages=0 if inode.is_dir else self.page_count(inode),
            atime=inode.atime, mtime=inode.mtime, ctime=inode.ctime,
        )

    def stat(self, cred: Cred, path: str) -> StatResult:
        return self.stat_inode(self.lookup(cred, path))

    def fstat(self, handle: Handle) -> StatResult:
        return self.stat_inode(self._live(handle))

    def chmod(self, cred: Cred, path: str, mode: int) -> None:
        inode = self.lookup(cred, path)
        if not (cred.root or cred.uid == inode.uid):
            raise FSError(errno.EPERM, f"{path!r}: only the owner may chmod")
        inode.mode = stat.S_IFMT(inode.mode) | (mode & 0o7777)
        inode.touch(modified=False)
        self.on_namespace_change(NameChanges([], [inode]))

    def access(self, cred: Cred, path: str, want: int) -> None:
        """Raise ENOENT or EACCES unless `path` exists and cred may R/W/X it as asked."""
        check(cred, self.lookup(cred, path), want, f"access {path!r}: permission denied")

    def chown(self, cred: Cred, path: str, uid: int, gid: int) -> None:
        """uid or gid -1 leaves that one as it is."""
        inode = self.lookup(cred, path)
        if not cred.root:
            raise FSError(errno.EPERM, f"{path!r}: only root may chown")
        check_ids(uid, gid, f"chown {path!r}", leave=True)
        if uid != -1 and uid != inode.uid:  # its counts move, even past the limits
            self.inodes.drop(inode.uid)
            self.inodes.add(uid)
            # The file's holds of its pages (those a pred reserved too) become uid's, and
            # so do the pages it will take once loaded.
            self.store.transfer(inode.pages, inode.uid, uid)
            n = self.unloaded.get(inode, 0)
            self.store.promise(inode.uid, -n)
            self.store.promise(uid, n)
        inode.uid = inode.uid if uid == -1 else uid
        inode.gid = inode.gid if gid == -1 else gid
        inode.touch(modified=False)
        self.on_namespace_change(NameChanges([], [inode]))

    # -- names --------------------------------------------------------------------------

    def unlink(self, cred: Cred, path: str) -> None:
        parent, name = self._parent(cred, path)
        inode = parent.entries.get(name)
        if inode is None:
            raise enoent(repr(path))
        self._names_a_directory(path, inode, False)
        self._writable_dir(cred, parent, path)  # first, as rmdir
        check_sticky(cred, parent, inode, repr(path))
        if inode.is_dir:
            raise FSError(errno.EISDIR, repr(path))
        del parent.entries[name]
        parent.touch()
        inode.nlink -= 1
        inode.touch(modified=False)
        self._maybe_free(inode)
        self.on_namespace_change(NameChanges([(parent, name, inode, None)], [parent, inode]))

    def link(self, handle: Handle, path: str) -> None:
        """Give an open file (anonymous or not) another name.

        As Linux's protected_hardlinks: only its owner, or who may read and write it, may
        link a file, since a name keeps its pages charged to the owner's quota. (A fork or
        splice of a file the caller may read is the caller's own to link: its pages are
        charged to the caller too, pages.py, so the name keeps nothing on another's quota.)"""
        inode = self._live(handle)
        cred = handle.cred
        if not (cred.uid == inode.uid or allowed(cred, inode, R | W)):
            raise FSError(errno.EPERM, f"link {path!r}: not the owner of the file, and "
                          "no read and write permission on it")
        parent, name = self._parent(cred, path)
        if name in parent.entries:
            raise FSError(errno.EEXIST, repr(path))
        self._names_a_directory(path, None, True)
        self._writable_dir(cred, parent, path)
        parent.entries[name] = inode
        parent.touch()
        inode.nlink += 1
        inode.touch(modified=False)
        inode.dirty = True  # now named: the next save writes it
        self.on_namespace_change(NameChanges([(parent, name, None, inode)], [parent, inode]))

    def rename(self, cred: Cred, old: str, new: str) -> None:
        """Atomic: the new name points at the file, or it never happened."""
        src_dir, src_name = self._parent(cred, old)
        dst_dir, dst_name = self._parent(cred, new)
        inode = src_dir.entries.get(src_name)
        if inode is None:
            raise enoent(repr(old))
        target = dst_dir.entries.get(dst_name)
        self._names_a_directory(old, inode, False)
        self._names_a_directory(new, target, not inode.is_dir)
        if target is inode:
            return
        self._not_skeleton(inode, old)
        self._not_skeleton(target, new)
        self._writable_dir(cred, src_dir, old)
        self._writable_dir(cred, dst_dir, new)
        check_sticky(cred, src_dir, inode, repr(old))
        if inode.is_dir:
            node = dst_dir
            while node is not self.root:
                if node is inode:
                    raise FSError(errno.EINVAL, f"{new!r} is inside {old!r}")
                node = node.parent
        if target is not None:
            check_sticky(cred, dst_dir, target, repr(new))
            if inode.is_dir and not target.is_dir:
                raise FSError(errno.ENOTDIR, f"{new!r} is not a directory")
            if not inode.is_dir and target.is_dir:
                raise FSError(errno.EISDIR, f"{new!r} is a directory")
            if target.is_dir and target.entries:
                raise FSError(errno.ENOTEMPTY, repr(new))
        # Nothing can fail from here on.
        if target is not None:
            if target.is_dir:
                dst_dir.nlink -= 1
                self.inodes.drop(target.uid)
            else:
                target.nlink -= 1
                self._maybe_free(target)
        del src_dir.entries[src_name]
        dst_dir.entries[dst_name] = inode
        if inode.is_dir and src_dir is not dst_dir:
            src_dir.nlink -= 1
            dst_dir.nlink += 1
            inode.parent = dst_dir
        for d in (src_dir, dst_dir):
            d.touch()
        inode.touch(modified=False)
        self.on_namespace_change(NameChanges(
            [(src_dir, src_name, inode, None), (dst_dir, dst_name, target, inode)],
            [src_dir, dst_dir, inode]))

    # -- open files ---------------------------------------------------------------------

    def open(self, cred: Cred, path: str, flags: int = os.O_RDONLY, mode: int = 0o600) -> Handle:
        """POSIX open for KV files; path "" makes an anonymous file (always read-write)."""
        acc = flags & O_ACCMODE
        if acc not in (os.O_RDONLY, os.O_WRONLY, os.O_RDWR):
            raise FSError(errno.EINVAL, f"open {path!r}: bad access mode")
        if path == "":
            self.inodes.check(cred.uid, "open anonymous file")
            inode = self._new_inode(stat.S_IFREG | (mode & 0o7777), cred)
            return self._handle(inode, cred, True, True)
        if path.startswith("/") and not path.strip("/"):
            raise FSError(errno.EISDIR, repr(path))
        parent, name = self._parent(cred, path)
        inode = parent.entries.get(name)
        self._names_a_directory(path, inode, bool(flags & os.O_CREAT))
        if inode is None:
            if not flags & os.O_CREAT:
                raise enoent(repr(path))
            self._writable_dir(cred, parent, path)
            self.inodes.check(cred.uid, f"open {path!r}")
            inode = self._new_inode(stat.S_IFREG | (mode & 0o7777), cred)
            inode.nlink = 1
            parent.entries[name] = inode
            parent.touch()
            self.on_namespace_change(NameChanges([(parent, name, None, inode)], [parent]))
            return self._handle(inode, cred, acc != os.O_WRONLY, acc != os.O_RDONLY)
        if flags & os.O_CREAT and flags & os.O_EXCL:
            raise FSError(errno.EEXIST, repr(path))
        if inode.is_dir:
            raise FSError(errno.EISDIR, repr(path))
        readable, writable = acc != os.O_WRONLY, acc != os.O_RDONLY
        trunc = bool(flags & os.O_TRUNC)
        want = (R if readable else 0) | (W if writable or trunc else 0)
        check(cred, inode, want, f"open {path!r}: permission denied")
        if inode.fingerprint != self.fingerprint:
            raise FSError(errno.EINVAL, f"open {path!r}: the file belongs to another model "
                          f"({inode.fingerprint[:16]}, serving {self.fingerprint[:16]})")
        if inode.length and not inode.pages:
            self.on_load(inode, path)
        handle = self._handle(inode, cred, readable, writable)
        if trunc and inode.length:
            try:
                self.truncate(handle, 0)
            except FSError:
                self.close(handle)
                raise
        return handle

    def _handle(self, inode: Inode, cred: Cred, readable: bool, writable: bool) -> Handle:
        inode.opens += 1
        return Handle(inode, readable, writable, cred)

    def _live(self, handle: Handle) -> Inode:
        if handle.closed:
            raise FSError(errno.EBADF, "file descriptor is closed")
        return handle.inode

    def _writable(self, handle: Handle, what: str) -> Inode:
        inode = self._live(handle)
        if not handle.writable:
            raise FSError(errno.EBADF, f"{what}: file not open for writing")
        if inode.busy:
            raise FSError(errno.EBUSY, f"{what}: a forward pass is writing the file")
        return inode

    def _readable(self, handle: Handle, what: str) -> Inode:
        inode = self._live(handle)
        if not handle.readable:
            raise FSError(errno.EBADF, f"{what}: file not open for reading")
        return inode

    def close(self, handle: Handle) -> None:
        inode = self._live(handle)
        handle.closed = True
        inode.opens -= 1
        if inode.dirty and inode.nlink > 0:
            self.on_change(inode)
        self._maybe_free(inode)

    def _maybe_free(self, inode: Inode) -> None:
        """Free a file's pages, and give back its inode, once it has neither a name nor
        an open handle."""
        if inode.nlink == 0 and inode.opens == 0 and not inode.is_dir:
            self._settle(inode)
            self.store.unref(inode.pages, inode.uid)
            inode.pages, inode.table = [], None
            self.inodes.drop(inode.uid)

    def fsync(self, handle: Handle) -> None:
        inode = self._live(handle)
        if inode.nlink > 0:
            self.on_sync(inode)

    # -- the canonical form (docs/kv-format.md) ------------------------------------------

    def export(self, handle: Handle) -> bytes:
        return export_bytes(self._readable(handle, "export"), self.store, self.layout)

    def read_bytes(self, handle: Handle, offset: int, size: int) -> bytes:
        """Bytes [offset, offset + size) of the export, reading only the pages they cover."""
        return read_range(self._readable(handle, "read"), self.store, self.layout, offset, size)

    def fill(self, inode: Inode, imported: Imported, quota: bool = True,
             shared: Mapping[int, Page | int] | None = None) -> None:
        """Give a file the entries and K/V of an import in place of what it held, all or
        nothing: its old pages are freed only once the new ones are written. quota=False:
        the owner's quota is not asked (a restored file's load: its pages are charged to
        its owner already, as those it would take at most, `restored`, and the load only
        puts what it holds in their place).
        `shared` (a restore's): full pages, none a hole, that hold the same K/V as the
        import's at their index, so are held instead of allocated: a page the owner holds
        already (it costs nothing), or the index of an earlier page of this import."""
        shared = shared or {}
        n, size = len(imported.tokens), self.page_size
        excluded = merge_ranges(list(imported.excluded))
        holes = self._holes(n, excluded)
        need = holes.count(False) - len(shared)
        self._room(inode, need, need if quota else 0)
        fresh = iter(self.store.new(need, inode.uid, quota))
        pages: list[Page | None] = []
        for i, hole in enumerate(holes):
            same = shared.get(i)
            pages.append(None if hole else next(fresh) if same is None
                         else pages[same] if isinstance(same, int) else same)
        pool, full = self.store.pool, n // size
        # Whole pages in one scatter, straight from views of the import; the tail by rows.
        kept = [i for i in range(full) if not holes[i] and i not in shared]
        if kept:
            k, v = (src[:, : full * size].view(src.shape[0], full, size, *src.shape[2:])
                    for src in (imported.k, imported.v))
            if len(kept) < full:
                k, v = k[:, kept], v[:, kept]
            pool.write_pages([pages[i].slot for i in kept], k, v)
        if n % size and pages[-1] is not None:
            pool.write_rows(pages[-1].slot, 0, imported.k[:, full * size:],
                            imported.v[:, full * size:])
        self.store.ref([pages[i] for i in shared], inode.uid)
        old, inode.pages, inode.table = inode.pages, pages, None
        inode.tokens, inode.positions = list(imported.tokens), list(imported.positions)
        inode.excluded = excluded
        inode.fingerprint = self.fingerprint  # parse checked it: even over another model's file
        self.store.unref(old, inode.uid)
        self._settle(inode)

    def _import_target(self, cred: Cred, path: str) -> tuple[Inode, str, Inode | None]:
        """Where an import to `path` goes: its directory, name, and the file it rewrites (None:
        it makes one). Checked as a write is: permission to write the file, else to write
        and search the directory."""
        parent, name = self._parent(cred, path)
        old = parent.entries.get(name)
        self._names_a_directory(path, old, True)
        if old is None:
            self._writable_dir(cred, parent, path)
        elif old.is_dir:
            raise FSError(errno.EISDIR, repr(path))
        else:
            check(cred, old, W, f"import {path!r}: write permission denied")
        return parent, name, old

    @contextmanager
    def receive(self, cred: Cred, path: str) -> Iterator[Incoming]:
        """An import stream to `path` for the block's length, checked before its body is
        taken: the caller's permission now, then its header as soon as that arrives, whose
        length must fit what the file's owner could ever hold, and whose declared size must
        keep the caller's streams in flight within their bound (kvfs/inflight.py). The bytes
        kept before the header is whole count too, then that size, against the caller until
        the block ends, however it ends."""
        old = self._import_target(cred, path)[2]
        owner = cred.uid if old is None else old.uid
        if old is None:
            self.inodes.check(cred.uid, f"import {path!r}")
        taken = 0

        def hold(kept: int) -> None:
            nonlocal taken
            if kept > taken:
                self.importing.take(cred.uid, kept - taken, self.largest_file(), path)
                taken = kept

        def admit(header: Header) -> None:
            nonlocal taken
            self._could_hold(owner, header.length, path)
            self.importing.give(cred.uid, taken)  # what it kept becomes its declared size
            taken = 0
            hold(header.size)

        try:
            yield Incoming(self.layout, admit, hold)
        finally:
            self.importing.give(cred.uid, taken)

    def largest_file(self) -> int:
        """Bytes of the largest file the device pool could hold."""
        return largest_file(self.store.capacity("device"), self.page_size,
                            self.store.pool.page_bytes)

    def _could_hold(self, uid: int, length: int, path: str) -> None:
        """Refuse a file of `length` entries whose pages could never all be had for uid, even
        with nothing else held: EDQUOT past uid's quota, EFBIG past the device pool. Counted
        unpunched: which pages are holes is known only once the whole file is in."""
        pages = self._pages_for(length)
        limit, capacity = self.store.limit(uid), self.store.capacity("device")
        if limit is not None and pages > limit:
            raise FSError(errno.EDQUOT, f"import {path!r}: {length} entries take up to {pages} "
                          f"pages, over uid {uid}'s quota of {limit}")
        if pages > capacity:
            raise FSError(errno.EFBIG, f"import {path!r}: {length} entries take up to {pages} "
                          f"pages, more than the KV pool's {capacity}")

    def import_file(self, cred: Cred, path: str, data: bytes | bytearray | memoryview,
                    mode: int = 0o600) -> Inode:
        """The canonical form `data` into `path`, as a write would put it there: over a file,
        its contents are replaced in place (same inode, owner, group, mode and links; `mode`
        is for a new file only). A bad or foreign-model file is refused whole (EINVAL), and
        a refused import changes nothing."""
        parent, name, old = self._import_target(cred, path)
        if old is not None and old.busy:
            raise FSError(errno.EBUSY, f"import {path!r}: a forward pass is writing the file")
        if old is None:
            self.inodes.check(cred.uid, f"import {path!r}")
        imported = parse(data, self.layout, self.vocab_size)
        if old is not None:
            self.fill(old, imported)
            old.touch()
            self.on_change(old)
            return old
        inode = self._new_inode(stat.S_IFREG | (mode & 0o7777), cred)
        try:
            self.fill(inode, imported)
        except BaseException:
            self.inodes.drop(inode.uid)  # never named: it dies here
            raise
        parent.entries[name] = inode
        inode.nlink = 1
        parent.touch()
        inode.touch()
        self.on_namespace_change(NameChanges([(parent, name, None, inode)], [parent]))
        self.on_change(inode)
        return inode

    # -- contents -----------------------------------------------------------------------

    def read(self, handle: Handle, start: int, count: int) -> tuple[list[int], list[int]]:
        """Token ids and positions of entries [start, start + count), clipped to the end."""
        inode = self._readable(handle, "read")
        if start < 0 or count < 0:
            raise FSError(errno.EINVAL, f"read: bad range start {start}, count {count}")
        end = min(inode.length, start + count)
        inode.atime = now_ns()
        return inode.tokens[start:end], inode.positions[start:end]

    def _pages_for(self, length: int) -> int:
        return -(-length // self.page_size)

    def _needs_private_tail(self, inode: Inode, length: int) -> bool:
        """Whether appending after `length` entries must first replace the last page: it
        is partly filled and shared (copy-on-write) or a punched hole (re-filled fresh)."""
        if length % self.page_size == 0:
            return False
        tail = inode.pages[length // self.page_size]
        return tail is None or tail.refs > 1

    def _private(self, inode: Inode, i: int) -> None:
        """Page i becomes the file's own: a shared page is copied, a punched hole re-filled
        fresh (room checked by the caller)."""
        page = inode.pages[i]
        inode.pages[i] = (self.store.copy(page, inode.uid) if page is not None
                          else self.store.new(1, inode.uid)[0])
        inode.table = None
        self.store.unref([page], inode.uid)

    def _room(self, inode: Inode, extra_device: int, new: int,
              shared: Sequence[Page | None] = ()) -> None:
        """Fail (EDQUOT, ENOSPC) unless `new` pages, and those of `shared` the file's owner
        holds in no file yet, may be charged to the owner, and `extra_device` more device
        pages are free."""
        self.store.charge(inode.uid, new, shared)
        free = self.store.pool.free_in("device")
        if extra_device > free:
            raise NoRoom(f"kv pool: {extra_device} device pages needed, {free} free",
                         extra_device - free)

    def _cut_entries(self, inode: Inode, length: int) -> None:
        """Drop the entries from `length` on (tokens, positions, excluded ranges)."""
        del inode.tokens[length:], inode.positions[length:]
        inode.excluded = [(s, min(e, length)) for s, e in inode.excluded if s < length]

    def truncate(self, handle: Handle, length: int) -> None:
        inode = self._writable(handle, "truncate")
        if not 0 <= length <= inode.length:
            raise FSError(errno.EINVAL, f"truncate: {length} is outside [0, {inode.length}]")
        if length == inode.length:
            return
        keep = self._pages_for(length)
        shared_tail = (length % self.page_size and inode.pages[keep - 1] is not None
                       and inode.pages[keep - 1].refs > 1)
        if shared_tail:
            self._room(inode, 1, 1)
        self.store.unref(inode.pages[keep:], inode.uid)
        del inode.pages[keep:]
        inode.table = None
        if shared_tail:
            self._private(inode, length // self.page_size)
        self._cut_entries(inode, length)
        inode.touch()

    def punch(self, handle: Handle, start: int, end: int) -> None:
        """Entries [start, end) leave attention; full pages left with no entry in attention
        are freed. Every other entry keeps its place and position."""
        inode = self._writable(handle, "punch")
        if not 0 <= start <= end <= inode.length:
            raise FSError(errno.EINVAL, f"punch: [{start}, {end}) is outside [0, {inode.length}]")
        if start == end:
            return
        inode.excluded = merge_ranges([*inode.excluded, (start, end)])
        size = self.page_size
        for i in range(start // size, min(self._pages_for(end), inode.length // size)):
            if inode.pages[i] is not None and covered(inode.excluded, i * size, (i + 1) * size):
                self.store.unref([inode.pages[i]], inode.uid)
                inode.pages[i] = inode.table = None
        inode.touch()

    def keep(self, handle: Handle, start: int, entries: Sequence[int]) -> None:
        """The file becomes entries [0, start) followed by `entries` (strictly increasing,
        each in [start, length)): what a tree pred's accepted branch keeps. Their K/V rows
        move down within the file, never recomputed; excluded ranges come with them."""
        inode = self._writable(handle, "keep")
        length, size, pages = inode.length, self.page_size, inode.pages
        if not 0 <= start <= length:
            raise FSError(errno.EINVAL, f"keep: start {start} is outside [0, {length}]")
        prev = start - 1
        for i, e in enumerate(entries):
            if not prev < e < length:
                raise FSError(errno.EINVAL, f"keep: entries[{i}] = {e} is not in "
                              f"({prev}, {length}): entries are strictly increasing, "
                              f"from start {start}")
            prev = e
        n = start + len(entries)
        if n == length:  # every entry kept where it is
            return
        out = [covered(inode.excluded, e, e + 1) for e in entries]
        excluded = merge_ranges([(s, min(e, start)) for s, e in inode.excluded if s < start]
                                + [(d, d + 1) for d, o in enumerate(out, start) if o])
        # Rows out of attention are never read again: only attended ones move.
        moves = [(e, d) for d, (e, o) in enumerate(zip(entries, out, strict=True), start)
                 if e != d and not o]
        written = {d // size for _, d in moves}
        if n % size and pages[n // size] is not None:
            written.add(n // size)  # the last page is private, as truncate leaves it
        read = {e // size for e, _ in moves} - written
        self._room_for(inode, written, read)
        self._own(inode, written)
        self.store.bring_up(pages[i] for i in read)
        if moves:  # one gather, then one scatter: in place is safe
            src, dst = ([pages[i // size].slot * size + i % size for i in side]
                        for side in zip(*moves, strict=True))
            self.store.pool.move_rows(src, dst)
        freed = pages[self._pages_for(n):]
        del pages[self._pages_for(n):]
        for i in range(start // size, n // size):  # full pages now wholly out of attention
            if pages[i] is not None and covered(excluded, i * size, (i + 1) * size):
                freed.append(pages[i])
                pages[i] = None
        self.store.unref(freed, inode.uid)
        inode.table = None
        inode.tokens[start:] = [inode.tokens[e] for e in entries]
        inode.positions[start:] = [inode.positions[e] for e in entries]
        inode.excluded = excluded
        inode.touch()

    def shift(self, handle: Handle, start: int, end: int, delta: int, limit: int,
              rotate: Callable[[torch.Tensor, int], None]) -> None:
        """Entries [start, end) move by `delta` positions, each kept in [0, limit). Their
        keys, rotated by position, are re-rotated by one call of rotate(rows, delta): rows
        the int64 device pool rows (slot * page_size + offset), on the CPU, of the range's
        attended entries (none: no call), in pages made the file's own and on the device
        first; rotate turns them in every shard (KVPool.key_layers)."""
        inode = self._writable(handle, "shift")
        if not 0 <= start <= end <= inode.length:
            raise FSError(errno.EINVAL, f"shift: [{start}, {end}) is outside "
                          f"[0, {inode.length}]")
        moved = [p + delta for p in inode.positions[start:end]]
        for i, p in enumerate(moved, start):
            if not 0 <= p < limit:
                raise FSError(errno.EOVERFLOW, f"shift: entry {i} would move to position "
                              f"{p}, outside [0, {limit})")
        if start == end or delta == 0:
            return
        size = self.page_size
        live = [i for i in range(start, end) if not covered(inode.excluded, i, i + 1)]
        own = {i // size for i in live}
        self._room_for(inode, own)
        self._own(inode, own)
        if live:
            rows = torch.tensor([inode.pages[i // size].slot * size + i % size for i in live],
                                dtype=torch.int64)
            rotate(rows, delta)
        inode.positions[start:end] = moved
        inode.touch()

    def _room_for(self, inode: Inode, own: set[int], read: Iterable[int] = ()) -> None:
        """Room (EDQUOT, ENOSPC) for _own(inode, own) and for bringing up the pages at
        `read`."""
        pages = inode.pages
        new = sum(pages[i] is None or pages[i].refs > 1 for i in own)
        up = [pages[i] for i in own if pages[i] is not None and pages[i].refs == 1]
        up += [pages[i] for i in read if pages[i] is not None]
        down = len({id(p) for p in up if p.tier != "device"})
        if down + new:  # else nothing to charge or to find room for
            self._room(inode, down + new, new)

    def _own(self, inode: Inode, own: set[int]) -> None:
        """The pages at indices `own` become the file's own, on the device."""
        for i in sorted(own):
            page = inode.pages[i]
            if page is None or page.refs > 1:
                self._private(inode, i)
        self.store.bring_up(inode.pages[i] for i in own)

    def fork(self, handle: Handle, cred: Cred, *, snapshot: bool = False) -> Handle:
        """A copy-on-write clone, as a new anonymous file of the caller's: full pages are
        shared, only a partly filled last page is copied. The clone's pages are charged to
        the caller: the copy, and each shared page it held in no file yet (pages.py), so a
        fork of one's own file costs its last page at most. A `snapshot` (export's, which
        lives as long as the export) counts against the caller's inodes and pages but is
        not refused at their limits for what it shares: reading a file needs no room for
        pages that are there already. Its copy of a partly filled last page is new memory,
        refused past the quota as any other (else each export stream held open would hold
        one page more, without bound)."""
        inode = self._readable(handle, "fork")
        # Only the committed entries: a forward pass may have reserved pages past them.
        pages = inode.pages[: self._pages_for(inode.length)]
        tail = inode.length % self.page_size != 0 and pages[-1] is not None
        full = pages[:-1] if tail else pages
        if not snapshot:
            self.inodes.check(cred.uid, "fork")
            self.store.charge(cred.uid, int(tail), full)
        elif tail:
            self.store.charge(cred.uid, 1)
        if tail and self.store.pool.free_in("device") < 1:
            raise NoRoom("fork: no device page free for the last page", 1)
        clone = self._new_inode(stat.S_IFREG | 0o600, cred)
        clone.tokens, clone.positions = list(inode.tokens), list(inode.positions)
        clone.excluded = list(inode.excluded)
        self.store.ref(full, cred.uid)
        clone.pages = list(full)
        if tail:
            clone.pages.append(self.store.copy(pages[-1], cred.uid, quota=False))
        return self._handle(clone, cred, True, True)

    def splice(self, src: Handle, start: int, end: int, dst: Handle) -> None:
        """Append entries [start, end) of src to dst, K/V included, never recomputed: whole
        pages are shared where both sides are page-aligned, rows are copied elsewhere."""
        s = self._readable(src, "splice source")
        d = self._writable(dst, "splice destination")
        if not 0 <= start <= end <= s.length:
            raise FSError(errno.EINVAL, f"splice: [{start}, {end}) is outside [0, {s.length}]")
        if start == end:
            return
        size, base, count = self.page_size, d.length, end - start
        aligned = start % size == 0 and base % size == 0
        shared = (count // size) if aligned else 0  # whole source pages taken by reference
        tail = self._needs_private_tail(d, base)
        new = self._pages_for(base + count) - len(d.pages) - shared
        down = int(base % size != 0 and d.pages[base // size] is not None
                   and d.pages[base // size].tier != "device")
        taken = s.pages[start // size: start // size + shared]
        # The pages it takes are charged to dst's owner too, each it holds in no file yet.
        self._room(d, down + new + tail, new + tail, taken)
        # Snapshot what is copied before anything of dst changes (src may be dst).
        src_pages = list(s.pages)
        tokens, positions = s.tokens[start:end], s.positions[start:end]
        excluded = [(max(a, start) - start + base, min(b, end) - start + base)
                    for a, b in s.excluded if a < end and b > start]
        if base % size:
            self.store.bring_up([d.pages[base // size]])
            if tail:
                self._private(d, base // size)
        self.store.ref(taken, d.uid)
        d.pages.extend(taken)
        d.pages.extend(self.store.new(new, d.uid))
        d.table = None
        self._copy_rows(src_pages, start + shared * size, end, d, base + shared * size)
        d.tokens.extend(tokens)
        d.positions.extend(positions)
        d.excluded = merge_ranges([*d.excluded, *excluded])
        d.touch()

    def _copy_rows(self, src_pages: list[Page | None], start: int, end: int,
                   d: Inode, at: int) -> None:
        """Copy K/V rows [start, end) of a page list into d's device pages from row `at`."""
        size, pool = self.page_size, self.store.pool
        cache: dict[int, tuple] = {}
        i = start
        while i < end:
            src_page, src_off = divmod(i, size)
            dst_page, dst_off = divmod(at + (i - start), size)
            n = min(size - src_off, size - dst_off, end - i)
            page = src_pages[src_page]
            if page is not None:  # a punched hole's rows are out of attention: leave them
                if src_page not in cache:
                    cache = {src_page: self.store.read(page)}
                k, v = cache[src_page]
                pool.write_rows(d.pages[dst_page].slot, dst_off,
                                k[:, src_off:src_off + n], v[:, src_off:src_off + n])
            i += n

    # -- the pred hook (reservation.py) -------------------------------------------------

    def reserve(self, handle: Handle, count: int, cut: int | None = None) -> Reservation:
        """reservation.reserve: room for `count` entries (after the first `cut`)."""
        return reservation.reserve(self, handle, count, cut)

    def reserve_after(self, res: Reservation, count: int) -> Reservation:
        """reservation.reserve_after: room for `count` entries right after those of `res`."""
        return reservation.reserve_after(self, res, count)

    def commit(self, res: Reservation, tokens: list[int], positions: list[int]) -> None:
        """reservation.commit: the entries of `res` join the file."""
        reservation.commit(self, res, tokens, positions)

    def rollback(self, res: Reservation) -> None:
        """reservation.rollback: give back the room of `res`."""
        reservation.rollback(self, res)
