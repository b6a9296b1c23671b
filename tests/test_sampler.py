"""Sampling: each filter keeps exactly the tokens it should, seeds replay, logprobs are exact."""

from __future__ import annotations

import pytest
import torch

from symphony.engine.sampler import GREEDY, SamplingParams, pick, sample

# Probabilities 0.4, 0.3, 0.15, 0.1, 0.05 on tokens 4, 0, 2, 1, 3.
PROBS = torch.tensor([0.3, 0.1, 0.15, 0.05, 0.4])
LOGITS = PROBS.log()[None, :]


def draws(params: SamplingParams, n: int = 2000) -> torch.Tensor:
    gens = [params.generator(torch.device("cpu")) for _ in range(n)]
    if params.seed is None:
        torch.manual_seed(0)
    return sample(LOGITS.expand(n, -1), [params] * n, gens).tokens


def test_greedy_is_argmax():
    logits = torch.randn(6, 50)
    assert torch.equal(sample(logits, [GREEDY] * 6, [None] * 6).tokens, logits.argmax(-1))


def test_pick_gives_the_tokens_sample_gives():
    logits = torch.randn(4, 300)
    params = [GREEDY, SamplingParams(temperature=1.0, seed=5), GREEDY,
              SamplingParams(temperature=0.7, seed=9)]

    def tokens(fn):
        return fn(logits, params, [p.generator(torch.device("cpu")) for p in params])

    assert torch.equal(tokens(pick), tokens(sample).tokens)


def test_plain_sampling_follows_the_distribution():
    counts = torch.bincount(draws(SamplingParams(temperature=1.0), 20000), minlength=5) / 20000
    assert (counts - PROBS).abs().max() < 0.015


@pytest.mark.parametrize(
    "params, allowed",
    [
        (SamplingParams(temperature=1.0, top_k=2), {4, 0}),
        (SamplingParams(temperature=1.0, top_p=0.65), {4, 0}),  # 0.4 + 0.3 reaches 0.65
        (SamplingParams(temperature=1.0, top_p=0.4), {4}),
        (SamplingParams(temperature=1.0, min_p=0.3), {4, 0, 2}),  # 0.15 >= 0.3 * 0.4 = 0.12
        (SamplingParams(temperature=1.0, top_k=3, min_p=0.3, top_p=0.5), {4, 0}),
    ],
)
def test_filters_keep_exactly_their_tokens(params, allowed):
    assert set(draws(params).tolist()) == allowed


def test_low_temperature_concentrates_and_high_flattens():
    cold = draws(SamplingParams(temperature=0.1))
    hot = torch.bincount(draws(SamplingParams(temperature=5.0), 20000), minlength=5) / 20000
    assert (cold == 4).float().mean() > 0.9
    assert hot.min() > 0.12


def test_seed_replays_and_differs_between_seeds():
    logits = torch.randn(1, 1000)

    def run(seed):
        p = SamplingParams(temperature=1.0, seed=seed)
        g = p.generator(torch.device("cpu"))
        return [sample(logits, [p], [g]).tokens.item() for _ in range(20)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_seeded_row_is_independent_of_its_batch():
    p = SamplingParams(temperature=1.0, seed=11)
    logits = torch.randn(3, 500)
    alone = sample(logits[1:2], [p], [p.generator(torch.device("cpu"))]).tokens.item()
    together = (
        sample(
            logits, [SamplingParams(temperature=1.0), p, GREEDY],
            [None, p.generator(torch.device("cpu")), None],
        )
        .tokens[1]
        .item()
    )
    assert alone == together


def test_logprobs_and_top_n_are_those_of_the_model():
    logits = torch.randn(4, 30)
    out = sample(
        logits, [SamplingParams(top_logprobs=5, temperature=0.5)] * 2 + [GREEDY] * 2, [None] * 4
    )
    exact = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, exact.gather(1, out.tokens[:, None])[:, 0])
    want_lp, want_ids = exact.topk(5)
    assert torch.equal(out.top_ids, want_ids)
    torch.testing.assert_close(out.top_logprobs, want_lp)


@pytest.mark.parametrize(
    "params, field",
    [
        (SamplingParams(temperature=-1), "temperature"),
        (SamplingParams(top_k=-1), "top_k"),
        (SamplingParams(top_p=0), "top_p"),
        (SamplingParams(min_p=1.5), "min_p"),
        (SamplingParams(top_logprobs=1000), "top_logprobs"),
    ],
)
def test_bad_params_name_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        params.validate(vocab_size=100)
