"""Inodes: directories, and KV files (an ordered list of entries stored in pages)."""

from __future__ import annotations

import stat
import time
from dataclasses import dataclass, field

from kvfs.pages import Page


def now_ns() -> int:
    return time.time_ns()


@dataclass(eq=False)
class Inode:
    ino: int
    mode: int  # file type and permission bits, as in st_mode
    uid: int
    gid: int
    nlink: int = 0
    atime: int = field(default_factory=now_ns)
    mtime: int = field(default_factory=now_ns)
    ctime: int = field(default_factory=now_ns)
    # Directories: name -> inode.
    entries: dict[str, Inode] | None = None
    parent: Inode | None = None
    # KV files. Entry i's K/V is row i % page_size of pages[i // page_size]; a punched
    # whole page is None. `excluded` holds half-open entry ranges out of attention. A file
    # restored from the state directory has entries but no pages until its first open.
    fingerprint: str = ""
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    excluded: list[tuple[int, int]] = field(default_factory=list)
    pages: list[Page | None] = field(default_factory=list)
    # The page table reserve last gave out (each page's device slot), kept so a pred costs
    # O(new pages), not O(pages): good while the store's `moves` is still `table_moves`
    # (no page moved tier since), None once the page list changed other than by reserve or
    # rollback.
    table: list[int] | None = None
    table_moves: int = -1
    opens: int = 0  # open handles: an unlinked file lives until the last close
    reserved: int = 0  # reservations not yet committed or rolled back (fs.reserve)
    dirty: bool = False  # changed since it was last saved

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def perm(self) -> int:
        return stat.S_IMODE(self.mode)

    @property
    def busy(self) -> bool:
        """A forward pass may be writing into the file's pages."""
        return self.reserved > 0

    @property
    def length(self) -> int:
        return len(self.tokens)

    def touch(self, *, modified: bool = True) -> None:
        t = now_ns()
        self.ctime = t
        if modified:
            self.mtime = t
            self.dirty = True
