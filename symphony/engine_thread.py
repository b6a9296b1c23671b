"""The engine thread: the one thread of the kernel that runs torch's parallel work.

The forward pass must not run on the event loop's thread, so it runs here. But OpenMP
keeps a team of worker threads for every thread that has run a parallel region, and once
libgomp manages more threads than there are CPUs it stops spinning between regions and
sleeps instead: every parallel op of the forward pass then pays for waking its team. On a
small model that made a decode step 15 to 25% slower than the same loop in-process. So
the loop's thread is held to one torch thread (it never forms a team) and the engine is
built, and runs, here with the process's full count.

Work comes in on a plain queue and results go back with call_soon_threadsafe: the
event loop's own run_in_executor, with its concurrent future chained to an asyncio one,
cost the loop thread about 0.1 ms a step, which on a small CPU is CPU the forward pass
running beside it loses.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

import torch

T = TypeVar("T")


def _settle(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class EngineThread:
    """Create it on the thread that will run the event loop, before any torch work there."""

    def __init__(self) -> None:
        threads = torch.get_num_threads()  # also fixes this thread's count from now on
        torch.set_num_threads(1)
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="engine", daemon=True)
        self._thread.start()
        # Stopped before the interpreter tears down: torch's thread pools must not go
        # from under a thread that is still inside them.
        atexit.register(self.close)
        self.call(torch.set_num_threads, threads)

    def close(self) -> None:
        """Stop the thread once the work queued before this is done."""
        if self._thread.is_alive():
            self._work.put(None)
            self._thread.join()

    def _serve(self) -> None:
        while (work := self._work.get()) is not None:
            fn, done = work
            try:
                result, error = fn(), None
            except BaseException as e:  # handed to the caller, whatever it is
                result, error = None, e
            try:
                done(result, error)
            except RuntimeError:  # the event loop closed meanwhile: nobody waits any more
                pass

    def call(self, fn: Callable[..., T], *args, **kwargs) -> T:
        """Run fn on the engine thread and wait for it (startup: building the engine)."""
        box: Future = Future()

        def done(result: object, error: BaseException | None) -> None:
            if error is not None:
                box.set_exception(error)
            else:
                box.set_result(result)

        self._work.put((functools.partial(fn, *args, **kwargs), done))
        return box.result()

    async def run(self, fn: Callable[..., T], *args) -> T:
        """Run fn on the engine thread; the event loop goes on meanwhile."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._work.put((functools.partial(fn, *args),
                        lambda result, error: loop.call_soon_threadsafe(
                            _settle, future, result, error)))
        return await future
