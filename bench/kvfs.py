"""kvfs costs: fork against file length, memory of many forks, save/load throughput, and a
change of names against the number of names.

    python bench/kvfs.py

The pool has the tiny model's KV shape (models/tiny: 6 layers, 4 KV heads of 32, page size
16, fp32).
Peers in the same run: copying the file's K/V bytes (what a fork without shared pages
costs), torch.save / torch.load of the same K/V tensors (what persisting costs done the
plain way), and writing the namespace whole (what each change of names cost before the
journal, kvfs/journal.py).
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path and its name would hide the
# kvfs package.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

import torch  # noqa: E402

from kvfs.fs import FileSystem  # noqa: E402
from kvfs.pages import PageStore  # noqa: E402
from kvfs.perm import ROOT  # noqa: E402
from kvfs.pool import KVPool, PageShape  # noqa: E402
from kvfs.state import StateDir  # noqa: E402

PAGE = 16
SHAPE = PageShape(layers=6, kv_heads=4, head_dim=32, page_size=PAGE, dtype=torch.float32)


def filled(fs: FileSystem, n: int):
    """A file of n entries with random K/V, written as a forward pass would."""
    h = fs.open(ROOT, "", os.O_RDWR)
    res = fs.reserve(h, n)
    pool = fs.store.pool
    for slot in res.page_table:
        pool.k[:, slot].normal_()
        pool.v[:, slot].normal_()
    fs.commit(res, [1] * n, list(range(n)))
    return h


def best(fn, repeat: int = 7) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    torch.manual_seed(0)
    lengths = [1024, 4096, 16384, 32768, 65536]
    pool = KVPool(SHAPE, 2 * max(lengths) // PAGE + 64)
    fs = FileSystem(PageStore(pool), "bench")
    print(f"# kvfs on {platform.machine()} {os.cpu_count()} cpus, torch "
          f"{torch.__version__}, page {pool.page_bytes / 1024:.0f} KiB")

    print(f"\n{'tokens':>8}{'pages':>8}{'fork us':>10}{'us/page':>9}{'copy bytes us':>15}"
          f"{'copy/fork':>10}")
    for n in lengths:
        h = filled(fs, n + 5)  # a partial last page: the one page fork copies
        forks = []

        def fork():
            forks.append(fs.fork(h, ROOT))  # noqa: B023

        t_fork = best(fork)
        for f in forks:
            fs.close(f)
        pages = len(h.inode.pages)
        ids = torch.tensor([p.slot for p in h.inode.pages])
        t_copy = best(lambda: (pool.k.index_select(1, ids), pool.v.index_select(1, ids)),  # noqa: B023
                      repeat=3)
        print(f"{n:>8}{pages:>8}{t_fork * 1e6:>10.0f}{t_fork * 1e6 / pages:>9.2f}"
              f"{t_copy * 1e6:>15.0f}{t_copy / t_fork:>9.0f}x")
        fs.close(h)

    h = filled(fs, 1000)
    used = pool.num_pages - pool.free_count
    forks = [fs.fork(h, ROOT) for _ in range(16)]
    extra = pool.num_pages - pool.free_count - used
    print(f"\n16 forks of a 1000-token file ({used} pages): {extra} more pages "
          f"(bound: 16 private last pages); unshared copies would take {16 * used}")
    for f in forks:
        fs.close(f)
    fs.close(h)

    print(f"\n{'tokens':>8}{'MB':>8}{'save MB/s':>11}{'torch.save':>12}{'load MB/s':>11}"
          f"{'torch.load':>12}")
    with tempfile.TemporaryDirectory() as tmp:
        state = StateDir(Path(tmp) / "state", fs)
        for n in (4096, 32768):
            h = fs.open(ROOT, f"/f{n}", os.O_RDWR | os.O_CREAT)
            res = fs.reserve(h, n)
            for slot in res.page_table:
                pool.k[:, slot].normal_()
            fs.commit(res, [1] * n, list(range(n)))
            ids = torch.tensor([p.slot for p in h.inode.pages])
            k, v = pool.k.index_select(1, ids), pool.v.index_select(1, ids)
            mb = 2 * k.numel() * k.element_size() / 1e6

            def save():
                h.inode.dirty = True  # noqa: B023
                state.save_file(h.inode)  # noqa: B023

            t_save = best(save, 3)
            t_tsave = best(lambda: torch.save({"k": k, "v": v}, Path(tmp) / "t.pt"), 3)  # noqa: B023

            def load():
                inode = h.inode  # noqa: B023
                fs.store.unref(inode.pages, inode.uid)
                inode.pages = []
                state.load_pages(inode)

            t_load = best(load, 3)
            t_tload = best(lambda: torch.load(Path(tmp) / "t.pt"), 3)  # noqa: B023
            print(f"{n:>8}{mb:>8.1f}{mb / t_save:>11.0f}{mb / t_tsave:>12.0f}"
                  f"{mb / t_load:>11.0f}{mb / t_tload:>12.0f}")
            fs.close(h)


def names() -> None:
    """A create in a directory of n named files, through the state directory (a journal
    line, fdatasynced; the namespace written whole now and then, counted in the mean), and
    the namespace written whole at n names, as every create did before the journal."""
    print(f"\n{'names':>8}{'create us':>11}{'whole namespace us':>20}{'whole/create':>14}")
    with tempfile.TemporaryDirectory() as tmp:
        fs = FileSystem(PageStore(KVPool(SHAPE, 64)), "bench")
        state = StateDir(Path(tmp) / "state", fs)
        state.restore()
        fs.mkdir(ROOT, "/d")
        made = 0

        def create() -> None:
            nonlocal made
            fs.close(fs.open(ROOT, f"/d/f{made}", os.O_RDWR | os.O_CREAT))
            made += 1

        for n in (1000, 4000, 16000):
            while made < n:
                create()
            start, count = time.perf_counter(), 500
            for _ in range(count):
                create()
            t_create = (time.perf_counter() - start) / count

            def whole() -> None:
                state.last = None  # else an unchanged namespace is not written again
                state.save_namespace()

            t_whole = best(whole, 3)
            print(f"{n:>8}{t_create * 1e6:>11.0f}{t_whole * 1e6:>20.0f}"
                  f"{t_whole / t_create:>13.0f}x")


if __name__ == "__main__":
    main()
    names()
