"""Issue 15's calls end to end on a real daemon, each against a reference computed another
way: a masked or biased pred against the full distribution of an unmasked one, scores
against full-distribution logprobs, a tree pred against each of its paths run as its own
file, keep() against that path's file, a truncating pred against truncate then pred,
shift() against a file computed at the target positions, and every bad argument against
the file it leaves as it was."""

from __future__ import annotations

import errno
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
from daemon import prompt

from symphony.syscall_table import pred_reply_bytes, sys_vocab
from syscalls import symphony_pb2 as pb
from syscalls.client import Kernel
from syscalls.convert import LogitControl

VOCAB, CONTEXT = 320, 4096  # the test model's (tests/checkpoints.py)
# A token budget of 16: the longer preds here (the tree's 20 tokens) run in two steps.
DAEMON_FLAGS = ("--kv-pages", "512", "--token-budget", "16")


@pytest.fixture()
def tol(k) -> float:
    """The parity tolerance on logprobs between two ways of computing the same thing:
    tests/test_engine_parity.py's in fp32, bf16's rounding on a GPU."""
    return 1e-4 if k.model_info().dtype == "float32" else 5e-2


def dist(output) -> np.ndarray:
    """The full distribution of an output asked with top_logprobs=VOCAB."""
    lp = np.full(VOCAB, -np.inf)
    for i, v in output.top:
        lp[i] = v
    return lp


def log_softmax(x: np.ndarray) -> np.ndarray:
    finite = x[np.isfinite(x)]
    return x - (finite.max() + np.log(np.exp(finite - finite.max()).sum()))


def snapshot(k: Kernel, f) -> tuple:
    return f.read(), k.export(f)


def raises(code: int, words: str, fn, *args, **kwargs) -> None:
    with pytest.raises(OSError) as e:
        fn(*args, **kwargs)
    assert e.value.errno == code, e.value
    assert words in str(e.value), e.value


@pytest.fixture()
def base(k):
    """A file of a 20-token prompt: the prefix the references are forked from."""
    with k.open() as f:
        f.pred(prompt(20), no_outputs=True)
        yield f


# -- logit masks and biases ---------------------------------------------------------------


@pytest.mark.parametrize("lifeline", [True, False])
def test_a_masked_greedy_pred_picks_the_best_allowed_token(daemon, lifeline, tol):
    with Kernel.connect(daemon.socket, lifeline_pred=lifeline) as k, k.open() as base:
        base.pred(prompt(20), no_outputs=True)
        with base.fork() as free_f, base.fork() as masked_f:
            (free,) = free_f.pred([5], top_logprobs=VOCAB)
            lp = dist(free)
            allowed = [t for t in range(VOCAB) if t % 3 == 1 and t != free.token]
            (masked,) = masked_f.pred([5], control=LogitControl.allowing(allowed, VOCAB),
                                      top_logprobs=VOCAB)
        want = max(allowed, key=lp.__getitem__)
        assert masked.token == want != free.token
        masked_lp = np.full(VOCAB, -np.inf)
        masked_lp[allowed] = log_softmax(lp[allowed])
        # logprob and top are of the masked distribution, model_logprob of the model's own
        assert masked.logprob == pytest.approx(masked_lp[want], abs=tol)
        assert masked.model_logprob == pytest.approx(lp[want], abs=tol)
        got = dist(masked)
        assert np.isneginf(got[[t for t in range(VOCAB) if t not in allowed]]).all()
        assert np.abs(got[allowed] - masked_lp[allowed]).max() < tol
        assert free.model_logprob == free.logprob and free.scores == []


def test_a_masked_sampled_pred_never_returns_a_disallowed_token(base):
    allowed = {7, 70, 170, 301}
    control = LogitControl.allowing(allowed, VOCAB)
    with base.fork() as f:
        for seed in range(24):
            (out,) = f.pred([5], control=control, temperature=2.0, seed=seed)
            assert out.token in allowed
            f.truncate(20)


def test_each_row_gets_its_own_control_whatever_the_order_of_outputs(base):
    tokens = prompt(6, salt=1)
    with base.fork() as free_f, base.fork() as masked_f:
        free = free_f.pred(tokens, outputs=[1, 4], top_logprobs=VOCAB)
        lps = {o.row: dist(o) for o in free}
        sets = {4: [t for t in range(VOCAB) if t % 5 == 2], 1: list(range(100, 140))}
        outs = masked_f.pred(tokens, outputs=[4, 1],
                             control=[LogitControl.allowing(sets[4], VOCAB),
                                      LogitControl.allowing(sets[1], VOCAB)])
    assert [o.row for o in outs] == [1, 4]  # rows come back in order, each with its control
    for o in outs:
        assert o.token == max(sets[o.row], key=lps[o.row].__getitem__)


def test_a_bias_moves_the_pick_and_the_logprob_is_of_the_biased_distribution(base, tol):
    with base.fork() as free_f, base.fork() as biased_f:
        (free,) = free_f.pred([9], top_logprobs=VOCAB)
        lp = dist(free)
        second, third = (int(t) for t in np.argsort(lp)[[-2, -3]])
        bias = {free.token: -1.5, second: lp[free.token] - lp[second] + 0.5, third: 0.25}
        (biased,) = biased_f.pred([9], control=LogitControl(bias=bias), top_logprobs=5)
    shifted = lp.copy()
    for t, v in bias.items():
        shifted[t] += v
    want, token = log_softmax(shifted), int(np.argmax(shifted))
    assert biased.token == token != free.token
    assert biased.logprob == pytest.approx(want[token], abs=tol)
    assert biased.model_logprob == pytest.approx(lp[token], abs=tol)
    assert [i for i, _ in biased.top] == list(np.argsort(-want)[:5])


# -- scores --------------------------------------------------------------------------------


def test_scores_and_next_logprobs_are_the_full_distribution_s(base, tol):
    tokens = prompt(7, salt=2)
    rows = [0, 3, 6, 2]
    with base.fork() as full_f, base.fork() as scored_f:
        full = {o.row: dist(o) for o in full_f.pred(tokens, outputs=rows, top_logprobs=VOCAB)}
        named = [3, 250, 3, 17]
        outs = scored_f.pred(tokens, outputs=rows, control=LogitControl(score=named),
                             score_next=True)
    for o in outs:
        assert np.abs(np.array(o.scores) - full[o.row][named]).max() < tol
        if o.row == len(tokens) - 1:
            assert o.next_logprob is None
        else:
            assert o.next_logprob == pytest.approx(full[o.row][tokens[o.row + 1]], abs=tol)
        assert o.model_logprob == o.logprob  # no mask, no bias: the same distribution


def test_score_next_alone_scores_teacher_forced_tokens(base, tol):
    tokens = prompt(5, salt=4)
    with base.fork() as full_f, base.fork() as scored_f:
        full = full_f.pred(tokens, outputs=range(5), top_logprobs=VOCAB)
        scored = scored_f.pred(tokens, outputs=range(5), score_next=True)
    for r in range(4):
        assert scored[r].next_logprob == pytest.approx(dist(full[r])[tokens[r + 1]], abs=tol)
        assert scored[r].scores == [] and scored[r].token == full[r].token
    assert scored[4].next_logprob is None


# -- tree attention and keep -----------------------------------------------------------------


def random_tree(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [-1 if i == 0 or rng.random() < 0.1 else rng.randrange(max(0, i - 4), i)
            for i in range(n)]


def paths(parents: list[int]) -> list[list[int]]:
    """Every root-to-leaf path, as rows of the tree."""
    leaves = set(range(len(parents))) - set(parents)
    out = []
    for leaf in sorted(leaves):
        path = [leaf]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        out.append(path[::-1])
    return out


def test_a_seeded_pred_over_several_steps_draws_on_where_its_last_step_left_off(k):
    """Rows in three steps (token budget 16) sample from one generator, as rows in one step
    do: the engine process sends it back advanced each step. Here each row's draw is redone
    from its returned distribution with one generator of the same seed."""
    import torch

    from symphony.engine.sampler import SamplingParams, pick

    rows = [5, 20, 39]
    with k.open("", 2) as f:
        outs = f.pred(prompt(40, salt=9), outputs=rows, temperature=2.0, seed=7,
                      top_logprobs=VOCAB)
    params = SamplingParams(temperature=2.0, seed=7)
    gen = params.generator(torch.device("cpu"))
    want = [pick(torch.tensor(dist(o), dtype=torch.float32)[None], [params], [gen]).item()
            for o in outs]
    assert [o.token for o in outs] == want


def test_a_tree_pred_equals_each_of_its_paths_run_as_a_file_and_keep_makes_that_file(k, base,
                                                                                     tol):
    parents = random_tree(20, seed=3)  # over the token budget: computed in two steps
    tokens = prompt(20, salt=5)
    with base.fork() as tree_f:
        outs = tree_f.pred(tokens, parents=parents, outputs=range(20), top_logprobs=VOCAB)
        tree_lp = [dist(o) for o in outs]
        assert len(paths(parents)) > 2
        for path in paths(parents):
            with base.fork() as linear:
                got = linear.pred([tokens[r] for r in path], outputs=range(len(path)),
                                  top_logprobs=VOCAB)
                for o, r in zip(got, path, strict=True):
                    assert np.abs(dist(o) - tree_lp[r]).max() < tol, (path, r)
        # Its positions: the prefix's next plus the depth.
        _, positions = tree_f.read(20)
        depth = [0] * 20
        for i, p in enumerate(parents):
            depth[i] = 0 if p < 0 else depth[p] + 1
        assert positions == [20 + d for d in depth]

        path = max(paths(parents), key=len)
        tree_f.keep(20, [20 + r for r in path])
        with base.fork() as linear:
            linear.pred([tokens[r] for r in path], no_outputs=True)
            assert tree_f.read() == linear.read()
            (kept,) = tree_f.pred([11], top_logprobs=VOCAB)
            (want,) = linear.pred([11], top_logprobs=VOCAB)
        assert kept.token == want.token and np.abs(dist(kept) - dist(want)).max() < tol


def test_a_tree_pred_with_positions_given_keeps_them(base):
    with base.fork() as f:
        outs = f.pred([4, 5, 6], positions=[20, 21, 21], parents=[-1, 0, 0], outputs=[1, 2])
        assert [o.row for o in outs] == [1, 2]
        assert f.read(20)[1] == [20, 21, 21]


# -- truncating preds ----------------------------------------------------------------------


@pytest.mark.parametrize("cut", [12, 25, 40])
def test_a_truncating_pred_equals_truncate_then_pred(k, cut, tol):
    """25: in a punched range, whose part past the cut must not hide the new entries; 40:
    the file's length, no cut at all."""
    tokens = prompt(6, salt=6)
    with k.open() as f:
        f.pred(prompt(40), no_outputs=True)
        f.punch(20, 30)
        with f.fork() as two_calls, f.fork() as one_call:
            two_calls.truncate(cut)
            want = two_calls.pred(tokens, outputs=[0, 5], top_logprobs=VOCAB)
            got = one_call.pred(tokens, outputs=[0, 5], top_logprobs=VOCAB, truncate=cut)
            assert one_call.read() == two_calls.read()
            assert [o.token for o in got] == [o.token for o in want]
            for a, b in zip(got, want, strict=True):
                assert np.abs(dist(a) - dist(b)).max() < tol
            # and the next pred sees the same file
            assert one_call.pred([3])[0].token == two_calls.pred([3])[0].token
        assert f.stat().tokens == 40  # the forks' source is untouched


def test_a_failing_truncating_pred_leaves_the_file_as_it_was(k):
    with k.open() as f:
        f.pred(prompt(30), positions=range(CONTEXT - 30, CONTEXT), no_outputs=True)
        before = snapshot(k, f)
        # past the file's length at admission
        raises(errno.EINVAL, "truncate 31", f.pred, [5], truncate=31)
        # positions past the context, after the entry before the cut
        raises(errno.EOVERFLOW, f"position {CONTEXT}", f.pred, [5, 6], truncate=29)
        # more pages than the pool
        n = 512 * 16 + 1
        raises(errno.ENOSPC, "device pages", f.pred, prompt(n), positions=[0] * n,
               truncate=4, no_outputs=True)
        raises(errno.EINVAL, "truncate -1", f.pred, [5], truncate=-1)
        assert snapshot(k, f) == before
        assert f.pred([5], truncate=2)[0].row == 0 and f.stat().tokens == 3


# -- shift -----------------------------------------------------------------------------------


def test_a_shifted_file_equals_one_computed_at_the_target_positions(k, tol):
    tokens = prompt(5, salt=7)
    with k.open() as moved, k.open() as computed:
        moved.pred(prompt(24), no_outputs=True)
        moved.shift(0, 24, 1000)
        computed.pred(prompt(24), positions=range(1000, 1024), no_outputs=True)
        assert moved.read() == computed.read()
        got = moved.pred(tokens, outputs=range(5), top_logprobs=VOCAB)
        want = computed.pred(tokens, outputs=range(5), top_logprobs=VOCAB)
        for a, b in zip(got, want, strict=True):
            assert np.abs(dist(a) - dist(b)).max() < tol


def test_a_shifted_range_equals_the_range_computed_at_the_target_positions(k, tol):
    """A Prompt-Cache-style module, computed on its own at positions 20..39, spliced after 4
    sink entries and moved back to 4..23 (as StreamingLLM keeps positions within the
    cache), equals the module computed on its own at 4..23: only relative positions shape
    its K/V, and the move re-rotates the keys. A fork taken before keeps its keys."""
    sinks, module = prompt(4, salt=8), prompt(20, salt=9)
    with k.open() as far, k.open() as near, k.open() as stream, k.open() as computed:
        far.pred(module, positions=range(20, 40), no_outputs=True)
        near.pred(module, positions=range(4, 24), no_outputs=True)
        for f, source in ((stream, far), (computed, near)):
            f.pred(sinks, no_outputs=True)
            f.splice_from(source, 0, 20)
        with stream.fork() as earlier, stream.fork() as later:
            (before,) = earlier.pred([9], top_logprobs=VOCAB)
            stream.shift(4, 24, -16)
            (after,) = later.pred([9], top_logprobs=VOCAB)
        assert before == after  # their shared pages were copied, not rotated
        assert stream.read() == computed.read()
        (got,) = stream.pred([9], top_logprobs=VOCAB)
        (want,) = computed.pred([9], top_logprobs=VOCAB)
        assert got.token == want.token and np.abs(dist(got) - dist(want)).max() < tol


def test_bad_keeps_and_shifts_fail_naming_the_argument_and_change_nothing(k):
    with k.open() as f:
        f.pred(prompt(10), no_outputs=True)
        before = snapshot(k, f)
        raises(errno.EINVAL, "entries[1] = 5", f.keep, 4, [6, 5])
        raises(errno.EINVAL, "entries[0] = 10", f.keep, 4, [10])
        raises(errno.EINVAL, "start 11", f.keep, 11, [])
        raises(errno.EINVAL, "[3, 11)", f.shift, 3, 11, 1)
        raises(errno.EOVERFLOW, "position -1", f.shift, 0, 4, -1)
        raises(errno.EOVERFLOW, f"position {CONTEXT}", f.shift, 5, 10, CONTEXT - 9)
        assert snapshot(k, f) == before


# -- the vocabulary ----------------------------------------------------------------------------


def test_the_vocabulary_spells_the_tokenizer_s_tokens(k):
    vocab = k.vocab()
    assert len(vocab.tokens) == VOCAB
    text = "def fibonacci(n):\n    return n if n < 2 else 'naïve'\n"
    assert b"".join(vocab.tokens[i] for i in k.tokenize(text)) == text.encode()
    assert vocab.special_ids == set(k.model_info().special_tokens.values())
    assert vocab.tokens[300:] == [b""] * 20  # the model's ids past the tokenizer's


def test_vocab_without_a_tokenizer_is_eopnotsupp_saying_why(tmp_path):
    kernel = SimpleNamespace(engine=SimpleNamespace(tokenizer=None, model_dir=tmp_path))
    with pytest.raises(OSError) as e:
        sys_vocab(kernel, None, None, pb.Void())
    assert e.value.errno == errno.EOPNOTSUPP
    assert "vocab: the model has no tokenizer (no tokenizer.json)" in str(e.value)


# -- bad arguments of pred ---------------------------------------------------------------------


BAD_PREDS = [
    (errno.EINVAL, "2 controls for 3 output rows",
     dict(outputs=[0, 1, 2], control=[LogitControl(score=[1])] * 2)),
    (errno.EINVAL, "controls[0].allowed is 6 bytes", dict(control=LogitControl(allowed=b"\0" * 6))),
    (errno.EINVAL, "allowed has 2 words, want at least 10",
     dict(control=LogitControl(allowed=b"\1" * 8))),
    (errno.EINVAL, "allows no token", dict(control=LogitControl(allowed=bytes(40)))),
    (errno.EINVAL, "bias_ids: token 320", dict(control=LogitControl(bias={320: 1.0}))),
    (errno.EINVAL, "bias_values must be finite", dict(control=LogitControl(bias={3: math.inf}))),
    (errno.EINVAL, "score_ids: token -1", dict(control=LogitControl(score=[-1]))),
    (errno.EINVAL, "controls given with no_outputs",
     dict(no_outputs=True, control=LogitControl(score=[1]))),
    (errno.EINVAL, "score_next given with no_outputs", dict(no_outputs=True, score_next=True)),
    (errno.EINVAL, "2 parents for 3 tokens", dict(parents=[-1, 0])),
    (errno.EINVAL, "parents[1] is 1", dict(parents=[-1, 1, 0])),
    (errno.EINVAL, "parents[0] is -2", dict(parents=[-2, 0, 0])),
    (errno.EMSGSIZE, "and their scores may take",
     dict(tokens=prompt(4000), positions=range(4000), outputs=range(4000),
          control=LogitControl(score=[1] * 5000))),
]


@pytest.mark.parametrize(("code", "words", "args"), BAD_PREDS,
                         ids=[words for _, words, _ in BAD_PREDS])
def test_a_bad_pred_fails_naming_the_argument_and_changes_nothing(k, base, code, words, args):
    args = {"tokens": [4, 5, 6], **args}
    before = snapshot(k, base)
    raises(code, words, base.pred, args.pop("tokens"), **args)
    assert snapshot(k, base) == before


def test_the_reply_bound_holds_with_scores():
    most = (1 << 31) - 1
    for rows, top, scores in ((1, 0, 1), (3, 7, 40), (40, 320, 320)):
        reply = pb.PredReply(outputs=[
            pb.PredOutput(row=most, token=most, logprob=-1.0,
                          top=[pb.TopLogprob(id=most, logprob=-1.0)] * top, model_logprob=-1.0,
                          scores=[-1.0] * scores, next_logprob=-1.0)] * rows)
        controls = [SimpleNamespace(score_ids=(0,) * scores)] * rows
        assert reply.ByteSize() <= pred_reply_bytes(rows, top, controls, score_next=True)
