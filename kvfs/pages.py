"""Logical KV pages: refcounted, movable between tiers, charged to each user holding them.

A file's page list holds `Page` objects, never raw pool ids, so a page shared by many files
moves tier once, for all of them. Full pages are immutable once shared; only the store
writes page contents, and only into pages with a single reference.

Every reference is a hold by a user (the holding file's owner, `Inode.uid`). A page is
charged to each user that holds it, once per user however many of that user's files,
forks and snapshots hold it, as XFS and btrfs quotas charge a reflinked extent to each
owner: `PageStore.used[uid]` is the number of distinct pages uid holds. A user's first
hold of a page charges it (refused with EDQUOT past its quota, when asked), its last hold
gives it back; the page itself is freed when its last hold goes. So sharing a page with
another user (a fork, a splice, then a link) never leaves the page on the first user's
quota once it lets go, and forks by the user who holds the pages cost nothing.

A user is also charged `PageStore.pending[uid]`: the pages its files restored from the state
directory will take once they load, at most (kvfs/fs.py `restored`), so a restart never
lets a user hold more than its quota. Its charge, `charged(uid)`, is both together.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable
from pathlib import Path

import torch

from kvfs.errors import FSError, NoRoom
from kvfs.pool import DEVICE, DISK, HOST, KVPool

SHARED = -1  # Page.uid of a page held by more than one user


class Page:
    """A page and its holds: `refs` in all; while every hold is one user's (almost always),
    that user is `uid` and `holders` is None, else `uid` is SHARED and `holders` maps each
    holding uid to its holds (they add up to refs). So `p.uid == uid` alone tells that uid
    is the page's only holder: the fast path of ref and unref."""

    __slots__ = ("tier", "slot", "refs", "uid", "holders")

    def __init__(self, tier: str, slot: int, uid: int):
        self.tier, self.slot, self.refs, self.uid = tier, slot, 1, uid
        self.holders: dict[int, int] | None = None

    def held_by(self, uid: int) -> bool:
        return self.uid == uid or (self.holders is not None and uid in self.holders)

    def __repr__(self) -> str:
        who = self.uid if self.holders is None else self.holders
        return f"Page({self.tier}:{self.slot}, refs={self.refs}, uid={who})"


class SwapFile:
    """The disk tier: fixed-size page slots in one file, lost at restart like swap."""

    def __init__(self, path: Path, slots: int, page_shape: tuple, dtype: torch.dtype):
        self.path, self.slots, self.shape, self.dtype = path, slots, page_shape, dtype
        self.page_bytes = 2 * dtype.itemsize * int(torch.Size(page_shape).numel())
        self._free = list(range(slots - 1, -1, -1))
        # 0600 whatever the umask: its pages are users' KV entries (docs/syscalls.md).
        self._file = (os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600),
                                "w+b") if slots else None)
        if self._file is not None:
            os.fchmod(self._file.fileno(), 0o600)

    def free_count(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)

    def write(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._file.seek(slot * self.page_bytes)
        for t in (k, v):
            self._file.write(t.contiguous().view(torch.uint8).numpy().tobytes())

    def read(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._file.seek(slot * self.page_bytes)
        raw = bytearray(self._file.read(self.page_bytes))
        both = torch.frombuffer(raw, dtype=torch.uint8).view(self.dtype)
        k, v = both.view(2, *self.shape)
        return k, v


class PageStore:
    def __init__(
        self,
        pool: KVPool,
        swap_path: Path | None = None,
        disk_pages: int = 0,
        quota: dict[int, int] | None = None,
        default_quota: int | None = None,
    ):
        self.pool = pool
        self.swap = SwapFile(swap_path, disk_pages if swap_path else 0, pool.shape.dims,
                             pool.dtype) \
            if swap_path else None
        self.quota, self.default_quota = dict(quota or {}), default_quota
        self.used: dict[int, int] = {}  # uid -> live pages it holds (distinct: see above)
        self.pending: dict[int, int] = {}  # uid -> pages its unloaded files will take, at most
        self.live: set[Page] = set()
        # Bumped whenever a page changes tier (and so slot): a page table kept since the last
        # bump still names every page where it is (FileSystem.reserve keeps one per file).
        self.moves = 0

    # -- accounting ---------------------------------------------------------------------

    def limit(self, uid: int) -> int | None:
        return None if uid == 0 else self.quota.get(uid, self.default_quota)

    def charged(self, uid: int) -> int:
        """What counts against uid's quota: the pages it holds, and those its restored
        files not loaded yet will take at most."""
        return self.used.get(uid, 0) + self.pending.get(uid, 0)

    def promise(self, uid: int, n: int) -> None:
        """uid's restored files not loaded yet will take n pages more (fewer, n < 0) at most:
        charged to it even past its limit (they were its pages before the restart)."""
        left = self.pending.get(uid, 0) + n
        if left:
            self.pending[uid] = left
        else:
            self.pending.pop(uid, None)

    def charge(self, uid: int, n: int, pages: Iterable[Page | None] = ()) -> None:
        """Fail with EDQUOT, changing nothing, when uid may not hold n more pages and the
        pages of `pages` it does not hold yet (each once)."""
        limit = self.limit(uid)
        if limit is None:
            return
        used = self.charged(uid)
        if not isinstance(pages, (list, tuple)):
            pages = list(pages)
        if used + n + len(pages) <= limit:  # even were every one new to uid: O(1)
            return
        more = n + len({id(p) for p in pages if p is not None and not p.held_by(uid)})
        if more and used + more > limit:  # nothing more is never refused, even past it
            pending = self.pending.get(uid, 0)
            unloaded = (f", {pending} of them by files restored and not opened since"
                        if pending else "")
            raise FSError(errno.EDQUOT, f"uid {uid} page quota {limit} "
                          f"({used} used{unloaded}, {more} more wanted)")

    def free_in(self, tier: str) -> int:
        if tier == DISK:
            return self.swap.free_count() if self.swap else 0
        return self.pool.free_in(tier)

    def capacity(self, tier: str) -> int:
        if tier == DISK:
            return self.swap.slots if self.swap else 0
        return self.pool.capacity(tier)

    # -- life cycle ---------------------------------------------------------------------

    def new(self, n: int, owner: int, quota: bool = True) -> list[Page]:
        """n fresh private device pages held by owner, all or none (ENOSPC; EDQUOT unless
        quota=False)."""
        if n == 0:
            return []
        if quota:
            self.charge(owner, n)
        free = self.pool.free_in(DEVICE)
        if n > free:
            raise NoRoom(f"kv pool: {n} device pages wanted, {free} free", n - free)
        pages = [Page(DEVICE, slot, owner) for slot in self.pool.allocate(n, DEVICE)]
        self.used[owner] = self.used.get(owner, 0) + n
        self.live.update(pages)
        return pages

    def ref(self, pages: Iterable[Page | None], uid: int) -> None:
        """One more hold of each page by uid: charged to it where it held none (the caller
        checked `charge(uid, 0, pages)` first, unless the charge may go past the limit)."""
        for p in pages:
            if p is not None:
                p.refs += 1
                if p.uid != uid:  # another's, or several users': the slow path
                    self._hold(p, uid)

    def _hold(self, p: Page, uid: int) -> None:
        h = p.holders
        if h is None:  # one other user's until now
            p.holders, p.uid = {p.uid: p.refs - 1, uid: 1}, SHARED
        elif uid in h:
            h[uid] += 1
            return
        else:
            h[uid] = 1
        self.used[uid] = self.used.get(uid, 0) + 1

    def unref(self, pages: Iterable[Page | None], uid: int) -> None:
        """Give back one hold of each page by uid (each held by it): a page uid holds no
        more is no longer charged to it, and one nobody holds is freed."""
        for p in pages:
            if p is not None:
                p.refs -= 1
                if p.uid != uid:  # several users': the slow path
                    self._drop(p, uid)
                elif p.refs == 0:
                    self._release(p)

    def _drop(self, p: Page, uid: int) -> None:
        h = p.holders
        left = h[uid] - 1
        if left:
            h[uid] = left
            return
        del h[uid]
        self.used[uid] -= 1
        if len(h) == 1:  # one user's again
            (p.uid,) = h
            p.holders = None

    def transfer(self, pages: Iterable[Page | None], old: int, new: int) -> None:
        """Holds of old become new's (chown): charged to new even past its limit."""
        if old != new:
            pages = list(pages)
            self.ref(pages, new)
            self.unref(pages, old)

    def _release(self, p: Page) -> None:
        if p.tier == DISK:
            self.swap.free(p.slot)
        else:
            self.pool.free([p.slot], p.tier)
        self.used[p.uid] -= 1
        self.live.discard(p)

    def copy(self, page: Page, owner: int, quota: bool = True) -> Page:
        """A private device copy of a page (copy-on-write), held by owner."""
        (new,) = self.new(1, owner, quota)
        if page.tier == DEVICE:
            self.pool.copy_page(page.slot, new.slot)
        else:
            self.pool.write_page(new.slot, *self.read(page))
        return new

    # -- contents -----------------------------------------------------------------------

    def read(self, page: Page) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of a whole page, on the CPU: [layers, page_size, heads, dim] each."""
        if page.tier == DISK:
            return self.swap.read(page.slot)
        return self.pool.read_page(page.slot, page.tier)

    def write(self, page: Page, k: torch.Tensor, v: torch.Tensor) -> None:
        """Fill a page (any tier) with whole-page K and V."""
        if page.tier == DISK:
            self.swap.write(page.slot, k, v)
        else:
            self.pool.write_page(page.slot, k, v, page.tier)

    # -- tiers --------------------------------------------------------------------------

    def bring_up(self, pages: Iterable[Page | None]) -> None:
        """Every page onto the device, all or none (ENOSPC)."""
        down = list({id(p): p for p in pages if p is not None and p.tier != DEVICE}.values())
        free = self.pool.free_in(DEVICE)
        if len(down) > free:
            raise NoRoom(f"kv pool: {len(down)} pages to bring back, {free} device pages free",
                         len(down) - free)
        for p in down:
            if p.tier == HOST:
                p.slot = self.pool.move(p.slot, HOST, DEVICE)
            else:
                (slot,) = self.pool.allocate(1, DEVICE)
                self.pool.write_page(slot, *self.swap.read(p.slot))
                self.swap.free(p.slot)
                p.slot = slot
            p.tier = DEVICE
            self.moves += 1

    def move_down(self, pages: Iterable[Page | None]) -> int:
        """Move device pages to the host tier, then to disk when the host is full.

        Returns how many moved; stops early (without error) when both are full.
        """
        moved = 0
        for p in {id(p): p for p in pages if p is not None and p.tier == DEVICE}.values():
            if self.pool.free_in(HOST):
                p.slot, p.tier = self.pool.move(p.slot, DEVICE, HOST), HOST
            elif self.swap and self.swap.free_count():
                slot = self.swap.allocate()
                self.swap.write(slot, *self.pool.read_page(p.slot))
                self.pool.free([p.slot])
                p.slot, p.tier = slot, DISK
            else:
                break
            moved += 1
            self.moves += 1
        return moved

    @staticmethod
    def device_ids(pages: Iterable[Page | None]) -> list[int]:
        """The page table the kernels read; holes (punched pages) read as page 0, masked."""
        return [0 if p is None else p.slot for p in pages]
