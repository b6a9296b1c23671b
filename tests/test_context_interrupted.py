"""A Context step, flush or fork interrupted once its pred's entries stood (the answer came
first, then the timeout or Ctrl-C): `tokens` is as before. The pending token was left
pending though already in the file, so the next step wrote it twice (an outside tester's
asyncio timeouts: 34 of 60 greedy contexts diverged). The race is a moment wide against a
kernel; a file that answers, then raises, makes it every time."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from syscalls.context import AsyncContext, Context


class Interrupted(BaseException):
    """A sync interruption, as KeyboardInterrupt or a signal handler's exception."""


class File:
    """A file's tokens; a pred appends (after its cut) and samples its last token plus one,
    and raises `interrupt` once `stand` says whether its entries stood."""

    def __init__(self, tokens: list[int]):
        self.tokens = list(tokens)
        self.interrupt: BaseException | None = None
        self.stand = True

    def _pred(self, tokens, truncate=None, **options):
        interrupt, self.interrupt = self.interrupt, None
        if interrupt is None or self.stand:
            del self.tokens[len(self.tokens) if truncate is None else truncate:]
            self.tokens += tokens
        if interrupt is not None:
            raise interrupt
        return [] if options.get("no_outputs") else [SimpleNamespace(token=tokens[-1] + 1)]

    def _read(self, start=0, n=None):
        kept = self.tokens[start:None if n is None else start + n]
        return kept, list(range(start, start + len(kept)))


class SyncFile(File):
    def pred(self, tokens, **options):
        return self._pred(tokens, **options)

    def stat(self):
        return SimpleNamespace(tokens=len(self.tokens))

    def read(self, start=0, n=None):
        return self._read(start, n)


class AsyncFile(File):
    async def pred(self, tokens, **options):
        await asyncio.sleep(0)
        return self._pred(tokens, **options)

    async def stat(self):
        return SimpleNamespace(tokens=len(self.tokens))

    async def read(self, start=0, n=None):
        return self._read(start, n)


@pytest.mark.parametrize("stood", [True, False])
def test_an_interrupted_step_leaves_the_tokens_as_they_were(stood):
    f = SyncFile([1, 2, 3])
    ctx = Context(None, f, [4])
    f.interrupt, f.stand = Interrupted(), stood
    with pytest.raises(Interrupted):
        ctx.step()
    assert ctx.tokens == [1, 2, 3, 4]
    assert ctx.pending == ([] if stood else [4])
    assert ctx.step().token == 5 and ctx.tokens == [1, 2, 3, 4, 5]  # its last entry again
    assert f.tokens == [1, 2, 3, 4]


@pytest.mark.parametrize("stood", [True, False])
def test_an_interrupted_flush_or_fork_leaves_the_tokens_as_they_were(stood):
    f = SyncFile([1])
    ctx = Context(None, f, [2, 3])
    f.interrupt, f.stand = Interrupted(), stood
    with pytest.raises(Interrupted):
        ctx.flush()
    assert ctx.tokens == [1, 2, 3]
    ctx.fill([4, 5])
    f.interrupt, f.stand = Interrupted(), stood
    with pytest.raises(Interrupted):
        ctx.fork()  # writes all pending tokens but the last first
    assert ctx.tokens == [1, 2, 3, 4, 5]


@pytest.mark.parametrize("stood", [True, False])
def test_a_cancelled_async_step_leaves_the_tokens_as_they_were(stood):
    async def main() -> None:
        f = AsyncFile([1, 2, 3])
        ctx = AsyncContext(None, f, [4])
        f.interrupt, f.stand = asyncio.CancelledError(), stood
        with pytest.raises(asyncio.CancelledError):
            await ctx.step()
        assert await ctx.tokens() == [1, 2, 3, 4]
        assert (await ctx.step()).token == 5 and await ctx.tokens() == [1, 2, 3, 4, 5]
        f.interrupt, f.stand = asyncio.CancelledError(), stood
        await ctx.fill([6, 7])
        with pytest.raises(asyncio.CancelledError):
            await ctx.flush()
        assert await ctx.tokens() == [1, 2, 3, 4, 5, 6, 7]

    asyncio.run(main())
