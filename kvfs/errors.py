"""Errno-carrying errors: every kvfs failure names its errno and the thing it refused."""

from __future__ import annotations

import errno
import os


class FSError(OSError):
    def __init__(self, code: int, message: str):
        super().__init__(code, f"{os.strerror(code)}: {message}")
        self.message = message


def enoent(what: str) -> FSError:
    return FSError(errno.ENOENT, what)
