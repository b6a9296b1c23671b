"""Random sequences of kvfs operations against a dictionary model of the file system.

After every step: each file's entries equal the model's, every attended entry holds the K/V
it was written with, every page's refcount equals the number of page lists holding it, and
each user is charged for the distinct pages its files hold (forks by other users and chown
mix owners; uid 1001 has a small quota). At the end, with everything closed and unlinked,
the pool is back to where it started.
"""

from __future__ import annotations

import errno
import os
from collections import Counter

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)
from kvfs_helpers import PAGE, append, assert_kv, kv_for, make_fs, write_kv
from test_kvfs import excluded_runs, written

from kvfs.errors import FSError
from kvfs.perm import ROOT, Cred, R, W, allowed
from kvfs.ranges import merge_ranges

LIMIT = 1000  # the context shift keeps positions under
NAMES = st.sampled_from([f"/tmp/f{i}" for i in range(4)] + ["/home/u/a", "/home/u/b"])
UIDS = st.sampled_from([0, 1000, 1001])


class Model:
    """What a file should hold."""

    def __init__(self, tokens=None, positions=None, excluded=None):
        self.tokens, self.positions = list(tokens or []), list(positions or [])
        self.excluded = list(excluded or [])


class KVFSMachine(RuleBasedStateMachine):
    handles = Bundle("handles")

    def __init__(self):
        super().__init__()
        self.fs = make_fs(pages=48, host=16, disk=0, quota={1001: 10})
        self.fs.mkdir(ROOT, "/home/u")
        self.start_free = self.fs.store.pool.free_in("device")
        self.names: dict[str, Model] = {}  # path -> model (hard links share the object)
        self.open: dict[int, tuple] = {}  # id(handle) -> (handle, model)

    def model_of(self, h) -> Model:
        return self.open[id(h)][1]

    def attempt(self, fn, *args):
        """Run an operation that may fail for lack of room: it must then change nothing."""
        try:
            fn(*args)
            return True
        except FSError as e:
            assert e.errno in (errno.ENOSPC, errno.EDQUOT), e
            return False

    @rule(target=handles, path=NAMES, tokens=st.lists(st.integers(0, 99), max_size=9))
    def create(self, path, tokens):
        h = self.fs.open(ROOT, path, os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        model = self.names.setdefault(path, Model())
        model.tokens.clear(), model.positions.clear(), model.excluded.clear()
        self.open[id(h)] = (h, model)
        if tokens and self.attempt(append, self.fs, h, tokens):
            model.tokens += tokens
            model.positions += range(len(tokens))
        return h

    @rule(target=handles)
    def anonymous(self):
        h = self.fs.open(ROOT, "")
        self.open[id(h)] = (h, Model())
        return h

    @rule(h=handles, tokens=st.lists(st.integers(0, 99), min_size=1, max_size=11),
          gap=st.integers(0, 50))
    def pred(self, h, tokens, gap):
        if id(h) not in self.open:
            return
        m = self.model_of(h)
        first = (m.positions[-1] + 1 if m.positions else 0) + gap
        positions = list(range(first, first + len(tokens)))
        if self.attempt(append, self.fs, h, tokens, positions):
            m.tokens += tokens
            m.positions += positions

    @rule(h=handles, count=st.integers(1, 11))
    def cancelled_pred(self, h, count):
        """Room reserved, then given back: what a pred cancelled or failed mid-step does."""
        if id(h) not in self.open:
            return
        try:
            res = self.fs.reserve(h, count)
        except FSError as e:
            assert e.errno in (errno.ENOSPC, errno.EDQUOT), e
            return
        self.fs.rollback(res)

    @rule(h=handles, data=st.data(), tokens=st.lists(st.integers(0, 99), min_size=1,
                                                     max_size=11),
          gap=st.integers(0, 50), commit=st.booleans())
    def cutting_pred(self, h, data, tokens, gap, commit):
        """A pred that first truncates the file to `cut` entries, done or given back."""
        if id(h) not in self.open:
            return
        m = self.model_of(h)
        cut = data.draw(st.integers(0, len(m.tokens)))
        first = (m.positions[cut - 1] + 1 if cut else 0) + gap
        positions = list(range(first, first + len(tokens)))
        try:
            res = written(self.fs, h, tokens, positions, cut)
        except FSError as e:
            assert e.errno in (errno.ENOSPC, errno.EDQUOT), e
            return
        if not commit:
            self.fs.rollback(res)
            return
        self.fs.commit(res, tokens, positions)
        del m.tokens[cut:], m.positions[cut:]
        m.tokens += tokens
        m.positions += positions
        m.excluded = [(s, min(e, cut)) for s, e in m.excluded if s < cut]

    @rule(h=handles, first=st.lists(st.integers(0, 99), min_size=1, max_size=6),
          second=st.lists(st.integers(0, 99), min_size=1, max_size=6),
          commits=st.integers(0, 2), commit_first=st.booleans())
    def stacked_preds(self, h, first, second, commits, commit_first):
        """Decoding ahead: a pred, and one more reserved after it before it commits; the
        first `commits` of them commit, in order, and the rest roll back, last first (with
        one of each, the commit first or the rollback first)."""
        if id(h) not in self.open:
            return
        m = self.model_of(h)
        start = m.positions[-1] + 1 if m.positions else 0
        entries = [(first, list(range(start, start + len(first))))]
        start += len(first)
        entries.append((second, list(range(start, start + len(second)))))
        reservations = []
        try:
            reservations.append(written(self.fs, h, *entries[0]))
            reservations.append(self.fs.reserve_after(reservations[0], len(second)))
        except FSError as e:
            assert e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EAGAIN), e
            for res in reservations:
                self.fs.rollback(res)
            return
        write_kv(self.fs, reservations[1], *entries[1])
        # (reservation, its entries to commit, or None: roll it back), in the order done
        ends = list(zip(reservations[:commits], entries[:commits], strict=True))
        ends += [(res, None) for res in reversed(reservations[commits:])]
        if commits == 1 and not commit_first:
            ends.reverse()
        for res, entry in ends:
            if entry is None:
                self.fs.rollback(res)
            else:
                self.fs.commit(res, *entry)
                m.tokens += entry[0]
                m.positions += entry[1]

    @rule(h=handles, data=st.data(), punched=st.booleans())
    def keep(self, h, data, punched):
        if id(h) not in self.open:
            return
        if punched:  # excluded ranges are rare otherwise: truncates and creates clear them
            self.punch(h, data)
        m = self.model_of(h)
        n = len(m.tokens)
        start = data.draw(st.integers(0, n))
        entries = sorted(data.draw(st.sets(st.integers(start, n - 1))) if start < n else [])
        out = [any(s <= i < e for s, e in m.excluded) for i in range(n)]
        if self.attempt(self.fs.keep, h, start, entries):
            kept = [*range(start), *entries]
            m.tokens[:] = [m.tokens[i] for i in kept]
            m.positions[:] = [m.positions[i] for i in kept]
            m.excluded = excluded_runs([out[i] for i in kept])

    @rule(h=handles, data=st.data(), delta=st.integers(-30, 30), punched=st.booleans())
    def shift(self, h, data, delta, punched):
        """Entries move by delta positions; the rotate given writes the K rows it is handed
        with what an entry at its new position holds, so contents_match checks the rows."""
        if id(h) not in self.open:
            return
        if punched:
            self.punch(h, data)
        m = self.model_of(h)
        start = data.draw(st.integers(0, len(m.tokens)))
        end = data.draw(st.integers(start, len(m.tokens)))
        live = [i for i in range(start, end) if not any(s <= i < e for s, e in m.excluded)]
        k = self.fs.store.pool.k

        def rotate(rows, d):
            assert rows.dtype == torch.int64 and len(rows) == len(live) and d == delta
            new, _ = kv_for([m.tokens[i] for i in live], [m.positions[i] + d for i in live])
            k.view(k.shape[0], -1, *k.shape[3:])[:, rows] = new

        if any(not 0 <= p + delta < LIMIT for p in m.positions[start:end]):
            try:
                self.fs.shift(h, start, end, delta, LIMIT, rotate)
            except FSError as e:
                assert e.errno == errno.EOVERFLOW, e
            else:
                raise AssertionError("shift past the limit was not refused")
        elif self.attempt(self.fs.shift, h, start, end, delta, LIMIT, rotate):
            m.positions[start:end] = [p + delta for p in m.positions[start:end]]

    @rule(h=handles, data=st.data())
    def swap_out(self, h, data):
        """Pages of a file move to the host tier (memory relief); a shared page moves for
        every file that holds it, and the next pred brings them back."""
        pages = [p for p in h.inode.pages if p is not None]
        if pages:
            self.fs.store.move_down(data.draw(st.lists(st.sampled_from(pages), max_size=4)))

    @rule(target=handles, h=handles, uid=UIDS, snapshot=st.booleans())
    def fork(self, h, uid, snapshot):
        if id(h) not in self.open:
            return None
        m = self.model_of(h)
        try:
            child = self.fs.fork(h, Cred(uid, uid), snapshot=snapshot)
        except FSError as e:
            # uid 1001 has a quota: a fork past it is EDQUOT, a snapshot only for its copy
            # of a partly filled last page (new memory; what it shares is never refused).
            tail = len(m.tokens) % PAGE
            assert e.errno == errno.ENOSPC or (e.errno == errno.EDQUOT and uid == 1001
                                               and (not snapshot or tail)), e
            return None
        self.open[id(child)] = (child, Model(m.tokens, m.positions, m.excluded))
        return child

    @rule(h=handles, data=st.data())
    def truncate(self, h, data):
        if id(h) not in self.open:
            return
        m = self.model_of(h)
        n = data.draw(st.integers(0, len(m.tokens)))
        if self.attempt(self.fs.truncate, h, n):
            del m.tokens[n:], m.positions[n:]
            m.excluded = [(s, min(e, n)) for s, e in m.excluded if s < n]

    @rule(h=handles, data=st.data())
    def punch(self, h, data):
        if id(h) not in self.open:
            return
        m = self.model_of(h)
        start = data.draw(st.integers(0, len(m.tokens)))
        end = data.draw(st.integers(start, len(m.tokens)))
        self.fs.punch(h, start, end)
        m.excluded = merge_ranges([*m.excluded, (start, end)])

    @rule(src=handles, dst=handles, data=st.data())
    def splice(self, src, dst, data):
        if id(src) not in self.open or id(dst) not in self.open:
            return
        s, d = self.model_of(src), self.model_of(dst)
        start = data.draw(st.integers(0, len(s.tokens)))
        end = data.draw(st.integers(start, len(s.tokens)))
        base = len(d.tokens)
        moved = [(max(a, start) - start + base, min(b, end) - start + base)
                 for a, b in s.excluded if a < end and b > start]
        tokens, positions = s.tokens[start:end], s.positions[start:end]
        if self.attempt(self.fs.splice, src, start, end, dst):
            d.tokens += tokens
            d.positions += positions
            d.excluded = merge_ranges([*d.excluded, *moved])

    @rule(h=consumes(handles))
    def close(self, h):
        if id(h) in self.open:
            self.fs.close(h)
            del self.open[id(h)]

    @precondition(lambda self: self.names)
    @rule(data=st.data())
    def unlink(self, data):
        path = data.draw(st.sampled_from(sorted(self.names)))
        self.fs.unlink(ROOT, path)
        del self.names[path]

    @precondition(lambda self: self.names)
    @rule(data=st.data(), uid=UIDS)
    def chown(self, data, uid):
        path = data.draw(st.sampled_from(sorted(self.names)))
        self.fs.chown(ROOT, path, uid, -1)

    @precondition(lambda self: self.names)
    @rule(data=st.data(), new=NAMES)
    def rename(self, data, new):
        old = data.draw(st.sampled_from(sorted(self.names)))
        self.fs.rename(ROOT, old, new)
        if self.names.get(new) is not self.names[old]:  # two links of one file: a no-op
            self.names[new] = self.names.pop(old)

    @rule(h=handles, path=NAMES)
    def link(self, h, path):
        if id(h) not in self.open:
            return
        if not h.cred.root and path.startswith("/home/"):  # root's 0755 directory
            path = "/tmp/" + path.rsplit("/", 1)[1]
        if not (h.cred.uid == h.inode.uid or allowed(h.cred, h.inode, R | W)):
            # protected_hardlinks: a file chowned away from the handle's user since
            with pytest.raises(FSError) as e:
                self.fs.link(h, path)
            assert e.value.errno == errno.EPERM
            return
        if path in self.names:
            try:
                self.fs.link(h, path)
            except FSError as e:
                assert e.errno == errno.EEXIST
            return
        self.fs.link(h, path)
        self.names[path] = self.model_of(h)

    @invariant()
    def contents_match(self):
        for path, m in self.names.items():
            h = self.fs.open(ROOT, path)
            assert self.fs.read(h, 0, 10**6) == (m.tokens, m.positions), path
            assert h.inode.excluded == m.excluded, path
            assert_kv(self.fs, h)
            self.fs.close(h)
        for h, m in self.open.values():
            assert h.inode.tokens == m.tokens and h.inode.excluded == m.excluded

    @invariant()
    def refcounts_equal_references(self):
        inodes = {id(h.inode): h.inode for h, _ in self.open.values()}
        for path in self.names:
            inode = self.fs.lookup(ROOT, path)
            inodes[id(inode)] = inode
        held = Counter(p for inode in inodes.values() for p in inode.pages if p is not None)
        assert set(held) == self.fs.store.live
        for page, n in held.items():
            assert page.refs == n, page
        on_device = sum(p.tier == "device" for p in held)
        assert self.fs.store.pool.free_in("device") == self.start_free - on_device

    @invariant()
    def each_user_charged_for_the_distinct_pages_it_holds(self):
        inodes = {id(h.inode): h.inode for h, _ in self.open.values()}
        for path in self.names:
            inode = self.fs.lookup(ROOT, path)
            inodes[id(inode)] = inode
        holds = Counter((id(p), inode.uid) for inode in inodes.values()
                        for p in inode.pages if p is not None)
        charged = Counter(uid for _, uid in holds)
        assert {u: n for u, n in self.fs.store.used.items() if n} == dict(charged)
        for page in self.fs.store.live:
            assert {u: n for (i, u), n in holds.items() if i == id(page)} == (
                page.holders or {page.uid: page.refs}), page

    @invariant()
    def page_tables_current(self):
        """The table a file keeps for its next pred names each page's device slot."""
        for h, _ in self.open.values():
            inode = h.inode
            if inode.table is not None and inode.table_moves == self.fs.store.moves:
                assert inode.table == self.fs.store.device_ids(inode.pages)
                assert all(p is None or p.tier == "device" for p in inode.pages)

    def teardown(self):
        for h, _ in list(self.open.values()):
            self.fs.close(h)
        for path in list(self.names):
            self.fs.unlink(ROOT, path)
        assert self.fs.store.pool.free_in("device") == self.start_free
        assert not self.fs.store.live and not any(self.fs.store.used.values())


KVFSMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kvfs_stateful = KVFSMachine.TestCase
