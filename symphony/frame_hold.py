"""The bytes of partial lifeline frames the kernel holds for each user.

A frame of up to 64 MiB (a pred too large for the ring) arrives in pieces, and the kernel
keeps what came until it is whole. Unbounded, a user's 256 processes could each hold a
frame that never ends: 16 GiB. Past HOLD_LIMIT bytes in all, a user's lifelines stop being
read, all but the one that started holding first: that one can always finish its frame,
after which the others go on, so every frame of the user's gets through, one after
another, while a frame that never ends stalls only its user. Root is not held to it.
A lifeline is paused through its ReadPause, so that its backed-up replies, the other reason
not to read it, keep it paused after FrameHold lets it go.
"""

from __future__ import annotations

from collections import Counter

from symphony.read_pause import FRAMES, ReadPause
from syscalls import wire

HOLD_LIMIT = wire.MAX_PAYLOAD


class FrameHold:
    def __init__(self) -> None:
        self.held: Counter[int] = Counter()  # uid -> bytes of partial frames
        # uid -> the lifelines holding some, in the order they started (dicts keep it)
        self._holders: dict[int, dict[ReadPause, None]] = {}
        self._paused: dict[int, set[ReadPause]] = {}  # uid -> lifelines not read

    def update(self, uid: int, lifeline: ReadPause, before: int, after: int) -> None:
        """The lifeline of a process of uid holds `after` bytes of a frame, where it held
        `before`: it stops being read if the user is past the limit and it is not the first
        holder; when the user's bytes fall, the paused ones are read again."""
        if uid == 0 or before == after:
            return
        self.held[uid] += after - before
        holders = self._holders.setdefault(uid, {})
        if after:
            holders.setdefault(lifeline, None)
        else:
            holders.pop(lifeline, None)
        if after < before:
            self._resume(uid)
        elif self.held[uid] > HOLD_LIMIT and next(iter(holders)) is not lifeline:
            paused = self._paused.setdefault(uid, set())
            if lifeline not in paused:
                paused.add(lifeline)
                lifeline.pause(FRAMES)
        if not self.held[uid]:
            del self.held[uid], self._holders[uid]

    def forget(self, uid: int, lifeline: ReadPause, held: int) -> None:
        """The lifeline is gone (it held `held` bytes)."""
        self._paused.get(uid, set()).discard(lifeline)
        self.update(uid, lifeline, held, 0)

    def _resume(self, uid: int) -> None:
        for lifeline in self._paused.pop(uid, ()):
            lifeline.resume(FRAMES)  # read again unless its replies still hold it
