"""Kernel statuses as Python exceptions: the OSError subclass that errno names."""

from __future__ import annotations

import errno as _errno


def error(code: int, message: str) -> OSError:
    """OSError(code, message): Python picks FileNotFoundError for ENOENT, PermissionError for
    EACCES and EPERM, FileExistsError, IsADirectoryError, NotADirectoryError, and so on."""
    return OSError(code, message or _errno.errorcode.get(code, "error"))


def check(reply):
    """Return the reply, or raise what its Error says."""
    err = reply.error
    if err.errno:
        raise error(err.errno, err.message)
    return reply
