"""One request's generation over the syscalls: what an engine hard-codes (n, stop strings,
logprobs, seeds, response_format, prefix caching) written as a program's logic.

    generation = generator.start(GenParams(prompt=ids, max_tokens=64, n=2, stop=("\\n",)))
    try:
        async for delta in generation:  # Deltas of the choices, as their tokens come
            ...
    finally:
        await generation.aclose()

A request's prompt goes into the KV file the prefix cache gives (the longest cached prefix,
forked): the rest of the prompt is sent with the first pred, so the prompt and the first
sample are one forward pass (as syscalls.context's Context does), and the file is handed
to the cache afterwards, off the token path. With n choices the prompt is written once: the
first choice goes on in that file, the others fork it (copy-on-write) and sample after the
prompt again, each with its own seed, all concurrently. A syscall the kernel refuses for
want of memory (ENOSPC, EDQUOT) is made again after the prefix cache evicts an idle entry,
or once another request ends (PrefixCache.making_room: the request holds a claim while it
is in flight), within a bounded wait. A request preempted meanwhile (every request waits:
the youngest gives its pages up) closes its files, keeping what it has generated, waits,
and computes its prompt and each choice's tokens again as a prefill (the prompt once,
forked per choice); each choice's next pred then samples what it would have, its sampler
and grammar at the same step, so nothing streamed is repeated or lost.

A batch of prompts (a completions request's array) is a Batch: a Generation per prompt,
all started at once, so the kernel batches their preds; their Deltas merge, renumbered in
OpenAI's order (prompt i's choice j is i * n + j). max_tokens 0 samples nothing: the prompt
is computed only for its logprobs (echo), and each choice ends "length" with no token.

Each step is one pred with the choice's sampler: the same Sampling every step, so that the
kernel can decode ahead (docs/architecture.md), or seed + choice + step for a seeded
request (a reproducible run, as Context's). A grammar's mask and a logit_bias travel as
the pred's LogitControl. Text is detokenized locally (lips/serving/text.py).

The generation runs in a task of its own from start(); its Deltas wait in a queue for the
consumer. Whichever way it ends (done, an error, aclose(), the consuming task cancelled by
a client that went away), the task cancels its preds (the client takes each back from the
kernel), waits for the cache's copy of its file, and closes its files.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import llguidance

from lips.constrained import GrammarError, grammar_tokenizer, matcher
from lips.serving.errors import ApiError, bad_field, from_kernel, gone
from lips.serving.metrics import Metrics, RequestClock
from lips.serving.prefix_cache import Preempted, PrefixCache
from lips.serving.text import Detokenizer, StopStrings, text_bytes
from syscalls.aio import AsyncFile, AsyncKernel
from syscalls.convert import LogitControl, ModelInfo, PredOutput, Sampling, Vocabulary

log = logging.getLogger(__name__)
T = TypeVar("T")

# vLLM's stand-in for a top logprob of -inf (a token the grammar's mask leaves out): JSON
# has no infinity.
MIN_LOGPROB = -9999.0


@dataclass(frozen=True)
class GenParams:
    prompt: list[int]  # token ids, the chat template already applied
    max_tokens: int  # >= 0; the HTTP layer checked prompt + max_tokens <= context. 0: no
    # token is sampled (the prompt's logprobs alone, when asked); each choice ends "length"
    n: int = 1
    temperature: float = 1.0  # OpenAI's default; 0 is greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit (vLLM extra)
    min_p: float = 0.0  # vLLM extra
    seed: int | None = None  # choice i of a seeded request uses seed + i
    stop: tuple[str, ...] = ()  # stop strings: the text is cut before the first match
    ignore_eos: bool = False  # (vLLM extra) do not stop at the model's EOS ids
    logprobs: int | None = None  # None: no logprobs; k >= 0: the chosen token's + top k
    prompt_logprobs: bool = False  # each prompt token's logprob; the first is None
    logit_bias: dict[int, float] | None = None
    grammar: str | None = None  # an llguidance grammar (response_format), or None


@dataclass(frozen=True)
class TokenLogprob:
    token: str  # the token's text decoded alone, errors="replace"
    token_id: int
    bytes: list[int]  # the token's bytes (vocab)
    logprob: float
    top: list[tuple[str, list[int], float]]  # (text, bytes, logprob), most likely first


@dataclass(frozen=True)
class Delta:
    index: int  # the choice
    text: str  # new text ("" while a stop string or a character is held back)
    token_ids: list[int]
    logprobs: list[TokenLogprob]  # one per token in token_ids, when params.logprobs is set
    finish_reason: str | None  # "stop" (EOS, a stop string, the grammar done) or "length"
    # on the choice's last Delta
    pieces: list[str] = field(default_factory=list)  # per token in token_ids, the text it
    # added to the choice's decode (special ids none), before stop strings cut it


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int  # all choices together (OpenAI's rule)
    cached_tokens: int  # prompt tokens taken from the prefix cache


class Generator:
    """Starts requests on the server's one kernel session; what they share (the model's
    vocabulary, the prefix cache, the metrics) lives here."""

    def __init__(self, kernel: AsyncKernel, info: ModelInfo, vocab: Vocabulary,
                 cache: PrefixCache, metrics: Metrics):
        self.kernel, self.info, self.vocab = kernel, info, vocab
        self.cache, self.metrics = cache, metrics
        self.pieces = text_bytes(vocab)
        self.eos = frozenset(info.eos_ids)
        self._grammar_tokenizer: asyncio.Future[llguidance.LLTokenizer] | None = None

    def start(self, params: GenParams) -> Generation:
        """The request starts now (in a task of its own); iterate it for its Deltas, and
        aclose() it when done with it."""
        return Generation(self, params)

    @functools.cached_property
    def token_texts(self) -> list[tuple[str, list[int]]]:
        """Per id, its text decoded alone and its bytes: what logprobs show of a token."""
        return [(piece.decode("utf-8", errors="replace"), list(piece))
                for piece in self.vocab.tokens]

    async def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A matcher of `grammar` (GrammarError if bad). The tokenizer (once) and each
        grammar are built in a thread: a large vocabulary or schema takes a while, and the
        other requests' tokens must not wait for it."""
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = asyncio.ensure_future(asyncio.to_thread(
                grammar_tokenizer, self.vocab, self.info))
        tokenizer = await asyncio.shield(self._grammar_tokenizer)
        return await asyncio.to_thread(matcher, tokenizer, grammar)

    def logprob(self, token: int, logprob: float,
                top: Sequence[tuple[int, float]]) -> TokenLogprob:
        texts = self.token_texts
        text, data = texts[token]
        return TokenLogprob(text, token, data, max(logprob, MIN_LOGPROB),
                            [(*texts[t], max(lp, MIN_LOGPROB)) for t, lp in top])


def _int64(seed: int) -> int:
    """A seed wrapped into pred's signed 64 bits, so that seed + choice + step never
    overflows: still one seed per step."""
    return (seed + (1 << 63)) % (1 << 64) - (1 << 63)


_END = object()  # the queue's last item when the generation ended without an error


class _Choice:
    """One choice's output: its text (detokenized, cut at a stop string), its grammar, and
    how it ends (EOS, a stop string, the grammar complete, max_tokens)."""

    def __init__(self, generation: Generation, index: int,
                 grammar: llguidance.LLMatcher | None):
        g, p = generation.generator, generation.params
        self.index, self.params, self.grammar = index, p, grammar
        self.text = Detokenizer(g.pieces)
        self.stops = StopStrings(p.stop) if p.stop else None
        # With a grammar, EOS is allowed only where the output is complete: it ends it.
        self.eos = g.eos if grammar is not None or not p.ignore_eos else frozenset()
        self.logprob = g.logprob if p.logprobs is not None else None
        self.ids: list[int] = []  # the tokens taken so far
        self.done = False  # its last Delta taken
        seed = None if p.seed is None else _int64(p.seed + index)
        self._sampler = Sampling(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                                 min_p=p.min_p, seed=seed, top_logprobs=p.logprobs or 0)
        self._bias = LogitControl(bias=p.logit_bias) if p.logit_bias else None

    def sampler(self) -> Sampling:
        """The next step's: the same every step unless seeded (then seed + step)."""
        s, steps = self._sampler, len(self.ids)
        if s.seed is None or not steps:
            return s
        return replace(s, seed=_int64(s.seed + steps))

    def control(self) -> LogitControl | None:
        """The next step's: the grammar's mask now, and the logit bias."""
        if self.grammar is None:
            return self._bias
        return LogitControl(allowed=self.grammar.compute_bitmask(),
                            bias=self.params.logit_bias)

    def take(self, out: PredOutput) -> Delta:
        """The Delta of the token `out` sampled."""
        token = out.token
        self.ids.append(token)
        finish = None
        if token in self.eos:
            piece = decoded = ""
            finish = "stop"
        else:
            piece = decoded = self.text.push(token)
            if self.grammar is not None:
                if not self.grammar.consume_token(token):
                    # A token the mask allowed: llguidance stopped on a limit of its parser
                    # (a schema too large for it), which only shows as the output grows.
                    raise bad_field("response_format", "the grammar cannot go on: "
                                    f"{self.grammar.get_error()}")
                if self.grammar.is_stopped():  # nothing may follow
                    finish = "stop"
            if finish is None and len(self.ids) == self.params.max_tokens:
                finish = "length"
        matched = False
        if self.stops is not None:
            piece, matched = self.stops.push(piece)
        if matched:
            finish = "stop"
        elif finish is not None:  # the end: what was held back comes out
            rest = self.text.finish()
            decoded += rest
            if self.stops is not None:
                rest, matched = self.stops.push(rest)
                rest += "" if matched else self.stops.flush()
            piece += rest
        logprobs = [self.logprob(token, out.logprob, out.top)] if self.logprob else []
        self.done = finish is not None
        return Delta(self.index, piece, [token], logprobs, finish, [decoded])


class Generation:
    """One request: async-iterate it for its Deltas. `usage` is final once iteration ends;
    `prompt_logprobs` (when asked) is set before the first Delta. An error raises ApiError
    from the iteration (before any Delta when the request cannot start)."""

    def __init__(self, generator: Generator, params: GenParams):
        self.generator, self.params = generator, params
        self.usage = Usage(len(params.prompt), 0, 0)
        self.prompt_logprobs: list[TokenLogprob | None] = []
        self._clock: RequestClock = generator.metrics.request(len(params.prompt))
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._opened: list[asyncio.Task[AsyncFile]] = []  # every file of this request
        self._insert: asyncio.Task[None] | None = None
        self._cancelled = False
        self._ended = False  # the queue has its last item
        self._claim = generator.cache.claim()
        self._runner = asyncio.get_running_loop().create_task(self._run())
        self._deltas = self._iterate()

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._deltas

    async def _iterate(self) -> AsyncIterator[Delta]:
        try:
            while (item := await self._queue.get()) is not _END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        """Cancel what runs and close the request's files (idempotent); an iteration in
        progress ends. Waits until all is freed, even if the caller is cancelled meanwhile
        (the freeing goes on then)."""
        if not self._runner.done():
            if not self._cancelled:  # once: the runner's own clean-up awaits
                self._cancelled = True
                self._runner.cancel()
            await asyncio.wait([self._runner])  # never cancels the runner itself
        if not self._ended:  # cancelled before it ran a line: nothing was opened
            self._end(_END)

    def _end(self, last: object) -> None:
        """The request has ended, its files closed: `last` is the queue's last item."""
        self._ended = True
        self.generator.cache.release(self._claim)
        self._clock.finish()
        self._queue.put_nowait(last)

    async def _run(self) -> None:
        error: BaseException | None = None
        try:
            await self._generate()
        except asyncio.CancelledError:
            pass  # aclose(): the preds were taken back on the way out; free the rest below
        except OSError as e:
            error = from_kernel(e)
        except ApiError as e:
            error = e
        except Exception as e:  # a fault of the server's
            log.exception("generation failed")
            error = ApiError(500, f"internal error: {e}", type="internal_error")
        finally:
            # The files are closed whatever comes meanwhile: aclose() cancelling the runner
            # while they close (the request ended by another prompt's error as this one
            # finished) would leave a file open in the kernel, its pages held.
            with contextlib.suppress(asyncio.CancelledError):
                await self._free()
            self._end(_END if error is None else error)

    async def _generate(self) -> None:
        g, p = self.generator, self.params
        if not p.prompt:
            raise bad_field("prompt", "the prompt has no tokens")
        if p.max_tokens < 0 or p.n < 1:
            raise bad_field("max_tokens" if p.max_tokens < 0 else "n",
                            "must be at least " + ("0" if p.max_tokens < 0 else "1"))
        choices = None
        if p.max_tokens > 0:
            grammars = await self._grammars()
            choices = [_Choice(self, i, grammar) for i, grammar in enumerate(grammars)]
        again = False
        while True:
            try:
                if choices is None:
                    await self._score_only()
                else:
                    await self._sample(choices, again)
                return
            except Preempted as e:  # the request's pages go to older requests for now
                g.metrics.preemptions.inc()
                await self._free()
                await g.cache.preempted(self._claim, e)
                again = True

    async def _sample(self, choices: list[_Choice], again: bool) -> None:
        """The choices' tokens, from the prompt's first pred on; `again` after a
        preemption: the prompt's first pred in a new file (if no token was out yet: the
        cache was looked up once, at the start), or else _recompute."""
        g, p = self.generator, self.params
        if choices[0].ids:
            await self._recompute(choices)
            return
        if p.prompt_logprobs or again:  # every prompt row is computed: none from the cache
            file, skip = await self._own(g.kernel.open()), 0
        else:
            file = await self._own(self._cached())
            skip = self.usage.cached_tokens
            self._claim.holds = skip > 0  # the cached prefix's pages, until it closes
        first = await self._first(file, choices[0], skip)
        self._insert = asyncio.create_task(self._remember(file))
        await _all([self._decode(choices[0], file, first),
                    *(self._branch(choice, file) for choice in choices[1:])])

    async def _recompute(self, choices: list[_Choice]) -> None:
        """After a preemption, once a token was out: the prompt computed again in a new
        file, forked for each unfinished choice as at the start, and each choice's tokens
        sent after it with the pred that samples its next token (that step's sampler and
        grammar mask: the token it would have sampled), then decoding goes on."""
        prompt = self.params.prompt
        left = [c for c in choices if not c.done]
        base = await self._own(self.generator.kernel.open())
        shared = len(prompt) - 1 if len(left) > 1 else 0  # one choice: one pred does all
        if shared:
            await self._room(functools.partial(base.pred, prompt[:shared], no_outputs=True))
        forks = [await self._own(self._room(base.fork)) for _ in left[1:]]
        await _all([self._resume(c, f, prompt[shared:])
                    for c, f in zip(left, [base, *forks], strict=True)])

    async def _resume(self, choice: _Choice, file: AsyncFile, rest: list[int]) -> None:
        (out,) = await self._room(functools.partial(
            file.pred, rest + choice.ids, sampler=choice.sampler(), control=choice.control()))
        await self._decode(choice, file, out)

    async def _score_only(self) -> None:
        """max_tokens 0: nothing sampled. With prompt_logprobs, the prompt is computed (one
        pred, in a file of its own) for its tokens' logprobs; each choice then ends, with no
        token, "length"."""
        g, p = self.generator, self.params
        if p.prompt_logprobs:
            scored: list[TokenLogprob | None] = [None]
            if len(p.prompt) > 1:
                file = await self._own(g.kernel.open())
                outs = await self._room(functools.partial(
                    file.pred, p.prompt, outputs=list(range(len(p.prompt) - 1)),
                    sampler=Sampling(top_logprobs=p.logprobs or 0), score_next=True))
                scored += [g.logprob(t, o.next_logprob, o.top)
                           for t, o in zip(p.prompt[1:], outs, strict=True)]
            self.prompt_logprobs = scored
        for i in range(p.n):
            self._queue.put_nowait(Delta(i, "", [], [], "length"))

    async def _grammars(self) -> list[llguidance.LLMatcher | None]:
        """Each choice's grammar matcher (None without a grammar)."""
        p = self.params
        if p.grammar is None:
            return [None] * p.n
        try:
            first = await self.generator.matcher(p.grammar)
        except GrammarError as e:
            raise bad_field("response_format", str(e)) from e
        return [first, *(first.deep_copy() for _ in range(p.n - 1))]

    async def _cached(self) -> AsyncFile:
        file, self.usage.cached_tokens = await self.generator.cache.open(self.params.prompt)
        return file

    async def _own(self, opening: Awaitable[AsyncFile]) -> AsyncFile:
        """A file for this request, closed at its end even if this wait is cancelled while
        the kernel opens it (the opening goes on, shielded)."""
        task = asyncio.ensure_future(opening)
        self._opened.append(task)
        return await asyncio.shield(task)

    def _room(self, call: Callable[[], Awaitable[T]]) -> Awaitable[T]:
        """call(), a syscall that may need pages: while the kernel has none (ENOSPC,
        EDQUOT) it is made again as the prefix cache frees some or other requests end."""
        return self.generator.cache.making_room(call, self._claim)

    async def _first(self, file: AsyncFile, choice: _Choice, skip: int) -> PredOutput:
        """The first pred: the prompt past the `skip` tokens `file` holds, sampled after its
        last token (with prompt_logprobs, also every prompt token's logprob)."""
        p = self.params
        rest = p.prompt[skip:]
        control = choice.control()
        if not p.prompt_logprobs:
            (out,) = await self._room(functools.partial(
                file.pred, rest, sampler=choice.sampler(), control=control))
            return out
        # The prompt's rows scored in one pred, unseeded, and its last token computed again
        # and sampled in a pred of its own: a seeded pred draws its rows' samples from one
        # generator in order, so sampled in the scoring pred the choice's token was that
        # generator's last draw, not its first, and not what the same seed gave without
        # echo and logprobs.
        rows, sampler = len(rest), choice.sampler()
        outs = []
        if rows > 1:
            outs = await self._room(functools.partial(
                file.pred, rest, outputs=list(range(rows - 1)),
                sampler=replace(sampler, seed=None), score_next=True))
        logprob = self.generator.logprob
        self.prompt_logprobs = [None, *(logprob(t, o.next_logprob, o.top)
                                        for t, o in zip(rest[1:], outs, strict=True))]
        if rows > 1:
            (out,) = await self._room(functools.partial(
                file.pred, rest[-1:], sampler=sampler, control=control,
                truncate=skip + rows - 1))
        else:
            (out,) = await self._room(functools.partial(
                file.pred, rest, sampler=sampler, control=control))
        return out

    async def _branch(self, choice: _Choice, root: AsyncFile) -> None:
        """Another choice: a fork of the prompt's file, sampled after the prompt again."""
        prompt = self.params.prompt
        file = await self._own(self._room(root.fork))
        (out,) = await self._room(functools.partial(
            file.pred, prompt[-1:], sampler=choice.sampler(), control=choice.control(),
            truncate=len(prompt) - 1))
        await self._decode(choice, file, out)

    async def _decode(self, choice: _Choice, file: AsyncFile, out: PredOutput) -> None:
        """The choice's tokens from its first sample `out` on, one pred each."""
        usage, clock, put = self.usage, self._clock, self._queue.put_nowait
        while True:
            delta = choice.take(out)
            usage.completion_tokens += 1
            clock.tokens(1, choice.index)
            put(delta)
            if delta.finish_reason is not None:
                return
            (out,) = await self._room(functools.partial(
                file.pred, delta.token_ids, sampler=choice.sampler(),
                control=choice.control()))

    async def _remember(self, file: AsyncFile) -> None:
        """The prompt's file goes to the prefix cache (it forks it)."""
        try:
            await self.generator.cache.insert(self.params.prompt, file)
        except Exception:  # the cache is an optimisation: never a request's failure
            log.exception("prefix cache: insert failed")

    async def _free(self) -> None:
        """After the last pred (or a preemption): the cache's copy made, every file of the
        request closed, even if the caller is cancelled meanwhile (the freeing goes on;
        the cancellation is raised once it is done)."""
        insert, opened = self._insert, self._opened
        self._insert, self._opened = None, []
        release = asyncio.ensure_future(_release(insert, opened))
        cancelled = False
        while not release.done():
            try:
                await asyncio.shield(release)
            except asyncio.CancelledError:
                cancelled = True
        release.result()  # a close that failed is the request's error
        if cancelled:
            raise asyncio.CancelledError


class Batch:
    """Several prompts of one request (a completions batch), each its own Generation, all
    started at once: they are independent work, so the kernel batches their preds. Iterate
    it for every Delta, prompt i's choice j renumbered i * n + j (OpenAI's order); `usage`
    sums the prompts'. An error of any prompt ends the whole (the others are closed)."""

    def __init__(self, generator: Generator, params: Sequence[GenParams]):
        if not params:
            raise ValueError("a batch needs a prompt")
        self.n = params[0].n
        self.generations = [generator.start(p) for p in params]
        self._deltas = self._iterate()

    @property
    def usage(self) -> Usage:
        us = [g.usage for g in self.generations]
        return Usage(sum(u.prompt_tokens for u in us), sum(u.completion_tokens for u in us),
                     sum(u.cached_tokens for u in us))

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self._deltas

    async def _iterate(self) -> AsyncIterator[Delta]:
        if len(self.generations) == 1:  # nothing to merge or renumber
            async for delta in self.generations[0]:
                yield delta
            return
        queue: asyncio.Queue[Any] = asyncio.Queue()
        forwarders = [asyncio.ensure_future(self._forward(i, g, queue))
                      for i, g in enumerate(self.generations)]
        try:
            running = len(forwarders)
            while running:
                item = await queue.get()
                if item is _END:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            await self.aclose()  # each forwarder's iteration ends with its generation
            await asyncio.wait(forwarders)

    async def _forward(self, i: int, gen: Generation, queue: asyncio.Queue[Any]) -> None:
        try:
            async for delta in gen:
                queue.put_nowait(replace(delta, index=i * self.n + delta.index))
        except Exception as e:  # ApiError; the consumer raises it
            queue.put_nowait(e)
        finally:
            queue.put_nowait(_END)

    async def aclose(self) -> None:
        """Every prompt's generation closed (idempotent), as Generation.aclose: the closing
        goes on if the caller is cancelled meanwhile."""
        await asyncio.wait([asyncio.ensure_future(g.aclose()) for g in self.generations])


async def _release(insert: asyncio.Task[None] | None,
                   opened: list[asyncio.Task[AsyncFile]]) -> None:
    """The cache's copy of a request's file made, then every file of `opened` closed."""
    if insert is not None:
        await asyncio.wait([insert])
    if opened:
        await asyncio.wait(opened)
    await asyncio.gather(*(_close(t) for t in opened))


async def _close(opened: asyncio.Task[AsyncFile]) -> None:
    if opened.cancelled() or opened.exception() is not None:
        return
    try:
        await opened.result().close()
    except OSError as e:
        if not gone(e):  # the kernel gone: its files with it
            log.warning("could not close a request's KV file: %s", e)


async def _all(steps: list[Awaitable[None]]) -> None:
    """Run `steps` concurrently; the first error cancels the others, which have ended when
    it is raised (their preds taken back)."""
    tasks = [asyncio.ensure_future(s) for s in steps]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks)

