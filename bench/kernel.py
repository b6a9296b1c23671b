"""The kernel's costs against the in-process engine, in one run (issue 5).

1. syscall tax: per-token decode latency of a LIP calling pred once per token, against
   the in-process loop (`symphony.engine.generate.generate`) at batch 1; the LIP's preds
   go through the syscall rings (the client's default), as frames on the lifeline, and
   over gRPC, a row each. Every other benchmark's LIPs use the rings; the path benchmark's
   take --path-transport.
2. batching: aggregate decode tokens/s of N concurrent LIPs (separate OS processes,
   started, prefilled, then timed from a barrier), against `generate` at batch N.
3. fairness: token rates of two CPU-bound LIPs under contention, at equal nice and at
   nice 0 against nice 10 (CFS weights 1024 / 1.25**nice: about 9.3x). Contention comes
   from --token-budget (256-token preds, budget 256) or --max-seqs 1 (1-token preds);
   each LIP keeps 1 or 2 preds in flight (one file and thread each).
4. prompt cache: time to first token of a question after forking a saved document file,
   against prefilling the document and the question into a fresh file, on a random-weight
   Llama of --model's shape (a checkpoint directory's config.json or a GGUF file's
   metadata) with a context of twice --doc-len, made in a temp dir.
5. the pred path, this system's getpid(): preds/s of one kernel with 1, 32 (also as one
   asyncio process) and 128 decoding LIPs, against generate at the same batch, on a
   random-weight model of one layer and hidden 64, where a forward pass costs next to
   nothing; with the kernel's and the LIPs' CPU per pred. With --path-engine sleep:MS the
   kernel's engine is a simulated accelerator whose steps take MS (`symphony kernel
   --engine`): also the preds it delivered per step time against the ideal, N. Beside
   them, what explains the CPU figures: a bare ping-pong's round trip, the Python floor
   of the loop's work, the sync client's own CPU a pred with no wait, the kernel's own
   path warm in one process with nothing asleep, and what the same slice of Python costs
   right after its thread slept (a pred's CPU here is as much the wake-ups around it as
   its code).
6. one long prefill: time to the first token of a 512-token prompt, generate against one
   pred of a LIP, with the same token budget, on a random Llama of a matmul-heavy shape
   (or Llama-3.2-1B's), with the kernel's steps and engine time for the pred.
7. logit masks (issue 15): N decoding LIPs on one kernel whose preds carry a token
   bitmask (a grammar engine's, as pred's LogitControl takes it), against the same LIPs
   without, rounds interleaved; the mask allows every token, so the tokens must not change.

Each benchmark starts its own kernel (`symphony start`, stopped at the end). Runs of the
two sides are interleaved and repeated; best and median are printed with their ratio.
Figures go to bench/RESULTS.md by hand, with the machine.

    python bench/kernel.py [--only tax,batch,fair,cache,path,prefill,masked] [--model DIR] ...

The LIPs are this file run again with --lip (they import only the syscalls package).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import queue
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path, and bench/kvfs.py would hide
# the kvfs package from anything imported here.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

BENCHES = ("tax", "batch", "fair", "cache", "path", "prefill", "masked")
LIP_TIMEOUT = 300.0  # seconds a LIP may take to answer one command
FAIR_MAX_S = 240.0  # the longest fairness run


def prompt(seed: int, length: int, vocab: int) -> list[int]:
    """The same random prompt on both sides (ids 3.. skip the special tokens)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


# -- the LIP side: this file run with --lip ----------------------------------------------


def lip_main(args: argparse.Namespace) -> int:
    """A LIP driven over stdin/stdout: it answers 'prep' with 'ready' and 'go ...' with
    'done ...', so the parent can line many of them up behind one barrier."""
    from syscalls.client import Kernel
    from syscalls.convert import LogitControl

    k = Kernel.connect(args.socket, name=f"bench-{args.lip}",
                       lifeline_pred=args.transport != "grpc", rings=args.transport == "ring")
    if args.nice:
        k.nice(args.nice)
    vocab = k.model_info().vocab_size
    every_token = LogitControl(allowed=b"\xff" * (4 * -(-vocab // 32)))
    files = [k.open("", os.O_RDWR) for _ in range(args.inflight)]
    say(f"attached {k.pid}")
    tok: list[int] = []

    def kernel_pred_ms() -> tuple[int, float]:
        """Count and total ms of this process's Pred calls as the kernel timed them."""
        for line in k.procfs(f"{k.pid}/syscalls").splitlines():
            parts = line.split("\t")
            if parts[0] == "Pred":
                return int(parts[1]), float(parts[2])
        return 0, 0.0

    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "prep":  # decode: prefill the prompt, keep the sampled token
            f = files[0]
            f.truncate(0)
            (out,) = f.pred(prompt(args.seed, args.prompt_len, vocab))
            tok = [out.token]
            before = kernel_pred_ms()
            say("ready")
        elif cmd[0] == "go" and args.lip == "decode":
            f, control = files[0], every_token if cmd[1:] == ["masked"] else None
            start, cpu = time.monotonic(), time.process_time()
            for _ in range(args.tokens - 1):
                (out,) = f.pred([tok[-1]], control=control)
                tok.append(out.token)
            end, cpu = time.monotonic(), time.process_time() - cpu
            after = kernel_pred_ms()
            calls, ms = after[0] - before[0], after[1] - before[1]
            say(f"done {start} {end} {args.tokens - 1} {ms / max(calls, 1)} {cpu} "
                f"{','.join(map(str, tok))}")
        elif cmd[0] == "go":  # chunk or step: keep pred busy until the deadline
            deadline = time.monotonic() + float(cmd[1])
            counts = [0] * len(files)
            threads = [threading.Thread(target=busy, args=(args, f, vocab, deadline, counts, i))
                       for i, f in enumerate(files)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            say(f"done {sum(counts)}")
    k.close()
    return 0


def alip_main(args: argparse.Namespace) -> int:
    """The asyncio twin of the 'decode' LIP: args.sessions sessions in one process, or
    with args.one_session one session decoding as many files (the OpenAI server's shape)."""
    import asyncio

    from syscalls.aio import AsyncKernel

    async def main() -> None:
        async def connect(i: int) -> AsyncKernel:
            return await AsyncKernel.connect(args.socket, name=f"bench-aio-{i}",
                                             lifeline_pred=args.transport != "grpc",
                                             rings=args.transport == "ring")

        ks = ([await connect(0)] * args.sessions if args.one_session else
              [await connect(i) for i in range(args.sessions)])
        vocab = (await ks[0].model_info()).vocab_size
        files = [await k.open("", os.O_RDWR) for k in ks]
        say(f"attached {ks[0].pid}")
        toks: list[list[int]] = [[] for _ in ks]
        loop = asyncio.get_running_loop()

        async def prep(i: int) -> None:
            await files[i].truncate(0)
            (out,) = await files[i].pred(prompt(args.seed + i, args.prompt_len, vocab))
            toks[i] = [out.token]

        async def decode(i: int) -> float:
            for _ in range(args.tokens - 1):
                (out,) = await files[i].pred([toks[i][-1]])
                toks[i].append(out.token)
            return time.monotonic()

        while line := await loop.run_in_executor(None, sys.stdin.readline):
            if line.split()[0] == "prep":
                await asyncio.gather(*(prep(i) for i in range(len(ks))))
                say("ready")
            else:
                start, cpu = time.monotonic(), time.process_time()
                ends = await asyncio.gather(*(decode(i) for i in range(len(ks))))
                cpu = time.process_time() - cpu
                ids = ";".join(",".join(map(str, t)) for t in toks)
                say(f"done {start} {max(ends)} {len(ks) * (args.tokens - 1)} 0 {cpu} {ids}")
        for k in set(ks):
            await k.close()

    asyncio.run(main())
    return 0


def busy(args: argparse.Namespace, f, vocab: int, deadline: float, counts: list[int],
         i: int) -> None:
    """One stream of back-to-back preds: 'chunk' preds args.chunk tokens and truncates the
    file back; 'step' decodes one token a call, cutting the file back at args.chunk."""
    rng = random.Random(args.seed * 1000 + i)
    if args.lip == "chunk":
        while time.monotonic() < deadline:
            f.pred([rng.randrange(3, vocab) for _ in range(args.chunk)])
            f.truncate(0)
            counts[i] += args.chunk
        return
    base = prompt(args.seed + i, args.prompt_len, vocab)
    f.truncate(0)
    (out,) = f.pred(base)
    length = len(base)
    while time.monotonic() < deadline:
        if length >= args.chunk:
            f.truncate(len(base) - 1)
            (out,) = f.pred(base[-1:])
            length = len(base)
        (out,) = f.pred([out.token])
        length += 1
        counts[i] += 1


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


# -- the parent side ---------------------------------------------------------------------


class Lip:
    """A LIP process; a reader thread queues its lines so every wait has a timeout."""

    def __init__(self, sock: Path, mode: str, attach: bool = True, script: str = __file__,
                 **opts):
        """`script --lip MODE --socket SOCK --OPT VALUE...`: this file, or another bench's.
        attach: wait for its 'attached' line."""
        argv = [sys.executable, script, "--lip", mode, "--socket", str(sock)]
        for key, value in opts.items():
            argv += [f"--{key.replace('_', '-')}", str(value)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, bufsize=1)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        if attach:
            self.attached()

    def attached(self) -> None:
        """Wait until the LIP has attached."""
        self.pid = int(self.expect("attached")[0])

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def expect(self, word: str) -> list[str]:
        try:
            line = self.lines.get(timeout=LIP_TIMEOUT)
        except queue.Empty:
            raise RuntimeError(f"LIP {self.proc.pid}: no answer in {LIP_TIMEOUT:.0f} s") from None
        if line is None:
            raise RuntimeError(f"LIP {self.proc.pid} exited with status {self.proc.wait()}")
        parts = line.split()
        if parts[0] != word:
            raise RuntimeError(f"LIP {self.proc.pid}: expected {word!r}, got {line!r}")
        return parts[1:]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def spawn(sock: Path, mode: str, n: int, **opts) -> list[Lip]:
    """n LIPs of seeds 0 to n - 1, started together (one after another, 128 take minutes)."""
    lips = [Lip(sock, mode, attach=False, seed=i, **opts) for i in range(n)]
    for lip in lips:
        lip.attached()
    return lips


class KernelDaemon:
    """`symphony start` in a temporary directory; `symphony stop` on leaving."""

    pipeline = "on"  # every kernel's --pipeline (the command line's)

    def __init__(self, tmp: Path, name: str, flags: list[str], env: dict[str, str] | None = None):
        self.dir = tmp / name
        self.socket = self.dir / "k.sock"
        self.flags = ["--state-dir", str(self.dir / "state"), "--pipeline", self.pipeline,
                      *flags]
        self.env = {**os.environ, **(env or {})}

    @property
    def pid(self) -> int:
        from symphony.control import kernel_pid

        pid = kernel_pid(self.socket)
        if pid is None:
            raise RuntimeError(f"no kernel answers on {self.socket}")
        return pid

    def __enter__(self) -> KernelDaemon:
        self.dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "symphony.cli"]
        r = subprocess.run([*cmd, "start", "--socket", str(self.socket), *self.flags],
                           capture_output=True, text=True, env=self.env)
        if r.returncode != 0:
            raise RuntimeError(f"symphony start failed: {r.stderr.strip()}")
        return self

    def __exit__(self, *exc: object) -> None:
        subprocess.run([sys.executable, "-m", "symphony.cli", "stop", "--socket",
                        str(self.socket)], capture_output=True, text=True)


def stats(xs: list[float]) -> tuple[float, float]:
    return min(xs), statistics.median(xs)


def row(name: str, unit: str, ours: list[float], peer: list[float], lower_better: bool,
        target: str) -> None:
    """Best and median of each side; the ratio is ours/theirs in the target's sense."""
    best = min if lower_better else max
    ob, om, pb, pm = best(ours), statistics.median(ours), best(peer), statistics.median(peer)
    rb, rm = ob / pb, om / pm
    print(f"  {name:<34}{ob:>14.2f}{om:>10.2f}{pb:>14.2f}{pm:>10.2f}"
          f"{rb:>11.2f}x{rm:>7.2f}x  {unit}; target {target}")


def header(ours: str, peer: str) -> None:
    print(f"  {'':<34}{ours + ' best':>14}{'median':>10}{peer + ' best':>14}{'median':>10}"
          f"{'ratio best':>12}{'median':>8}")


def machine_line() -> str:
    import torch

    cpu, flags, mem = platform.processor() or platform.machine(), set(), 0
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
        mem = int(Path("/proc/meminfo").read_text().split()[1]) // 2**20
    except OSError:
        pass
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU only"
    return (f"# machine: {cpu}, {os.cpu_count()} cores, {isa}, {mem} GiB, {gpu}; "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
            f"{datetime.datetime.now().isoformat(timespec='seconds')}; load average "
            f"{os.getloadavg()[0]:.2f} (other work on the machine skews every figure)")


# -- 1 and 2: decode through the kernel against generate --------------------------------


def kernel_cpu_seconds(kernel_pid: int) -> float:
    """CPU seconds of the kernel and of its engine process (symphony/engine_process.py)."""
    from symphony.process import os_cpu_seconds

    try:
        children = Path(f"/proc/{kernel_pid}/task/{kernel_pid}/children").read_text().split()
    except OSError:
        children = []
    return os_cpu_seconds(kernel_pid) + sum(os_cpu_seconds(int(c)) for c in children)


def decode_round(lips: list[Lip], kernel_pid: int, go: str = "go"
                 ) -> tuple[float, int, list[float], list[list[int]], tuple[float, float]]:
    """Prefill every LIP, then time them all from one barrier: (seconds, tokens,
    kernel-side ms per pred of each, tokens of each, CPU seconds of the kernel and of the
    LIPs meanwhile). The LIPs time their own CPU: /proc counts in clock ticks, too coarse
    for a LIP's few milliseconds a round."""
    for lip in lips:
        lip.send("prep")
    for lip in lips:
        lip.expect("ready")
    kernel_cpu = kernel_cpu_seconds(kernel_pid)
    start = time.monotonic()
    for lip in lips:
        lip.send(go)
    ends, tokens, kernel_ms, outs, lip_cpu = [], 0, [], [], 0.0
    for lip in lips:
        _, end, n, ms, cpu, ids = lip.expect("done")
        ends.append(float(end))
        tokens += int(n)
        kernel_ms.append(float(ms))
        lip_cpu += float(cpu)
        outs += [[int(x) for x in one.split(",")] for one in ids.split(";")]
    return (max(ends) - start, tokens, kernel_ms, outs,
            (kernel_cpu_seconds(kernel_pid) - kernel_cpu, lip_cpu))


def in_process(engine, prompts: list[list[int]], new: int
               ) -> tuple[float, list[list[int]], float]:
    """generate's decode time for new - 1 tokens (N new minus 1 new: no prefill), its
    tokens, and the CPU seconds of that decode."""
    from symphony.engine.generate import generate
    from symphony.engine.sampler import GREEDY

    t, c = time.perf_counter(), time.process_time()
    out = generate(engine, prompts, GREEDY, new, stop_ids=())
    mid, cm = time.perf_counter(), time.process_time()
    generate(engine, prompts, GREEDY, 1, stop_ids=())
    end, ce = time.perf_counter(), time.process_time()
    return (mid - t) - (end - mid), out, (cm - c) - (ce - cm)


def bench_decode(args: argparse.Namespace, tmp: Path, engine, which: list[str]) -> None:
    vocab = engine.config.vocab_size
    flags = ["--kv-pages", str(args.kv_pages)]
    if args.model:
        flags += ["--model", args.model]
    # A second kernel with decoding ahead off shows what it buys, in the same run.
    env = {"OMP_NUM_THREADS": str(args.engine_threads)} if args.engine_threads else None
    with KernelDaemon(tmp, "decode", flags, env) as kd, \
            KernelDaemon(tmp, "decode-ahead-off", [*flags, "--decode-ahead", "off"],
                         env) as koff:
        opts = {"prompt_len": args.prompt_len, "tokens": args.tokens}
        if "tax" in which:
            print(f"\n## 1. syscall tax: decode at batch 1, {args.tokens} tokens after a "
                  f"{args.prompt_len}-token prompt, greedy; best/median of {args.repeat}")
            sides = {"ring": (kd, "ring"), "lifeline": (kd, "lifeline"), "grpc": (kd, "grpc"),
                     "ring, decode ahead off": (koff, "ring")}
            lips = {name: (Lip(kern.socket, "decode", seed=0, transport=t, **opts), kern.pid)
                    for name, (kern, t) in sides.items()}
            try:
                p = [prompt(0, args.prompt_len, vocab)]
                in_process(engine, p, args.tokens)  # warm-up of every side
                for lip, pid in lips.values():
                    decode_round([lip], pid)
                peer: list[float] = []
                peer_cpu: list[float] = []
                ours: dict[str, list[float]] = {name: [] for name in lips}
                kms: dict[str, list[float]] = {name: [] for name in lips}
                cpu: dict[str, list[float]] = {name: [] for name in lips}
                same = True
                for _ in range(args.repeat):
                    t, ref, c = in_process(engine, p, args.tokens)
                    peer.append(t / (args.tokens - 1) * 1e3)
                    peer_cpu.append(c / (args.tokens - 1) * 1e3)
                    for name, (lip, pid) in lips.items():
                        secs, n, kernel_ms, outs, c = decode_round([lip], pid)
                        ours[name].append(secs / n * 1e3)
                        kms[name].append(kernel_ms[0])
                        cpu[name].append((c[0] / n * 1e3, c[1] / n * 1e3))
                        same &= outs[0] == ref[0]
            finally:
                for lip, _ in lips.values():
                    lip.close()
            with kernel_client(kd.socket) as k:
                noop = []
                for _ in range(500):
                    t = time.perf_counter()
                    k.getpid()
                    noop.append((time.perf_counter() - t) * 1e3)
            header("LIP", "generate")
            for name in lips:
                row(f"per-token latency, pred on {name}", "ms/token", ours[name],
                    peer, True, "<= 1.10x")
            print(f"  a no-op syscall (getpid, gRPC) round trip: median "
                  f"{statistics.median(noop):.2f} ms, best {min(noop):.2f} ms")
            for name in lips:
                kc, lc = (statistics.median(c) for c in zip(*cpu[name], strict=True))
                print(f"  pred on {name}: as /proc/PID/syscalls times it, median "
                      f"{statistics.median(kms[name]):.2f} ms; CPU, median: kernel "
                      f"{kc:.2f} + LIP {lc:.2f} ms/token")
            print(f"  generate's CPU: median {statistics.median(peer_cpu):.2f} ms/token. "
                  f"Same tokens as generate: {same}")
        if "batch" in which:
            bench_batch(args, {"": kd, ", decode ahead off": koff}, engine, opts)


def bench_batch(args: argparse.Namespace, kernels: dict[str, KernelDaemon], engine,
                opts: dict) -> None:
    """kernels: the kernels the LIP processes run on, by the suffix their rows get; the
    asyncio LIP runs on the first."""
    n_lips, vocab = args.batch, engine.config.vocab_size
    modes = [m for m in args.batch_modes.split(",") if m]
    print(f"\n## 2. batching: {n_lips} LIPs x {args.tokens} tokens (timed from a barrier "
          f"after their prefill) against generate at batch {n_lips}; best/median of "
          f"{args.repeat}")
    groups: dict[str, tuple[list[Lip], KernelDaemon]] = {}
    first = next(iter(kernels.values()))
    try:
        if "procs" in modes:
            for suffix, kern in kernels.items():
                groups[f"{n_lips} LIP processes{suffix}"] = (
                    spawn(kern.socket, "decode", n_lips, **opts), kern)
        if "asyncio" in modes:
            groups[f"1 asyncio LIP, {n_lips} sessions"] = (
                [Lip(first.socket, "adecode", seed=0, sessions=n_lips, **opts)], first)
        p = [prompt(i, args.prompt_len, vocab) for i in range(n_lips)]
        in_process(engine, p, args.tokens)
        for lips, kern in groups.values():
            decode_round(lips, kern.pid)
        peer: list[float] = []
        peer_cpu: list[float] = []
        ours: dict[str, list[float]] = {name: [] for name in groups}
        seqs: dict[str, list[float]] = {name: [] for name in groups}
        cpu: dict[str, list[float]] = {name: [] for name in groups}
        same: dict[str, int] = {}
        clients = {id(kern): kernel_client(kern.socket) for _, kern in groups.values()}
        try:
            for _ in range(args.repeat):
                t, ref, c = in_process(engine, p, args.tokens)
                peer.append(n_lips * (args.tokens - 1) / t)
                peer_cpu.append(c / (n_lips * (args.tokens - 1)) * 1e3)
                for name, (lips, kern) in groups.items():
                    k = clients[id(kern)]
                    steps = sched(k)["steps"]
                    secs, n, _, outs, c = decode_round(lips, kern.pid)
                    ours[name].append(n / secs)
                    seqs[name].append(n / max(1.0, sched(k)["steps"] - steps))
                    cpu[name].append((c[0] / n * 1e3, c[1] / n * 1e3))
                    same[name] = sum(o == r for o, r in zip(outs, ref, strict=True))
        finally:
            for k in clients.values():
                k.close()
    finally:
        for lips, _ in groups.values():
            for lip in lips:
                lip.close()
    header("LIPs", "generate")
    for name in groups:
        row(f"{name}", "tokens/s", ours[name], peer, False, ">= 0.85x")
    cores, gen_rate = os.cpu_count() or 1, statistics.median(peer)
    print(f"  generate's CPU: median {statistics.median(peer_cpu):.3f} ms/token")
    for name in groups:
        # With every core busy the LIPs could go no faster than cores / CPU per token.
        kc, lc = (statistics.median(c) for c in zip(*cpu[name], strict=True))
        print(f"  {name}: {statistics.median(seqs[name]):.1f} sequences per kernel step "
              f"(median of rounds; generate: {n_lips}); sequences with generate's tokens: "
              f"{same[name]} of {n_lips}; CPU, median: kernel {kc:.3f} + LIPs {lc:.3f} "
              f"ms/token, so {cores} cores allow at most "
              f"{cores / (kc + lc) * 1e3 / gen_rate:.2f}x of generate's median")


def kernel_client(sock: Path):
    from syscalls.client import Kernel

    return Kernel.connect(sock, name="bench")


def sched(k) -> dict[str, float]:
    """/proc/sched's numeric fields."""
    from syscalls.convert import proc_fields

    out = {}
    for key, value in proc_fields(k.procfs("sched")).items():
        with contextlib.suppress(ValueError):
            out[key] = float(value)
    return out


# -- 3: fairness -------------------------------------------------------------------------


def fair_run(sock: Path, mode: str, nices: tuple[int, int], seconds: float, inflight: int,
             chunk: int, prompt_len: int) -> tuple[float, float, float]:
    """Two LIPs busy for `seconds`; their token rates over the middle 60% of the run, from
    the kernel's own per-process counts, and the kernel's steps a second meanwhile."""
    lips = []
    k = kernel_client(sock)
    try:
        for i, nice in enumerate(nices):
            lips.append(Lip(sock, mode, seed=i, nice=nice, inflight=inflight, chunk=chunk,
                            prompt_len=prompt_len))
        for lip in lips:
            lip.send(f"go {seconds}")
        time.sleep(seconds * 0.2)
        t0, c0, s0 = time.monotonic(), tokens_of(k, lips), sched(k)["steps"]
        time.sleep(seconds * 0.6)
        t1, c1, s1 = time.monotonic(), tokens_of(k, lips), sched(k)["steps"]
        for lip in lips:
            lip.expect("done")
    finally:
        k.close()
        for lip in lips:
            lip.close()
    a, b = ((y - x) / (t1 - t0) for x, y in zip(c0, c1, strict=True))
    return a, b, (s1 - s0) / (t1 - t0)


def tokens_of(k, lips: list[Lip]) -> list[int]:
    by_pid = {p.pid: p.tokens for p in k.ps()}
    return [by_pid[lip.pid] for lip in lips]


def bench_fair(args: argparse.Namespace, tmp: Path) -> None:
    weight = 1.25**10
    print(f"\n## 3. fairness: two busy LIPs, {args.fair_seconds:.0f} s each run or as long as "
          f"{args.fair_steps} steps take (the first run's step rate tells), rates over its "
          f"middle 60% (kernel's per-process token counts); nice 10 target {weight:.2f}x "
          f"(1024/1.25**nice)")
    settings = [
        ("chunk", ["--token-budget", str(args.chunk)],
         f"{args.chunk}-token preds, --token-budget {args.chunk}"),
        ("step", ["--max-seqs", "1"], "1-token decode preds, --max-seqs 1"),
    ]
    model = ["--model", args.model] if args.model else []
    print(f"  {'setting':<44}{'in flight':>10}{'nice':>8}{'A tok/s':>10}{'B tok/s':>10}"
          f"{'A/B':>8}{'steps':>7}  target")
    for mode, flags, label in settings:
        with KernelDaemon(tmp, f"fair-{mode}", [*model, "--kv-pages", "1024", *flags]) as kd:
            # A step is the unit the kernel shares: with 256-token preds on a model of 0.4 s a
            # step, 10 s held 15 steps and nice 10's one or two of them made the ratio 7x or
            # 15x. So a run whose window held fewer than --fair-steps is made again, long
            # enough at its step rate, and the setting's later runs as long (FAIR_MAX_S).
            seconds = args.fair_seconds
            for inflight in [int(x) for x in args.fair_inflight.split(",")]:
                for nices, target in (((0, 0), "within 10%"), ((0, 10), f"{weight:.2f}x")):
                    while True:
                        a, b, rate = fair_run(kd.socket, mode, nices, seconds, inflight,
                                              args.chunk, args.prompt_len)
                        steps = rate * seconds * 0.6
                        need = min(FAIR_MAX_S, args.fair_steps / max(rate, 1e-3) / 0.6)
                        if steps >= args.fair_steps or seconds >= need:
                            break
                        seconds = need
                    print(f"  {label:<44}{inflight:>10}{f'{nices[0]}/{nices[1]}':>8}"
                          f"{a:>10.1f}{b:>10.1f}{a / b:>7.2f}x{steps:>7.0f}  {target}")


# -- 4: prompt cache ---------------------------------------------------------------------


def random_model(out: Path, cfg: dict, dtype: str = "bfloat16") -> Path:
    """A random-weight Llama checkpoint of config `cfg` (LlamaConfig's keywords) in `out`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    return out


def long_context_model(tmp: Path, base: Path, context: int) -> Path:
    """A random-weight Llama of `base`'s shape with a longer context. `base` is a checkpoint
    directory (its config.json, and its tokenizer files copied) or a GGUF file (the shape
    the engine reads from its metadata; no tokenizer: the bench passes token ids)."""
    from symphony.engine.gguf_file import is_gguf
    from symphony.engine.loader import load_config

    if is_gguf(base):
        c = load_config(base)
        cfg = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                   intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
                   num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                   head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                   tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias,
                   bos_token_id=c.bos_token_id, eos_token_id=list(c.eos_token_ids))
    else:
        cfg = json.loads((base / "config.json").read_text())
        cfg.pop("architectures", None)
    cfg["max_position_embeddings"] = context
    out = random_model(tmp / f"random-{context}", cfg)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (base / name).exists():
            shutil.copy(base / name, out / name)
    return out


def bench_cache(args: argparse.Namespace, tmp: Path) -> None:
    from symphony.engine.engine import default_model_dir
    from symphony.engine.loader import load_config

    base = Path(args.model) if args.model else default_model_dir()
    context = args.doc_len * 2
    own = load_config(base).max_position_embeddings
    model = long_context_model(tmp, base, context)
    print(f"\n## 4. prompt cache: time to first token of a {args.question_len}-token question "
          f"after a {args.doc_len}-token document; best/median of {args.repeat}")
    print(f"  model: random weights, {base.name}'s shape with max_position_embeddings "
          f"{context} (its own: {own}), made in a temporary dir")
    from syscalls.client import Kernel

    with KernelDaemon(tmp, "cache", ["--model", str(model), "--kv-pages", "2048"]) as kd, \
            Kernel.connect(kd.socket, name="bench-cache") as k:
        vocab = k.model_info().vocab_size
        doc = prompt(1, args.doc_len, vocab)
        question = prompt(2, args.question_len, vocab)
        path = f"{k.home.rstrip('/')}/bench-doc.kv"
        with k.open(path, os.O_RDWR | os.O_CREAT) as f:
            f.pred(doc, no_outputs=True)
            f.fsync()

        def forked() -> int:
            with k.open(path) as saved, saved.fork() as f:
                return f.pred(question)[0].token

        def cold() -> int:
            with k.open("", os.O_RDWR) as f:
                return f.pred(doc + question)[0].token

        fns = [forked, cold]
        firsts = [fn() for fn in fns]  # warm-up
        times: list[list[float]] = [[], []]
        for _ in range(args.repeat):
            for i, fn in enumerate(fns):
                t = time.perf_counter()
                fn()
                times[i].append((time.perf_counter() - t) * 1e3)
        k.unlink(path)
    header("fork", "prefill")
    (fb, fm), (cb, cm) = stats(times[0]), stats(times[1])
    print(f"  {'time to first token':<34}{fb:>14.2f}{fm:>10.2f}{cb:>14.2f}{cm:>10.2f}"
          f"{cb / fb:>11.1f}x{cm / fm:>7.1f}x  ms (ratio prefill/fork); target >= 10x")
    print(f"  same first token both ways: {firsts[0] == firsts[1]}")


# -- 5: the pred path --------------------------------------------------------------------

# tests/checkpoints.py's SMALL shape with one layer: the forward pass is next to nothing, so
# what is measured is the path of a pred, this system's getpid().
TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=1,
            num_attention_heads=8, num_key_value_heads=2, bos_token_id=1, eos_token_id=2)


def bench_path(args: argparse.Namespace, tmp: Path) -> None:
    import torch

    from symphony.cli import parse_engine
    from symphony.engine.engine import Engine

    context = args.prompt_len + args.path_preds + 1
    model = random_model(tmp / "tiny", {**TINY, "max_position_embeddings": context}, "float32")
    # The same torch threads on both sides, one by default: this model's forward pass gains
    # nothing from more, and a busy machine stalls OpenMP's barriers for milliseconds.
    threads = torch.get_num_threads()
    torch.set_num_threads(args.path_threads)
    engine = Engine(model, kv_pages=args.kv_pages)
    counts = [int(n) for n in args.path_lips.split(",") if n]
    print(f"\n## 5. the pred path: preds/s of one kernel on a random model of one layer, "
          f"hidden 64, with N LIPs decoding ({args.path_preds} 1-token greedy preds a round "
          f"in all, after a {args.prompt_len}-token prompt each, timed from a barrier), "
          f"against generate at batch N; {args.path_threads} torch thread(s) each side; "
          f"best/median of {args.repeat}")
    groups = [(f"{n} LIP process{'es' if n > 1 else ''}", n, "decode", n, False)
              for n in counts]
    for shapes, what in ((args.path_asyncio, "sessions"),
                         (args.path_files, "files of one session")):
        for procs, sessions in (map(int, g.split("x")) for g in shapes.split(",") if g):
            groups.append((f"{procs} asyncio LIP{'s' if procs > 1 else ''}, {sessions} {what}"
                           f"{' each' if procs > 1 else ''}", procs * sessions, "adecode", procs,
                           what != "sessions"))
    results = []
    flags = ["--model", str(model), "--kv-pages", str(args.kv_pages),
             "--engine", args.path_engine]
    sleep_ms = parse_engine(args.path_engine)
    if sleep_ms is not None:
        print(f"# the kernel's engine: {args.path_engine}, a simulated accelerator (its tokens "
              f"are not generate's)")
    with KernelDaemon(tmp, "path", flags, {"OMP_NUM_THREADS": str(args.path_threads)}) as kd:
        for name, n, mode, procs, one_session in groups:
            started, tokens = time.monotonic(), args.path_preds // n + 1
            opts = {"prompt_len": args.prompt_len, "tokens": tokens,
                    "transport": args.path_transport}
            lips = (spawn(kd.socket, mode, n, **opts) if mode == "decode" else
                    [Lip(kd.socket, mode, seed=p * (n // procs), sessions=n // procs,
                         one_session=int(one_session), **opts) for p in range(procs)])
            try:
                p = [prompt(i, args.prompt_len, engine.config.vocab_size) for i in range(n)]
                in_process(engine, p, tokens)  # warm-up of both sides
                decode_round(lips, kd.pid)
                ours, peer, cpu, peer_cpu, same = [], [], [], [], 0
                for _ in range(args.repeat):
                    t, ref, c = in_process(engine, p, tokens)
                    peer.append(n * (tokens - 1) / t)
                    peer_cpu.append(c / (n * (tokens - 1)) * 1e6)
                    secs, preds, _, outs, (kc, lc) = decode_round(lips, kd.pid)
                    ours.append(preds / secs)
                    cpu.append((kc / preds * 1e6, lc / preds * 1e6))
                    same = sum(o == r for o, r in zip(outs, ref, strict=True))
                with kernel_client(kd.socket) as k:  # its last seconds: this group's rounds
                    figures = sched(k)
                    loop, engine_busy = figures["loop_cpu_us_per_pred"], figures["engine_busy"]
            finally:
                for lip in lips:
                    lip.close()
            results.append((name, n, ours, peer, cpu, peer_cpu, same, loop, engine_busy,
                            time.monotonic() - started))
    torch.set_num_threads(threads)
    header("LIPs", "generate")
    for name, _, ours, peer, *_ in results:
        row(name, "preds/s", ours, peer, False, "none set")
    print(f"  the floor: {pingpong_floor(tmp)}")
    print(f"  the Python floor: {python_floor()}")
    print(f"  the client's Python: {client_cost()}")
    print(f"  the loop's path warm: {warm_loop_cost()}")
    print(f"  this machine's wake-ups: {wake_cost()}")
    for name, n, ours, _, cpu, peer_cpu, same, loop, engine_busy, secs in results:
        kc, lc = (statistics.median(c) for c in zip(*cpu, strict=True))
        print(f"  {name}: CPU per pred, median: kernel {kc:.0f} (its loop thread {loop:.0f}, "
              f"/proc/sched) + LIP {lc:.0f} us (generate {statistics.median(peer_cpu):.0f} us); "
              f"sequences with generate's tokens: {same} of {n}; {secs:.0f} s")
        if sleep_ms is not None:  # at best every LIP gets its pred in every step: N per MS
            per_step = statistics.median(ours) * sleep_ms / 1e3
            print(f"    {args.path_engine}: {per_step:.1f} preds per {sleep_ms:g} ms step time, "
                  f"{per_step / n:.2f} of the ideal {n}; engine_busy {engine_busy:.2f}")
            # What these CPU costs a pred allow at most: the loop is one thread, and every
            # side shares the machine's cores. The loop's own figure is /proc/sched's, over
            # its last 10 s; the kernel's whole CPU a pred, over the rounds, bounds it too.
            step_us, cores, mine = sleep_ms * 1e3, os.cpu_count(), min(loop, kc)
            if mine > 0:  # 0: no step in /proc/sched's window (a run too short to say)
                print(f"    at these costs the loop thread allows at most "
                      f"{min(1.0, step_us / (n * mine)):.2f} of the ideal ({n} x {mine:.0f} us "
                      f"a step), the {cores} cores at most "
                      f"{min(1.0, cores * step_us / (n * (kc + lc))):.2f} ({n} x "
                      f"{kc + lc:.0f} us)")


def pingpong_floor(tmp: Path) -> str:
    """The floor under a pred's round trip when both sides sleep (bench/pingpong.c): two
    processes woken in turn by a futex, and by an eventfd as the rings' bells are, on the
    machine's CPUs as the scheduler places them and pinned to one CPU."""
    binary = tmp / "pingpong"
    built = subprocess.run([os.environ.get("CC", "cc"), "-O2", "-o", str(binary),
                            str(Path(__file__).with_name("pingpong.c"))],
                           capture_output=True, text=True)
    if built.returncode:
        return f"no floor: bench/pingpong.c did not build: {built.stderr.strip()[:200]}"
    parts = []
    for how in ("futex", "eventfd"):
        # taskset, not preexec_fn: subprocess's fork would run gRPC's at-fork handler in
        # this process, which has used channels, and that can hang; the binary's own fork
        # inherits the CPU mask, so both sides are on CPU 0.
        for pin, where in (([], "any CPUs"), (["taskset", "-c", "0"], "one CPU")):
            out = subprocess.run([*pin, str(binary), how, "20000"], capture_output=True,
                                 text=True, check=True)
            wall, cpu = (float(x) / 1e3 for x in out.stdout.split())
            parts.append(f"{how} on {where} {wall:.1f} us ({cpu:.1f} us of CPU)")
    return "a bare ping-pong between two processes, a round trip: " + ", ".join(parts)


def python_floor(preds: int = 20000) -> str:
    """What the kernel's loop would spend a pred with only the work no design avoids, in
    Python: a record copied out of a real ring, its PredRequest parsed (upb), the file
    looked up, the guess compared, the token appended, a PredReply built and serialized,
    posted to the completion ring, the bells read and written; one pred a drain (a process
    waking the loop alone) and 32 (a step's worth). The loop's figure above less this is
    its own structure's cost."""
    from syscalls import ring
    from syscalls import symphony_pb2 as pb

    kernel, process = ring_pair()
    files: dict[int, list[int]] = {fd: [] for fd in range(32)}
    payloads = [pb.PredRequest(fd=fd, tokens=[5]).SerializeToString() for fd in files]

    def drain() -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(kernel.kernel_bell)
        for _, call, payload in kernel.take():
            request = pb.PredRequest.FromString(payload)
            tokens = files[request.fd]
            if list(request.tokens) != [5] or request.HasField("sampler"):
                raise AssertionError("not the guess")
            tokens.append(request.tokens[0])
            reply = pb.PredReply(outputs=[pb.PredOutput(row=0, token=7, logprob=-0.5)])
            kernel.post(ring.REPLY, call, reply.SerializeToString())
        kernel.ring_process()
        os.eventfd_write(process.process_bell, 1)

    parts = []
    try:
        for batch in (1, 32):
            cpu = 0.0
            for start in range(0, preds, batch):
                for i in range(batch):
                    process.submit(ring.PRED, start + i, payloads[i], bell=False)
                t = time.thread_time()
                drain()
                cpu += time.thread_time() - t
                process.completions()
                for tokens in files.values():
                    tokens.clear()
            parts.append(f"{cpu / preds * 1e6:.1f} us of CPU a pred {batch} a drain")
    finally:
        process.close()
        kernel.close()
    return ", ".join(parts)


def ring_pair(kernel_bell: int | None = None) -> tuple:
    """A real pair of syscall rings in this process: the kernel's side and the process's
    (the kernel's bell `kernel_bell`, or the ring's own)."""
    from syscalls import ring

    kernel = ring.KernelRing(kernel_bell)
    process = ring.ProcessRing(ring.RingMemory(os.dup(kernel.memfd)), os.dup(kernel.kernel_bell),
                               os.dup(kernel.process_bell))
    return kernel, process


def client_cost(preds: int = 20000) -> str:
    """The sync client's CPU a pred with no wait in it: a one-token greedy pred written,
    sent through its RingLine over a real ring pair, and its reply read, the kernel's side
    answering the moment it is rung (its take and post counted too). The LIP's figure
    above less this is its sleeps and wake-ups."""
    import socket

    from syscalls import convert, wire
    from syscalls.ring_line import RingLine

    kernel, process = ring_pair()
    reply = convert.plain_reply([(0, 12345, -0.5)])

    def answer() -> None:
        for _, call, _ in kernel.take():
            kernel.post(wire.REPLY, call, reply)
        kernel.ring_process()

    process.ring_kernel = answer
    ours, theirs = socket.socketpair()
    line = RingLine(ours, "bench", process)
    try:
        best = float("inf")
        for _ in range(3):
            t = time.thread_time()
            for i in range(preds):
                request = convert.pred_request(3, [i % 1000], None, None, convert.GREEDY, False)
                convert.pred_outputs(line.call(request))
            best = min(best, (time.thread_time() - t) / preds * 1e6)
    finally:
        theirs.close()
        ours.close()
        process.close()
        kernel.close()
    return f"{best:.1f} us of CPU a pred, the kernel's side of the ring included (best of 3)"


def warm_loop_cost(processes: int = 32, steps: int = 200) -> str:
    """The kernel's own CPU a pred for decode loops in one process with nothing asleep:
    `processes` real `Hello`s, each on a real ring pair whose records this function writes
    as their LIPs would, the real scheduler (decoding ahead, pipelined) over a real kvfs, a
    step's samples made up instead of an engine. Counted: the bells' callbacks (drain, known
    pred, queue), planning, finishing (answers posted), the processes' bells. The loop's
    figures above less this are wake-ups and a shared machine's cold caches."""
    import asyncio
    from types import SimpleNamespace

    import torch

    from kvfs.fs import FileSystem
    from kvfs.pages import PageStore
    from kvfs.perm import Cred
    from kvfs.pool import KVPool, PageShape
    from symphony.kernel_bell import KernelBell
    from symphony.owed import Owed
    from symphony.process import Process
    from symphony.read_pause import ReadPause
    from symphony.scheduler import Scheduler
    from symphony.server import Front, Hello
    from symphony.step import StepResult
    from syscalls import convert, ring

    class OpenTransport:  # a lifeline that stays open, never written: answers go on rings
        def is_closing(self) -> bool:
            return False

        def write(self, data: bytes) -> None:
            raise AssertionError("a reply on the lifeline: the ring was full")

    async def run() -> float:
        config = SimpleNamespace(max_position_embeddings=4096, vocab_size=320)
        engine = SimpleNamespace(config=config, device=torch.device("cpu"),
                                 eos_ids=lambda: ())
        fs = FileSystem(PageStore(KVPool(PageShape(1, 1, 8, 16, torch.float32), 8192, 0,
                                         "cpu", 1), None, 0), fingerprint="bench")
        procs: list = []
        sched = Scheduler(engine, fs, lambda: procs, 4096, 256, True, pipeline=True)
        kernel = SimpleNamespace(engine=engine, sched=sched, owed=Owed())
        front, lips = Front(kernel), []
        for pid in range(1, processes + 1):
            proc = Process(pid, 0, Cred(1000 + pid, 1000 + pid), f"t{pid}")
            procs.append(proc)
            fd = proc.add_fd(fs.open(proc.cred, "", os.O_RDWR))
            hello = Hello(kernel, front)
            hello.proc, hello.debtor, hello.transport = proc, proc, OpenTransport()
            hello.reads = ReadPause(hello.transport)
            bell = KernelBell()  # the process's, as the kernel gives it (one a process)
            hello.ring, side = ring_pair(bell.fd)
            bell.rings[hello] = None
            side.sleeping(True)
            side.submit(ring.PRED, 1, convert.pred_request(fd, list(range(1, 33)), None, None,
                                                           convert.GREEDY, False), bell=False)
            hello.drain()  # the prompt, parsed and checked
            lips.append((hello, side, fd, bell))
        plans: list = []

        def plan() -> None:  # up to two steps in flight, as the pipelined kernel keeps
            while len(plans) < 2 and (step := sched.schedule()) is not None:
                plans.append(step)

        plan()
        cpu, preds, call = 0.0, 0, 2
        for n in range(steps):
            if n == steps // 5:  # the first fifth warms up
                cpu, preds = 0.0, 0
            done = plans.pop(0)
            samples = done.rows
            t = time.thread_time()
            sched.finish(done, StepResult([7 + n % 50] * samples, [-1.0] * samples,
                                          [[]] * samples, [[]] * samples, 0.005))
            await asyncio.sleep(0)  # the bells' callback
            cpu += time.thread_time() - t
            for _, side, fd, bell in lips:
                for _, _, reply in side.completions():
                    token = convert.pred_outputs(reply)[0].token
                    side.submit(ring.PRED, call, convert.pred_request(
                        fd, [token], None, None, convert.GREEDY, False))
                    call += 1
                    t = time.thread_time()
                    bell.rung()
                    cpu += time.thread_time() - t
                    preds += 1
            t = time.thread_time()
            plan()
            cpu += time.thread_time() - t
        for hello, side, _, bell in lips:
            side.close()
            hello.ring.close()
            os.close(bell.fd)
        return cpu / preds * 1e6

    return (f"{asyncio.run(run()):.1f} us of the kernel's CPU a pred, {processes} processes "
            "on rings decoding, in one process with nothing asleep and no engine")


def wake_cost(slices: int = 400) -> str:
    """The same slice of Python (a loop and a dict, some 10 us) timed warm, and right after
    its thread slept 1 and 5 ms: what waking costs the work that follows it on this machine
    (a virtual CPU that idled runs slowly for a while). Every LIP sleeps between its preds,
    and the loop between steps."""

    def work() -> int:
        total, names = 0, {}
        for i in range(300):
            total += i * i
        for i in range(50):
            names[i] = str(i)
        return total + len(names)

    for _ in range(1000):
        work()
    parts = []
    for pause in (0.0, 0.001, 0.005):
        cpu = 0.0
        for _ in range(slices):
            if pause:
                time.sleep(pause)
            t = time.thread_time()
            work()
            cpu += time.thread_time() - t
        parts.append(f"{cpu / slices * 1e6:.0f} us" + (f" after {pause * 1e3:g} ms asleep"
                                                     if pause else " warm"))
    return "a fixed slice of Python takes " + ", ".join(parts)


def bench_masked(args: argparse.Namespace, tmp: Path) -> None:
    n = args.batch
    print(f"\n## 7. logit masks: {n} LIPs x {args.tokens} tokens on one kernel, each pred with "
          f"a token bitmask against the same LIPs without; best/median of {args.repeat}")
    flags = ["--kv-pages", str(args.kv_pages), *(["--model", args.model] if args.model else [])]
    results = []
    # A masked pred is never computed ahead (its next mask is unknown), so the plain side
    # runs with decoding ahead on (the default) and off: the second isolates the mask's cost.
    for ahead in ("on", "off"):
        with KernelDaemon(tmp, f"masked-{ahead}", [*flags, "--decode-ahead", ahead]) as kd:
            lips = spawn(kd.socket, "decode", n, prompt_len=args.prompt_len, tokens=args.tokens)
            try:
                decode_round(lips, kd.pid, "go masked")  # warm-up
                plain, masked, cpu, same = [], [], [[], []], True
                for _ in range(args.repeat):
                    secs, preds, _, ref, (kc, _) = decode_round(lips, kd.pid)
                    plain.append(preds / secs)
                    cpu[0].append(kc / preds * 1e6)
                    secs, preds, _, outs, (kc, _) = decode_round(lips, kd.pid, "go masked")
                    masked.append(preds / secs)
                    cpu[1].append(kc / preds * 1e6)
                    same = same and outs == ref
            finally:
                for lip in lips:
                    lip.close()
        results.append((ahead, plain, masked, cpu, same))
    header("masked", "plain")
    for ahead, plain, masked, *_ in results:
        row(f"{n} LIPs, decoding ahead {ahead}", "tokens/s", masked, plain, False, ">= 0.9x")
    for ahead, _, _, cpu, same in results:
        print(f"  decoding ahead {ahead}: kernel CPU per pred, median: plain "
              f"{statistics.median(cpu[0]):.0f} us, masked {statistics.median(cpu[1]):.0f} us; "
              f"the same tokens as without the mask: {same}")


# -- 6: one long prefill ----------------------------------------------------------------

# Random Llamas for the prefill comparison: one still matmul-heavy that two cores prefill
# in about a second, and Llama-3.2-1B's shape (10 GB a side in fp32, weights packed twice).
PREFILL_SHAPES = {
    "mid": dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096,
                num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4),
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
               num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192}),
}


def bench_prefill(args: argparse.Namespace, tmp: Path) -> None:
    from symphony.engine.engine import Engine
    from symphony.engine.generate import generate
    from symphony.engine.sampler import GREEDY
    from syscalls.client import Kernel

    cfg = {**PREFILL_SHAPES[args.prefill_shape], "max_position_embeddings": 131072,
           "tie_word_embeddings": True, "rope_theta": 500000.0, "bos_token_id": 1,
           "eos_token_id": 2}
    model = random_model(tmp / f"prefill-{args.prefill_shape}", cfg)
    budget, n = args.prefill_budget, args.prefill_len
    print(f"\n## 6. one long prefill: a {n}-token prompt and its first token, generate "
          f"(prefill_budget {budget}) against one pred of a LIP (--token-budget {budget}), "
          f"random Llama of shape {args.prefill_shape}; best/median of {args.repeat}")
    engine = Engine(model, kv_pages=args.kv_pages)
    p = prompt(0, n, cfg["vocab_size"])
    flags = ["--model", str(model), "--kv-pages", str(args.kv_pages), "--token-budget",
             str(budget)]
    with KernelDaemon(tmp, "prefill", flags) as kd, Kernel.connect(kd.socket) as k:

        def in_process() -> float:
            t = time.perf_counter()
            generate(engine, [p], GREEDY, 1, stop_ids=(), prefill_budget=budget)
            return time.perf_counter() - t

        def lip() -> tuple[float, float, float]:
            """Seconds to the answer, seconds of engine steps charged, steps taken."""
            before = sched(k)["steps"], next(q for q in k.ps() if q.pid == k.pid)
            with k.open("", os.O_RDWR) as f:
                t = time.perf_counter()
                f.pred(p)
                secs = time.perf_counter() - t
            mine = next(q for q in k.ps() if q.pid == k.pid)
            return (secs, mine.accel_seconds - before[1].accel_seconds,
                    sched(k)["steps"] - before[0])

        first = in_process(), lip()[0]  # warm-up: the first forward of each shape
        ours, peer, engine_s, steps = [], [], [], []
        for _ in range(args.repeat):
            peer.append(in_process())
            secs, accel, taken = lip()
            ours.append(secs)
            engine_s.append(accel)
            steps.append(taken)
    header("LIP", "generate")
    row("time to first token", "s", ours, peer, True, "parity")
    print(f"  first calls: generate {first[0]:.2f} s, LIP {first[1]:.2f} s; the kernel's steps "
          f"a pred: {', '.join(f'{s:.0f}' for s in steps)}; of the LIP's median "
          f"{statistics.median(ours):.2f} s, engine steps {statistics.median(engine_s):.2f} s")


# -- main --------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(BENCHES), help="a subset of " + ",".join(BENCHES))
    ap.add_argument("--model", help="checkpoint (default: $SYMPHONY_MODEL, else the default "
                    "model, SmolLM2-135M-Instruct where installed; `make bench` sets the tiny "
                    "model, models/tiny)")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=128, help="decoded tokens per LIP")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32, help="concurrent LIPs for batching")
    ap.add_argument("--batch-modes", default="procs,asyncio",
                    help="procs: one process per LIP; asyncio: one process, a session each")
    ap.add_argument("--kv-pages", type=int, default=2048)
    ap.add_argument("--engine-threads", type=int,
                    help="tax and batching: torch threads of the kernel's engine and of "
                         "generate (default: torch's, one a core); 1 leaves the other "
                         "cores to the kernel's loop and the LIPs, as a GPU would")
    ap.add_argument("--fair-seconds", type=float, default=10.0,
                    help="fairness: the shortest run")
    ap.add_argument("--fair-steps", type=int, default=120,
                    help="fairness: steps a run's measured window holds at least (the runs "
                         "of a setting after its first last as long as they take)")
    ap.add_argument("--fair-inflight", default="1,2",
                    help="preds each fairness LIP keeps in flight (one file each)")
    ap.add_argument("--chunk", type=int, default=256,
                    help="fairness: tokens per pred and --token-budget")
    ap.add_argument("--doc-len", type=int, default=2048)
    ap.add_argument("--question-len", type=int, default=16)
    ap.add_argument("--path-asyncio", default="1x32",
                    help="asyncio LIPs of the path benchmark, PROCSxSESSIONS, comma-separated "
                         "(e.g. 1x32,4x64)")
    ap.add_argument("--path-files", default="",
                    help="asyncio LIPs of the path benchmark with one session each, decoding "
                         "FILES files (the OpenAI server's shape), PROCSxFILES, comma-separated")
    ap.add_argument("--path-lips", default="1,32,128",
                    help="the pred path: LIP counts (at 32, also one asyncio LIP)")
    ap.add_argument("--path-preds", type=int, default=4096,
                    help="the pred path: preds a round, shared by the LIPs")
    ap.add_argument("--path-threads", type=int, default=1,
                    help="the pred path: torch threads of the kernel and of generate")
    ap.add_argument("--path-engine", default="model",
                    help="the pred path: the kernel's --engine (sleep:MS: a simulated "
                    "accelerator whose steps take MS)")
    ap.add_argument("--pipeline", choices=["on", "off"], default="on",
                    help="every kernel's --pipeline (default on, the kernel's)")
    ap.add_argument("--prefill-shape", choices=sorted(PREFILL_SHAPES), default="mid",
                    help="the long prefill: the random model's shape (1b: 20 GB in all)")
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--prefill-budget", type=int, default=512,
                    help="the long prefill: --token-budget, and generate's prefill_budget")
    # The LIP side (internal).
    ap.add_argument("--lip", choices=["decode", "adecode", "chunk", "step"], help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--nice", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--inflight", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--sessions", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--one-session", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--path-transport", choices=["ring", "lifeline", "grpc"], default="ring",
                    help="how the path benchmark's LIPs send their preds")
    ap.add_argument("--transport", choices=["ring", "lifeline", "grpc"], default="ring",
                    help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.lip == "adecode":
        return alip_main(args)
    if args.lip:
        return lip_main(args)

    which = [w for w in args.only.split(",") if w]
    bad = set(which) - set(BENCHES)
    if bad:
        ap.error(f"--only: unknown {', '.join(sorted(bad))}")
    if args.engine_threads is not None and args.engine_threads < 1:
        ap.error(f"--engine-threads: {args.engine_threads} is not a positive count")
    from symphony.cli import parse_engine  # not before: a LIP imports only syscalls

    try:
        parse_engine(args.path_engine)
    except ValueError as e:
        ap.error(f"--path-engine: {e}")
    if args.engine_threads:
        import torch

        torch.set_num_threads(args.engine_threads)
    KernelDaemon.pipeline = args.pipeline
    print(machine_line())
    print(f"# every kernel: --pipeline {args.pipeline}")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="symphony-bench-") as tmp:
        if "tax" in which or "batch" in which:
            from symphony.engine.engine import Engine

            engine = Engine(args.model, kv_pages=args.kv_pages)
            print(f"# model {engine.model_dir} ({engine.dtype}); in-process peer: generate on "
                  f"an Engine in this process; LIPs: separate processes, sync client")
            bench_decode(args, Path(tmp), engine, which)
            del engine
        if "fair" in which:
            bench_fair(args, Path(tmp))
        if "cache" in which:
            bench_cache(args, Path(tmp))
        if "path" in which:
            bench_path(args, Path(tmp))
        if "prefill" in which:
            bench_prefill(args, Path(tmp))
        if "masked" in which:
            bench_masked(args, Path(tmp))
    print(f"\n# {time.monotonic() - started:.0f} s in all; load average now "
          f"{os.getloadavg()[0]:.2f} (this run's own load counts in it)")
    return 0


if __name__ == "__main__":
    # A SIGTERM (timeout, pkill) unwinds as an exit: each kernel this started is stopped on
    # the way out, not left running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
