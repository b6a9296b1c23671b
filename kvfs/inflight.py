"""Bytes held by import streams in flight, per user.

Each import stream is bounded by its header's declared size (before its header is whole,
by the bytes it kept), but a user may open any number of them at once, and each keeps a
buffer of that size until it ends. So a user
other than root may have at most the largest file the KV pool could hold declared by all
its streams in flight together, as the mount bounds what a user spools in its open
writers (kvfs/fuse.py); a stream past it is refused (EDQUOT), not kept waiting, since a
waiting stream would hold its connection and its header for as long as the others take.
"""

from __future__ import annotations

import errno
from collections import Counter

from kvfs.errors import FSError


class ImportsInFlight:
    def __init__(self) -> None:
        self.held: Counter[int] = Counter()  # per uid: bytes its streams' headers declare

    def take(self, uid: int, size: int, bound: int, path: str) -> None:
        """Count a stream's `size` declared bytes against uid, or fail (EDQUOT) changing
        nothing when that would take a user other than root past `bound`."""
        if uid and self.held[uid] + size > bound:
            raise FSError(errno.EDQUOT, f"import {path!r}: {size} bytes: the imports uid {uid} "
                          f"has in flight would hold {self.held[uid] + size} bytes in all, "
                          f"more than the largest file the KV pool could hold ({bound} bytes)")
        self.held[uid] += size

    def give(self, uid: int, size: int) -> None:
        """A stream that took `size` bytes has ended."""
        self.held[uid] -= size
        if not self.held[uid]:
            del self.held[uid]
