"""The state directory: named KV files outside /tmp survive a restart.

    STATE/namespace.json   directories, names, modes, owners, times (everything but /tmp)
    STATE/namespace.log    the changes to it since (kvfs/journal.py)
    STATE/files/INO.kv     each file's contents in the canonical form (docs/kv-format.md)

Every write goes to a temporary file, is fsynced, then renamed over the old one, and the
directory is fsynced: a crash at any point leaves the old or the new version, never a
torn one; a change of names is a line appended to the journal and fdatasynced. When the
journal has as many lines as there are named inodes (1024 at least), the namespace is
written whole and the journal starts again: a change costs O(1) on the loop, amortized.
The namespace on disk never names a file whose data is not on disk: a file's data is
written before the change or the namespace that names it, and a data file no name needs
any more is removed only once the change without that name is on disk. So after a crash
at any instant each named file is its last saved version or the new one. The namespace
marks each file whose data was saved, so restore tells a file created empty (no data
file, none expected) from lost data (refused, EIO).

A failed save never fails the call that changed things, which stands in memory: it is
logged and tried again (a file at its next save, the namespace at the next change, both
at stop); only fsync reports it (EIO), as a disk's fsync would.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import stat
import weakref
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from kvfs import journal
from kvfs.errors import FSError
from kvfs.format import Imported, exported_size, parse, read_meta, read_range
from kvfs.fs import FileSystem, NameChanges
from kvfs.inode import Inode
from kvfs.journal import JOURNAL
from kvfs.pages import Page
from kvfs.ranges import covered, merge_ranges

NAMESPACE = "namespace.json"
VERSION = 1
JOURNAL_MIN = 1024  # lines the journal may reach before the namespace is written whole
log = logging.getLogger("kvfs.state")

CHUNK = 8 << 20


_held: dict[Path, int] = {}  # the state directories this process holds: their locks' fds


def hold(path: Path) -> int:
    """Take the state directory for this process's life (an flock on STATE/lock, which goes
    with the process however it ends), or EBUSY naming the kernel that has it: two kernels on
    one directory write the same swap file, files and namespace, and the last to save loses
    the other's names. Returns the lock's fd, to keep open. A directory this process holds
    already is its own (`symphony kernel` takes it before it waits for its ranks; the
    kernel takes it again): the same fd."""
    key = path.resolve()
    if key in _held:
        return _held[key]
    fd = os.open(path / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise FSError(errno.EBUSY, f"state directory {path}: another kernel uses it (pid "
                      f"{holder})") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _held[key] = fd
    return fd


def release(path: Path) -> None:
    """Give back a state directory this process holds (hold); nothing if it holds none."""
    fd = _held.pop(path.resolve(), None)
    if fd is not None:
        os.close(fd)


def atomic_write(path: Path, chunks: Iterable[bytes]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    # 0600 whatever the umask: a state directory others can enter must not hand them the
    # entries of a user's 0600 file, nor the namespace.
    tmp.unlink(missing_ok=True)  # one a crash left may have another mode
    with open(tmp, "wb", opener=lambda name, flags: os.open(name, flags, 0o600)) as f:
        for data in chunks:
            f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StateDir:
    def __init__(self, path: str | Path, fs: FileSystem):
        self.path, self.fs = Path(path), fs
        self.files = self.path / "files"
        self.files.mkdir(parents=True, exist_ok=True)
        self.files.chmod(0o700)
        # Every inode named outside /tmp, as of the last namespace change: one lookup tells
        # whether a file is saved at all.
        self.named: dict[int, Inode] = {}
        # Per named inode, the names it has in named directories (the root's included): a
        # change of names tells from it which inodes come to be named or stop being.
        self.refs: dict[int, int] = {}
        self.written: set[int] = set()  # files with a data file on disk
        # The namespace on disk is older than the one in memory (a failed save): the next
        # save writes it whole, as a journal line after a lost one would not do.
        self.stale = False
        self.last: dict | None = None  # the namespace as last written, less next_ino
        self.generation = 0  # namespace.json's, which its journal carries
        self.journal_lines = 0  # changes in the journal since
        # Where the full pages restored files loaded are, by owner and digest (_digest): the
        # files (weakly: a file gone takes its places along) and page indices that held
        # them, each checked as it is when looked up (load_pages), so no page is kept alive
        # here and none changed or freed since is shared.
        self.loaded: dict[tuple[int, bytes], list[tuple[weakref.ref[Inode], int]]] = {}
        # Per restored file not loaded yet, its data file's identity when the restore read
        # its header (_identity): the load reads the file only if it is still that one.
        self.seen: weakref.WeakKeyDictionary[Inode, tuple[int, ...]] = (
            weakref.WeakKeyDictionary())
        fs.on_change = self.changed
        fs.on_namespace_change = self.namespace_changed
        fs.on_sync = self.sync
        fs.on_load = self.load_pages

    def _data(self, ino: int) -> Path:
        return self.files / f"{ino}.kv"

    def _walk(self) -> tuple[dict[int, Inode], dict[int, int]]:
        """Every inode with a name outside /tmp, by inode number, and how many such names
        each has (a loop, not recursion: a tree may be deeper than Python's stack)."""
        out: dict[int, Inode] = {}
        refs: dict[int, int] = {}
        tmp = self.fs.root.entries["tmp"]
        stack = [self.fs.root]
        while stack:
            for child in stack.pop().entries.values():
                if child is tmp:
                    continue
                refs[child.ino] = refs.get(child.ino, 0) + 1
                if child.ino not in out:
                    out[child.ino] = child
                    if child.is_dir:
                        stack.append(child)
        return out, refs

    # -- the file system's hooks ----------------------------------------------------------

    def changed(self, inode: Inode) -> None:
        """A changed file was closed or imported: save it, or log why not (it stays dirty)."""
        try:
            self.save_file(inode)
        except Exception:
            log.exception("saving inode %d failed; kept in memory, tried again at its next "
                          "save and at stop", inode.ino)

    def namespace_changed(self, change: NameChanges) -> None:
        """Save a change of names, or log why not (the namespace is then saved whole at the
        next change, at fsync and at stop)."""
        try:
            self._record(change)
        except Exception:
            log.exception("saving the namespace failed; kept in memory, tried again at the "
                          "next change and at stop")

    def sync(self, inode: Inode) -> None:
        """fsync: the file, and a namespace whose save failed, are on disk, or EIO."""
        try:
            self.save_file(inode)
            if self.stale:
                self.save_namespace()
        except OSError as e:
            raise FSError(errno.EIO, f"fsync of inode {inode.ino}: {e}") from e

    # -- saving ---------------------------------------------------------------------------

    def save_file(self, inode: Inode) -> None:
        """Write a named file's data if it changed, then its attributes: its times, and that
        it has data, so that restore knows a missing data file is lost."""
        if self._save(inode):
            self._record(NameChanges([], [inode]))

    def _save(self, inode: Inode) -> bool:
        """Write a named file's data if it changed; whether it did."""
        if inode.is_dir or inode.ino not in self.named or not inode.dirty:
            return False
        if inode.length and not inode.pages:
            return False  # restored but never loaded: what is on disk is already current
        self._write_data(inode)
        return True

    def _write_data(self, inode: Inode) -> None:
        # Streamed a chunk at a time: a long file is never held twice in memory.
        store, layout = self.fs.store, self.fs.layout
        size = exported_size(inode, layout)
        atomic_write(self._data(inode.ino), (read_range(inode, store, layout, off, CHUNK)
                                             for off in range(0, size, CHUNK)))
        inode.dirty = False
        self.written.add(inode.ino)

    def _record(self, change: NameChanges) -> None:
        """Put a change on disk: a line of the journal, or the namespace whole when the
        journal is long or behind. Raises what the disk says (then the next save is whole)."""
        if self.stale or self.journal_lines >= max(JOURNAL_MIN, len(self.named)):
            self.save_namespace()
            return
        root, ops = self.fs.root, []
        counts: dict[int, int] = {}  # names gained (lost: negative) in named directories
        by_ino: dict[int, Inode] = {}
        for d, name, old, new in change.names:
            if not (d is root or self.named.get(d.ino) is d):
                continue  # under /tmp, or in a directory with no name
            if old is not None:
                ops.append(["unlink", d.ino, name])
                counts[old.ino], by_ino[old.ino] = counts.get(old.ino, 0) - 1, old
            if new is not None:
                ops.append(["link", d.ino, name, new.ino])
                counts[new.ino], by_ino[new.ino] = counts.get(new.ino, 0) + 1, new
        entered: list[Inode] = []
        left: list[Inode] = []
        for ino, n in counts.items():
            self._count(by_ino[ino], n, entered, left)
        for inode in entered:  # a file's data before any name of it
            if not inode.is_dir and inode.length and inode.ino not in self.written:
                self._write_data(inode)
        new = {inode.ino for inode in entered}
        ops = ([["set", inode.ino, self._meta(inode)] for inode in entered] + ops
               + [["drop", inode.ino] for inode in left])
        for inode in change.touched:
            if inode is root:
                ops.append(["root", self._attrs(inode)])
            elif self.named.get(inode.ino) is inode and inode.ino not in new:
                ops.append(["attr", inode.ino, self._attrs(inode)])
        if not ops:
            return
        try:
            journal.append(self.path / JOURNAL, ops, self.fs.next_ino)
        except BaseException:
            self.stale = True
            raise
        self.journal_lines += 1
        for inode in left:
            if inode.ino in self.written and not self._unloaded(inode):
                self._data(inode.ino).unlink(missing_ok=True)
                self.written.discard(inode.ino)

    def _unloaded(self, inode: Inode) -> bool:
        """A restored file not loaded yet that still has a name, under /tmp or in a
        directory with no name: its data file is its only copy of its K/V, kept until it
        loads (load_pages) or the file goes."""
        return inode in self.seen and inode.nlink > 0

    def _count(self, inode: Inode, n: int, entered: list[Inode], left: list[Inode]) -> None:
        """inode has n names more (fewer, n < 0) in named directories: when it comes to
        have some, or none, it enters or leaves the named inodes, a directory with its tree."""
        stack = [(inode, n)]
        while stack:
            node, n = stack.pop()
            before = self.refs.get(node.ino, 0)
            after = before + n
            if after:
                self.refs[node.ino] = after
            else:
                self.refs.pop(node.ino, None)
            if before == 0 < after:
                self.named[node.ino] = node
                entered.append(node)
                if node.is_dir:
                    stack += [(child, 1) for child in node.entries.values()]
            elif before > 0 == after:
                del self.named[node.ino]
                left.append(node)
                if node.is_dir:
                    stack += [(child, -1) for child in node.entries.values()]

    def save_namespace(self) -> None:
        """Write the data of every named file with entries and none on disk yet, then the
        namespace and a new journal, then remove the data files no name needs any more."""
        self.stale = True
        self.named, self.refs = self._walk()
        for inode in self.named.values():
            if not inode.is_dir and inode.length and inode.ino not in self.written:
                self._write_data(inode)
        record = {
            "version": VERSION,
            "root": self._meta(self.fs.root),
            "inodes": {str(ino): self._meta(inode) for ino, inode in self.named.items()},
        }
        # A change under /tmp alone leaves this as it was: no write. next_ino may then be
        # behind on disk, but only numbers of inodes never saved are then used again.
        if record != self.last or self.journal_lines:
            generation = self.generation + 1
            atomic_write(self.path / NAMESPACE, [json.dumps(
                {**record, "next_ino": self.fs.next_ino, "generation": generation},
                indent=1).encode()])
            self.generation, self.last = generation, record
            atomic_write(self.path / JOURNAL, [journal.header(generation)])
            self.journal_lines = 0
        self.stale = False
        needed = self.named.keys() | {inode.ino for inode in self.seen if self._unloaded(inode)}
        for ino in self.written - needed:
            self._data(ino).unlink(missing_ok=True)
        self.written &= needed

    def _attrs(self, inode: Inode) -> dict:
        attrs = {k: getattr(inode, k) for k in ("mode", "uid", "gid", "atime", "mtime",
                                                 "ctime")}
        if not inode.is_dir:
            attrs["fingerprint"] = inode.fingerprint
            attrs["saved"] = inode.ino in self.written
        return attrs

    def _meta(self, inode: Inode) -> dict:
        meta = self._attrs(inode)
        if inode.is_dir:
            tmp = self.fs.root.entries["tmp"]
            meta["entries"] = {n: c.ino for n, c in inode.entries.items() if c is not tmp}
        return meta

    def shutdown(self) -> None:
        """Save every changed named file, then the namespace: all that can be saved is, what
        cannot is logged, and then EIO says what was lost."""
        lost = []
        for inode in self.named.values():
            try:
                self._save(inode)
            except Exception:
                log.exception("saving inode %d at stop failed", inode.ino)
                lost.append(f"inode {inode.ino}")
        try:
            self.save_namespace()
        except Exception:
            log.exception("saving the namespace at stop failed")
            lost.append("the namespace")
        if lost:
            raise FSError(errno.EIO, f"{self.path}: not saved: {', '.join(lost)}")

    # -- restoring ------------------------------------------------------------------------

    def restore(self) -> None:
        """Rebuild the namespace from disk: entries now, pages on each file's first open.
        Leftovers of interrupted writes and files no name refers to are removed."""
        index = self.path / NAMESPACE
        for leftover in [*self.path.glob("*.tmp"), *self.files.glob("*.tmp")]:
            leftover.unlink()
        if not index.exists():
            self.save_namespace()
            return
        changes = self.path / JOURNAL
        try:
            record = json.loads(index.read_bytes())
            if record.get("version") != VERSION:
                raise ValueError(f"version {record.get('version')!r}")
            text = changes.read_bytes() if changes.exists() else b""
            replayed = journal.replay(record, text, self.fs.root.ino)
        except (json.JSONDecodeError, ValueError) as e:
            raise FSError(errno.EINVAL, f"{index}: unreadable state ({e})") from e
        self.generation = record.get("generation", 0)
        fs, metas = self.fs, {int(k): v for k, v in record["inodes"].items()}
        made: dict[int, Inode] = {}
        written: set[int] = set()
        root = fs.root
        entries: dict[str, Inode] = {}
        # A loop, not recursion: a tree may be deeper than Python's stack. Everything is
        # built aside and put in place only once the whole namespace has been read.
        stack = [(root, entries, record["root"]["entries"], "")]
        while stack:
            parent, into, names, path = stack.pop()
            for name, ino in names.items():
                node = made.get(ino)
                if node is None:
                    node = made[ino] = self._restored(ino, metas[ino], f"{path}/{name}",
                                                      written)
                    if node.is_dir:
                        node.parent = parent
                        stack.append((node, node.entries, metas[ino]["entries"],
                                      f"{path}/{name}"))
                into[name] = node
                node.nlink += not node.is_dir  # a file has a link per name
            if parent is not root:
                parent.nlink = 2 + sum(c.is_dir for c in into.values())
        # Each restored inode counts against its owner's inode quota (kvfs/inodes.py), past
        # it if need be (it was the owner's before the restart); those replaced are given
        # back: a restart leaves every user's count as it was. A file's pages count against
        # its owner's page quota likewise, before they load (FileSystem.restored).
        for name, node in root.entries.items():
            if name != "tmp":
                fs.inodes.drop(node.uid)
        for node in made.values():
            fs.inodes.add(node.uid)
            fs.restored(node)
        fs.inodes.drop(root.uid)
        for key in ("mode", "uid", "gid", "atime", "mtime", "ctime"):
            setattr(root, key, record["root"][key])
        fs.inodes.add(root.uid)
        entries["tmp"] = root.entries["tmp"]
        root.entries, root.nlink = entries, 2 + sum(c.is_dir for c in entries.values())
        fs.next_ino = max(fs.next_ino, record["next_ino"])
        self.named, self.written = made, written
        self.refs = self._walk()[1]
        if replayed is None or replayed or not text.endswith(b"\n"):
            # The journal folded into a namespace written whole: a new one starts, clear
            # of the changes and of any torn line a crash left at its end. A disk that
            # cannot take it now stops no start: what is on disk stands, and the next
            # change saves the namespace whole.
            try:
                self.save_namespace()
            except OSError:
                log.exception("saving the restored namespace failed; tried again at the "
                              "next change, at fsync and at stop")
        for data in self.files.glob("*.kv"):
            if int(data.stem) not in made:
                data.unlink()

    def _restored(self, ino: int, meta: dict, path: str, written: set[int]) -> Inode:
        """One inode of namespace.json (a directory without its entries yet); a file's
        entries come from its data file, if it has one."""
        inode = Inode(ino=ino, mode=meta["mode"], uid=meta["uid"], gid=meta["gid"],
                      atime=meta["atime"], mtime=meta["mtime"], ctime=meta["ctime"])
        if stat.S_ISDIR(inode.mode):
            inode.entries = {}
            return inode
        inode.fingerprint = meta["fingerprint"]
        data = self._data(ino)
        if data.exists():
            # Taken before the header is read: a change after it shows at the load.
            self.seen[inode] = _identity(os.stat(data))
            m = read_meta(data)
            inode.fingerprint = m.header.layout.fingerprint
            inode.tokens, inode.positions = m.tokens, m.positions
            inode.excluded = m.excluded
            written.add(ino)
        elif meta.get("saved"):  # else created empty (also state from before the mark)
            raise FSError(errno.EIO, f"{data}: missing, yet {path!r} was saved there")
        return inode

    def load_pages(self, inode: Inode, path: str) -> None:
        """The K/V of a restored file, read and checked in full on its first open. A full
        page identical (token ids, positions, K/V bytes) to one the owner holds in a file
        loaded before, or to an earlier page of this one, is shared instead of allocated
        again: forks, links and aligned splices share their pages after a restart as they
        did before it. The owner was charged the file's pages unshared since the restart
        (FileSystem.restored): the load charges what the file holds in their place, as
        many or fewer. Pages of other users' are never looked at: sharing between users is
        not made again. A data file changed on disk since the restart is not loaded (EIO,
        `_changed`): one that is not the file the restore read (its identity), or whose
        entries are not those restored (the owner was charged for those: others could take
        more pages). `path`: the file as the open named it, for the error.
        A file moved out of the saved namespace before it loaded (to /tmp) had its data
        file kept for this (_unloaded), removed once loaded."""
        data = self._data(inode.ino)
        try:
            with open(data, "rb") as f:
                # The file read is the one checked: a rename over it after this is not.
                if _identity(os.fstat(f.fileno())) != self.seen.get(inode):
                    raise self._changed(path, data, "is not the one the restart read")
                raw = f.read()
        except FileNotFoundError:
            raise self._changed(path, data, "is gone") from None
        imported = parse(raw, self.fs.layout, self.fs.vocab_size)
        if (imported.tokens, imported.positions, imported.excluded) != (
                inode.tokens, inode.positions, inode.excluded):
            raise self._changed(path, data, "holds other entries than the restart read")
        size, uid = self.fs.page_size, inode.uid
        excluded = merge_ranges(imported.excluded)
        keys: dict[int, tuple[int, bytes]] = {}
        shared: dict[int, Page | int] = {}
        first: dict[tuple[int, bytes], int] = {}  # this file's first page of each key
        for i in range(len(imported.tokens) // size):
            if covered(excluded, i * size, (i + 1) * size):
                continue  # a hole stays one
            keys[i] = key = (uid, _digest(imported, i, size))
            j = first.get(key)
            if j is not None and _same_kv(imported, i, size, *_rows(imported, j, size)):
                shared[i] = j
            elif (page := self._loaded_page(key, imported, i)) is not None:
                shared[i] = page
            else:
                first.setdefault(key, i)
        self.fs.fill(inode, imported, quota=False, shared=shared)
        del self.seen[inode]
        if inode.ino in self.written and self.named.get(inode.ino) is not inode:
            self._data(inode.ino).unlink(missing_ok=True)  # kept for this load alone
            self.written.discard(inode.ino)
        ref = weakref.ref(inode, lambda gone: self._forget(gone, set(keys.values())))
        for i, key in keys.items():
            self.loaded.setdefault(key, []).append((ref, i))

    @staticmethod
    def _changed(path: str, data: Path, why: str) -> FSError:
        """EIO for a file whose data file changed on disk since the restart, named as the
        open named it: the caller may be any user, and where root keeps the data file is
        root's; the kernel's log names the data file and why."""
        log.error("%s %s: not loaded", data, why)
        return FSError(errno.EIO, f"open {path!r}: its data file changed on disk since the "
                       "restart")

    def _loaded_page(self, key: tuple[int, bytes], imported: Imported, i: int
                     ) -> Page | None:
        """A page of the owner's identical to page i of `imported`: found by its key among
        the places of pages loaded before, then checked against that file as it is now,
        entries and bytes (the digest is of a part: it may alias two pages). The page must
        be full and below its file's length, where nothing is writing it (a forward pass
        writes from the length on; other writes are over within their call): once
        compared, it may be shared. Places passed on the way that hold no such page any
        more are dropped."""
        size, uid = self.fs.page_size, key[0]
        lo, hi = i * size, (i + 1) * size
        places = self.loaded.get(key, [])
        found, kept, n = None, [], 0
        while found is None and n < len(places):
            ref, j = places[n]
            n += 1
            holder = ref()
            page = (holder.pages[j] if holder is not None and holder.uid == uid
                    and (j + 1) * size <= holder.length and j < len(holder.pages) else None)
            if page is None:
                continue
            kept.append((ref, j))
            if (holder.tokens[j * size:(j + 1) * size] == imported.tokens[lo:hi]
                    and holder.positions[j * size:(j + 1) * size] == imported.positions[lo:hi]
                    and _same_kv(imported, i, size, *self.fs.store.read(page))):
                found = page
        kept += places[n:]
        if kept:
            self.loaded[key] = kept
        else:
            self.loaded.pop(key, None)
        return found

    def _forget(self, ref: weakref.ref, keys: set[tuple[int, bytes]]) -> None:
        """A loaded file is gone: its places leave the index."""
        for key in keys:
            places = [p for p in self.loaded.get(key, ()) if p[0] is not ref]
            if places:
                self.loaded[key] = places
            else:
                self.loaded.pop(key, None)


def _identity(st: os.stat_result) -> tuple[int, ...]:
    """What tells a data file's bytes apart cheaply: a write changes its change time, which
    no one but the clock sets (a digest of the whole file would make a start as slow as
    reading every file); a rename over it, its inode."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _rows(imported: Imported, i: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of page i of an import: [layers, size, heads, dim] each."""
    return imported.k[:, i * size:(i + 1) * size], imported.v[:, i * size:(i + 1) * size]


def _same_kv(imported: Imported, i: int, size: int, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether page i of an import holds exactly these K and V bytes (NaNs and signed
    zeros included, as a float comparison would not)."""
    return all(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
               for a, b in zip(_rows(imported, i, size), (k, v), strict=True))


def _digest(imported: Imported, i: int, size: int) -> bytes:
    """The index's key of page i of an import: sha256 of its token ids, positions and its
    last entry's K/V in every layer (which, past the first layer, depend on every entry
    before: pages of equal tokens after different ones part here), not of the whole page:
    hashing every byte would cost more than the load; the bytes are compared on a match."""
    lo, hi = i * size, (i + 1) * size
    h = hashlib.sha256()
    h.update(np.asarray(imported.tokens[lo:hi], dtype="<i8").tobytes())
    h.update(np.asarray(imported.positions[lo:hi], dtype="<i8").tobytes())
    for t in (imported.k, imported.v):
        h.update(t[:, hi - 1].contiguous().view(torch.uint8).numpy().tobytes())
    return h.digest()
