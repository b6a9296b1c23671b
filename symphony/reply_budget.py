"""How many bytes of gRPC pred replies a user's processes may have the kernel hold at once.

A unary Pred rpc's reply is gRPC's to send once the handler returns, and gRPC keeps it
until the client reads it: a process that issued hundreds of Pred rpcs with large replies
and never read them made the kernel hold every reply (400 of 0.76 MB: 640 MB more). So
each Pred rpc takes its reply's bound (syscall_table.reply_bound) from its debtor's budget
(its user's processes together, or one of root's: `debtor`) before it is
submitted, and gives it back when the rpc ends, its reply sent; past LIMIT the next Pred
rpc waits for room, in arrival order. One alone always goes, however large (submit_pred's
EMSGSIZE is the bound on one).
"""

from __future__ import annotations

import asyncio
from collections import deque

from symphony.process import Process

# A quarter of the lifeline's OWED_MAX (symphony/owed.py): a reply gRPC holds costs the
# kernel about five times its bytes (400 Pred rpcs of 0.76 MB replies held 1.7 GB).
LIMIT = 16 << 20


def debtor(proc: Process) -> object:
    """Whose budget a process's Pred rpcs take from: its user's, all its processes
    together (else a user's 256 processes could each hold LIMIT); root's are each their
    own."""
    return proc.uid or proc


class ReplyBudget:
    def __init__(self) -> None:
        self.held = 0  # bytes taken by rpcs not ended
        self._waiting: deque[tuple[int, asyncio.Future]] = deque()

    def _fits(self, size: int) -> bool:
        return self.held == 0 or self.held + size <= LIMIT

    async def take(self, size: int) -> None:
        if not self._waiting and self._fits(size):
            self.held += size
            return
        room = asyncio.get_running_loop().create_future()
        self._waiting.append((size, room))
        try:
            await room
        except asyncio.CancelledError:
            if room.done() and not room.cancelled():  # granted as it was cancelled
                self.give(size)
            raise

    def idle(self) -> bool:
        return self.held == 0 and not self._waiting

    def give(self, size: int) -> None:
        self.held -= size
        while self._waiting and self._fits(self._waiting[0][0]):
            size, room = self._waiting.popleft()
            if not room.done():  # else its rpc was cancelled while it waited
                self.held += size
                room.set_result(None)
