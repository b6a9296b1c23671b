"""A process's budget of gRPC pred replies the kernel holds (symphony/reply_budget.py)."""

from __future__ import annotations

import asyncio

import pytest

from symphony.reply_budget import LIMIT, ReplyBudget


def test_past_the_limit_rpcs_wait_in_order_and_one_alone_always_goes():
    async def run() -> list[str]:
        budget, got = ReplyBudget(), []
        await budget.take(LIMIT * 2)  # one alone, larger than the limit: it goes
        got.append("huge")

        async def rpc(name: str, size: int) -> None:
            await budget.take(size)
            got.append(name)

        waiting = [asyncio.create_task(rpc(n, LIMIT // 2)) for n in ("a", "b", "c")]
        await asyncio.sleep(0)
        assert got == ["huge"]  # nothing fits beside it
        budget.give(LIMIT * 2)
        await asyncio.sleep(0)
        assert got == ["huge", "a", "b"] and budget.held == LIMIT  # c waits, in order
        budget.give(LIMIT // 2)
        await asyncio.gather(*waiting)
        return got

    assert asyncio.run(run()) == ["huge", "a", "b", "c"]


@pytest.mark.parametrize("granted_first", [False, True])
def test_a_waiting_rpc_cancelled_holds_nothing(granted_first):
    """Cancelled while it waits, or just as room was given to it: its bytes are not kept."""
    async def run() -> int:
        budget = ReplyBudget()
        await budget.take(LIMIT)
        waiter = asyncio.create_task(budget.take(10))
        await asyncio.sleep(0)
        if granted_first:
            budget.give(LIMIT)  # room given, the task not yet resumed
            waiter.cancel()
        else:
            waiter.cancel()
            await asyncio.sleep(0)
            budget.give(LIMIT)
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return budget.held

    assert asyncio.run(run()) == 0
