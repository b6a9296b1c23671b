"""A thin layer over the syscalls for the common shape of a LIP: grow a context, sample from
it, branch it.

A Context is one KV file plus the tokens not yet in it ("pending"). pred returns samples
only for rows it computes, so the token to sample after must go in with the pred that
samples. fill() only adds to the pending tokens; each generation step sends them all in one
pred that samples after the last, and keeps the sampled token pending for the next. So a
prompt or a question costs one forward pass, not a prefill and then a one-token pred. A
fork first writes all pending tokens but the last, so that branches share them. A step,
flush or fork interrupted (a timeout, a cancelled task, Ctrl-C) leaves `tokens` as it was:
if the pred's entries stood (its answer came first), the tokens it wrote leave the pending
ones (the sample is lost; with nothing pending the next step computes the last entry again).

    with Context(k) as ctx:
        ctx.fill(k.tokenize("def f", add_special=True))
        ids = list(ctx.generate(16))
        branch = ctx.fork()  # copy-on-write, pending tokens copied
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator, Iterable, Iterator
from typing import Any

from syscalls.aio import AsyncFile, AsyncKernel
from syscalls.client import File, Kernel
from syscalls.convert import KvPath, PredOutput


def _step_sampling(sampling: dict[str, Any], step: int) -> dict[str, Any]:
    """Sampling for one step: a seed becomes seed + step, so a seeded run is reproducible
    without every step drawing the same noise."""
    if sampling.get("seed") is None:
        return sampling
    return {**sampling, "seed": sampling["seed"] + step}


def _kept(pending: list[int], written: int, length: int) -> list[int]:
    """The pending tokens left when a context of `written` file tokens is cut to `length`."""
    return pending[: max(0, length - written)]


def _interrupted(pending: list[int], sent: int, written: int, now: int | None) -> int | None:
    """A pred of the first `sent` pending tokens of a file of `written` entries was
    interrupted, and the file has `now` (None: unknown): if its entries stood, those tokens
    leave `pending`. The file's length."""
    if now is not None and now == written + sent:
        del pending[:sent]
    return now


class Context:
    """A KV file (anonymous unless given; the context closes it) and its pending tokens."""

    def __init__(
        self,
        kernel: Kernel,
        file: File | None = None,
        pending: Iterable[int] = (),
        stop: Iterable[int] | None = None,
    ):
        self.kernel = kernel
        self.file = kernel.open() if file is None else file
        self.pending = list(pending)
        self._stop = None if stop is None else tuple(stop)
        self._written = 0 if file is None else None  # the file's length, when known

    def close(self) -> None:
        self.file.close()

    def _append(self, sent: list[int], **kwargs: Any) -> list[PredOutput]:
        """pred of `sent`, the first pending tokens; interrupted after its entries stood,
        they leave the pending ones."""
        if self._written is None:
            self._written = self.file.stat().tokens
        try:
            outs = self.file.pred(sent, **kwargs)
        except BaseException:
            try:
                now = self.file.stat().tokens
            except OSError:  # no session, or no kernel: the context is done with
                now = None
            self._written = _interrupted(self.pending, len(sent), self._written, now)
            raise
        self._written += len(sent)
        return outs

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.file.__exit__(*exc)

    @property
    def tokens(self) -> list[int]:
        """The file's tokens, then the pending ones."""
        return self.file.read()[0] + self.pending

    @property
    def stop(self) -> tuple[int, ...]:
        """Default stop tokens: the model's EOS ids."""
        if self._stop is None:
            self._stop = self.kernel.model_info().eos_ids
        return self._stop

    def fill(self, text_or_ids: str | Iterable[int], add_special: bool = False) -> None:
        """Add pending tokens (text is tokenized; add_special: with the tokenizer's BOS);
        the next step, fork or save writes them."""
        if isinstance(text_or_ids, str):
            text_or_ids = self.kernel.tokenize(text_or_ids, add_special=add_special)
        self.pending += text_or_ids

    def _write_all_but_last(self) -> None:
        if len(self.pending) > 1:
            self._append(self.pending[:-1], no_outputs=True)
            del self.pending[:-1]

    def flush(self) -> None:
        """Write the pending tokens into the file."""
        if self.pending:
            self._append(self.pending, no_outputs=True)
            self.pending.clear()

    def step(self, **sampling: Any) -> PredOutput:
        """Send the pending tokens, sample after them; the sample becomes pending. With
        nothing pending, the file's last entry is computed again, at its own position (one
        pred that cuts it and writes it back), to sample after it."""
        if self.pending:
            (out,) = self._append(self.pending, **sampling)
        else:
            n = self.file.stat().tokens
            if n == 0:
                raise ValueError("context: nothing to predict from")
            tokens, positions = self.file.read(n - 1, 1)
            (out,) = self.file.pred(tokens, positions=positions, truncate=n - 1, **sampling)
            self._written = n
        self.pending = [out.token]
        return out

    def samples(
        self, max_new_tokens: int, stop: Iterable[int] | None = None, **sampling: Any
    ) -> Iterator[PredOutput]:
        """Up to max_new_tokens steps, ending after a stop token (default: EOS), which is
        yielded too. Sampling keywords as Kernel.pred's; the default is greedy."""
        stop = self.stop if stop is None else tuple(stop)
        for i in range(max_new_tokens):
            out = self.step(**_step_sampling(sampling, i))
            yield out
            if out.token in stop:
                return

    def generate(
        self, max_new_tokens: int, stop: Iterable[int] | None = None, **sampling: Any
    ) -> Iterator[int]:
        """The tokens of samples()."""
        for out in self.samples(max_new_tokens, stop, **sampling):
            yield out.token

    def fork(self) -> Context:
        """A copy-on-write branch: a forked file and the same pending tokens (all but the
        last written first, so that the branches share their pages)."""
        self._write_all_but_last()
        branch = Context(self.kernel, self.file.fork(), self.pending, self._stop)
        branch._written = self._written
        return branch

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens."""
        written = self.file.stat().tokens
        if length < written:
            self.file.truncate(length)
        self.pending = _kept(self.pending, written, length)
        self._written = min(written, length)

    def save(self, path: KvPath) -> None:
        """Give the file, pending tokens written, a name."""
        self.flush()
        self.file.link(path)


class _Turns:
    """Tasks go one at a time, in the order they came, as under asyncio.Lock. But a waiter
    that is cancelled leaves no work: asyncio.Lock's takes itself out of its deque with
    deque.remove, which compares it with every waiter ahead of it, so cancelling n waiting
    tasks cost O(n^2) (asyncio.run's cleanup of a LIP that gathered 100000 forks, one of
    which failed with EMFILE, spun 75 s before the error was printed). Here it stays in the
    deque, done, and is skipped when the turn passes: O(1) a waiter."""

    def __init__(self) -> None:
        self._taken = False
        self._waiting: collections.deque[asyncio.Future] = collections.deque()

    async def __aenter__(self) -> None:
        if not self._taken:
            self._taken = True
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiting.append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if not turn.cancelled():  # given the turn, then cancelled before it ran
                self._pass()
            raise

    async def __aexit__(self, *exc: object) -> None:
        self._pass()

    def _pass(self) -> None:
        """The turn goes to the first task still waiting; none: no one has it."""
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)
                return
        self._taken = False


class AsyncContext:
    """Context for asyncio: the same methods, awaitable; make one with `create`."""

    def __init__(
        self,
        kernel: AsyncKernel,
        file: AsyncFile,
        pending: Iterable[int] = (),
        stop: Iterable[int] | None = None,
    ):
        self.kernel = kernel
        self.file = file
        self.pending = list(pending)
        self._stop = None if stop is None else tuple(stop)
        self._forking = _Turns()  # concurrent forks write the pending tokens once
        self._written: int | None = None  # the file's length, when known

    @classmethod
    async def create(
        cls,
        kernel: AsyncKernel,
        file: AsyncFile | None = None,
        pending: Iterable[int] = (),
        stop: Iterable[int] | None = None,
    ) -> AsyncContext:
        """A context over `file`, or over a new anonymous file."""
        context = cls(kernel, await kernel.open() if file is None else file, pending, stop)
        context._written = 0 if file is None else None
        return context

    async def close(self) -> None:
        await self.file.close()

    async def _append(self, sent: list[int], **kwargs: Any) -> list[PredOutput]:
        """Context._append's, awaited."""
        if self._written is None:
            self._written = (await self.file.stat()).tokens
        try:
            outs = await self.file.pred(sent, **kwargs)
        except BaseException:
            try:
                now = (await self.file.stat()).tokens
            except OSError:
                now = None
            self._written = _interrupted(self.pending, len(sent), self._written, now)
            raise
        self._written += len(sent)
        return outs

    async def __aenter__(self) -> AsyncContext:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.file.__aexit__(*exc)

    async def tokens(self) -> list[int]:
        return (await self.file.read())[0] + self.pending

    async def stop(self) -> tuple[int, ...]:
        if self._stop is None:
            self._stop = (await self.kernel.model_info()).eos_ids
        return self._stop

    async def fill(self, text_or_ids: str | Iterable[int], add_special: bool = False) -> None:
        if isinstance(text_or_ids, str):
            text_or_ids = await self.kernel.tokenize(text_or_ids, add_special=add_special)
        self.pending += text_or_ids

    async def _write_all_but_last(self) -> None:
        if len(self.pending) > 1:
            await self._append(self.pending[:-1], no_outputs=True)
            del self.pending[:-1]

    async def flush(self) -> None:
        if self.pending:
            await self._append(self.pending, no_outputs=True)
            self.pending.clear()

    async def step(self, **sampling: Any) -> PredOutput:
        if self.pending:
            (out,) = await self._append(self.pending, **sampling)
        else:
            n = (await self.file.stat()).tokens
            if n == 0:
                raise ValueError("context: nothing to predict from")
            tokens, positions = await self.file.read(n - 1, 1)
            (out,) = await self.file.pred(tokens, positions=positions, truncate=n - 1,
                                          **sampling)
            self._written = n
        self.pending = [out.token]
        return out

    async def samples(
        self, max_new_tokens: int, stop: Iterable[int] | None = None, **sampling: Any
    ) -> AsyncIterator[PredOutput]:
        stop = await self.stop() if stop is None else tuple(stop)
        for i in range(max_new_tokens):
            out = await self.step(**_step_sampling(sampling, i))
            yield out
            if out.token in stop:
                return

    async def generate(
        self, max_new_tokens: int, stop: Iterable[int] | None = None, **sampling: Any
    ) -> AsyncIterator[int]:
        async for out in self.samples(max_new_tokens, stop, **sampling):
            yield out.token

    async def fork(self) -> AsyncContext:
        async with self._forking:
            await self._write_all_but_last()
            branch = await self.file.fork()
        context = AsyncContext(self.kernel, branch, self.pending, self._stop)
        context._written = self._written
        return context

    async def truncate(self, length: int) -> None:
        written = (await self.file.stat()).tokens
        if length < written:
            await self.file.truncate(length)
        self.pending = _kept(self.pending, written, length)
        self._written = min(written, length)

    async def save(self, path: KvPath) -> None:
        await self.flush()
        await self.file.link(path)


class TextStream:
    """The text of a growing list of tokens, piece by piece, as `detokenize` of the whole
    list gives it. Each push decodes a window of the last tokens (at most WINDOW), not the
    whole list, so a stream of any length costs the same a token: a token's text is what
    decoding the window with it adds to decoding the window without it (a token alone may
    be part of a character, and a tokenizer may strip the text's first space; both decodes
    start at the same token, so they agree). An incomplete character at the end waits for
    the tokens that complete it."""

    WINDOW = 64  # tokens a push decodes at most, before the window moves up
    CONTEXT = 8  # tokens already shown that a moved window starts with

    def __init__(self, kernel: Kernel):
        self.kernel = kernel
        self.text = ""  # every piece so far
        self._ids: list[int] = []  # the window: tokens from its start on
        self._shown = ""  # the window's text up to the last piece

    def push(self, token: int) -> str:
        """The text that `token` adds."""
        self._ids.append(token)
        text = self.kernel.detokenize(self._ids)
        if text.endswith("\ufffd"):
            return ""
        new, self._shown = text[len(self._shown):], text
        self.text += new
        if len(self._ids) > self.WINDOW:
            self._move_window()
        return new

    def _move_window(self) -> None:
        """Start the window CONTEXT tokens before the end, everything in it shown; not
        while those tokens have no text (specials): a window starting with a text-less run
        decodes as the start of a text, where a tokenizer may strip a space."""
        ids = self._ids[-self.CONTEXT:]
        shown = self.kernel.detokenize(ids)
        if shown:
            self._ids, self._shown = ids, shown

    def finish(self) -> str:
        """What is still held back (an incomplete character at the very end)."""
        text = self.kernel.detokenize(self._ids)
        new, self._shown = text[len(self._shown):], text
        self.text += new
        return new
