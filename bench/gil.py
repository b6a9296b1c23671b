"""The GIL probe: why the kernel runs its engine in a process of its own.

In-process `generate` at batch 32 (one torch thread), alone and then beside a second
thread that runs Python 1 ms in every 2, as the kernel's event loop did beside an engine
thread. Prints ms per decode step, best of --repeat, the two sides interleaved
(docs/architecture.md, "The GIL"; bench/RESULTS.md, sessions 10 and 11).

    python bench/gil.py [--model DIR] [--batch 32] [--repeat 3]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path, and bench/kernels.py would
# hide the kernels package from the engine.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

import torch  # noqa: E402

from symphony.engine.engine import SHIPPED_MODEL, Engine  # noqa: E402
from symphony.engine.generate import generate  # noqa: E402
from symphony.engine.sampler import GREEDY  # noqa: E402

NEW = 64  # decoded tokens a measurement


def step_ms(engine: Engine, prompts: list[list[int]]) -> float:
    """generate's decode step: N new tokens minus 1 new token (no prefill), per step."""
    t = time.perf_counter()
    generate(engine, prompts, GREEDY, NEW, stop_ids=())
    mid = time.perf_counter()
    generate(engine, prompts, GREEDY, 1, stop_ids=())
    end = time.perf_counter()
    return ((mid - t) - (end - mid)) / (NEW - 1) * 1e3


def python_half_the_time(stop: threading.Event) -> None:
    while not stop.is_set():
        busy_until, spins = time.perf_counter() + 1e-3, 0
        while time.perf_counter() < busy_until:
            spins += 1
        time.sleep(1e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(SHIPPED_MODEL),
                    help="checkpoint (default: models/tiny, the 5.5M test model "
                    "bench/RESULTS.md's figures were taken on)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    for flag in ("batch", "repeat"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag}: {getattr(args, flag)} is not a positive count")
    torch.set_num_threads(1)
    engine = Engine(args.model, kv_pages=2048)
    vocab = engine.config.vocab_size
    prompts = [[(7 * i + 13 * s) % (vocab - 6) + 6 for i in range(32)]
               for s in range(args.batch)]
    step_ms(engine, prompts)  # warm
    alone, beside = [], []
    for _ in range(args.repeat):
        alone.append(step_ms(engine, prompts))
        stop = threading.Event()
        other = threading.Thread(target=python_half_the_time, args=(stop,))
        other.start()
        try:
            beside.append(step_ms(engine, prompts))
        finally:
            stop.set()
            other.join()
    print(f"batch {args.batch}, one torch thread: alone {min(alone):.2f} ms a step, beside a "
          f"thread running Python half the time {min(beside):.2f} ms "
          f"({min(beside) / min(alone):.2f}x); all: {[round(a, 2) for a in alone]} and "
          f"{[round(b, 2) for b in beside]}")


if __name__ == "__main__":
    main()
