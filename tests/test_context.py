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


def test_a_step_with_nothing_pending_recomputes_the_last_entry_where_it_is(daemon):
    """A context over a file whose last entry is not at the position after the one before
    it (a Prompt Cache layout, a shifted file): the entry is computed again at its own
    position, in one pred, and the file's positions stay as they were; the async context
    too, made by create with the pending tokens it takes."""
    ids, positions = [10, 11, 12, 13], [0, 1, 2, 50]
    with daemon.connect("ctx") as k:
        with k.open("", os.O_RDWR) as ref:
            ref.pred(ids[:3], positions=positions[:3], no_outputs=True)
            (expected,) = ref.pred(ids[3:], positions=positions[3:])
        with k.open("", os.O_RDWR) as f:
            f.pred(ids, positions=positions, no_outputs=True)
            before = preds_made(k)
            out = Context(k, f).step()
            assert preds_made(k) - before == 1
            assert f.read() == (ids, positions)
            assert (out.token, out.logprob) == (expected.token, expected.logprob)

    async def run() -> tuple:
        k = await AsyncKernel.connect(daemon.socket, name="actx")
        f = await k.open()
        await f.pred(ids, positions=positions, no_outputs=True)
        stepped = await (await AsyncContext.create(k, f)).step()
        read = await f.read()
        async with await AsyncContext.create(k, pending=ids[:3]) as fresh:
            first = await fresh.step()
        await f.close()
        await k.close()
        return stepped, read, first

    stepped, read, first = asyncio.run(run())
    assert read == (ids, positions)
    assert (stepped.token, stepped.logprob) == (expected.token, expected.logprob)
    with daemon.connect("ctx") as k:
        assert first.token == greedy_after(k, ids[:3])
