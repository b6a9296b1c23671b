"""Sampling: each filter keeps exactly the tokens it should, seeds replay, logprobs are exact."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from symphony.engine.sampler import GREEDY, RowControl, SamplingParams, pick, sample

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


@pytest.mark.parametrize("temperature", [1e-6, 1e-38, 1e-45, 5e-324])
def test_a_temperature_near_zero_is_greedy(temperature):
    """Divided by one near float32's smallest, the logits were infinite and the draw NaN:
    a token of any likelihood came back."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3)) * 5
    params = [SamplingParams(temperature=temperature, seed=s) for s in range(4)]
    gens = [torch.Generator().manual_seed(s) for s in range(4)]
    assert sample(logits, params, gens).tokens.tolist() == logits.argmax(-1).tolist()


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


# Logit control. References unpack the mask one id at a time and apply it row by row.
VOCAB = 100  # not a multiple of 32: the last word has bits past the vocabulary


def packed(allowed: set[int], vocab: int = VOCAB, junk: bool = True) -> torch.Tensor:
    """xgrammar's layout, with every bit past the vocabulary set (they must be ignored)."""
    words = [0] * -(-vocab // 32)
    for t in list(allowed) + (list(range(vocab, len(words) * 32)) if junk else []):
        words[t // 32] |= 1 << (t % 32)
    return torch.tensor(np.array(words, dtype=np.uint32).view(np.int32))


def allowed_ref(words: torch.Tensor, vocab: int) -> list[bool]:
    return [(int(words[t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab)]


def controlled_ref(logits: torch.Tensor, controls: list) -> torch.Tensor:
    out = logits.clone()
    for i, c in enumerate(controls):
        if c is None:
            continue
        if c.allowed is not None:
            for t, ok in enumerate(allowed_ref(c.allowed, logits.shape[1])):
                if not ok:
                    out[i, t] = -math.inf
        for t, v in zip(c.bias_ids, c.bias_values, strict=True):
            out[i, t] += v
    return out


def random_allowed(rng: np.random.Generator, avoid: int, n: int = 20) -> set[int]:
    return set(rng.choice([t for t in range(VOCAB) if t != avoid], n, replace=False).tolist())


def test_greedy_never_picks_a_disallowed_token_even_the_raw_argmax():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    logits = torch.randn(8, VOCAB)
    controls = [RowControl(packed(random_allowed(rng, int(row.argmax())))) for row in logits]
    tokens = sample(logits, [GREEDY] * 8, [None] * 8, controls).tokens
    want = controlled_ref(logits, controls).argmax(-1)
    assert torch.equal(tokens, want)
    assert not (tokens == logits.argmax(-1)).any()
    assert torch.equal(pick(logits, [GREEDY] * 8, [None] * 8, controls), want)


def test_every_bit_of_the_mask_is_its_token():
    logits = torch.randn(VOCAB, VOCAB)
    controls = [RowControl(packed({t})) for t in range(VOCAB)]
    tokens = sample(logits, [GREEDY] * VOCAB, [None] * VOCAB, controls).tokens
    assert torch.equal(tokens, torch.arange(VOCAB))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=2.0, top_k=2),
        SamplingParams(temperature=1.0, top_p=0.9, min_p=0.1),
    ],
)
def test_seeded_sampling_draws_only_allowed_tokens_from_the_masked_distribution(params):
    allowed = {0, 2, 3}  # probabilities 0.3, 0.15, 0.05 of PROBS: 0.6, 0.3, 0.1 renormalised
    n = 6000
    seeded = [SamplingParams(**{**params.__dict__, "seed": s}) for s in range(n)]
    control = RowControl(packed(allowed, vocab=5))
    tokens = sample(
        LOGITS.expand(n, -1), seeded, [p.generator(torch.device("cpu")) for p in seeded],
        [control] * n,
    ).tokens
    assert set(tokens.tolist()) <= allowed
    if params.temperature == 1.0 and params.top_p == 1.0:
        counts = torch.bincount(tokens, minlength=5) / n
        assert (counts - torch.tensor([0.6, 0, 0.3, 0.1, 0])).abs().max() < 0.02


def test_many_seeded_draws_over_a_large_vocabulary_stay_allowed():
    torch.manual_seed(1)
    rng = np.random.default_rng(1)
    logits = torch.randn(64, VOCAB) * 3
    controls = [RowControl(packed(random_allowed(rng, -1, n=5))) for _ in range(64)]
    for seed in range(20):
        params = [SamplingParams(temperature=1.5, seed=seed * 64 + i) for i in range(64)]
        tokens = sample(logits, params, [p.generator(torch.device("cpu")) for p in params],
                        controls).tokens
        ok = controlled_ref(logits, controls).gather(1, tokens[:, None]) > -math.inf
        assert ok.all()


def test_bias_shifts_the_argmax_and_leaves_the_logits_alone():
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    low = [int(row.argmin()) for row in logits]
    controls = [
        RowControl(bias_ids=(low[0],), bias_values=(100.0,)),
        RowControl(bias_ids=(int(logits[1].argmax()),), bias_values=(-100.0,)),
        RowControl(bias_ids=(low[2], low[2]), bias_values=(60.0, 60.0)),  # repeats add up
    ]
    out = sample(logits, [GREEDY] * 3, [None] * 3, controls)
    assert out.tokens.tolist()[0] == low[0] and out.tokens.tolist()[2] == low[2]
    assert torch.equal(out.tokens, controlled_ref(logits, controls).argmax(-1))
    assert torch.equal(logits, before)


def test_logprobs_are_of_the_controlled_distribution_and_model_logprobs_of_the_raw():
    torch.manual_seed(2)
    logits = torch.randn(4, VOCAB)
    controls = [
        RowControl(packed(set(range(0, VOCAB, 3))), bias_ids=(3, 7), bias_values=(1.5, -2.0)),
        RowControl(packed(set(range(50)))),
        RowControl(bias_ids=(9,), bias_values=(4.0,)),
        None,
    ]
    params = [SamplingParams(temperature=0.8, seed=3, top_logprobs=6), GREEDY, GREEDY, GREEDY]
    out = sample(logits, params, [p.generator(torch.device("cpu")) for p in params], controls)
    exact = torch.log_softmax(controlled_ref(logits, controls), -1)
    model = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, exact.gather(1, out.tokens[:, None])[:, 0])
    torch.testing.assert_close(out.model_logprobs, model.gather(1, out.tokens[:, None])[:, 0])
    want_lp, want_ids = exact.topk(6)
    assert torch.equal(out.top_ids, want_ids)
    torch.testing.assert_close(out.top_logprobs, want_lp)
    assert out.scores is None


def test_scores_are_the_model_logprobs_of_the_named_tokens_padded():
    torch.manual_seed(3)
    logits = torch.randn(3, VOCAB)
    controls = [
        RowControl(packed({1, 2}), score_ids=(5, 0, 99)),  # scores ignore the mask
        None,
        RowControl(score_ids=(42,)),
    ]
    out = sample(logits, [GREEDY] * 3, [None] * 3, controls)
    model = torch.log_softmax(logits, -1)
    assert out.scores.shape == (3, 3)
    for i, c in enumerate(controls):
        names = c.score_ids if c else ()
        for j in range(3):
            if j < len(names):
                torch.testing.assert_close(out.scores[i, j], model[i, names[j]])
            else:
                assert out.scores[i, j].isnan()


def test_scores_alone_sample_as_without_controls():
    logits = torch.randn(2, VOCAB)
    plain = sample(logits, [GREEDY] * 2, [None] * 2)
    scored = sample(logits, [GREEDY] * 2, [None] * 2, [RowControl(score_ids=(3,)), None])
    assert torch.equal(scored.tokens, plain.tokens)
    assert torch.equal(scored.logprobs, plain.logprobs)
    assert scored.model_logprobs is None
    torch.testing.assert_close(scored.scores[0, 0], torch.log_softmax(logits[0], -1)[3])


def test_no_controls_give_no_model_logprobs_or_scores():
    logits = torch.randn(2, VOCAB)
    for controls in (None, [None, None]):
        out = sample(logits, [GREEDY] * 2, [None] * 2, controls)
        assert out.model_logprobs is None and out.scores is None


def test_mixed_batch_leaves_uncontrolled_rows_exactly_as_without_controls():
    torch.manual_seed(4)
    logits = torch.randn(6, VOCAB)
    params = [
        SamplingParams(temperature=1.0, seed=1, top_logprobs=4),
        SamplingParams(temperature=0.7, seed=2, top_logprobs=4),
        GREEDY,
        SamplingParams(temperature=1.0, seed=3, top_k=10),
        GREEDY,
        SamplingParams(temperature=1.3, seed=4, min_p=0.05),
    ]
    controls = [
        RowControl(packed({4, 5, 6})),
        None,
        RowControl(bias_ids=(int(logits[2].argmin()),), bias_values=(50.0,)),
        None,
        RowControl(score_ids=(1, 2)),
        None,
    ]

    def run(ctl):
        return sample(logits, params, [p.generator(torch.device("cpu")) for p in params], ctl)

    plain, mixed = run(None), run(controls)
    free = [1, 3, 4, 5]
    for field in ("tokens", "logprobs", "top_ids", "top_logprobs"):
        assert torch.equal(getattr(mixed, field)[free], getattr(plain, field)[free]), field
    assert torch.equal(mixed.model_logprobs[free], plain.logprobs[free])
    assert mixed.tokens[0].item() in {4, 5, 6}
    assert mixed.tokens[2].item() == logits[2].argmin().item()


def test_words_past_the_vocabulary_are_ignored():
    # llguidance's masks carry a word more than ceil(vocab / 32) when vocab is a multiple of
    # 32: they are taken as they are.
    longer = RowControl(packed({1}, vocab=200))  # 7 words for a vocabulary of 100: 4
    longer.validate(VOCAB)
    logits = torch.randn(2, VOCAB)
    logits[:, 1] = -50.0
    s = sample(logits, [GREEDY] * 2, [None] * 2, [longer, RowControl(packed({7}))])
    assert s.tokens.tolist() == [1, 7]


def test_controls_must_match_the_rows():
    with pytest.raises(ValueError, match="controls"):
        sample(torch.randn(2, VOCAB), [GREEDY] * 2, [None] * 2, [RowControl(score_ids=(1,))])


@pytest.mark.parametrize(
    "control, message",
    [
        (RowControl(packed({1}, vocab=64)), r"allowed has 2 words, want at least 4"),
        (RowControl(packed({1}).long()), "allowed must be a 1-D int32"),
        (RowControl(packed(set())), "allowed allows no token"),  # only bits past the vocabulary
        (RowControl(bias_ids=(VOCAB,), bias_values=(1.0,)), "bias_ids: token 100"),
        (RowControl(bias_ids=(-1,), bias_values=(1.0,)), "bias_ids: token -1"),
        (RowControl(bias_ids=(1,), bias_values=(math.inf,)), "bias_values must be finite"),
        (RowControl(bias_ids=(1,), bias_values=(math.nan,)), "bias_values must be finite"),
        (RowControl(bias_ids=(1, 2), bias_values=(1.0,)), "bias_ids has 2 ids but bias_values"),
        (RowControl(score_ids=(3, VOCAB)), "score_ids: token 100"),
    ],
)
def test_validate_names_the_bad_field(control, message):
    with pytest.raises(ValueError, match=message):
        control.validate(VOCAB)


def test_validate_accepts_a_good_control():
    RowControl(packed({99}), bias_ids=(0,), bias_values=(-3.0,), score_ids=(0, 99)).validate(VOCAB)
    RowControl(packed({31}, vocab=32, junk=False)).validate(32)
