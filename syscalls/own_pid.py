"""This process's pid, read without a system call.

The clients refuse a pred from a forked child on its parent's session (the ring and the
lifeline are the parent's), so they compare the caller's pid with the opener's once a
pred. os.getpid() is a system call on Linux (glibc keeps no copy since 2.25), which on a
virtual machine costs a LIP a microsecond or more a pred; the pid is kept here instead,
and read again in a child as os.fork() makes it.
"""

from __future__ import annotations

import os

_pid = os.getpid()


def own_pid() -> int:
    return _pid


def _forked() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_forked)
