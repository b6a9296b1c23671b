"""Memory relief: room on the device for a pred that is short of pages.

A pred reserves every page its file needs on the device when it is admitted. When they are
not free, guesses (decoding ahead) give theirs back first; then pages move down (host
tier, then the swap file), first of files nobody has open, then of idle processes, then of
processes whose preds only wait in the run queue (preempted: they come back when admitted),
lowest priority and longest idle first. Pages never move that the asking process uses, or
a process with work admitted or in a step, or that a step in flight may write (a file with
a reservation open: a dropped guess is rolled back only when its step ends); and nothing
moves unless enough can. Failing that the pred waits while others run (they may go idle
and free theirs), and fails with ENOSPC only when nothing else is running.
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Iterable

from kvfs.errors import FSError
from kvfs.fs import FileSystem, Handle, Reservation
from kvfs.inode import Inode
from kvfs.pages import DEVICE, DISK, HOST, Page
from symphony.process import Process
from symphony.sched_stats import SchedStats


class Relief:
    def __init__(self, fs: FileSystem, procs: Callable[[], Iterable[Process]],
                 working: Callable[[], set[Process]], stats: SchedStats):
        """`working`: the processes with work admitted or in a step."""
        self.fs, self.procs, self.working, self.stats = fs, procs, working, stats

    def reserve(self, handle: Handle, count: int, *, cut: int | None = None,
                give_way: Callable[[], bool], others: bool,
                asker: Process | None = None) -> Reservation | None:
        """Room for `count` entries (after the first `cut`: fs.reserve), made if need be.
        `give_way` drops every guess and says whether there were any; `others`: whether
        other work is admitted or running; `asker`: whose pred it is (its pages stay). None:
        it must wait for them. Raises the FSError that fails the pred."""
        fs = self.fs
        try:
            return fs.reserve(handle, count, cut=cut)
        except FSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT) and give_way():
                return self.reserve(handle, count, cut=cut, give_way=give_way,
                                    others=others, asker=asker)
            if e.errno != errno.ENOSPC:
                raise
        self.relieve(self.device_need(handle.inode, count), asker)
        try:
            return fs.reserve(handle, count, cut=cut)
        except FSError as e:
            if e.errno != errno.ENOSPC or not others:
                raise
            self.stats.waits += 1
            return None

    def device_need(self, inode: Inode, count: int) -> int:
        """Device pages missing for `count` more entries of inode."""
        size = self.fs.page_size
        new = -(-(inode.length + count) // size) - len(inode.pages) + 1  # +1: a private tail
        down = sum(p is not None and p.tier != DEVICE for p in inode.pages)
        return max(0, new + down - self.fs.store.pool.free_in(DEVICE))

    def relieve(self, need: int, asker: Process | None = None) -> None:
        """Move `need` device pages down, or none if that many cannot move."""
        if need <= 0:
            return
        procs = list(self.procs())
        kept = self.working() | ({asker} if asker is not None else set())
        unopened = [i for i in self.fs.files() if i.opens == 0]
        protected = {id(page) for p in procs for h in p.fds.values()
                     if p in kept or h.inode.busy for page in h.inode.pages if page is not None}
        order = sorted((p for p in procs if p not in kept),
                       key=lambda p: (p.pending > 0, -p.nice, p.last_active))
        groups: list[tuple[Process | None, list[Inode]]] = [(None, unopened)]
        groups += [(p, [h.inode for h in p.fds.values()]) for p in order]
        victims: list[tuple[Process | None, list[Page]]] = []
        seen: set[int] = set(protected)
        for proc, inodes in groups:
            pages = []
            for page in (pg for inode in inodes for pg in inode.pages):
                if page is not None and page.tier == DEVICE and id(page) not in seen:
                    seen.add(id(page))
                    pages.append(page)
            if pages:
                victims.append((proc, pages))
        store = self.fs.store
        movable = sum(len(pages) for _, pages in victims)
        if min(movable, store.free_in(HOST) + store.free_in(DISK)) < need:
            return  # it cannot help: leave everyone where they are
        moved = 0
        for proc, pages in victims:
            n = store.move_down(pages[: need - moved])
            moved += n
            self.stats.pages_swapped_out += n
            if proc is not None and n:
                proc.swapped = True
                self.stats.preemptions += 1
            if moved >= need:
                return
