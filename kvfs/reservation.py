"""The pred hook of the KV file system: room for a forward pass's new entries, reserved
before the pass writes their K/V, then committed (they join the file) or rolled back (the
file is as it was).

`reserve` makes the room: every page of the file on the device, its last page private,
new pages for the entries, and the page table the forward pass writes through. That table
is kept on the inode (`Inode.table`, good while the page store's `moves` is still
`Inode.table_moves`), so that a pred costs O(new pages), not O(pages). A pred that
truncates first (`cut`) reserves after the cut into fresh pages (the page holding the cut
copied), so the old tail stays intact until `commit` swaps it out. `reserve_after` stacks
one more reservation on an open appending one, for decoding ahead: stacked reservations
commit in order and roll back in reverse, and the file is busy (`Inode.reserved`) until
the last of them ends.

These are functions of a `FileSystem` (fs.py), which offers them as its methods
`reserve`, `reserve_after`, `commit` and `rollback`; they use its room and page helpers
and, as every operation there, check everything before they change anything.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvfs.errors import FSError
from kvfs.pages import Page

if TYPE_CHECKING:
    from kvfs.fs import FileSystem, Handle


@dataclass
class Reservation:
    """Room for `count` new entries made before a forward pass writes their K/V."""

    handle: Handle
    start: int  # where the new entries go: the file's length, or the cut
    count: int
    new_pages: list[Page] = field(default_factory=list)
    # Device ids, covering start + count. An appending reservation's is the file's own
    # table, not a copy (a pred costs O(new pages)): later reservations may add pages at
    # its end and their rollbacks take them off again, never touching the pages before,
    # and a move or a cut gives the file a new list. Read it right away (a step is
    # pickled as it is planned).
    page_table: list[int] = field(default_factory=list)
    # What the forward pass attends around: the file's excluded ranges before `start`.
    excluded: list[tuple[int, int]] = field(default_factory=list)
    # A cutting reservation: new_pages take the place of the file's pages from the one
    # holding entry `start` on, at commit; page_table is good while the store's moves are
    # still table_moves.
    cutting: bool = False
    table_moves: int = -1
    # Stacked reservations (reserve_after): the one made right after this, and the one this
    # was made after, while they are open.
    follower: Reservation | None = None
    leader: Reservation | None = None
    # Who holds new_pages: the file's owner when it was reserved. Pages in the file's list
    # move with a chown (fs.chown); a cutting reservation's are not there yet, so commit
    # moves them to the owner then, and rollback gives them back as this uid's.
    uid: int = -1


def reserve(fs: FileSystem, handle: Handle, count: int, cut: int | None = None) -> Reservation:
    """Room for `count` entries, every page of the file on the device, and the page
    table the forward pass writes through. Commit or roll back when it is done.

    With `cut`, the new entries go after the first `cut` entries (only the pages
    before it brought up) and replace the rest at commit: until then those and their
    K/V stay as they are."""
    inode = fs._writable(handle, "append")
    if count <= 0:
        raise FSError(errno.EINVAL, f"append: {count} entries")
    if cut is not None and not 0 <= cut <= inode.length:
        raise FSError(errno.EINVAL, f"append: truncate {cut} is outside "
                      f"[0, {inode.length}]")
    if cut is not None and cut < inode.length:
        return _reserve_cut(fs, handle, count, cut)
    length, store = inode.length, fs.store
    tail = fs._needs_private_tail(inode, length)
    new = fs._pages_for(length + count) - len(inode.pages)
    # The table kept from the last reserve, while no page has moved since: then every
    # page is still on the device where it says.
    table = inode.table if inode.table_moves == store.moves else None
    down = 0 if table is not None else sum(p is not None and p.tier != "device"
                                           for p in inode.pages)
    if down + new + tail:  # else nothing to charge or to find room for
        fs._room(inode, down + new + tail, new + tail)
    if table is None:
        store.bring_up(inode.pages)
    if tail:
        fs._private(inode, length // fs.page_size)
    res = Reservation(handle, length, count, store.new(new, inode.uid) if new else [],
                      excluded=inode.excluded, uid=inode.uid)
    if new:
        inode.pages.extend(res.new_pages)
    if table is None or tail:
        table = store.device_ids(inode.pages)
    elif res.new_pages:
        table.extend(p.slot for p in res.new_pages)
    inode.table, inode.table_moves = table, store.moves
    res.page_table = table  # the file's own (see page_table)
    inode.reserved = 1
    return res


def reserve_after(fs: FileSystem, res: Reservation, count: int) -> Reservation:
    """Room for `count` entries right after those of `res`, an appending reservation
    not committed yet (decoding ahead guesses the pred after a guess). Reservations so
    stacked commit in order and roll back in reverse; the file stays busy until the
    last of them ends. EAGAIN when a page of the file moved since `res` was made."""
    inode, store = fs._live(res.handle), fs.store
    if (res.cutting or res.follower is not None or not inode.busy or inode.table is None
            or inode.table_moves != store.moves):
        raise FSError(errno.EAGAIN, "append: not the file's last appending reservation, "
                      "or its pages moved")
    if count <= 0:
        raise FSError(errno.EINVAL, f"append: {count} entries")
    start = res.start + res.count
    new = fs._pages_for(start + count) - len(inode.pages)
    if new:
        fs._room(inode, new, new)
    after = Reservation(res.handle, start, count, store.new(new, inode.uid) if new else [],
                        excluded=res.excluded, leader=res, uid=inode.uid)
    if after.new_pages:  # one entry a guess: a new page only every page_size of them
        inode.pages.extend(after.new_pages)
        inode.table.extend(p.slot for p in after.new_pages)
    after.page_table = inode.table
    res.follower = after
    inode.reserved += 1
    return after


def _reserve_cut(fs: FileSystem, handle: Handle, count: int, cut: int) -> Reservation:
    """reserve after entry `cut` < length: the new entries go into fresh pages (the page
    holding entry `cut` copied, its first rows kept), so the old ones stay intact for a
    rollback; the file's page list changes at commit."""
    inode, store, size = handle.inode, fs.store, fs.page_size
    kept = inode.pages[: cut // size]
    partial = inode.pages[cut // size] if cut % size else None
    copies = int(cut % size != 0)
    fresh = fs._pages_for(cut + count) - len(kept) - copies
    table = inode.table if inode.table_moves == store.moves else None
    down = 0 if table is not None else sum(p is not None and p.tier != "device"
                                           for p in kept)
    fs._room(inode, down + copies + fresh, copies + fresh)
    if table is None:
        store.bring_up(kept)
    new_pages = []
    if copies:  # a punched hole has no rows to keep: a fresh page will do
        new_pages = ([store.copy(partial, inode.uid)] if partial is not None
                     else store.new(1, inode.uid))
    new_pages += store.new(fresh, inode.uid)
    page_table = (table[: len(kept)] if table is not None else store.device_ids(kept))
    page_table += [p.slot for p in new_pages]
    excluded = [(s, min(e, cut)) for s, e in inode.excluded if s < cut]
    inode.reserved = 1
    return Reservation(handle, cut, count, new_pages, page_table, excluded, cutting=True,
                       table_moves=store.moves, uid=inode.uid)


def commit(fs: FileSystem, res: Reservation, tokens: list[int], positions: list[int]) -> None:
    """The forward pass wrote the K/V of `res`'s entries: they join the file, with these
    token ids and positions (a cutting reservation's pages replace the old tail now)."""
    inode = res.handle.inode
    if len(tokens) != res.count or len(positions) != res.count:
        raise FSError(errno.EINVAL, "commit: entries do not match the reservation")
    if res.leader is not None:
        raise FSError(errno.EBUSY, "commit: the reservation before it is still open")
    if res.follower is not None:
        res.follower.leader = None
    if res.cutting:
        first = res.start // fs.page_size
        old = inode.pages[first:]
        fs.store.transfer(res.new_pages, res.uid, inode.uid)  # a chown since the reserve
        inode.pages[first:] = res.new_pages
        fs.store.unref(old, inode.uid)
        fs._cut_entries(inode, res.start)
        inode.table, inode.table_moves = list(res.page_table), res.table_moves
    inode.tokens.extend(tokens)
    inode.positions.extend(positions)
    inode.reserved -= 1
    inode.touch()


def rollback(fs: FileSystem, res: Reservation) -> None:
    """Give back the room of `res`: the file is as it was before it was reserved."""
    inode = res.handle.inode
    if res.follower is not None:
        raise FSError(errno.EBUSY, "rollback: a reservation after it is still open")
    if res.leader is not None:
        res.leader.follower = None
    if not res.cutting:  # a cutting reservation's pages never joined the file
        del inode.pages[len(inode.pages) - len(res.new_pages):]
        if inode.table is not None:
            del inode.table[len(inode.pages):]
    # Pages in the file's list were its owner's, chown or not; a cutting one's, res.uid's.
    fs.store.unref(res.new_pages, res.uid if res.cutting else inode.uid)
    inode.reserved -= 1
