"""One request's generation (lips/serving/generation.py): first the Generator itself on a
real kernel, each result checked another way (a plain Context's decode, pred's own
logprobs, a whole detokenize); then the same through `symphony serve` and the openai
client.

The test model has random weights, so its texts are gibberish: the checks are exact
equalities, never content.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import openai
import pytest
import torch
from daemon import ROOT, SYMPHONY, prompt, wait_for
from test_lip_constrained import SCHEMAS, violations

from lips.constrained import schema_grammar
from lips.serving.errors import ApiError
from lips.serving.generation import Delta, Generation, Generator, GenParams, Usage
from lips.serving.metrics import Metrics
from lips.serving.prefix_cache import PrefixCache
from syscalls.aio import AsyncKernel
from syscalls.context import Context

T = TypeVar("T")
PROMPT = prompt(21, salt=3)


def served(daemon, body: Callable[[Generator, AsyncKernel], Awaitable[T]],
           cache_pages: int = 0) -> T:
    """body(generator, kernel) run on a fresh session, with a prefix cache of cache_pages."""

    async def main() -> T:
        async with await AsyncKernel.connect(daemon.socket, name="serve-test") as k:
            info = await k.model_info()
            cache = PrefixCache(k, info.page_size, cache_pages)
            try:
                return await body(Generator(k, info, await k.vocab(), cache, Metrics("m")), k)
            finally:
                await cache.close()

    return asyncio.run(main())


async def collect(gen: Generation) -> list[Delta]:
    try:
        return [d async for d in gen]
    finally:
        await gen.aclose()


def outputs(deltas: list[Delta], n: int = 1) -> list[dict[str, Any]]:
    """Per choice: its text, token ids, logprobs and finish reason."""
    out = [{"text": "", "ids": [], "logprobs": [], "finish": None} for _ in range(n)]
    for d in deltas:
        c = out[d.index]
        assert c["finish"] is None, "a Delta after the choice's last"
        c["text"] += d.text
        c["ids"] += d.token_ids
        c["logprobs"] += d.logprobs
        c["finish"] = d.finish_reason
    return out


def generate(daemon, cache_pages: int = 0, **params: Any) -> list[dict[str, Any]]:
    p = GenParams(**{"prompt": PROMPT, "max_tokens": 24, **params})

    async def body(g: Generator, k: AsyncKernel) -> list[Delta]:
        return await collect(g.start(p))

    return outputs(served(daemon, body, cache_pages), p.n)


def context_greedy(daemon, ids: list[int], n: int) -> list[int]:
    """A plain Context's greedy decode (what `symphony generate` equals), EOS kept."""
    with daemon.connect() as k, Context(k) as ctx:
        ctx.fill(ids)
        return list(ctx.generate(n))


def detokenize(daemon, ids: list[int]) -> str:
    with daemon.connect() as k:
        return k.detokenize(ids)


def test_greedy_is_a_plain_decode_and_its_text_the_kernels(daemon):
    (out,) = generate(daemon, temperature=0, max_tokens=40)
    expected = context_greedy(daemon, PROMPT, 40)
    assert out["ids"] == expected
    assert out["finish"] == ("stop" if len(expected) < 40 else "length")
    assert out["text"] == detokenize(daemon, out["ids"])


def test_ignore_eos_runs_to_max_tokens_and_text_matches_detokenize(daemon):
    for seed in range(3):
        (out,) = generate(daemon, temperature=1.0, seed=seed, ignore_eos=True, max_tokens=64)
        assert out["finish"] == "length" and len(out["ids"]) == 64
        assert out["text"] == detokenize(daemon, out["ids"])


def test_the_same_seed_gives_the_same_text_and_choice_i_uses_seed_plus_i(daemon):
    a = generate(daemon, n=3, seed=11, max_tokens=16, ignore_eos=True)
    assert a == generate(daemon, n=3, seed=11, max_tokens=16, ignore_eos=True)
    assert len({c["text"] for c in a}) == 3
    for i in range(3):  # the forks sample as a fresh request of seed + i would
        assert [a[i]] == generate(daemon, seed=11 + i, max_tokens=16, ignore_eos=True)


def test_concurrent_requests_each_equal_running_alone(daemon):
    params = [GenParams(prompt(12 + i, salt=i), 12, temperature=0.8, seed=i, ignore_eos=True)
              for i in range(16)]

    async def together(g: Generator, k: AsyncKernel) -> list[list[Delta]]:
        return await asyncio.gather(*(collect(g.start(p)) for p in params))

    async def alone(g: Generator, k: AsyncKernel) -> list[list[Delta]]:
        return [await collect(g.start(p)) for p in params]

    assert ([outputs(d) for d in served(daemon, together)]
            == [outputs(d) for d in served(daemon, alone)])


def test_stop_strings_cut_the_text_before_the_first_match(daemon):
    (full,) = generate(daemon, temperature=0, ignore_eos=True, max_tokens=40)
    text = full["text"]
    for stop in (text[5:8], text[20:21], text[len(text) // 2:len(text) // 2 + 4]):
        deltas = served(daemon, lambda g, k, stop=stop: collect(g.start(GenParams(
            PROMPT, 40, temperature=0, ignore_eos=True, stop=(stop, "never seen")))))
        (out,) = outputs(deltas)
        assert out["text"] == text[: text.find(stop)] and out["finish"] == "stop"
        assert out["ids"] == full["ids"][: len(out["ids"])]
        shown = ""
        for d in deltas:  # no Delta ever shows a part of the stop string
            shown += d.text
            assert text.startswith(shown) and len(shown) <= text.find(stop)


def test_logprobs_are_preds_own(daemon):
    (out,) = generate(daemon, temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    assert [lp.token_id for lp in out["logprobs"]] == out["ids"]
    with daemon.connect() as k, k.open() as f:
        vocab = k.vocab()
        outs = f.pred(PROMPT + out["ids"][:-1], outputs=range(len(PROMPT) - 1,
                      len(PROMPT) + len(out["ids"]) - 1), top_logprobs=3)
    for lp, o in zip(out["logprobs"], outs, strict=True):
        assert lp.token_id == o.token and lp.logprob == pytest.approx(o.logprob, abs=1e-4)
        assert [(t, b) for t, b, _ in lp.top] == [
            (vocab.tokens[i].decode(errors="replace"), list(vocab.tokens[i])) for i, _ in o.top]
        assert [x for _, _, x in lp.top] == pytest.approx([x for _, x in o.top], abs=1e-4)
        assert lp.bytes == list(vocab.tokens[lp.token_id])


def test_prompt_logprobs_are_the_prompts_scores(daemon):
    async def body(g: Generator, k: AsyncKernel) -> tuple[list, list[Delta]]:
        gen = g.start(GenParams(PROMPT, 4, temperature=0, prompt_logprobs=True, logprobs=2,
                                n=2))
        deltas = await collect(gen)
        return gen.prompt_logprobs, deltas

    scores, deltas = served(daemon, body, cache_pages=64)
    with daemon.connect() as k, k.open() as f:
        vocab = k.vocab()
        outs = f.pred(PROMPT, outputs=range(len(PROMPT)), score_next=True, top_logprobs=2)
    assert scores[0] is None and len(scores) == len(PROMPT)
    for lp, token, o in zip(scores[1:], PROMPT[1:], outs, strict=False):
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(o.next_logprob, abs=1e-4)
        assert [b for _, b, _ in lp.top] == [list(vocab.tokens[i]) for i, _ in o.top]
    a, b = outputs(deltas, 2)
    assert a["ids"] == b["ids"] == context_greedy(daemon, PROMPT, 4)[: len(a["ids"])]


def test_a_seeded_choice_samples_the_same_with_prompt_logprobs(daemon):
    """Scoring the prompt (echo with logprobs) changes no seeded sample: the prompt's rows
    and the choice's first sample were one pred, whose seeded generator drew a sample for
    each row, so the choice's token was its last draw and the text another seed's."""
    for seed in range(4):
        plain = generate(daemon, temperature=1.0, seed=seed, n=2, max_tokens=12,
                         ignore_eos=True)
        scored = generate(daemon, temperature=1.0, seed=seed, n=2, max_tokens=12,
                          ignore_eos=True, prompt_logprobs=True, logprobs=1)
        assert [c["ids"] for c in scored] == [c["ids"] for c in plain]


def test_logit_bias_moves_the_sample(daemon):
    (out,) = generate(daemon, temperature=0, max_tokens=6, ignore_eos=True,
                      logit_bias={77: 100.0})
    assert out["ids"] == [77] * 6


@pytest.mark.parametrize("name", ["nested", "array"])
def test_a_json_schema_response_always_validates(daemon, name):
    grammar = schema_grammar(SCHEMAS[name])
    for seed in range(3):
        outs = generate(daemon, temperature=1.0, seed=seed, grammar=grammar, max_tokens=96,
                        n=2)
        for out in outs:
            assert out["finish"] == "stop", out
            assert violations(json.loads(out["text"]), SCHEMAS[name]) == []


def test_a_bad_grammar_is_a_400_naming_response_format(daemon):
    with pytest.raises(ApiError) as e:
        generate(daemon, grammar="start: nonsense ::= ???")
    assert e.value.status == 400 and e.value.param == "response_format"


def test_a_shared_prefix_is_a_cache_hit_with_the_same_output(daemon):
    system = prompt(70, salt=9)

    async def body(g: Generator, k: AsyncKernel) -> list[tuple[Usage, list[Delta]]]:
        results = []
        for tail in ([5, 6, 7], [8, 9], [5, 6, 7]):
            gen = g.start(GenParams(system + tail, 8, temperature=0))
            results.append((gen.usage, await collect(gen)))
        return results

    (u1, d1), (u2, d2), (u3, d3) = served(daemon, body, cache_pages=64)
    with daemon.connect() as k:
        page = k.model_info().page_size
    assert page <= 70  # else nothing of the system prompt could be cached
    assert u1.cached_tokens == 0 and u2.cached_tokens == 70 // page * page
    assert u3.cached_tokens == 72 // page * page
    assert outputs(d1) == outputs(d3)
    assert outputs(d1)[0]["ids"] == context_greedy(daemon, system + [5, 6, 7], 8)
    assert u1.completion_tokens == len(outputs(d1)[0]["ids"])


def test_a_cache_hit_changes_no_output_of_sampled_choices(daemon):
    params = GenParams(prompt(50, salt=2), 10, n=3, seed=5, temperature=1.0)

    async def body(g: Generator, k: AsyncKernel) -> list[tuple[Usage, list[Delta]]]:
        results = []
        for _ in range(2):
            gen = g.start(params)
            results.append((gen.usage, await collect(gen)))
        return results

    (miss, d1), (hit, d2) = served(daemon, body, cache_pages=64)
    assert miss.cached_tokens == 0 and hit.cached_tokens > 0
    assert outputs(d1, 3) == outputs(d2, 3)
    assert hit.completion_tokens == sum(len(c["ids"]) for c in outputs(d2, 3))


async def pages_of(k: AsyncKernel) -> int:
    """The pages of the session's open files (ps)."""
    return next(p.pages for p in await k.ps() if p.pid == k.pid)


async def cancelled_midstream(k: AsyncKernel, stream: Any,
                              until: Callable[[list[Delta]], bool]) -> tuple[int, list[Delta]]:
    """Consumes `stream` (a generation or a batch) in a task until `until(deltas so far)`,
    then cancels the task, as a client's disconnect cancels the task streaming to it, and
    closes the stream, which returns once all is freed. The session's pages while it
    streamed, and the deltas it got."""
    deltas: list[Delta] = []
    started = asyncio.Event()

    async def consume() -> None:
        async for delta in stream:
            deltas.append(delta)
            if until(deltas):
                started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    during = await pages_of(k)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await stream.aclose()
    return during, deltas


def test_a_cancelled_consumer_frees_its_pages(daemon):
    async def body(g: Generator, k: AsyncKernel) -> tuple[int, int, int]:
        before = await pages_of(k)
        gen = g.start(GenParams(prompt(150, salt=4), 2000, n=2, ignore_eos=True))
        during, _ = await cancelled_midstream(k, gen, lambda deltas: len(deltas) == 6)
        return before, during, await pages_of(k)

    before, during, after = served(daemon, body)
    assert during > before and after == before


def test_aclose_as_the_generation_closes_its_files_frees_everything(daemon):
    """aclose() right after the last Delta, while the runner closes the request's files (a
    batch ended by another prompt's error does this): the closing is not cut short, and no
    file is left open in the kernel. Each round yields to the loop a different number of
    times first, to land at each of the closing's steps."""

    async def body(g: Generator, k: AsyncKernel) -> tuple[int, list[int]]:
        before, after = await pages_of(k), []
        for yields in range(12):
            gen = g.start(GenParams(prompt(20, salt=yields), 3, ignore_eos=True))
            async for delta in gen:
                if delta.finish_reason is not None:
                    break
            for _ in range(yields):
                await asyncio.sleep(0)
            await gen.aclose()
            after.append(await pages_of(k))
        return before, after

    before, after = served(daemon, body)
    assert after == [before] * len(after)


def test_aclose_before_iterating_frees_everything(daemon):
    async def body(g: Generator, k: AsyncKernel) -> tuple[int, int]:
        before = await pages_of(k)
        gen = g.start(GenParams(prompt(40), 500, ignore_eos=True))
        await gen.aclose()
        await gen.aclose()  # idempotent
        assert [d async for d in gen] == []
        return before, await pages_of(k)

    before, after = served(daemon, body)
    assert after == before


# -- through `symphony serve` and the openai client -----------------------------------------


def model_name(server) -> str:
    return server.client.models.list().data[0].id


def chat_ids(daemon, messages: list[dict[str, str]]) -> list[int]:
    with daemon.connect() as k:
        return k.tokenize(messages=messages, add_generation_prompt=True)


MESSAGES = [{"role": "user", "content": "def fibonacci(n): the quick brown fox"}]


def test_chat_streamed_and_not_is_the_generators_output(daemon, server):
    name = model_name(server)
    reply = server.client.chat.completions.create(model=name, messages=MESSAGES,
                                                  temperature=0, max_tokens=24)
    ids = chat_ids(daemon, MESSAGES)
    expected = context_greedy(daemon, ids, 24)
    (choice,) = reply.choices
    assert choice.message.content == detokenize(daemon, expected)
    assert reply.usage.completion_tokens == len(expected)
    assert reply.usage.prompt_tokens == len(ids)
    assert choice.finish_reason == ("stop" if len(expected) < 24 else "length")
    stream = server.client.chat.completions.create(
        model=name, messages=MESSAGES, temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        choice.message.content)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected)


def test_completions_greedy_equals_symphony_generate(daemon, server, model):
    ids = prompt(17, salt=5)
    run = subprocess.run(
        [*SYMPHONY, "generate", "--model", str(model), "--prompt-ids", ",".join(map(str, ids)),
         "--max-new-tokens", "32", "--json"], capture_output=True, text=True, timeout=300,
        cwd=ROOT)
    assert run.returncode == 0, run.stderr
    expected = json.loads(run.stdout)["output_ids"]
    name = model_name(server)
    reply = server.client.completions.create(model=name, prompt=ids, max_tokens=32,
                                             temperature=0)
    assert reply.choices[0].text == detokenize(daemon, expected)
    assert reply.usage.completion_tokens == len(expected)
    streamed = server.client.completions.create(model=name, prompt=ids, max_tokens=32,
                                                temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == reply.choices[0].text


def test_n_choices_and_the_same_seed_twice(server):
    name = model_name(server)

    def ask(**extra: Any) -> list[str]:
        reply = server.client.completions.create(model=name, prompt="The quick brown", n=3,
                                                 max_tokens=16, temperature=1.0, seed=42,
                                                 extra_body={"ignore_eos": True}, **extra)
        if extra.get("stream"):
            texts = [""] * 3
            for chunk in reply:
                for c in chunk.choices:
                    texts[c.index] += c.text
            return texts
        assert reply.usage.completion_tokens == 48
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

    first = ask()
    assert len(set(first)) == 3
    assert ask() == first and ask(stream=True) == first
    single = server.client.completions.create(model=name, prompt="The quick brown",
                                              max_tokens=16, temperature=1.0, seed=43,
                                              extra_body={"ignore_eos": True})
    assert single.choices[0].text == first[1]  # choice i is seed + i


def test_a_seed_is_any_signed_64_bit_integer_each_its_own(server):
    """A seed outside pred's signed 64 bits is a 400 naming it (one was folded modulo 2**64:
    2**64 gave seed 0's text); within them no two seeds share a stream: a negative seed is
    its 64 bits read unsigned (-1 is 2**64 - 1, -2**63 is 2**63), and seed + i wraps
    around them."""
    name = model_name(server)

    def texts(seed: int, n: int = 1) -> list[str]:
        reply = server.client.completions.create(model=name, prompt="The quick brown", n=n,
                                                 max_tokens=16, temperature=1.0, seed=seed,
                                                 extra_body={"ignore_eos": True})
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)]

    for seed in (2**64, 2**64 - 1, 2**63, -(2**63) - 1):
        with pytest.raises(openai.BadRequestError) as e:
            texts(seed)
        assert e.value.param == "seed"
    edges = [0, 1, -1, 2**63 - 1, -(2**63), 2**63 - 2, -(2**63) + 1]
    outs = {seed: texts(seed) for seed in edges}
    assert texts(2**63 - 1, n=2) == [*outs[2**63 - 1], *outs[-(2**63)]]  # seed + 1, wrapped
    if not torch.cuda.is_available():
        # A CPU kernel's torch generator (mt19937) keys on a seed's low 32 bits alone (CUDA's
        # Philox on all 64): there seeds that differ only above them share a stream.
        edges = list({seed % 2**32: seed for seed in reversed(edges)}.values())
    assert len({outs[seed][0] for seed in edges}) == len(edges)


def test_stop_strings_are_cut_exactly(server):
    name = model_name(server)
    base = dict(model=name, prompt="def fibonacci", max_tokens=40, temperature=0,
                extra_body={"ignore_eos": True})
    text = server.client.completions.create(**base).choices[0].text
    for stop in (text[6:9], [text[20:22], "never"]):
        first = min(text.find(s) for s in ([stop] if isinstance(stop, str) else stop)
                    if s in text)
        reply = server.client.completions.create(**base, stop=stop)
        assert reply.choices[0].text == text[:first]
        assert reply.choices[0].finish_reason == "stop"
        shown = ""
        for chunk in server.client.completions.create(**base, stop=stop, stream=True):
            shown += chunk.choices[0].text
            assert text[:first].startswith(shown)
        assert shown == text[:first]


def test_chat_logprobs_agree_with_preds(daemon, server):
    reply = server.client.chat.completions.create(
        model=model_name(server), messages=MESSAGES, temperature=0, max_tokens=10,
        logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    ids = chat_ids(daemon, MESSAGES)
    with daemon.connect() as k, Context(k) as ctx:
        vocab = k.vocab()
        ctx.fill(ids)
        outs = [ctx.step(top_logprobs=3) for _ in range(10)]
    assert len(content) == len(outs)
    for lp, o in zip(content, outs, strict=True):
        assert lp.bytes == list(vocab.tokens[o.token])
        assert lp.logprob == pytest.approx(o.logprob, abs=1e-4)
        assert [t.bytes for t in lp.top_logprobs] == [list(vocab.tokens[i]) for i, _ in o.top]
        assert [t.logprob for t in lp.top_logprobs] == pytest.approx(
            [x for _, x in o.top], abs=1e-4)


def test_concurrent_streams_each_equal_running_alone(server):
    name = model_name(server)

    async def one(client, i: int) -> str:
        stream = await client.completions.create(
            model=name, prompt=prompt(10 + i, salt=i), max_tokens=12, temperature=0.9,
            seed=i, stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream])

    async def together() -> list[str]:
        async with server.aclient as client:  # a client per event loop
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    async def alone() -> list[str]:
        async with server.aclient as client:
            return [await one(client, i) for i in range(16)]

    assert asyncio.run(together()) == asyncio.run(alone())


def test_json_schema_responses_validate(server):
    schema = SCHEMAS["nested"]
    for seed in range(3):
        reply = server.client.chat.completions.create(
            model=model_name(server), messages=MESSAGES, temperature=1.0, seed=seed,
            max_tokens=96, n=2, response_format={
                "type": "json_schema", "json_schema": {"name": "user", "schema": schema}})
        for choice in reply.choices:
            assert choice.finish_reason == "stop"
            assert violations(json.loads(choice.message.content), schema) == []


def test_a_shared_system_prompt_is_a_cache_hit(daemon, server):
    with daemon.connect() as k:
        page = k.model_info().page_size
    system = {"role": "system", "content": "The quick brown fox jumps over the lazy dog. "
              * (3 * page // 8 + 4)}
    assert len(chat_ids(daemon, [system])) > 2 * page
    usages = [server.client.chat.completions.create(
        model=model_name(server), messages=[system, {"role": "user", "content": question}],
        temperature=0, max_tokens=4).usage for question in ("def", "fibonacci(n)")]
    assert usages[0].prompt_tokens_details.cached_tokens == 0
    assert usages[1].prompt_tokens_details.cached_tokens >= 2 * page


def server_pages(daemon) -> int:
    """The pages of the server's open files (its process is named so in ps)."""
    with daemon.connect() as k:
        (pages,) = [p.pages for p in k.ps() if p.name == "openai_server"]
        return pages


def test_a_disconnect_mid_stream_frees_its_pages(daemon, server):
    base = dict(model=model_name(server), prompt=prompt(90, salt=7), temperature=0,
                extra_body={"ignore_eos": True})
    server.client.completions.create(**base, max_tokens=2)  # the prompt cached, if it will be
    before = server_pages(daemon)
    stream = server.client.completions.create(**base, max_tokens=3000, stream=True)
    chunks = iter(stream)
    for _ in range(5):
        next(chunks)
    assert server_pages(daemon) > before
    stream.close()  # the client goes away
    wait_for(lambda: server_pages(daemon) == before, what="the stream's pages freed")
