"""AsyncContext.fork's cost when the forks waiting their turn are cancelled, in counts: a
LIP that gathers n forks and sees one fail (EMFILE past the kernel's FD_MAX) ends in
asyncio.run's cleanup, which cancels every fork still waiting. Each waiter took itself out
of asyncio.Lock's deque by deque.remove, comparing it with the waiters ahead of it: O(n^2)
in all (best_of_n --n 100000 spun 75 s before printing its error)."""

from __future__ import annotations

import asyncio
import errno
from types import SimpleNamespace

import pytest

from syscalls.context import AsyncContext


class Compared(asyncio.Future):
    """A future that counts the equality tests made on it (deque.remove makes one for
    each element it passes)."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        Compared.compared += 1
        return self is other

    __hash__ = asyncio.Future.__hash__


class File:
    """An AsyncFile whose forks fail with EMFILE past `limit`, as the kernel's do."""

    def __init__(self, counts: dict[str, int], limit: int):
        self.counts, self.limit = counts, limit

    async def pred(self, tokens, **options):
        await asyncio.sleep(0)
        self.counts["preds"] += 1
        return []

    async def stat(self) -> SimpleNamespace:
        return SimpleNamespace(tokens=0)

    async def fork(self) -> File:
        await asyncio.sleep(0)
        self.counts["forks"] += 1
        if self.counts["forks"] > self.limit:
            raise OSError(errno.EMFILE, "fork: too many fds open")
        return File(self.counts, self.limit)


def run_forks(n: int, limit: int) -> dict[str, int]:
    counts = {"preds": 0, "forks": 0}

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.create_future = lambda: Compared(loop=loop)
        root = AsyncContext(None, File(counts, limit), [1, 2, 3])
        await asyncio.gather(*(root.fork() for _ in range(n)))

    Compared.compared = 0
    with pytest.raises(OSError) as e:
        asyncio.run(main())
    assert e.value.errno == errno.EMFILE
    counts["compared"] = Compared.compared
    return counts


def test_cancelling_forks_waiting_their_turn_costs_linear_work():
    n = 4000
    counts = run_forks(n, limit=10)
    assert counts["preds"] == 1  # the pending tokens written once, by the first fork
    # Forks go one at a time: the failure ended the run after a few more, not all n.
    assert counts["forks"] < n // 2
    # asyncio.Lock: about n^2 / 4 comparisons (4 million here).
    assert counts["compared"] <= n


def test_concurrent_forks_still_write_the_pending_tokens_once_and_all_get_a_branch():
    counts = {"preds": 0, "forks": 0}

    async def main() -> list[AsyncContext]:
        root = AsyncContext(None, File(counts, 1 << 30), [1, 2, 3])
        branches = await asyncio.gather(*(root.fork() for _ in range(50)))
        assert root.pending == [3]
        return branches

    branches = asyncio.run(main())
    assert counts == {"preds": 1, "forks": 50}
    assert all(b.pending == [3] for b in branches)
