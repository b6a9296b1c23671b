"""`symphony serve` on a kernel with almost no KV memory: a request that cannot get its
pages is a 503 in OpenAI's shape, nothing is left behind, and the server goes on serving
requests that fit; requests that fit one after another wait for each other's pages."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest
from daemon import meminfo, start_server, wait_for

DAEMON_FLAGS = ("--kv-pages", "8", "--host-pages", "0")
SERVE_FLAGS = ("--prefix-cache-pages", "0")


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_past_the_kernel_s_memory_is_a_503_and_the_server_goes_on(server, daemon,
                                                                            stream):
    """Streamed too: the first token is awaited before the headers, so the status is 503
    rather than a 200 and an error event."""
    with daemon.connect() as k:
        info = k.model_info()
        used = meminfo(k)["device_used"]
        too_many = 9 * info.page_size  # nine pages' worth: one more than the whole pool
        assert too_many + 16 <= info.context_length  # within the context: not a 400
        with pytest.raises(openai.APIStatusError) as e:
            server.client.completions.create(model=info.name, prompt=[7] * too_many,
                                             max_tokens=4, temperature=0, stream=stream)
        assert e.value.status_code == 503
        error = e.value.body
        assert error["type"] == "overloaded_error" and "KV memory" in error["message"]
        assert meminfo(k)["device_used"] == used  # nothing held
        fits = server.client.completions.create(model=info.name, prompt=[7] * 8,
                                                max_tokens=4, temperature=0)
        assert fits.usage.completion_tokens == 4


@pytest.mark.parametrize("big_first", [False, True])
def test_a_streamed_batch_with_one_prompt_past_memory_is_a_503(server, daemon, big_first):
    """Every prompt's first token is awaited before the headers, not only whichever
    prompt answers first: a batch whose small prompt starts at once and whose big one the
    kernel cannot take is a 503 however they are ordered, never a 200 and an error
    event."""
    with daemon.connect() as k:
        info = k.model_info()
        small, big = [7] * 4, [7] * (9 * info.page_size)
        prompts = [big, small] if big_first else [small, big]
        used = meminfo(k)["device_used"]
        for _ in range(3):  # the small prompt's token may come before the refusal or not
            with pytest.raises(openai.APIStatusError) as e:
                stream = server.client.completions.create(
                    model=info.name, prompt=prompts, max_tokens=4, temperature=0,
                    stream=True)
                list(stream)  # a 200's events; an error event raises openai.APIError
            assert e.value.status_code == 503, e.value
            assert e.value.body["type"] == "overloaded_error"
            # The small prompt's file too is closed (its pages freed) by the time the
            # refusal is sent: the request's generations are closed before it.
            assert meminfo(k)["device_used"] == used


@pytest.mark.parametrize("stream", [False, True])
def test_the_prefix_cache_gives_its_pages_back_to_a_request_that_needs_them(daemon, stream):
    """The cache's idle entries are evicted when the kernel is out of KV memory: a request
    that fits the pool is served, never refused for the pages the cache keeps. The cache
    evicted only to stay under its own budget, so with the pool full of cached pages the
    request was a 503 every time."""
    s = start_server(daemon, "--prefix-cache-pages", "4")
    try:
        with daemon.connect() as k:
            info = k.model_info()
            used = meminfo(k)["device_used"]
            first = s.client.completions.create(model=info.name,
                                                prompt=[5] * (4 * info.page_size + 1),
                                                max_tokens=1, temperature=0)
            assert first.usage.completion_tokens == 1
            wait_for(lambda: int(meminfo(k)["device_used"]) == int(used) + 4,
                     what="the cache's four pages")
            # Seven pages of prompt and one more as it decodes: the whole pool of eight.
            big = dict(model=info.name, prompt=[7] * (7 * info.page_size), max_tokens=2,
                       temperature=0)
            if stream:
                chunks = list(s.client.completions.create(**big, stream=True))
                assert chunks[-1].choices[0].finish_reason == "length"
            else:
                assert s.client.completions.create(**big).usage.completion_tokens == 2
            wait_for(lambda: meminfo(k)["device_used"] == used, what="every page freed")
    finally:
        assert s.stop() == 0, s.log_text()


def test_requests_past_the_pool_together_wait_for_each_other_and_all_succeed(server, daemon):
    """Six concurrent requests of four pages each on the eight-page pool: two fit at once,
    and the others wait for them to end rather than fail (four were 503s)."""
    with daemon.connect() as k:
        info = k.model_info()
        used = meminfo(k)["device_used"]
        prompt = [7] * (3 * info.page_size + 4)  # and 8 tokens: within the fourth page

        async def burst() -> list[int]:
            client = server.aclient
            async with client:
                done = await asyncio.gather(*(client.completions.create(
                    model=info.name, prompt=prompt, max_tokens=8, temperature=0, seed=i)
                    for i in range(6)))
            return [c.usage.completion_tokens for c in done]

        assert asyncio.run(burst()) == [8] * 6
        wait_for(lambda: meminfo(k)["device_used"] == used, what="every page freed")


def test_when_every_request_waits_for_pages_one_fails_and_the_other_goes_on(server, daemon):
    """Two requests that fill the pool with their prompts, each needing one page more to
    decode: neither would ever free one, so one (the older) is a 503 and the other
    completes, at once, not after the wait's limit. (Both complete when the first ends
    before the second's prompt is in.)"""
    with daemon.connect() as k:
        info = k.model_info()
        used = meminfo(k)["device_used"]
        prompt = [7] * (4 * info.page_size - 1)  # four pages; the fifth as it decodes

        async def both() -> list[object]:
            client = server.aclient
            async with client:
                return await asyncio.gather(*(client.completions.create(
                    model=info.name, prompt=prompt, max_tokens=8, temperature=0)
                    for _ in range(2)), return_exceptions=True)

        start = time.monotonic()
        done = asyncio.run(both())
        assert time.monotonic() - start < 30  # the wait's limit is 60 s
        failed = [r for r in done if isinstance(r, Exception)]
        assert len(failed) <= 1, failed
        for e in failed:
            assert isinstance(e, openai.APIStatusError) and e.status_code == 503, e
            assert "1 device pages needed" in e.body["message"]
        served = [r.usage.completion_tokens for r in done if r not in failed]
        assert served == [8] * (2 - len(failed))
        wait_for(lambda: meminfo(k)["device_used"] == used, what="every page freed")
