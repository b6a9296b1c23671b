"""The kernel bells: one eventfd a process rings for all its syscall rings.

A process with many sessions (an asyncio LIP serving many clients) has a ring a session,
and rings the kernel's bell after each submission. With a bell a ring, the loop ran a
callback, read an eventfd and drained one ring for every pred: a step's answers brought a
step's worth of callbacks back. The rings of one process (its OS pid, under its uid) share
one bell instead, and its one callback drains every one of them, taking a whole turn of
the process's submissions at once. Nothing crosses processes: a bell drains only the
rings of the process it was given to, and a ring is read as its own session's. The
process's side is unchanged: each of its rings got a descriptor of the same eventfd.
"""

from __future__ import annotations

import asyncio
import os
from typing import Protocol


class Drains(Protocol):
    def drain(self) -> bool: ...


class KernelBell:
    """One process's bell and the rings it drains (each a lifeline's, by its Hello)."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self.rings: dict[Drains, None] = {}  # in the order they were set up

    def rung(self) -> None:
        try:  # once a turn of the process's submissions: cheaper than contextlib.suppress
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass
        for ring in list(self.rings):  # a drain may drop a ring (a broken one)
            ring.drain()


class KernelBells:
    """The bells of the processes that have rings, by (uid, OS pid)."""

    def __init__(self) -> None:
        self.bells: dict[tuple[int, int], KernelBell] = {}

    def bell(self, key: tuple[int, int]) -> KernelBell:
        """The process's bell, made and watched by the loop if it has none yet (OSError
        when no eventfd can be made). join() a ring to it, or unused() it."""
        bell = self.bells.get(key)
        if bell is None:
            bell = self.bells[key] = KernelBell()
            asyncio.get_running_loop().add_reader(bell.fd, bell.rung)
        return bell

    def join(self, key: tuple[int, int], ring: Drains) -> None:
        self.bells[key].rings[ring] = None

    def leave(self, key: tuple[int, int], ring: Drains) -> None:
        """The ring is gone: the bell with it, if it was the process's last."""
        bell = self.bells.get(key)
        if bell is not None:
            bell.rings.pop(ring, None)
            self.unused(key)

    def unused(self, key: tuple[int, int]) -> None:
        """Close the process's bell if no ring uses it (a ring setup that failed)."""
        bell = self.bells.get(key)
        if bell is not None and not bell.rings:
            del self.bells[key]
            asyncio.get_running_loop().remove_reader(bell.fd)
            os.close(bell.fd)
