"""/proc/kv without a daemon: a line per page with more than one reference, the pages
meminfo's `shared` counts, with the files that hold it; an export's snapshot holds one too,
but is no file (docs/syscalls.md)."""

from __future__ import annotations

import os
from types import SimpleNamespace

from kvfs_helpers import append, make_fs

from kvfs.perm import Cred
from symphony.procfs import ProcFS
from syscalls.convert import proc_fields


def test_an_exports_snapshot_counts_in_refs_and_shared_but_is_no_inode():
    fs = make_fs()
    root = Cred(0, 0)
    a = fs.open(root, "", os.O_RDWR)
    append(fs, a, list(range(10)))  # 2 full pages and a partial one
    kernel = SimpleNamespace(fs=fs, engine=SimpleNamespace(pool=fs.store.pool),
                             procs=[SimpleNamespace(fds={3: a})])
    proc = ProcFS(kernel)

    def rows() -> list[tuple[str, str]]:
        lines = proc.read("kv", root).splitlines()
        assert lines[0] == "page\ttier\trefs\tinodes"
        assert len(lines) - 1 == int(proc_fields(proc.read("meminfo", root))["shared"])
        return [tuple(line.split("\t")[2:]) for line in lines[1:]]

    fs.fork(a, root, snapshot=True)  # an export's: in no process's fds, with no name
    assert rows() == [("2", str(a.inode.ino))] * 2
    fs.fork(a, root, snapshot=True)
    kernel.procs = []
    fs.close(a)  # the two snapshots alone hold the full pages now
    assert rows() == [("2", "")] * 2
