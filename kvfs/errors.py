"""Errno-carrying errors: every kvfs failure names its errno and the thing it refused."""

from __future__ import annotations

import errno
import os


class FSError(OSError):
    def __init__(self, code: int, message: str):
        super().__init__(code, f"{os.strerror(code)}: {message}")
        self.message = message


class NoRoom(FSError):
    """ENOSPC: `short` more free device pages would have let the call through (the kernel
    may move that many down, symphony/relief.py, and try again)."""

    def __init__(self, message: str, short: int):
        super().__init__(errno.ENOSPC, message)
        self.short = short


def enoent(what: str) -> FSError:
    return FSError(errno.ENOENT, what)
