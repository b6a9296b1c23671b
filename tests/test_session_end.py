"""Calls that are waiting when their session ends or they are interrupted, on a kernel
whose steps take STEP seconds (a simulated accelerator, `--engine sleep:MS`), so that the
preds are in a running step when it happens: an interrupted pred_many takes back every
pred, and a pred waiting when its session exits or closes raises the session's reason."""

from __future__ import annotations

import asyncio
import errno
import signal
import threading

import pytest

from syscalls.aio import AsyncKernel
from syscalls.client import Kernel

STEP = 0.3
DAEMON_FLAGS = ("--kv-pages", "512", "--engine", f"sleep:{STEP * 1000:g}")
TRANSPORTS = {"ring": {}, "lifeline": {"rings": False}, "grpc": {"lifeline_pred": False}}


class Alarm(Exception):
    pass


def alarm(signum, frame) -> None:
    raise Alarm


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_interrupted_pred_many_takes_back_every_pred_of_the_step(daemon, transport):
    """Each CANCEL goes before any reply is waited for: one by one, the others of the step
    were answered while the first was rolled back."""
    previous = signal.signal(signal.SIGALRM, alarm)
    try:
        with Kernel.connect(daemon.socket, **TRANSPORTS[transport]) as k:
            files = [k.open() for _ in range(4)]
            signal.setitimer(signal.ITIMER_REAL, STEP / 3)
            with pytest.raises(Alarm):
                k.pred_many([{"fd": f, "tokens": [1, 2, 3]} for f in files])
            assert [f.stat().tokens for f in files] == [0, 0, 0, 0]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_pred_waiting_when_its_session_exits_raises_eperm(daemon, transport):
    k = Kernel.connect(daemon.socket, **TRANSPORTS[transport])
    f = k.open()
    leaving = threading.Timer(STEP / 3, k.exit, (0,))
    leaving.start()
    try:
        with pytest.raises(PermissionError, match="no session"):
            f.pred([1, 2, 3])
    finally:
        leaving.join()
    with pytest.raises(PermissionError, match="no session"):
        f.stat()


@pytest.mark.parametrize("how", ["exit", "close"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_async_pred_waiting_when_its_session_ends_raises_its_reason(daemon, transport, how):
    async def main() -> None:
        k = await AsyncKernel.connect(daemon.socket, **TRANSPORTS[transport])
        f = await k.open()
        waiting = asyncio.create_task(f.pred([1, 2, 3]))
        await asyncio.sleep(STEP / 3)
        await (k.exit(0) if how == "exit" else k.close())
        with pytest.raises(OSError) as e:
            await waiting
        assert e.value.errno == (errno.EPERM if how == "exit" else errno.EBADF), e.value

    asyncio.run(main())
