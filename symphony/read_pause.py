"""Why a lifeline is not read: each reason pauses it on its own, and it is read again only
once no reason is left.

Four hold a lifeline today: FrameHold (its user is past 64 MiB of partial frames), the
lifeline's own replies (its write buffer past its high-water mark: the process does not
read them, so the kernel takes no more of its preds), the process's preds in flight
(IN_FLIGHT_MAX of them), and what its user's preds in flight could reply (symphony/owed.py).
One reason ending must not resume reading that another still holds.
"""

from __future__ import annotations

import asyncio

FRAMES = "frames"  # FrameHold: the user's partial frames are past HOLD_LIMIT
REPLIES = "replies"  # the replies not read by the process are past the high-water mark
IN_FLIGHT = "in flight"  # the process has IN_FLIGHT_MAX preds in flight (symphony/server.py)
OWED = "owed"  # its user's preds in flight could reply OWED_MAX bytes (symphony/owed.py)


class ReadPause:
    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.reasons: set[str] = set()

    def pause(self, reason: str) -> None:
        if not self.reasons and not self.transport.is_closing():
            self.transport.pause_reading()
        self.reasons.add(reason)

    def resume(self, reason: str) -> None:
        if reason not in self.reasons:
            return
        self.reasons.discard(reason)
        if not self.reasons and not self.transport.is_closing():
            self.transport.resume_reading()
