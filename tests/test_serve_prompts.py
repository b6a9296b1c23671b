"""What real clients send to `symphony serve`'s /v1/completions (issue 29), with the real
`openai` client against a real server on a real kernel: every shape of `prompt` (a string,
an array of strings, an array of token ids, an array of token-id arrays) with `n` per
prompt in OpenAI's order, the prompts computed together; `max_tokens: 0` (scoring a prompt
with `echo` and `logprobs`, as lm-eval and the legacy API's clients do); completion
logprobs whose `tokens` and `text_offset` agree with `text` when a prompt holds a special
token; and vLLM's `add_special_tokens`. Each of these was a 400 or a wrong answer before.

The test model has random weights: every check is an equality with another way to get the
same figures (a request of its own, pred's own scores, the kernel's tokenizer).
"""

from __future__ import annotations

from typing import Any

import httpx2 as httpx
import openai
import pytest
from daemon import prompt
from test_serve_generation import cancelled_midstream, pages_of, served

from lips.serving.errors import ApiError
from lips.serving.generation import Batch, Generator, GenParams
from syscalls.aio import AsyncKernel
from syscalls.convert import proc_fields

TEXTS = ["The quick brown", "def fibonacci(n):", "lazy dog"]
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def name(server) -> str:
    return server.client.models.list().data[0].id


@pytest.fixture(scope="module")
def bos(daemon) -> int:
    with daemon.connect() as k:
        return k.model_info().bos_id


def by_index(reply: Any) -> list[Any]:
    choices = sorted(reply.choices, key=lambda c: c.index)
    assert [c.index for c in choices] == list(range(len(choices)))
    return choices


def streamed(stream: Any, count: int) -> tuple[list[str], list[dict[str, list]]]:
    """Per choice: the text of a stream's chunks joined, and their logprobs' lists joined."""
    texts = [""] * count
    logprobs: list[dict[str, list]] = [
        {"tokens": [], "token_logprobs": [], "text_offset": []} for _ in range(count)]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.logprobs is not None:
                for key, values in logprobs[c.index].items():
                    values += getattr(c.logprobs, key)
    return texts, logprobs


def assert_consistent(text: str, logprobs: Any) -> None:
    """tokens joined are the text, and each offset is the length of the text before it."""
    tokens = logprobs.tokens
    assert "".join(tokens) == text
    assert logprobs.text_offset == [len("".join(tokens[:i])) for i in range(len(tokens))]
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == len(tokens)


def test_an_array_of_strings_gives_n_choices_per_prompt_in_openais_order(server, name):
    ask = dict(model=name, n=2, max_tokens=8, temperature=1.0, seed=5,
               extra_body={"ignore_eos": True})
    batch = server.client.completions.create(prompt=TEXTS, **ask)
    texts = [c.text for c in by_index(batch)]
    assert len(texts) == len(TEXTS) * 2 and len(set(texts)) == len(texts)
    prompt_tokens = 0
    for i, text in enumerate(TEXTS):  # prompt i's choice j is index i * n + j
        alone = server.client.completions.create(prompt=text, **ask)
        assert texts[2 * i: 2 * i + 2] == [c.text for c in by_index(alone)]
        prompt_tokens += alone.usage.prompt_tokens
    assert batch.usage.prompt_tokens == prompt_tokens  # each prompt once, not per choice
    assert batch.usage.completion_tokens == len(texts) * 8
    assert streamed(server.client.completions.create(prompt=TEXTS, stream=True, **ask),
                    len(texts))[0] == texts


def test_token_id_arrays_are_scored_as_lm_eval_asks(server, name):
    """lm-eval's local-completions at --batch_size 4: echo, logprobs 1, max_tokens 1."""
    prompts = [prompt(9 + 3 * i, salt=i) for i in range(4)]
    ask = dict(model=name, echo=True, logprobs=1, max_tokens=1, temperature=0)
    batch = by_index(server.client.completions.create(prompt=prompts, **ask))
    assert len(batch) == 4
    for ids, choice in zip(prompts, batch, strict=True):
        (alone,) = server.client.completions.create(prompt=ids, **ask).choices
        assert choice.text == alone.text
        assert choice.logprobs.tokens == alone.logprobs.tokens
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(
            alone.logprobs.token_logprobs[1:], abs=1e-4)
        assert len(choice.logprobs.tokens) == len(ids) + 1
        assert_consistent(choice.text, choice.logprobs)
    assert by_index(server.client.completions.create(prompt=[prompts[0]], **ask))[0].text == (
        batch[0].text)  # an array holding one token-id array is that prompt


def sched_steps(k) -> int:
    return int(proc_fields(k.procfs("sched"))["steps"])


def test_a_batchs_prompts_are_computed_together(server, name, k):
    """Six prompts of 8 tokens each: one after another would be at least 48 forward
    passes; together, the kernel batches them."""
    prompts = [prompt(11, salt=20 + i) for i in range(6)]
    before = sched_steps(k)
    reply = server.client.completions.create(model=name, prompt=prompts, max_tokens=8,
                                             temperature=0, extra_body={"ignore_eos": True})
    steps = sched_steps(k) - before
    assert reply.usage.completion_tokens == 48
    assert steps <= 24, f"{steps} forward passes for 6 prompts of 8 tokens"


def test_max_tokens_0_with_echo_and_logprobs_scores_the_prompt(server, name, k, bos):
    prompts = [[bos, *prompt(12, salt=1)], prompt(7, salt=2)]
    reply = server.client.completions.create(model=name, prompt=prompts, max_tokens=0,
                                             echo=True, logprobs=2, temperature=0)
    for ids, choice in zip(prompts, by_index(reply), strict=True):
        assert choice.finish_reason == "length"
        assert choice.text == k.detokenize(ids)
        lp = choice.logprobs
        assert_consistent(choice.text, lp)
        assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
        assert lp.top_logprobs[0] is None
        with k.open() as f:
            outs = f.pred(ids, outputs=range(len(ids) - 1), score_next=True, top_logprobs=2)
        assert lp.token_logprobs[1:] == pytest.approx([o.next_logprob for o in outs], abs=1e-4)
        for top, score, o in zip(lp.top_logprobs[1:], lp.token_logprobs[1:], outs,
                                 strict=True):  # the token's own, then pred's top 2
            assert max(top.values()) == pytest.approx(max(o.top[0][1], score), abs=1e-4)
            assert all(min(abs(v - x) for x in (score, *(x for _, x in o.top))) < 1e-4
                       for v in top.values())
    assert reply.usage.completion_tokens == 0
    assert reply.usage.prompt_tokens == sum(map(len, prompts))
    texts, logprobs = streamed(server.client.completions.create(
        model=name, prompt=prompts, max_tokens=0, echo=True, logprobs=2, stream=True), 2)
    for choice, text, lp in zip(by_index(reply), texts, logprobs, strict=True):
        assert text == choice.text
        assert lp["tokens"] == choice.logprobs.tokens
        assert lp["text_offset"] == choice.logprobs.text_offset
        assert lp["token_logprobs"] == pytest.approx(choice.logprobs.token_logprobs)


def test_max_tokens_0_without_echo_is_empty_text_and_no_tokens(server, name):
    reply = server.client.completions.create(model=name, prompt=TEXTS[:2], max_tokens=0, n=2,
                                             logprobs=1)
    for c in by_index(reply):
        assert (c.text, c.finish_reason, c.logprobs.tokens) == ("", "length", [])
    assert len(reply.choices) == 4 and reply.usage.completion_tokens == 0
    echoed = by_index(server.client.completions.create(model=name, prompt=TEXTS[:2],
                                                       max_tokens=0, n=2, echo=True))
    assert [c.text for c in echoed] == [TEXTS[0]] * 2 + [TEXTS[1]] * 2
    texts, _ = streamed(server.client.completions.create(
        model=name, prompt=TEXTS[0], max_tokens=0, stream=True), 1)
    assert texts == [""]


@pytest.mark.parametrize("seed", range(3))
def test_tokens_and_offsets_agree_with_the_text_around_special_tokens(server, name, k, bos,
                                                                      seed):
    """A special id gives no text (as generated text, and the kernel's detokenize): its
    token is "" and the offsets run over the text. The sampled tokens of a random model
    often split a character: the token holding its first bytes is "" too."""
    ids = [bos, *k.tokenize("Once upon a"), bos, *k.tokenize(" time")]
    ask = dict(model=name, prompt=[ids], echo=True, logprobs=1, max_tokens=24,
               temperature=1.0, seed=seed, extra_body={"ignore_eos": True})
    (choice,) = server.client.completions.create(**ask).choices
    assert choice.text.startswith("Once upon a time") and "<|bos|>" not in choice.text
    assert choice.logprobs.tokens[0] == "" and len(choice.logprobs.tokens) == len(ids) + 24
    assert_consistent(choice.text, choice.logprobs)
    texts, logprobs = streamed(server.client.completions.create(stream=True, **ask), 1)
    assert texts == [choice.text]
    assert logprobs[0]["tokens"] == choice.logprobs.tokens
    assert logprobs[0]["text_offset"] == choice.logprobs.text_offset


def test_a_generated_special_token_is_no_text(server, name, k, bos):
    eos = k.model_info().eos_ids[0]
    (choice,) = server.client.completions.create(
        model=name, prompt=[bos, *k.tokenize("Once")], echo=True, logprobs=1, max_tokens=3,
        temperature=0, logit_bias={str(eos): 100},
        extra_body={"ignore_eos": True}).choices
    assert choice.text == "Once"
    assert choice.logprobs.tokens[-3:] == ["", "", ""]
    assert_consistent(choice.text, choice.logprobs)


def test_add_special_tokens_false_leaves_out_bos(server, name, k, bos):
    text = TEXTS[0]
    plain = k.tokenize(text)
    assert k.tokenize(text, add_special=True) == [bos, *plain]
    ask = dict(model=name, prompt=text, max_tokens=6, temperature=0, echo=True,
               extra_body={"ignore_eos": True})
    default = server.client.completions.create(**ask)
    without = server.client.completions.create(**{**ask, "extra_body": {
        "ignore_eos": True, "add_special_tokens": False}})
    assert default.usage.prompt_tokens == len(plain) + 1
    assert without.usage.prompt_tokens == len(plain)
    as_ids = server.client.completions.create(**{**ask, "prompt": plain})
    assert without.choices[0].text == as_ids.choices[0].text  # the same tokens computed
    assert without.choices[0].text.startswith(text)


def test_chat_add_special_tokens_puts_bos_before_the_template(server, name, k, bos):
    template = k.tokenize(messages=MESSAGES, add_generation_prompt=True)
    assert template[0] != bos

    def prompt_tokens(**extra: Any) -> int:
        return server.client.chat.completions.create(
            model=name, messages=MESSAGES, max_tokens=1, extra_body=extra).usage.prompt_tokens

    assert prompt_tokens() == prompt_tokens(add_special_tokens=False) == len(template)
    assert prompt_tokens(add_special_tokens=True) == len(template) + 1
    r = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES,
                                                   "add_special_tokens": True},
                   headers={"Authorization": f"Bearer {server.api_key}"})
    assert r.json()["tokens"] == [bos, *template]


def test_a_batch_prompt_past_the_context_is_named(server, name, k):
    context = k.model_info().context_length
    with pytest.raises(openai.BadRequestError) as e:
        server.client.completions.create(model=name, prompt=[[7, 8], [7] * context],
                                         max_tokens=1)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt[1]"


# -- the Batch itself, on the kernel ------------------------------------------------------


def test_a_failing_prompt_fails_the_batch_and_frees_every_prompts_pages(daemon):
    async def body(g: Generator, k: AsyncKernel) -> tuple[int, int]:
        before = await pages_of(k)
        batch = Batch(g, [GenParams(prompt(60, salt=i), 400, ignore_eos=True)
                          for i in range(3)] + [GenParams([], 4)])
        with pytest.raises(ApiError) as e:
            async for _ in batch:
                pass
        assert e.value.param == "prompt"
        return before, await pages_of(k)

    before, after = served(daemon, body)
    assert after == before


def test_a_cancelled_batch_consumer_frees_every_prompts_pages(daemon):
    async def body(g: Generator, k: AsyncKernel) -> tuple[int, int, int, set[int]]:
        before = await pages_of(k)
        batch = Batch(g, [GenParams(prompt(90, salt=i), 2000, n=2, ignore_eos=True)
                          for i in range(3)])
        during, deltas = await cancelled_midstream(
            k, batch, lambda deltas: len({d.index for d in deltas}) == 6)
        return before, during, await pages_of(k), {d.index for d in deltas}

    before, during, after, seen = served(daemon, body)
    assert seen == set(range(6)) and during > before and after == before
