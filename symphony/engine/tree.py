"""Tree-shaped preds: which of a pred's own rows each row may attend to, as packed bits.

Row ``i`` of a tree attends to itself and its ancestors. The bits are packed 32 to an int32
word, bit ``c % 32`` of word ``c // 32`` standing for row ``c``, the layout the attention
kernels read.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def depths(parents: Sequence[int]) -> list[int]:
    """Depth of each row (a root is 0); parents are checked (-1 <= parents[i] < i)."""
    out: list[int] = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def ancestor_bits(parents: Sequence[int]) -> np.ndarray:
    """``[n, ceil(n / 32)]`` int32: bit c of row i is set iff c == i or c is an ancestor of i."""
    n = len(parents)
    rows = np.arange(n)
    bits = np.zeros((n, -(-n // 32)), dtype=np.uint32)
    bits[rows, rows // 32] = np.uint32(1) << (rows % 32).astype(np.uint32)
    parent = np.asarray(parents, dtype=np.int64)
    depth = np.asarray(depths(parents), dtype=np.int64)
    # Level by level: a row's parent is one level up and already complete, so a whole level
    # inherits its parents' rows at once.
    order = np.argsort(depth, kind="stable")
    bounds = np.searchsorted(depth[order], np.arange(1, int(depth.max(initial=0)) + 2))
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        level = order[lo:hi]
        bits[level] |= bits[parent[level]]
    return bits.view(np.int32)
