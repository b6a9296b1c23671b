"""syscalls/context.py against a real kernel: a prompt costs one pred, and branches share
the prompt's pages."""

from __future__ import annotations

import asyncio
import os

from daemon import prompt

from syscalls.aio import AsyncKernel
from syscalls.context import AsyncContext, Context

DAEMON_FLAGS = ("--kv-pages", "256")


def preds_made(k) -> int:
    rows = (line.split("\t") for line in k.procfs(f"{k.pid}/syscalls").splitlines()[1:])
    return {row[0]: int(row[1]) for row in rows}.get("Pred", 0)


def greedy_after(k, ids: list[int]) -> int:
    with k.open("", os.O_RDWR) as f:
        (out,) = f.pred(ids)
        return out.token


def test_a_prompt_and_its_first_sample_take_one_pred(daemon):
    ids = prompt(30, salt=1)
    with daemon.connect("ctx") as k:
        expected = greedy_after(k, ids)
        before = preds_made(k)
        with Context(k) as ctx:
            ctx.fill(ids)
            out = ctx.step()
            assert preds_made(k) - before == 1
            assert out.token == expected
            assert ctx.file.stat().tokens == len(ids)
            assert ctx.tokens == [*ids, out.token]


def test_branches_share_the_prompt_written_once(daemon):
    ids = prompt(40, salt=2)
    with daemon.connect("ctx") as k:
        expected = greedy_after(k, ids)
        before = preds_made(k)
        with Context(k) as ctx:
            ctx.fill(ids)
            with ctx.fork() as a, ctx.fork() as b:
                assert preds_made(k) - before == 1  # the prompt but its last token, once
                assert ctx.file.stat().tokens == len(ids) - 1
                assert [a.step().token, b.step().token] == [expected, expected]


def test_concurrent_async_forks_write_the_prompt_once(daemon):
    ids = prompt(40, salt=3)

    async def run() -> tuple[int, list[int]]:
        k = await AsyncKernel.connect(daemon.socket, name="actx")
        async with await AsyncContext.create(k) as root:
            await root.fill(ids)
            branches = await asyncio.gather(*(root.fork() for _ in range(4)))
            written = (await root.file.stat()).tokens
            tokens = [(await b.step()).token for b in branches]
            for b in branches:
                await b.close()
        await k.close()
        return written, tokens

    with daemon.connect("ctx") as k:
        expected = greedy_after(k, ids)
    written, tokens = asyncio.run(run())
    assert written == len(ids) - 1
    assert tokens == [expected] * 4
