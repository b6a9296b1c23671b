"""lips/serving/prefix_cache.py on a real daemon: what a hit holds and predicts, LRU under the
page budget (counted against the kernel's own /proc/meminfo), concurrent requests, and a
kernel out of memory.

Each test drives the cache as the server does (`serve` below) on a session of its own; the
device has no host tier here, so a full device is ENOSPC rather than swapping.
"""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Awaitable, Callable

import pytest
from daemon import prompt

from lips.serving.prefix_cache import PrefixCache
from syscalls.aio import AsyncFile, AsyncKernel
from syscalls.convert import proc_fields

DAEMON_FLAGS = ("--kv-pages", "128", "--host-pages", "0")
P = 16  # the test model's page size (checked below)


def on_kernel(daemon, body: Callable[[AsyncKernel], Awaitable[None]]) -> None:
    async def main() -> None:
        async with await AsyncKernel.connect(daemon.socket, name="prefix-cache-test") as k:
            assert (await k.model_info()).page_size == P
            await body(k)

    asyncio.run(main())


async def used(k: AsyncKernel) -> int:
    """Device pages in use, by the kernel's count."""
    return int(proc_fields(await k.procfs("meminfo"))["device_used"])


async def serve(cache: PrefixCache, tokens: list[int]) -> int:
    """One request as the server runs it: its cached prefix forked, the rest of the prompt
    computed, the prompt inserted, its file closed. The tokens taken from the cache."""
    file, cached = await cache.open(tokens)
    async with file:
        await file.pred(tokens[cached:], no_outputs=True)
        await cache.insert(tokens, file)
    return cached


async def tokens_of(file: AsyncFile) -> list[int]:
    return (await file.read())[0]


def test_a_hit_is_the_page_aligned_prefix_and_predicts_as_a_fresh_prefill(daemon):
    system = prompt(40)  # 2 whole pages and 8 tokens
    question = system[:37] + prompt(20, salt=3)

    async def body(k: AsyncKernel) -> None:
        tol = 1e-4 if (await k.model_info()).dtype == "float32" else 5e-2
        base = await used(k)
        cache = PrefixCache(k, P, budget_pages=64)
        assert await serve(cache, system) == 0  # a miss: all computed
        assert cache.pages == 2 and await used(k) - base == 2

        file, cached = await cache.open(question)
        async with file:
            assert cached == 2 * P and await tokens_of(file) == question[:2 * P]
            (hit,) = await file.pred(question[cached:], top_logprobs=10)
        async with await k.open() as fresh:
            (computed,) = await fresh.pred(question, top_logprobs=10)
        assert [i for i, _ in hit.top] == [i for i, _ in computed.top]
        assert [lp for _, lp in hit.top] == pytest.approx([lp for _, lp in computed.top],
                                                          abs=tol)

        # The last prompt token is never served from the cache, and less than a page is
        # never a hit.
        for length, hit_tokens in ((2 * P, P), (2 * P + 1, 2 * P), (P, 0), (1, 0)):
            file, cached = await cache.open(system[:length])
            async with file:
                assert cached == hit_tokens
                assert await tokens_of(file) == system[:hit_tokens]
        assert cache.queries == 40 + len(question) + 2 * P + 2 * P + 1 + P + 1
        assert cache.hits == 2 * P + P + 2 * P
        await cache.close()
        assert await used(k) == base

    on_kernel(daemon, body)


def test_a_miss_is_an_empty_file(daemon):
    async def body(k: AsyncKernel) -> None:
        cache = PrefixCache(k, P, budget_pages=64)
        await serve(cache, prompt(40, salt=1))
        other = [prompt(40, salt=1)[0] + 1, *prompt(40, salt=1)[1:]]  # the first page differs
        file, cached = await cache.open(other)
        async with file:
            assert cached == 0 and (await file.stat()).tokens == 0
        assert cache.hits == 0
        await cache.close()

    on_kernel(daemon, body)


def test_shared_prefixes_are_one_set_of_pages_counted_once(daemon):
    """Prompts sharing 2 pages, whether the later ones came through the cache or were
    computed apart: the cache's files hold each page once, and `pages` is the kernel's
    count of them. A prompt extending a cached one adds only its new pages."""
    shared = prompt(2 * P, salt=2)
    a, b, c = (shared + prompt(P + 3, salt=s) for s in (4, 5, 6))

    async def body(k: AsyncKernel) -> None:
        base = await used(k)
        cache = PrefixCache(k, P, budget_pages=64)
        assert await serve(cache, a) == 0
        assert await serve(cache, b) == 2 * P  # b forks a's 2 pages, adds 1
        async with await k.open() as file:  # c computed without the cache
            await file.pred(c, no_outputs=True)
            await cache.insert(c, file)
            assert await serve(cache, a) == 3 * P  # a's whole 3 pages now
        assert cache.pages == 2 + 3 and await used(k) - base == 5

        await serve(cache, a + prompt(P, salt=7))  # extends a
        assert cache.pages == 6 and await used(k) - base == 6
        async with await k.open() as file:
            await file.pred(a, no_outputs=True)
            await cache.insert(a, file)  # cached already: nothing happens
        assert cache.pages == 6
        await cache.close()
        assert cache.pages == 0 and await used(k) == base

    on_kernel(daemon, body)


def test_least_recently_used_entries_go_past_the_budget(daemon):
    a, b, c = (prompt(2 * P + 5, salt=s) for s in (10, 11, 12))

    async def body(k: AsyncKernel) -> None:
        base = await used(k)
        cache = PrefixCache(k, P, budget_pages=4)
        await serve(cache, a)
        await serve(cache, b)
        assert await serve(cache, a) == 2 * P  # a is used again: b is the oldest now
        await serve(cache, c)
        assert cache.pages == 4 and await used(k) - base == 4  # b's pages were freed
        for tokens, hit in ((a, 2 * P), (b, 0), (c, 2 * P)):
            file, cached = await cache.open(tokens)
            await file.close()
            assert cached == hit
        await serve(cache, prompt(6 * P, salt=13))  # past the whole budget: not cached
        assert cache.pages == 4
        await cache.close()
        assert await used(k) == base

    on_kernel(daemon, body)


def test_concurrent_requests_keep_the_index_consistent(daemon):
    """16 requests at once, sharing a system prompt and in 4 pairs of the same prompt,
    under a budget that evicts while others open and insert."""
    system = prompt(2 * P, salt=20)
    prompts = [system + prompt(P + 1 + i % 4, salt=21 + i % 8) for i in range(16)]

    async def body(k: AsyncKernel) -> None:
        base = await used(k)
        cache = PrefixCache(k, P, budget_pages=6)
        for _ in range(2):
            await asyncio.gather(*(serve(cache, p) for p in prompts))
        assert cache.pages <= 6 and await used(k) - base == cache.pages
        for p in prompts:  # whatever is cached is what a prompt starts with
            file, cached = await cache.open(p)
            async with file:
                assert cached in (0, 2 * P, 3 * P) and await tokens_of(file) == p[:cached]
        await cache.close()
        assert await used(k) == base

    on_kernel(daemon, body)


def test_an_insert_while_the_request_decodes_on(daemon):
    """The server inserts its prompt off the token path, while its next pred writes the
    same file: the cache keeps the prompt's pages only."""
    tokens = prompt(3 * P + 7, salt=25)

    async def body(k: AsyncKernel) -> None:
        cache = PrefixCache(k, P, budget_pages=64)
        file, _ = await cache.open(tokens)
        async with file:
            (first,) = await file.pred(tokens)
            await asyncio.gather(cache.insert(tokens, file), file.pred([first.token]))
        file, cached = await cache.open(tokens)
        async with file:
            assert cached == 3 * P and await tokens_of(file) == tokens[:3 * P]
        assert cache.pages == 3
        await cache.close()

    on_kernel(daemon, body)


def test_a_budget_of_zero_disables_the_cache(daemon):
    tokens = prompt(3 * P, salt=30)

    async def body(k: AsyncKernel) -> None:
        base = await used(k)
        cache = PrefixCache(k, P, budget_pages=0)
        assert await serve(cache, tokens) == 0
        assert await serve(cache, tokens) == 0
        assert cache.pages == 0 and await used(k) == base
        assert cache.queries == 2 * len(tokens) and cache.hits == 0

    on_kernel(daemon, body)


def test_out_of_memory_on_insert_evicts_and_never_raises(daemon):
    cached, new = prompt(2 * P, salt=40), prompt(2 * P + 5, salt=41)

    async def body(k: AsyncKernel) -> None:
        base = await used(k)
        cache = PrefixCache(k, P, budget_pages=64)
        await serve(cache, cached)
        request = await k.open()
        await request.pred(new, no_outputs=True)  # its last page is partial: a fork copies it
        seed = await k.open()
        await seed.pred(prompt(P + 1, salt=42), no_outputs=True)
        fillers = [seed]
        with pytest.raises(OSError) as full:
            while True:  # each fork copies the partial last page
                fillers.append(await seed.fork())
        assert full.value.errno == errno.ENOSPC
        await cache.insert(new, request)  # ENOSPC inside: the oldest entry goes instead
        assert cache.pages == 0
        file, hit = await cache.open(cached)
        assert hit == 0
        for f in [file, request, *fillers]:
            await f.close()
        assert await used(k) == base

    on_kernel(daemon, body)
