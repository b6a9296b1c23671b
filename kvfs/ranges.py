"""Half-open entry ranges [start, end): the excluded (punched) parts of a KV file."""

from __future__ import annotations

import bisect
from collections.abc import Iterator


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint, non-adjacent, non-empty: the one form a file keeps."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(r for r in ranges if r[0] < r[1]):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def overlapping(ranges: list[tuple[int, int]], lo: int, hi: int) -> Iterator[tuple[int, int]]:
    """The ranges that meet [lo, hi); `ranges` sorted and disjoint."""
    i = bisect.bisect_right(ranges, lo, key=lambda x: x[1])
    while i < len(ranges) and ranges[i][0] < hi:
        yield ranges[i]
        i += 1


def covered(ranges: list[tuple[int, int]], lo: int, hi: int) -> bool:
    """Whether sorted, disjoint `ranges` cover [lo, hi) entirely (adjacent ones count)."""
    pos = lo
    for start, end in overlapping(ranges, lo, hi):
        if start > pos:
            return False
        pos = end
    return pos >= hi
