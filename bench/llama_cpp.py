"""Our engine against llama.cpp on the same GGUF file, in one run (issue 28).

Decode tokens/s at batch 1 and 32 (B prompts of 32 tokens, then 64 new tokens each: ours
times 64 new minus 1 new, llama-batched-bench its TG phase), and prefill tokens/s of one
512-token prompt (ours: the prompt and one token; llama-bench's pp512). Ours runs with the
weights quantized (the default) and as their fp32 copy (--weights float); every workload
runs each system in turn, --repeat times, so that a slow spell of a shared machine hits all
of them alike; the table has the best of each. On a machine others use, --wait-idle starts
each run only once the CPUs were mostly idle for a second (threads that share their cores
with another process wait at every barrier, ours and llama.cpp's alike).

Memory last: the resident set of a fresh process that loads the model and prefills 512
tokens (ours with 40 KV pages, 640 tokens; llama.cpp's llama-bench -p 512 -n 0), each
weights mode of ours and llama.cpp: ours at the end (VmRSS) and at its peak (VmHWM),
llama.cpp's peak (its ru_maxrss).

    bash bench/llama_server.sh                       # builds llama.cpp's tools into ../llama
    python bench/llama_cpp.py [--model FILE.gguf] [--threads 2] [--llama-dir ../llama]
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path, and bench/kernels.py would
# hide the kernels package from the engine.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

import torch  # noqa: E402

from symphony.engine.engine import Engine, default_model_dir  # noqa: E402
from symphony.engine.generate import generate  # noqa: E402
from symphony.engine.sampler import GREEDY  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPT, NEW, PREFILL = 32, 64, 512


def ours(engine: Engine, batch: int, prefill: bool, gen: torch.Generator) -> float:
    """tokens/s of one run of the workload."""
    vocab = engine.config.vocab_size
    if prefill:
        prompt = torch.randint(3, vocab, (1, PREFILL), generator=gen).tolist()
        t = time.perf_counter()
        generate(engine, prompt, GREEDY, 1, stop_ids=())
        return PREFILL / (time.perf_counter() - t)
    prompts = torch.randint(3, vocab, (batch, PROMPT), generator=gen).tolist()
    times = []
    for new in (NEW, 1):
        t = time.perf_counter()
        generate(engine, prompts, GREEDY, new, stop_ids=())
        times.append(time.perf_counter() - t)
    return batch * (NEW - 1) / (times[0] - times[1])


def llama(bin_dir: Path, model: Path, threads: int, batch: int, prefill: bool) -> float:
    """tokens/s of one run of the same workload in llama.cpp (its own timers)."""
    t = str(threads)
    if prefill:
        cmd = [bin_dir / "llama-bench", "-m", model, "-t", t, "-p", str(PREFILL), "-n", "0",
               "-r", "1", "-o", "jsonl"]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        return float(json.loads(out.splitlines()[-1])["avg_ts"])
    cmd = [bin_dir / "llama-batched-bench", "-m", model, "-t", t, "-tb", t, "-c",
           str(batch * (PROMPT + NEW) + 256), "-npp", str(PROMPT), "-ntg", str(NEW),
           "-npl", str(batch), "--output-format", "jsonl"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    lines = [x for x in (done.stdout + done.stderr).splitlines() if '"speed_tg"' in x]
    if not lines:
        raise RuntimeError(f"no result from {' '.join(map(str, cmd))}:\n{done.stdout}{done.stderr}")
    return float(json.loads(lines[-1][lines[-1].index("{"):])["speed_tg"])


RSS_SCRIPT = """
import sys, torch
from pathlib import Path
from symphony.engine.engine import Engine
from symphony.engine.generate import generate
from symphony.engine.sampler import GREEDY
torch.set_num_threads(int(sys.argv[3]))
engine = Engine(Path(sys.argv[1]), device="cpu", kv_pages=40, weights=sys.argv[2])
prompt = torch.randint(3, engine.config.vocab_size, (1, 512)).tolist()
generate(engine, prompt, GREEDY, 1, stop_ids=())
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print(int(status["VmRSS"].split()[0]) // 1024, int(status["VmHWM"].split()[0]) // 1024)
"""


def our_rss(model: Path, weights: str, threads: int) -> tuple[int, int]:
    """(resident MiB at the end, at the peak) of a process that loads `model` with `weights`
    and prefills 512 tokens."""
    out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(model), weights, str(threads)],
                         capture_output=True, text=True, check=True, cwd=ROOT).stdout
    end, peak = out.split()
    return int(end), int(peak)


def llama_rss(bin_dir: Path, model: Path, threads: int) -> int:
    """Peak resident MiB of llama-bench prefilling 512 tokens (this process's largest child
    so far: call it before any other child runs)."""
    subprocess.run([bin_dir / "llama-bench", "-m", model, "-t", str(threads), "-p",
                    str(PREFILL), "-n", "0", "-r", "1"], capture_output=True, check=True)
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss // 1024


def cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies of all CPUs so far."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return fields[3] + fields[4], sum(fields)


def wait_idle(fraction: float, timeout: float = 60.0) -> None:
    """Return once the CPUs were at least `fraction` idle over a second (or after timeout)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        idle, total = cpu_times()
        time.sleep(1.0)
        idle2, total2 = cpu_times()
        if (idle2 - idle) >= fraction * max(1, total2 - total):
            return


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=default_model_dir())
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-dir", type=Path, default=ROOT.parent / "llama")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--memory-only", action="store_true",
                    help="the resident memory table alone (it does not depend on the load)")
    ap.add_argument("--wait-idle", type=float, default=0.0, metavar="FRACTION",
                    help="start each run once the CPUs were this idle over a second (0.8)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    bin_dir = args.llama_dir / "build" / "bin"
    # First: ru_maxrss is the largest child's, and llama-bench must be the first child.
    memory = {"llama.cpp": (None, llama_rss(bin_dir, args.model, args.threads))}
    for w in ("quantized", "float"):
        memory[f"ours {w}"] = our_rss(args.model, w, args.threads)
    if args.memory_only:
        return print_memory(args.model, memory)
    engines = {w: Engine(args.model, device="cpu", kv_pages=512, weights=w)
               for w in ("quantized", "float")}
    gen = torch.Generator().manual_seed(0)
    workloads = [(f"decode batch {b}", int(b), False) for b in args.batches.split(",")]
    workloads.append((f"prefill {PREFILL}", 1, True))
    systems = {f"ours {w}": (lambda b, p, e=e: ours(e, b, p, gen)) for w, e in engines.items()}
    systems["llama.cpp"] = lambda b, p: llama(bin_dir, args.model, args.threads, b, p)
    for _, batch, prefill in workloads:  # warm-up: allocator, kernels' first builds
        for run in systems.values():
            run(batch, prefill)
    best = {(w, s): 0.0 for w, _, _ in workloads for s in systems}
    for _ in range(args.repeat):
        for name, batch, prefill in workloads:
            for system, run in systems.items():
                if args.wait_idle:
                    wait_idle(args.wait_idle)
                value = run(batch, prefill)
                print(f"# {name}, {system}: {value:.1f}", flush=True)
                best[name, system] = max(best[name, system], value)

    print(f"# {args.model.name}, {platform.machine()}, {args.threads} threads, best of "
          f"{args.repeat}, tokens/s")
    cols = list(systems)
    print(f"{'workload':<18}" + "".join(f"{c:>16}" for c in cols) + f"{'quantized/llama':>17}")
    for name, _, _ in workloads:
        row = [best[name, c] for c in cols]
        print(f"{name:<18}" + "".join(f"{v:>16.1f}" for v in row)
              + f"{row[0] / row[-1]:>16.2f}x")
    print_memory(args.model, memory)


def print_memory(model: Path, memory: dict[str, tuple[int | None, int]]) -> None:
    print(f"\n# {model.name}: resident memory, MiB, of a process that loads the model and "
          "prefills 512 tokens")
    print(f"{'':<18}{'at the end':>16}{'peak':>16}")
    for system, (end, peak) in memory.items():
        print(f"{system:<18}{'-' if end is None else end:>16}{peak:>16}")


if __name__ == "__main__":
    main()
