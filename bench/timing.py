"""How the kernel benchmarks time a call: the best of several, after a warm-up."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def timed(fn: Callable[[], object], repeat: int, cuda: bool) -> float:
    """Best seconds of `repeat` calls after a warm-up (which also compiles). On CUDA, by the
    device's own events: the host's clock would time the launch, not the kernel."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
    return best
