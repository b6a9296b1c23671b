"""The engine thread: the one thread of the kernel that runs torch's parallel work.

The forward pass must not run on the event loop's thread, so it runs here. But OpenMP
keeps a team of worker threads for every thread that has run a parallel region, and once
libgomp manages more threads than there are CPUs it stops spinning between regions and
sleeps instead: every parallel op of the forward pass then pays for waking its team. On a
small model that made a decode step 15 to 25% slower than the same loop in-process. So
the loop's thread is held to one torch thread (it never forms a team) and the engine is
built, and runs, here with the process's full count.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


class EngineThread:
    """Create it on the thread that will run the event loop, before any torch work there."""

    def __init__(self) -> None:
        threads = torch.get_num_threads()  # also fixes this thread's count from now on
        torch.set_num_threads(1)
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.call(torch.set_num_threads, threads)

    def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """Run fn on the engine thread and wait for it (startup: building the engine)."""
        return self._executor.submit(fn, *args, **kwargs).result()

    async def run(self, fn: Callable[..., T], *args) -> T:
        """Run fn on the engine thread; the event loop goes on meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
