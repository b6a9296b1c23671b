"""The Pred rpc for the synchronous client, so that an interrupted pred is taken back.

A blocking grpc call looks at signals every 200 ms only (grpc's completion queue), so Ctrl-C
or a timeout's signal reached the caller up to 200 ms late, the pred answered by then. The
rpcs are futures instead, cancelled when their wait is interrupted: the kernel takes the
preds back, and the next call on their file waits for the rollback (those answered first
stand).

Signal handlers run in the main thread only, and there they may raise at any function
call's return. grpc's Python API is not safe to interrupt so: its futures wait on a
threading.Condition, whose Python __enter__ and wait can be interrupted holding its lock
(grpc's threads then hang) or having let it go (RuntimeError), and an interruption between
an rpc's start and its future's return would leave a pred running that nothing cancels. So
for the main thread a thread of the session's (Rpcs) starts the rpcs, and cancels them when
asked; their answers are taken in grpc's own thread, which rings an eventfd; the main thread
waits on it, which an interruption leaves as it was, and touches nothing of grpc's. Other
threads make and wait for their rpcs themselves.

A signal sent to the process (a timeout's SIGALRM, Ctrl-C's SIGINT) goes to any of its
threads that does not block it, often the one running at that moment, and Python only
notes it there: the main thread runs the handler when it next runs Python code, so a main
thread asleep in a wait (a pred's reply, on any transport) slept on until the reply came,
and its pred, answered, could not be taken back. So every thread the client starts
(gRPC's, started with a channel, and the Rpcs thread) blocks MAIN_THREAD_SIGNALS, and the
OS gives them to the main thread, whose wait they interrupt at once (so long as the
LIP's own threads block them too).
"""

from __future__ import annotations

import functools
import os
import queue
import select
import signal
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import grpc

from syscalls.lifeline import MAIN_WAIT_SLICE
from syscalls.own_pid import own_pid

Start = Callable[[Any], Any]  # a request -> the rpc's future (stub.Pred.future)
T = TypeVar("T")

# The asynchronous signals a LIP may handle, which the client's threads leave to the main
# thread. Not the ones a fault raises in the thread at fault (SIGSEGV, SIGBUS, SIGFPE...),
# nor SIGPROF and SIGVTALRM, which samplers want in the thread that runs.
MAIN_THREAD_SIGNALS = frozenset({
    signal.SIGALRM, signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,
    signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD, signal.SIGWINCH,
})


def leave_signals_to_main() -> None:
    """This thread, and the threads it starts from now on, block MAIN_THREAD_SIGNALS (not
    the main thread: a handler could never run)."""
    if (hasattr(signal, "pthread_sigmask")
            and threading.current_thread() is not threading.main_thread()):
        signal.pthread_sigmask(signal.SIG_BLOCK, MAIN_THREAD_SIGNALS)


def apart(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) called in a thread of its own that blocks MAIN_THREAD_SIGNALS, so
    that the threads it starts (gRPC's, making a channel) block them too: a thread starts
    with its creator's mask. The caller's own mask is never changed, so no interruption can
    leave it changed."""
    out: list[Any] = []

    def run() -> None:
        leave_signals_to_main()
        try:
            out.append((True, fn(*args, **kwargs)))
        except BaseException as e:  # noqa: BLE001  (raised in the caller)
            out.append((False, e))

    thread = threading.Thread(target=run, name="symphony-start", daemon=True)
    thread.start()
    thread.join()
    ok, value = out[0]
    if not ok:
        raise value
    return value


def outcomes(futures: list[Any]) -> list[Any]:
    """Each done future's reply, or the RpcError it failed with (FutureCancelledError when
    it was cancelled)."""
    out: list[Any] = []
    for future in futures:
        try:
            out.append(future.result())
        except (grpc.RpcError, grpc.FutureCancelledError) as e:
            out.append(e)
    return out


def start_all(start: Start, requests: list[Any]) -> list[Any]:
    futures: list[Any] = []
    try:
        for request in requests:
            futures.append(start(request))
    except BaseException:
        for future in futures:
            future.cancel()
        raise
    return futures


def here(start: Start, requests: list[Any]) -> list[Any]:
    """The rpcs made and waited for by this thread (not the main thread), cancelled if the
    wait is interrupted."""
    futures = start_all(start, requests)
    try:
        for future in futures:
            future.exception()  # waits until done
    except BaseException:
        for future in futures:
            future.cancel()  # nothing for one answered: its answer stands
        raise
    return outcomes(futures)


class Job:
    """The main thread's rpcs: started by the thread, answered in grpc's (the callbacks set
    `outcomes` and ring the bell); the main thread touches nothing of grpc's."""

    def __init__(self, start: Start, requests: list[Any]):
        self.start, self.requests = start, requests
        self.futures: list[Any] = []
        self.outcomes: list[Any] = [None] * len(requests)
        self.finished: list[int] = []  # appended by the callbacks (atomic in any thread)
        self.error: BaseException | None = None  # starting them failed
        self.cancelled = False  # the thread has cancelled them

    def done(self) -> bool:
        return self.error is not None or len(self.finished) == len(self.requests)


class Rpcs:
    """The thread that starts the main thread's rpcs, and cancels them when the main thread
    asks (its queue's jobs: ("start", job) and ("cancel", job), done in order). `bell` rings
    the main thread: a job's rpc is done, or its start failed, or its rpcs are cancelled."""

    def __init__(self) -> None:
        self.pid = own_pid()
        self.jobs: queue.SimpleQueue[tuple[str, Job] | None] = queue.SimpleQueue()
        self.bell = os.eventfd(0, os.EFD_CLOEXEC)
        # Closed once nothing refers to this any more: not the main thread waiting on it,
        # nor an rpc's callback (grpc holds them until they have run), nor the thread.
        weakref.finalize(self, os.close, self.bell)
        self.ended = False  # the thread has ended (the session closed)
        self.thread = threading.Thread(target=self._run, name="symphony-rpcs", daemon=True)
        self.thread.start()

    def call(self, start: Start, requests: list[Any]) -> list[Any]:
        """The outcomes of the rpcs; interrupted, they are cancelled before the interruption
        goes on (interrupted again, it goes on at once)."""
        job, queued = Job(start, requests), []
        try:
            # list.extend calls put from C: queued says whether it happened, wherever an
            # interruption lands.
            queued.extend(map(self.jobs.put, (("start", job),)))
            self._wait(job.done)
        except BaseException:
            if queued:
                self.jobs.put(("cancel", job))
                self._wait(lambda: job.cancelled)
            raise
        if job.error is not None:
            raise job.error
        if not job.done():  # the session closed first: the thread is gone
            return [grpc.FutureCancelledError()] * len(requests)
        return job.outcomes

    def _wait(self, done: Callable[[], bool]) -> None:
        while not done() and not self.ended:
            # In slices (lifeline.MAIN_WAIT_SLICE): a signal may land just before the wait.
            if select.select([self.bell], [], [], MAIN_WAIT_SLICE)[0]:
                os.eventfd_read(self.bell)  # interrupted, it has read nothing; a wake-up
                # left by an earlier job's rpc only makes it look again

    def close(self) -> None:
        """The thread ends (once it has started the rpcs asked before: the session closes
        its channel first, which ends them, and their callbacks still ring the bell)."""
        self.jobs.put(None)

    def _ring(self) -> None:
        os.eventfd_write(self.bell, 1)

    def _run(self) -> None:
        leave_signals_to_main()  # and grpc's threads it starts (a future's spin thread)
        try:
            while (item := self.jobs.get()) is not None:
                what, job = item
                if what == "start":
                    self._start(job)
                else:
                    for future in job.futures:
                        future.cancel()  # nothing for one answered: its answer stands
                    job.cancelled = True
                    self._ring()
        finally:
            self.ended = True
            self._ring()  # a caller whose job came after the end stops waiting

    def _start(self, job: Job) -> None:
        try:
            job.futures = start_all(job.start, job.requests)
        except BaseException as e:  # noqa: BLE001  (handed to the caller)
            job.error = e
            self._ring()
            return
        for i, future in enumerate(job.futures):
            future.add_done_callback(functools.partial(self._finished, job, i))

    def _finished(self, job: Job, i: int, future: Any) -> None:
        job.outcomes[i] = outcomes([future])[0]
        job.finished.append(i)
        self._ring()
