"""lips/cacheback.py: n-gram tree speculation against plain decoding on a real daemon."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter

import pytest
from daemon import ROOT, SYMPHONY, prompt

from lips import cacheback
from syscalls.context import Context

N = 48


def plain(k, ids: list[int], n: int, **sampling) -> list[int]:
    """One pred per token (Context.generate), stopping at EOS."""
    with Context(k, stop=k.model_info().eos_ids) as ctx:
        ctx.fill(ids)
        return list(ctx.generate(n, **sampling))


def speculated(k, ids: list[int], n: int, stats: cacheback.Stats, config=None,
               **sampling) -> list[int]:
    with k.open() as f:
        return list(cacheback.decode(f, ids, n, sampling, config or cacheback.Config(), stats,
                                     stop=k.model_info().eos_ids))


def test_tables_keep_the_most_recent_followers_and_forget_the_oldest_leader():
    tables = cacheback.NgramTables(cacheback.Config(ngram=2, followers=2, table_size=2))
    tables.update([1, 2, 1, 3, 1, 4])
    assert tables.followers([1], 3) == [4, 3]  # 2 was pushed out by two newer followers
    assert tables.followers([3, 1], 1) == [4]  # the 2-gram first
    assert tables.followers([3, 1], 2) == [4, 3]  # then the 1-gram's, to fill up
    assert tables.followers([9, 1], 3) == [4, 3]  # an unknown 2-gram: the 1-gram's
    # Two leaders per table: (2,) was used least recently when (3,) came.
    assert tables.followers([2], 1) == [] and tables.followers([3], 1) == [1]


def test_draft_tree_is_preorder_with_the_best_chain_first():
    tables = cacheback.NgramTables(cacheback.Config())
    tables.update([1, 5, 8, 9, 2, 5, 6, 7])
    tree = cacheback.draft_tree(tables, [3, 5], depth=3, width=2)
    # 5's most recent follower 6 (then 7) first, its older one 8 (then 9, 2) as a sibling.
    assert tree.tokens == [5, 6, 7, 8, 9, 2] and tree.parents == [-1, 0, 1, 0, 3, 4]
    assert tree.children == [[1, 3], [2], [], [4], [5], []]
    tables.update([5, 6, 7, 5, 6, 7, 5, 6, 7])
    tree = cacheback.draft_tree(tables, [5], depth=3, width=2)
    assert tree.tokens[:4] == [5, 6, 7, 5] and len(tree.tokens) <= 1 + 3 * 2
    assert all(-1 <= p < i for i, p in enumerate(tree.parents))
    assert cacheback.draft_tree(tables, [4], depth=3, width=2).tokens == [4]  # nothing known


def test_greedy_is_plain_greedy_token_for_token(k):
    """10 prompts x 48 tokens; the drafts are accepted often, branches are kept by keep and
    by truncate, and some outputs end at EOS."""
    total = cacheback.Stats()
    for i in range(10):
        ids = prompt(20 + 3 * i, salt=i)
        assert speculated(k, ids, N, total) == plain(k, ids, N), i
    assert total.accepted >= 50 and total.keeps > 0, vars(total)
    assert total.preds < 10 * N - total.accepted + 10


def test_a_chain_and_a_deep_tree_are_greedy_too(k):
    ids = prompt(24, salt=3)
    want = plain(k, ids, N)
    for config in (cacheback.Config(width=1), cacheback.Config(width=4, max_depth=12)):
        assert speculated(k, ids, N, cacheback.Stats(), config) == want


def chi_square_p(observed: list[int], expected: list[float]) -> float:
    """P(chi2 >= statistic), by Wilson and Hilferty's normal approximation."""
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    df = len(observed) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


def exact_pairs(k, ids: list[int], temperature: float,
                top_k: int) -> dict[tuple[int, int], float]:
    """The model's distribution of the first two sampled tokens, from full logprob rows."""
    vocab = k.model_info().vocab_size

    def row(context: list[int]) -> dict[int, float]:
        with k.open() as f:
            f.pred(context[:-1], no_outputs=True)
            (out,) = f.pred(context[-1:], top_logprobs=vocab)
        weights = sorted(((math.exp(lp / temperature), t) for t, lp in out.top), reverse=True)
        kept = weights[:top_k] if top_k else weights
        z = sum(v for v, _ in kept)
        return {t: v / z for v, t in kept}

    return {(a, b): pa * pb for a, pa in row(ids).items() if pa > 1e-3
            for b, pb in row(ids + [a]).items()}


@pytest.mark.parametrize("top_k", [0, 3])
def test_sampling_draws_from_the_models_distribution(k, top_k):
    """The first two tokens of 300 seeded runs (3 new tokens, so the tree is two deep)
    against the model's exact joint distribution (computed from full logprob rows, which
    is a stricter reference than a sample of plain decoding), with and without a top-k
    cut-off. The prompt ends in the model's own greedy loop, so the drafts are often
    accepted and often rejected (T = 0.1: the first token's top four are 0.48, 0.15, 0.13,
    0.11)."""
    base = prompt(12)
    ids = base + plain(k, base, 24)
    temperature, runs = 0.1, 300
    exact = exact_pairs(k, ids, temperature, top_k)
    stats, config, spec = cacheback.Stats(), cacheback.Config(), Counter()
    sampling = {"temperature": temperature, "top_k": top_k}
    with k.open() as prefix:
        prefix.pred(ids[:-1], no_outputs=True)
        for s in range(runs):
            with prefix.fork() as f:
                out = cacheback.decode(f, ids, 3, {**sampling, "seed": 1000 * s}, config,
                                       stats, written=len(ids) - 1)
                spec[tuple(out)[:2]] += 1
    assert 0.2 * runs < stats.accepted and stats.drafted - stats.accepted > 0.2 * runs, stats
    cells = sorted((c for c, p in exact.items() if p * runs >= 5), key=exact.get, reverse=True)
    assert len(cells) >= 5
    counts = [spec[c] for c in cells]
    expected = [exact[c] * runs for c in cells]
    counts[-1] += runs - sum(counts)  # every other pair, pooled with the least likely
    expected[-1] += runs - sum(expected)
    assert chi_square_p(counts, expected) > 1e-3, (spec.most_common(8), cells)


def run_lip(daemon, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SYMPHONY, "run", "lips/cacheback.py", *args], env=daemon.env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_symphony_run_prints_what_complete_prints(daemon):
    ids = ",".join(map(str, prompt(30, salt=5)))
    lip = run_lip(daemon, "--prompt-ids", ids, "--max-new-tokens", "32", "--json", "--stats")
    assert lip.returncode == 0, lip.stderr
    ref = subprocess.run([*SYMPHONY, "run", "lips/complete.py", "--prompt-ids", ids,
                          "--max-new-tokens", "32", "--json"], env=daemon.env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    got, want = json.loads(lip.stdout), json.loads(ref.stdout)
    assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
    assert got["stats"]["tokens"] == len(got["output_ids"])
    assert "cacheback: preds" in lip.stderr


def test_bad_arguments_get_a_message_and_no_traceback(daemon):
    for args, status, message in [
        (["--prompt-ids", "1,2", "--width", "0"], 2, "--width must be >= 1, got 0"),
        (["--prompt-ids", "1,2", "--max-depth", "-1"], 2, "--max-depth must be >= 1"),
        (["--prompt-ids", "1,2", "--max-new-tokens", "0"], 2, "--max-new-tokens: must be >= 1"),
        (["--prompt-ids", "1,x"], 2, "--prompt-ids wants integers"),
        (["--width", "2"], 2, "one of the arguments"),
        (["--prompt-ids", "1,999999"], 2, "token 999999 is outside [0, 320)"),
    ]:
        lip = run_lip(daemon, *args)
        assert lip.returncode == status and message in lip.stderr, (args, lip.stderr)
        assert "Traceback" not in lip.stderr
    gone = subprocess.run([sys.executable, "lips/cacheback.py", "--prompt-ids", "1,2"],
                          env={**daemon.env(), "SYMPHONY_SOCKET": "/nonexistent/k.sock"},
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert gone.returncode == 1 and "no Symphony kernel" in gone.stderr, gone.stderr
