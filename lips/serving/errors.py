"""OpenAI's error object, and the HTTP status for each way a request can fail.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p",
               "code": null}}
"""

from __future__ import annotations

import errno
from typing import Any

from syscalls.client import reaped


class ApiError(Exception):
    """A request the server answers with an error object and `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        # A message may quote the request; JSON out must be valid UTF-8.
        message = message.encode(errors="backslashreplace").decode()
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_field(param: str, message: str) -> ApiError:
    """400 naming the field (`param` as OpenAI writes it: `messages[1].content`)."""
    return ApiError(400, f"{param}: {message}", param=param)


# The kernel's statuses a request can meet, and what the client is told. Anything else is
# the server's fault (500): a request that passed our checks must not fail in the kernel.
_KERNEL = {
    errno.ENOSPC: (503, "overloaded_error", "the kernel is out of KV memory; retry later"),
    errno.EDQUOT: (503, "overloaded_error", "the server's KV quota is used up; retry later"),
    errno.EAGAIN: (503, "overloaded_error", "the kernel is busy; retry later"),
    errno.EPIPE: (503, "overloaded_error", "the kernel does not answer (stopped or gone)"),
    errno.EOVERFLOW: (400, "invalid_request_error", "the request passes the model's context"),
}


def from_kernel(e: OSError) -> ApiError:
    """The error object for a failed syscall."""
    status, kind, what = _KERNEL.get(e.errno or 0, (500, "internal_error", "kernel error"))
    return ApiError(status, f"{what} ({e.strerror or e})", type=kind,
                    code=errno.errorcode.get(e.errno or 0))


def gone(e: OSError) -> bool:
    """Whether a syscall's error says the kernel has stopped or died: its session's calls
    fail with EPIPE (unreachable, or stopping), or the kernel has reaped the process."""
    return e.errno == errno.EPIPE or reaped(e.errno or 0, e.strerror or "")
