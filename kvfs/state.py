"""The state directory: named KV files outside /tmp survive a restart.

    STATE/namespace.json   directories, names, modes, owners, times (everything but /tmp)
    STATE/files/INO.kv     each file's contents in the canonical form (docs/kv-format.md)

Every write goes to a temporary file, is fsynced, then renamed over the old one, and the
directory is fsynced: a crash at any point leaves the old or the new version, never a
torn one. The namespace on disk never names a file whose data is not on disk: a namespace
save first writes every named file with entries and no data file yet, and a data file no
name needs any more is removed only once the namespace without that name is on disk. So
after a crash at any instant each named file is its last saved version or the new one.
namespace.json marks each file whose data was saved, so restore tells a file created empty
(no data file, none expected) from lost data (refused, EIO).

A failed save never fails the call that changed things, which stands in memory: it is
logged and tried again (a file at its next save, the namespace at the next change, both
at stop); only fsync reports it (EIO), as a disk's fsync would.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from kvfs.errors import FSError
from kvfs.format import exported_size, parse, read_meta, read_range
from kvfs.fs import FileSystem
from kvfs.inode import Inode

NAMESPACE = "namespace.json"
VERSION = 1
log = logging.getLogger("kvfs.state")

CHUNK = 8 << 20


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
        self.written: set[int] = set()  # files with a data file on disk
        self.stale = False  # the namespace on disk is older than the one in memory
        self.last: dict | None = None  # the namespace as last written, less next_ino
        fs.on_change = self.changed
        fs.on_namespace_change = self.namespace_changed
        fs.on_sync = self.sync
        fs.on_load = self.load_pages

    def _data(self, ino: int) -> Path:
        return self.files / f"{ino}.kv"

    def _walk(self) -> dict[int, Inode]:
        """Every inode with a name outside /tmp, by inode number (a loop, not recursion:
        a tree may be deeper than Python's stack)."""
        out: dict[int, Inode] = {}
        tmp = self.fs.root.entries["tmp"]
        stack = [self.fs.root]
        while stack:
            for child in stack.pop().entries.values():
                if child is not tmp and child.ino not in out:
                    out[child.ino] = child
                    if child.is_dir:
                        stack.append(child)
        return out

    # -- the file system's hooks ----------------------------------------------------------

    def changed(self, inode: Inode) -> None:
        """A changed file was closed or imported: save it, or log why not (it stays dirty)."""
        try:
            self.save_file(inode)
        except Exception:
            log.exception("saving inode %d failed; kept in memory, tried again at its next "
                          "save and at stop", inode.ino)

    def namespace_changed(self) -> None:
        """Save the namespace, or log why not (tried again at the next change and at stop)."""
        try:
            self.save_namespace()
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
        """Write a named file's data if it changed; the first time, the namespace too: it
        records that the file has data, so that restore knows a missing data file is lost."""
        if self._save(inode):
            self.save_namespace()

    def _save(self, inode: Inode) -> bool:
        """Write a named file's data if it changed; whether it is the file's first data file."""
        if inode.is_dir or inode.ino not in self.named or not inode.dirty:
            return False
        if inode.length and not inode.pages:
            return False  # restored but never loaded: what is on disk is already current
        first = inode.ino not in self.written
        self._write_data(inode)
        return first

    def _write_data(self, inode: Inode) -> None:
        # Streamed a chunk at a time: a long file is never held twice in memory.
        store, layout = self.fs.store, self.fs.layout
        size = exported_size(inode, layout)
        atomic_write(self._data(inode.ino), (read_range(inode, store, layout, off, CHUNK)
                                             for off in range(0, size, CHUNK)))
        inode.dirty = False
        self.written.add(inode.ino)

    def save_namespace(self) -> None:
        """Write the data of every named file with entries and none on disk yet, then the
        namespace, then remove the data files no name needs any more."""
        self.stale = True
        self.named = self._walk()
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
        if record != self.last:
            atomic_write(self.path / NAMESPACE, [json.dumps(
                {**record, "next_ino": self.fs.next_ino}, indent=1).encode()])
            self.last = record
        self.stale = False
        for ino in self.written - self.named.keys():
            self._data(ino).unlink(missing_ok=True)
        self.written &= self.named.keys()

    def _meta(self, inode: Inode) -> dict:
        meta = {k: getattr(inode, k) for k in ("mode", "uid", "gid", "atime", "mtime", "ctime")}
        if inode.is_dir:
            tmp = self.fs.root.entries["tmp"]
            meta["entries"] = {n: c.ino for n, c in inode.entries.items() if c is not tmp}
        else:
            meta["fingerprint"] = inode.fingerprint
            meta["saved"] = inode.ino in self.written
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
        try:
            record = json.loads(index.read_bytes())
            if record.get("version") != VERSION:
                raise ValueError(f"version {record.get('version')!r}")
        except (json.JSONDecodeError, ValueError) as e:
            raise FSError(errno.EINVAL, f"{index}: unreadable state ({e})") from e
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
        for key in ("mode", "uid", "gid", "atime", "mtime", "ctime"):
            setattr(root, key, record["root"][key])
        entries["tmp"] = root.entries["tmp"]
        root.entries, root.nlink = entries, 2 + sum(c.is_dir for c in entries.values())
        fs.next_ino = max(fs.next_ino, record["next_ino"])
        self.named, self.written = made, written
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
            m = read_meta(data)
            inode.fingerprint = m.header.layout.fingerprint
            inode.tokens, inode.positions = m.tokens, m.positions
            inode.excluded = m.excluded
            written.add(ino)
        elif meta.get("saved"):  # else created empty (also state from before the mark)
            raise FSError(errno.EIO, f"{data}: missing, yet {path!r} was saved there")
        return inode

    def load_pages(self, inode: Inode) -> None:
        """The K/V of a restored file, read and checked in full on its first open."""
        data = self._data(inode.ino)
        self.fs.fill(inode, parse(data.read_bytes(), self.fs.layout, self.fs.vocab_size),
                     quota=False)
