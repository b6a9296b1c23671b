"""Asynchronous against synchronous function calling (AsyncLM), end to end (issue 16).

One task: greedy decoding of --tokens tokens on --model (default: the tiny model,
models/tiny) with --calls tool calls spread evenly over them, each a Python subprocess that
sleeps 0.5 to 1 s and prints a number, then --answer-tokens more once every result is in.
lips/async_lm.py runs it twice over: asynchronously (the tools run while decoding goes on,
each result injected when it comes) and synchronously (decoding waits for each result), runs
interleaved and repeated. A third row, decoding alone with no calls, is the floor.

The tiny model is not fine-tuned on the call protocol, so the calls are SCRIPTED: their
text is teacher-forced at fixed points (--script). What is measured is the system (tools,
decoding and injection overlapping), as AsyncLM measures end-to-end latency (it reports
1.6x-5.4x for its own tasks), not the model's calling skill.

    python bench/async_lm.py [--calls 4] [--tokens 64] [--answer-tokens 16] [--repeat 5]
        [--model DIR]

Times are the LIP's own (first pred to last token); process start and connect are out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, this file's folder comes first on sys.path (bench/kvfs.py would hide the
# kvfs package); the repository root lets `bench.kernel` be imported for its helpers.
sys.path = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

from bench.kernel import KernelDaemon, machine_line  # noqa: E402

PROMPT = "def parse_args(argv):"


def script(calls: int, tokens: int) -> list[dict]:
    """Calls spread evenly over the tokens, sleeping 0.5 to 1 s each."""
    out = []
    for i in range(calls):
        sleep = 0.5 + 0.5 * i / max(1, calls - 1)
        code = f"python: import time; time.sleep({sleep:.3f}); print({i + 1} * 7)"
        out.append({"after": (i + 1) * tokens // (calls + 1),
                    "text": f" [CALL] {i + 1} [HEAD] {code} [END]"})
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_lip(sock: Path, args: argparse.Namespace, *extra: str) -> dict:
    env = {**os.environ, "SYMPHONY_SOCKET": str(sock)}
    out = subprocess.run(
        [sys.executable, "lips/async_lm.py", "--prompt", PROMPT, "--json", "--max-new-tokens",
         str(args.tokens), "--answer-tokens", str(args.answer_tokens), *extra],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if out.returncode:
        raise RuntimeError(f"async_lm failed: {out.stderr.strip()}")
    r = json.loads(out.stdout)
    bad = [c for c in r["calls"] if not c["ok"]]
    if bad:
        raise RuntimeError(f"a call failed: {bad[0]}")
    return r


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=4)
    p.add_argument("--tokens", type=int, default=64, help="tokens sampled around the calls")
    p.add_argument("--answer-tokens", type=int, default=16)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--model", default=str(ROOT / "models" / "tiny"),
                   help="checkpoint (default: models/tiny, the 5.5M test model "
                   "bench/RESULTS.md's figures were taken on)")
    args = p.parse_args()
    print(machine_line())
    plan = script(args.calls, args.tokens)
    print(f"# task: {args.calls} scripted calls (teacher-forced) at tokens "
          f"{[c['after'] for c in plan]}, sleeping "
          f"{', '.join(c['text'].split('sleep(')[1].split(')')[0] for c in plan)} s; "
          f"{args.tokens} + {args.answer_tokens} tokens greedy; {args.repeat} runs each")
    with tempfile.TemporaryDirectory(prefix="bench-async-lm-") as tmp:
        path = Path(tmp) / "script.json"
        path.write_text(json.dumps(plan))
        with KernelDaemon(Path(tmp), "k", ["--model", args.model]) as kernel:
            sides = {"async": ["--script", str(path)], "sync": ["--script", str(path), "--sync"],
                     "no calls": []}
            for extra in sides.values():  # warm the kernel up
                run_lip(kernel.socket, args, *extra)
            seconds: dict[str, list[float]] = {name: [] for name in sides}
            cpu: dict[str, list[float]] = {name: [] for name in sides}  # the kernel's
            lag = []  # from a result's return to its injection, async
            pid = kernel.pid
            for _ in range(args.repeat):
                for name, extra in sides.items():
                    before = cpu_seconds(pid)
                    r = run_lip(kernel.socket, args, *extra)
                    cpu[name].append(cpu_seconds(pid) - before)
                    seconds[name].append(r["seconds"])
                    if name == "async":
                        lag += [c["injected"] - c["returned"] for c in r["calls"]]
    print(f"  {'seconds end to end':<22}{'best':>8}{'median':>8}{'kernel CPU s, median':>22}")
    for name, xs in seconds.items():
        print(f"  {name:<22}{min(xs):>8.2f}{statistics.median(xs):>8.2f}"
              f"{statistics.median(cpu[name]):>22.2f}")
    best = min(seconds["sync"]) / min(seconds["async"])
    median = statistics.median(seconds["sync"]) / statistics.median(seconds["async"])
    rounds = zip(seconds["sync"], seconds["async"], strict=True)
    paired = statistics.median([s / a for s, a in rounds])
    print(f"  speedup, sync / async {best:>7.2f}x{median:>7.2f}x  (AsyncLM reports 1.6x-5.4x); "
          f"median of each round's ratio {paired:.2f}x")
    sleeps = sum(0.5 + 0.5 * i / max(1, args.calls - 1) for i in range(args.calls))
    print(f"  the sleeps in sequence: {sleeps:.2f} s; async, from a result to its injection: "
          f"median {statistics.median(lag) * 1000:.0f} ms, at most {max(lag) * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
