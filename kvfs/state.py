"""The state directory: named KV files outside /tmp survive a restart.

    STATE/namespace.json   directories, names, modes, owners, times (everything but /tmp)
    STATE/files/INO.kv     each file's contents in the canonical form (docs/kv-format.md)

Every write goes to a temporary file, is fsynced, then renamed over the old one, and the
directory is fsynced: a crash at any point leaves the old or the new version, never a
torn one. A file's data is written before the namespace that names it.
"""

from __future__ import annotations

import errno
import json
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


CHUNK = 8 << 20


def atomic_write(path: Path, chunks: Iterable[bytes]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
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
        fs.on_change = self.save_file
        fs.on_namespace_change = self.save_namespace
        fs.on_load = self.load_pages

    def _data(self, inode: Inode) -> Path:
        return self.files / f"{inode.ino}.kv"

    def persisted(self) -> dict[int, Inode]:
        """Every inode with a name outside /tmp, by inode number."""
        out: dict[int, Inode] = {}
        tmp = self.fs.root.entries["tmp"]

        def walk(d: Inode) -> None:
            for child in d.entries.values():
                if child is tmp:
                    continue
                out[child.ino] = child
                if child.is_dir:
                    walk(child)

        walk(self.fs.root)
        return out

    # -- saving ---------------------------------------------------------------------------

    def save_file(self, inode: Inode) -> None:
        if inode.is_dir or inode.ino not in self.persisted() or not inode.dirty:
            return
        if inode.length and not inode.pages:
            return  # restored but never loaded: what is on disk is already current
        # Streamed a chunk at a time: a long file is never held twice in memory.
        store, layout = self.fs.store, self.fs.layout
        size = exported_size(inode, layout)
        atomic_write(self._data(inode), (read_range(inode, store, layout, off, CHUNK)
                                         for off in range(0, size, CHUNK)))
        inode.dirty = False

    def save_namespace(self) -> None:
        nodes = self.persisted()
        record = {
            "version": VERSION,
            "next_ino": self.fs.next_ino,
            "root": self._meta(self.fs.root),
            "inodes": {str(ino): self._meta(inode) for ino, inode in nodes.items()},
        }
        atomic_write(self.path / NAMESPACE, [json.dumps(record, indent=1).encode()])

    def _meta(self, inode: Inode) -> dict:
        meta = {k: getattr(inode, k) for k in ("mode", "uid", "gid", "atime", "mtime", "ctime")}
        if inode.is_dir:
            tmp = self.fs.root.entries["tmp"]
            meta["entries"] = {n: c.ino for n, c in inode.entries.items() if c is not tmp}
        else:
            meta["fingerprint"] = inode.fingerprint
        return meta

    def shutdown(self) -> None:
        """Save every changed named file, then the namespace."""
        for inode in self.persisted().values():
            self.save_file(inode)
        self.save_namespace()

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
        fs.next_ino = max(fs.next_ino, record["next_ino"])
        made: dict[int, Inode] = {}

        def build(ino: int, meta: dict, parent: Inode) -> Inode:
            inode = Inode(ino=ino, mode=meta["mode"], uid=meta["uid"], gid=meta["gid"],
                          atime=meta["atime"], mtime=meta["mtime"], ctime=meta["ctime"])
            if stat.S_ISDIR(inode.mode):
                inode.entries, inode.parent, inode.nlink = {}, parent, 2
                for name, child in meta["entries"].items():
                    node = made.get(child) or build(child, metas[child], inode)
                    inode.entries[name] = node
                    node.nlink += 0 if node.is_dir else 1
                    inode.nlink += node.is_dir
            else:
                inode.fingerprint = meta["fingerprint"]
                data = self._data(inode)
                if data.exists():  # never saved: created, then nothing written
                    m = read_meta(data)
                    inode.fingerprint = m.header.layout.fingerprint
                    inode.tokens, inode.positions = m.tokens, m.positions
                    inode.excluded = m.excluded
            made[ino] = inode
            return inode

        root = fs.root
        tmp = root.entries["tmp"]
        for key in ("mode", "uid", "gid", "atime", "mtime", "ctime"):
            setattr(root, key, record["root"][key])
        root.entries.clear()
        root.nlink = 2
        for name, child in record["root"]["entries"].items():
            node = build(child, metas[child], root)
            root.entries[name] = node
            root.nlink += node.is_dir
        root.entries["tmp"] = tmp
        root.nlink += 1
        for data in self.files.glob("*.kv"):
            if int(data.stem) not in made:
                data.unlink()

    def load_pages(self, inode: Inode) -> None:
        """The K/V of a restored file, read and checked in full on its first open."""
        data = self._data(inode)
        self.fs.fill(inode, parse(data.read_bytes(), self.fs.layout, self.fs.vocab_size))
