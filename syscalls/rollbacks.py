"""The files whose pred this session cancelled lately (a gRPC rpc's cancellation, or a
CANCEL whose reply was not awaited), which the kernel may not have taken back yet.

A cancelled rpc reaches the kernel's handler apart from the calls that follow it on the
same channel (grpc's completion queue hands the kernel each as it comes), so the close or
truncate an `except` clause makes right after an interrupted pred can come first and find
the pred still in progress: EBUSY. Such a call is made again until the rollback is done,
CANCEL_WAIT at most, so that an interrupted pred over gRPC leaves its file as the rings and
the lifeline do: free for the call that follows. Those wait for their CANCEL's reply, but
an interruption of that wait (a second Ctrl-C; a task cancelled again, as a server closing
a request's generations does) leaves the same race, and the same remedy.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Iterable
from typing import Any

from syscalls.convert import Call
from syscalls.lifeline import CANCEL_WAIT

RETRY_PAUSE = 0.005  # seconds between tries of a call that found the file busy


def written_fd(request: Any) -> int | None:
    """The fd of the file a request changes or closes (the destination of a splice); None
    for a request without one (a streamed import's is an iterator of chunks)."""
    fields = getattr(getattr(request, "DESCRIPTOR", None), "fields_by_name", {})
    for field in ("fd", "dst_fd"):
        if field in fields:
            return getattr(request, field)
    return None


class Rollbacks:
    """fd -> until when a call on it that finds it busy is made again."""

    def __init__(self) -> None:
        self.until: dict[int, float] = {}

    def cancelled(self, fds: Iterable[int]) -> None:
        """Preds on these fds were cancelled (their answers may have come first: a call on
        their file then finds it free at once): a gRPC rpc's cancellation, or a CANCEL
        whose reply was not waited for (the wait interrupted again)."""
        deadline = time.monotonic() + CANCEL_WAIT
        for fd in fds:
            self.until[fd] = deadline

    def again(self, call: Call, reply: Any) -> bool:
        """Whether to make the call again: it found busy a file whose cancelled pred may
        not have been taken back yet. A close that went through forgets the fd (a later
        open may reuse it)."""
        if not self.until:
            return False
        fd = written_fd(call.request)
        if fd is None or fd not in self.until:
            return False
        if reply.error.errno != errno.EBUSY:
            if not reply.error.errno and call.rpc == "Close":
                del self.until[fd]
            return False
        if time.monotonic() < self.until[fd]:
            return True
        del self.until[fd]
        return False
