"""Page quotas across users: a page is charged to each user holding it, once per user.

A page shared by forks, splices and links of several users' files is charged to each of
them while one of its files holds it (kvfs/pages.py), so no user can keep pages on another
user's quota: the hostile case is B forking A's readable file and linking the fork, then A
unlinking its own.
"""

from __future__ import annotations

import errno
import os

import pytest
from kvfs_helpers import PAGE, append, make_fs
from test_kvfs import raises, snapshot, written

from kvfs.perm import ROOT, Cred

ALICE, BOB = Cred(1000, 1000), Cred(1001, 1001)
RW_CREAT = os.O_RDWR | os.O_CREAT


def used(fs, uid: int) -> int:
    return fs.store.used.get(uid, 0)


def holds(fs, *handles) -> dict[int, int]:
    """What each user should be charged: the distinct pages of its files (named ones, and
    `handles`' files, open anonymous ones included)."""
    inodes = {id(i): i for i in fs.files()} | {id(h.inode): h.inode for h in handles}
    pages: dict[int, set[int]] = {}
    for inode in inodes.values():
        pages.setdefault(inode.uid, set()).update(id(p) for p in inode.pages if p is not None)
    return {uid: len(ids) for uid, ids in pages.items() if ids}


def charged(fs) -> dict[int, int]:
    return {uid: n for uid, n in fs.store.used.items() if n}


def alice_file(fs, pages: int, path="/home/alice/f", extra: int = 0):
    """A file of alice's, 0644 (readable by bob, as a file made for sharing), of `pages`
    full pages and `extra` entries more."""
    h = fs.open(ALICE, path, RW_CREAT, 0o644)
    append(fs, h, list(range(pages * PAGE + extra)))
    return h


@pytest.fixture
def fs():
    fs = make_fs(pages=32, host=0, quota={1000: 6, 1001: 6})
    fs.home(ALICE, "alice")
    fs.home(BOB, "bob")
    return fs


@pytest.mark.parametrize("how", ["fork", "splice"])
def test_a_fork_linked_by_another_user_is_charged_to_it_not_to_the_owner(fs, how):
    """The attack: bob forks (or splices) alice's readable file and links the result; alice
    unlinks hers. The pages are bob's to pay for now, alice's quota is whole again."""
    a = alice_file(fs, 5)
    fs.close(a)
    assert charged(fs) == {1000: 5}
    r = fs.open(BOB, "/home/alice/f", os.O_RDONLY)
    if how == "fork":
        g = fs.fork(r, BOB)
    else:
        g = fs.open(BOB, "", RW_CREAT)
        fs.splice(r, 0, 5 * PAGE, g)
    fs.close(r)
    assert [p.refs for p in g.inode.pages] == [2] * 5  # shared, not copied
    fs.link(g, "/home/bob/x")
    fs.close(g)
    assert charged(fs) == {1000: 5, 1001: 5} == holds(fs)  # each holds the 5 pages
    fs.unlink(ALICE, "/home/alice/f")
    assert charged(fs) == {1001: 5} == holds(fs)
    # Alice has her whole quota again: a file of 6 pages is hers to make.
    b = alice_file(fs, 6, "/home/alice/g")
    assert charged(fs) == {1000: 6, 1001: 5} == holds(fs, b)
    # And bob's name lets go of the pages once it goes.
    fs.unlink(BOB, "/home/bob/x")
    fs.close(b)
    assert charged(fs) == {1000: 6} == holds(fs)
    assert len(fs.store.live) == 6


def test_forks_of_ones_own_pages_cost_nothing_more(fs):
    """Beam search and best_of_n fork a lot: each fork of a user's own file costs a copy
    of its partly filled last page at most, however many forks share the full pages."""
    a = alice_file(fs, 4)
    forks = [fs.fork(a, ALICE) for _ in range(10)]
    assert used(fs, 1000) == 4 and all(p.refs == 11 for p in a.inode.pages)
    assert all(p.holders is None for p in a.inode.pages)  # one user's: the compact form
    for f in forks:
        fs.link(f, f"/home/alice/fork{forks.index(f)}")
    fs.close(a)
    fs.unlink(ALICE, "/home/alice/f")
    assert used(fs, 1000) == 4
    # With a partial last page, each fork copies it: one page each.
    b = fs.open(ALICE, "", RW_CREAT)
    append(fs, b, [1, 2])  # a 5th page: the quota has room for one more
    bf = fs.fork(b, ALICE)
    assert used(fs, 1000) == 6
    raises(errno.EDQUOT, fs.fork, b, ALICE)
    # A splice of whole pages of her own files costs nothing either.
    c = fs.open(ALICE, "", RW_CREAT)
    fs.splice(forks[0], 0, 4 * PAGE, c)
    fs.splice(c, 0, 4 * PAGE, c)  # the same pages twice in one file: charged once
    assert used(fs, 1000) == 6 and charged(fs) == holds(fs, b, bf, c, *forks)


def test_fork_or_splice_by_another_user_past_its_quota_is_edquot_and_changes_nothing(fs):
    a = alice_file(fs, 4)
    bob = fs.open(BOB, "/home/bob/mine", RW_CREAT)
    append(fs, bob, list(range(3 * PAGE)))  # 3 of bob's 6 pages
    r = fs.open(BOB, "/home/alice/f", os.O_RDONLY)
    before = snapshot(fs)
    e = raises(errno.EDQUOT, fs.fork, r, BOB)  # 3 + 4 > 6
    assert "uid 1001 page quota 6 (3 used, 4 more wanted)" in e.message
    raises(errno.EDQUOT, fs.splice, r, 0, 4 * PAGE, bob)
    assert snapshot(fs) == before and charged(fs) == {1000: 4, 1001: 3}
    assert fs.inodes.used[1001] == 2  # no inode made either: home, mine
    # Three of them fit, and the fourth does not; alice pays nothing more for either.
    fs.splice(r, 0, 3 * PAGE, bob)
    assert charged(fs) == {1000: 4, 1001: 6} == holds(fs, a, bob)
    raises(errno.EDQUOT, fs.splice, r, 3 * PAGE, 4 * PAGE, bob)
    # Pages bob holds already are free to take again.
    fs.splice(r, 0, 3 * PAGE, bob)
    assert charged(fs) == {1000: 4, 1001: 6} == holds(fs, a, bob)


def test_chown_moves_a_files_charges_to_the_new_owner_even_past_its_quota():
    fs = make_fs(pages=32, host=0, quota={1000: 10, 1001: 6})
    fs.home(ALICE, "alice")
    fs.home(BOB, "bob")
    a = alice_file(fs, 4)
    keep = fs.fork(a, ALICE)  # alice holds the same pages through another file
    b = fs.open(ALICE, "/home/alice/g", RW_CREAT)
    append(fs, b, list(range(2 * PAGE + 1)))
    bob = fs.open(BOB, "/home/bob/mine", RW_CREAT)
    append(fs, bob, list(range(5 * PAGE)))
    assert charged(fs) == {1000: 7, 1001: 5}
    fs.chown(ROOT, "/home/alice/g", 1001, -1)  # 3 pages more for bob: 8 of 6
    assert charged(fs) == {1000: 4, 1001: 8} == holds(fs, a, b, keep, bob)
    raises(errno.EDQUOT, fs.reserve, bob, 1)  # over it: nothing more for bob
    fs.chown(ROOT, "/home/alice/f", 1001, -1)  # alice's fork still holds its pages
    assert charged(fs) == {1000: 4, 1001: 12} == holds(fs, a, b, keep, bob)
    fs.close(keep)
    assert charged(fs) == {1001: 12} == holds(fs, a, b, bob)
    fs.chown(ROOT, "/home/alice/f", 1000, -1)
    fs.chown(ROOT, "/home/alice/g", 0, -1)
    assert charged(fs) == {0: 3, 1000: 4, 1001: 5} == holds(fs, a, b, bob)


def test_chown_while_a_pred_is_reserved(fs):
    """Pages a pred reserved move with the file; a cutting pred's, not in the file's list
    yet, move at commit, and a rollback gives them back as whose they were."""
    a = alice_file(fs, 2, extra=2)
    res = written(fs, a, [7, 8, 9], [10, 11, 12])  # the tail's page and one more
    fs.chown(ROOT, "/home/alice/f", 1001, -1)
    assert charged(fs) == {1001: 4} == holds(fs, a)
    fs.rollback(res)
    assert charged(fs) == {1001: 3} == holds(fs, a)
    cut = written(fs, a, [7, 8, 9, 10, 11], list(range(5)), 2)  # 2 new pages, bob's
    fs.chown(ROOT, "/home/alice/f", 1000, -1)
    assert charged(fs) == {1000: 3, 1001: 2}
    fs.rollback(cut)
    assert charged(fs) == {1000: 3} == holds(fs, a)
    cut = written(fs, a, [7, 8, 9, 10, 11], list(range(5)), 2)
    fs.chown(ROOT, "/home/alice/f", 1001, -1)
    fs.commit(cut, [7, 8, 9, 10, 11], list(range(5)))
    assert charged(fs) == {1001: 2} == holds(fs, a)


def test_snapshots_are_not_refused_for_what_they_share(fs):
    """An export's snapshot (a fork as the reader, `snapshot=True`) holds the file's
    pages for the reader while it streams, past the reader's page quota too: reading a
    file it may read needs no room for pages that are there already."""
    a = alice_file(fs, 5)  # 5 full pages
    bob = fs.open(BOB, "/home/bob/mine", RW_CREAT)
    append(fs, bob, list(range(6 * PAGE)))  # bob's quota full
    r = fs.open(BOB, "/home/alice/f", os.O_RDONLY)
    raises(errno.EDQUOT, fs.fork, r, BOB)
    snap = fs.fork(r, BOB, snapshot=True)
    assert charged(fs) == {1000: 5, 1001: 11} == holds(fs, a, bob, snap)
    assert fs.export(snap) == fs.export(a)
    again = fs.fork(r, BOB, snapshot=True)  # past his quota: nothing more is charged
    assert charged(fs) == {1000: 5, 1001: 11}
    for h in (snap, again):
        fs.close(h)
    assert charged(fs) == {1000: 5, 1001: 6} == holds(fs, a, bob)


def test_a_snapshots_copy_of_a_partial_last_page_is_refused_past_the_quota(fs):
    """The copy of a partly filled last page is new memory: refused past the reader's
    quota, so export streams held open cannot take the pool a page each (an outside
    tester's 532 streams of one file held 596 pages on a quota of 80)."""
    a = alice_file(fs, 3, extra=1)  # 3 full pages and a partial one
    r = fs.open(BOB, "/home/alice/f", os.O_RDONLY)
    snaps = [fs.fork(r, BOB, snapshot=True) for _ in range(3)]  # 3 shared + 3 copies
    assert charged(fs) == {1000: 4, 1001: 6} == holds(fs, a, *snaps)
    before = snapshot(fs)
    raises(errno.EDQUOT, fs.fork, r, BOB, snapshot=True)
    assert snapshot(fs) == before
    fs.close(snaps.pop())
    snaps.append(fs.fork(r, BOB, snapshot=True))  # room again
    for h in snaps:
        fs.close(h)
    assert charged(fs) == {1000: 4} == holds(fs, a)


def test_nothing_more_is_never_refused_past_the_quota(fs):
    """A user past its quota (chown, a restore) may still take holds of pages it holds
    already: open, fork of its own full pages. It read "EDQUOT (112 used, 0 more wanted)"
    on opening its own files after a restart."""
    a = alice_file(fs, 6)
    fs.chown(ROOT, "/home/alice/f", 1001, -1)  # bob: 6 of 6
    b = alice_file(fs, 2, path="/home/alice/g")
    fs.chown(ROOT, "/home/alice/g", 1001, -1)  # bob: 8 of 6
    assert charged(fs) == {1001: 8}
    r = fs.open(BOB, "/home/alice/f", os.O_RDONLY)
    clone = fs.fork(r, BOB)  # his own full pages: nothing more
    assert charged(fs) == {1001: 8} == holds(fs, a, b, clone)
    for h in (clone, r, a, b):
        fs.close(h)


def test_pred_pages_are_the_files_owners_whoever_writes(fs):
    """A pred (reserve, then commit or rollback) charges the file's owner, not the writer:
    bob writing alice's 0666 file uses alice's quota, and alice's limit refuses it."""
    h = fs.open(ALICE, "/home/alice/shared", RW_CREAT, 0o666)
    fs.close(h)
    w = fs.open(BOB, "/home/alice/shared", os.O_RDWR)
    append(fs, w, list(range(5 * PAGE)))
    assert charged(fs) == {1000: 5}
    res = fs.reserve(w, 3)  # a 6th page
    assert charged(fs) == {1000: 6}
    raises(errno.EDQUOT, fs.reserve_after, res, PAGE)
    fs.rollback(res)
    assert charged(fs) == {1000: 5}
    before = snapshot(fs)
    raises(errno.EDQUOT, fs.reserve, w, 2 * PAGE)
    raises(errno.EDQUOT, fs.reserve, w, 2 * PAGE, 3 * PAGE + 1)  # a cut: a copy and 2
    assert snapshot(fs) == before
    cut = written(fs, w, [1] * PAGE, list(range(PAGE)), 4 * PAGE)  # page 4 anew
    assert charged(fs) == {1000: 6}
    fs.commit(cut, [1] * PAGE, list(range(PAGE)))
    assert charged(fs) == {1000: 5} == holds(fs, w)


def test_copy_on_write_of_a_shared_page_moves_its_charge(fs):
    """Writing into a page bob shares with alice copies it for the writer's file: alice
    still pays for the original while she holds it, bob for his copy."""
    a = alice_file(fs, 2)
    r = fs.open(BOB, "/home/alice/f", os.O_RDONLY)
    g = fs.fork(r, BOB)
    fs.truncate(g, PAGE + 1)  # page 1 now partly filled, and bob's own copy
    assert charged(fs) == {1000: 2, 1001: 2} == holds(fs, a, g)
    assert g.inode.pages[0] is a.inode.pages[0] and g.inode.pages[1] is not a.inode.pages[1]
    fs.punch(g, 0, PAGE)  # bob's hold of page 0 goes: only alice's stays
    assert charged(fs) == {1000: 2, 1001: 1} == holds(fs, a, g)
    assert a.inode.pages[0].holders is None and a.inode.pages[0].refs == 1
