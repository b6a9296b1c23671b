"""Tree attention inside one pred: the packed ancestor bits, and a tree forward against each of
its root-to-leaf paths run as a file of its own."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_engine_parity import ATOL, shuffled_pages

from symphony.engine.engine import Batch, Engine, TreeRows
from symphony.engine.tree import ancestor_bits, depths


def path_to(parents: list[int], i: int) -> list[int]:
    """Root-to-i rows, recursively."""
    return [] if i < 0 else [*path_to(parents, parents[i]), i]


def random_parents(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(-1, i) if rng.random() > 0.1 else -1 for i in range(n)]


@pytest.mark.parametrize("n", [0, 1, 5, 31, 32, 33, 100])
def test_ancestor_bits_and_depths_match_the_paths(n):
    trees = [random_parents(n, seed) for seed in range(3)]
    trees += [list(range(-1, n - 1)), [-1] * n]  # a chain, and only roots
    for parents in trees:
        bits = ancestor_bits(parents)
        assert bits.dtype == np.int32 and bits.shape == (n, -(-n // 32))
        unpacked = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little")[:, :n]
        for i in range(n):
            assert set(np.flatnonzero(unpacked[i])) == set(path_to(parents, i))
        assert depths(parents) == [len(path_to(parents, i)) - 1 for i in range(n)]


# A prefix, then a forest: node 0 and node 9 are roots; the last node is not the child of the
# one before it, so a one-token chunk of it is wrong under plain causal attention.
PREFIX = 19
PARENTS = [-1, 0, 0, 1, 1, 2, 5, 3, 6, -1, 9, 4, 10, 7]


@pytest.fixture(scope="module", params=["torch", "c", "triton"])
def engine(request, model):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SYMPHONY_ATTENTION", request.param)
        engine = Engine(model, kv_pages=32, page_size=8)
    assert engine.kernels.name == request.param
    return engine


@pytest.mark.parametrize("split", [0, 6, len(PARENTS) - 1], ids=["whole", "mid", "last"])
def test_tree_forward_equals_each_path_alone(engine, split):
    """A tree pred after its prefix, in one forward (or two chunks, the second starting
    mid-tree) gives every node the logits of its root-to-node path run as a file of its own."""
    rng = random.Random(5)
    vocab = engine.config.vocab_size
    prefix = [rng.randrange(vocab) for _ in range(PREFIX)]
    nodes = [rng.randrange(vocab) for _ in PARENTS]
    n = len(PARENTS)
    positions = [PREFIX + d for d in depths(PARENTS)]
    bits = ancestor_bits(PARENTS)
    pages = shuffled_pages(engine, -(-(PREFIX + n) // 8))
    engine.forward(Batch(prefix, list(range(PREFIX)), [PREFIX], [PREFIX], [pages], [0]))
    got = []
    for a, b in [(0, split), (split, n)] if split else [(0, n)]:
        got.append(engine.forward(Batch(nodes[a:b], positions[a:b], [b - a], [PREFIX + b],
                                        [pages], list(range(b - a)),
                                        trees=[TreeRows(PREFIX, bits[a:b])])))
    got = torch.cat(got)
    engine.pool.free(pages)

    for leaf in sorted(set(range(n)) - set(PARENTS)):
        path = path_to(PARENTS, leaf)
        length = PREFIX + len(path)
        solo = shuffled_pages(engine, -(-length // 8))
        want = engine.forward(Batch(prefix + [nodes[i] for i in path], list(range(length)),
                                    [length], [length], [solo], list(range(PREFIX, length))))
        engine.pool.free(solo)
        for row, i in enumerate(path):
            assert (got[i] - want[row]).abs().max() < ATOL, (leaf, i)


def test_check_refuses_bad_trees(engine):
    good = ancestor_bits([-1, 0, 1])

    def batch(*trees):
        return Batch([1, 2, 3], [0, 1, 2], [3], [5], [[0]], [0], trees=list(trees))

    engine.check(batch(TreeRows(2, good)))
    engine.check(batch(None))
    with pytest.raises(ValueError, match="trees and q_lens"):
        engine.check(batch(None, None))
    with pytest.raises(ValueError, match=r"trees\[0\].start 3 outside \[0, 2\]"):
        engine.check(batch(TreeRows(3, good)))
    with pytest.raises(ValueError, match=r"trees\[0\].start -1"):
        engine.check(batch(TreeRows(-1, good)))
    with pytest.raises(ValueError, match="int32"):
        engine.check(batch(TreeRows(2, good.astype(np.int64))))
    with pytest.raises(ValueError, match=r"shape \(2, 1\)"):
        engine.check(batch(TreeRows(2, good[:2])))
    # 40 rows from the tree's start need two words of bits.
    wide = Batch([1] * 3, [0, 1, 2], [3], [40], [[0, 1, 2, 3, 4]], [0],
                 trees=[TreeRows(0, np.zeros((3, 1), np.int32))])
    with pytest.raises(ValueError, match=r">= 2\]"):
        engine.check(wide)
    assert engine.metadata(batch(None)).tree_bits is None
