"""Symphony's OpenAI-compatible server against llama.cpp's, in one run (issue 17).

Ours: `symphony serve` (lips/openai_server.py) on a kernel of --model (default: the default
model, SmolLM2-135M-Instruct's GGUF file where installed; float32 activations on a CPU),
both started here. The peer: llama.cpp's `llama-server` (C++, continuous batching, its
prompt cache on as by default) on the same GGUF file, or for the tiny model (models/tiny)
its conversion to GGUF f32, with as many slots as the largest concurrency, each of
--context tokens (default: the model's context, at most 2048). bench/llama_server.sh builds
it from PyPI's sdist and converts the tiny model (out of CI).

Both compute with --threads threads (llama-server's -t and -tb; the kernel's
OMP_NUM_THREADS, which torch and our C kernels follow), one fewer than the cores by
default: both meet at spinning barriers many times a step, and when every core is taken
(the client and our server process need CPU too) one thread is often descheduled while the
other spins. On 2 cores, 2 threads gave llama-server a tenth of 1 thread's throughput at 32
streams, and our kernel's steps went from 3 to about 265 ms under other load.

Both get the same client (the `openai` package's AsyncOpenAI, a new connection a request)
and the same requests: streamed chat completions, greedy, a fixed max_tokens and
`ignore_eos` (a vLLM extra both accept), so every answer has the same length. A first
request without ignore_eos shows whether both give the same greedy answer and prompt length
(on a quantized file llama.cpp rounds the activations to 8 bits, and may answer otherwise).
Prompts (--prompts): for the tiny model, the chat prompts of its held-out evaluation slice
(data/corpus/eval.txt, models/README.md; fetched if missing), system prompt and question;
for any other, bench/chat_prompts.jsonl (a JSON list of messages a line), with the
repository's docs as the prefix section's documents. Successive runs take successive
prompts, the same ones on both sides.

Sections (--only):
- concurrent: N streaming clients (--concurrency), each sending its next request as soon as
  its last answer is done, max(--min-requests, 2N) requests a level;
- poisson: open-loop arrivals at each of --rates requests/s (exponential gaps, seeded: both
  servers see the same schedule), --poisson-requests a rate;
- prefix: a shared system prompt (the first --system-tokens tokens of an evaluation-slice
  library page: prompts close to the model's 1024-token context) before varied short
  questions (a page of docs/ for a --prompts file), --prefix-clients clients; TTFT of ours
  with its prefix cache against ours with
  `--prefix-cache-pages 0` (a second `symphony serve` on the same kernel), and against
  llama.cpp. Two requests with the system prompt warm each side first.

Per run: throughput (output tokens over the run's wall time, first request sent to last
answer done), TTFT (request sent to the first chunk with text), TPOT (a request's first to
last chunk over its tokens after the first) and ITL (every gap between chunks with text; a
chunk may carry several tokens, so its p50 can be near 0) at p50 and p99. Each side gets a
warm-up before the first run; then the sides take turns, one loaded at a time, in an order
that flips every repeat (--repeat). Best and median over repeats are printed with the ratio
ours / llama.cpp (lower is better for the latencies). Failed requests are counted, printed
with the end of their server's log, and left out of the figures. The client shares the
machine with the servers.

    bash bench/llama_server.sh        # once: builds llama-server and the GGUF
    python bench/serve.py [--model models/tiny] [--only concurrent,poisson,prefix] ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import openai

# Run as a script, this file's folder comes first on sys.path, and bench/kvfs.py would hide
# the kvfs package; the project root makes bench.kernel importable.
ROOT = Path(__file__).resolve().parents[1]
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]
sys.path[:0] = [str(ROOT), str(ROOT / "models")]

from bench.kernel import KernelDaemon, header, machine_line, row  # noqa: E402
from symphony.engine.engine import SHIPPED_MODEL, default_model_dir  # noqa: E402
from symphony.engine.gguf_file import is_gguf  # noqa: E402
from syscalls.client import Kernel  # noqa: E402

SECTIONS = ("concurrent", "poisson", "prefix")
OURS, PEER = "ours", "llama.cpp"
LABELS = {PEER: "llama"}  # in column headers, which are 14 characters wide
START_TIMEOUT = 300.0  # seconds a server may take to come up
CHAT_PROMPTS = ROOT / "bench" / "chat_prompts.jsonl"


# -- the servers -------------------------------------------------------------------------


class OurServer:
    """`symphony serve` on a running kernel; SIGTERM on leaving (it must exit 0)."""

    def __init__(self, sock: Path, log: Path, flags: list[str]):
        self.cmd = [sys.executable, "-m", "symphony.cli", "serve", "--socket", str(sock),
                    "--port", "0", *flags]
        self.log = log
        self.url = ""

    def __enter__(self) -> OurServer:
        with self.log.open("w") as err:
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        for line in self.proc.stdout:  # the one line it prints once it accepts connections
            m = re.match(r"symphony serve: listening on (http://\S+)", line)
            if m:
                self.url = m.group(1)
                return self
        self.proc.wait()
        raise RuntimeError(f"{' '.join(self.cmd)} exited {self.proc.returncode}:\n"
                           f"{self.log.read_text()[-2000:]}")

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGTERM)
        if self.proc.wait(timeout=60) != 0:
            print(f"# warning: symphony serve exited {self.proc.returncode} on SIGTERM")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama-server on the GGUF: `slots` slots of `context` tokens each, continuous
    batching, its prompt cache on (its defaults); ready when /health answers 200."""

    def __init__(self, binary: Path, gguf: Path, slots: int, context: int, threads: int,
                 log: Path, flags: list[str]):
        self.port = free_port()
        self.cmd = [str(binary), "-m", str(gguf), "--jinja", "-np", str(slots),
                    "-c", str(slots * context), "--cont-batching", "-t", str(threads),
                    "-tb", str(threads), "--host", "127.0.0.1", "--port", str(self.port), *flags]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log

    def __enter__(self) -> LlamaServer:
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:  # refused while it starts, 503 while it loads the model
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"{' '.join(self.cmd)} did not come up:\n"
                           f"{self.log.read_text()[-2000:]}")

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


# -- the workload ------------------------------------------------------------------------


Messages = list[dict[str, str]]


def eval_chats(data: Path) -> tuple[list[Messages], list[str]]:
    """The evaluation slice's chat prompts (system if any, and user; no answer) and its
    library pages' texts (titled "`module` --- ..."), in file order."""
    corpus = data / "corpus" / "eval.txt"
    if not corpus.exists():
        from prepare_corpus import prepare

        prepare(data)
    chats, docs = [], []
    for doc in corpus.read_text(encoding="utf-8").split("<|bos|>"):
        turns = re.findall(r"<\|(system|user)\|>\n(.*?)<\|eos\|>", doc, re.S)
        if turns:
            chats.append([{"role": role, "content": text} for role, text in turns])
        elif re.match(r"`[\w.]+` ---", doc):
            docs.append(doc.split("<|eos|>")[0])
    return chats, docs


def file_chats(path: Path) -> tuple[list[Messages], list[str]]:
    """The chats of a JSONL file (a list of messages a line), and the repository's docs."""
    chats = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return chats, [f.read_text() for f in sorted((ROOT / "docs").glob("*.md"))]


def system_prompt(k: Kernel, docs: list[str], tokens: int) -> str:
    """The first `tokens` tokens of the first document that long, as text."""
    for doc in docs:
        ids = k.tokenize(doc[: 8 * tokens])
        if len(ids) >= tokens:
            return k.detokenize(ids[:tokens])
    raise SystemExit(f"no document of {tokens} tokens for the shared system prompt")


class Prompts:
    """Successive chat prompts; `take` gives the next n (cycling), the same on both sides
    when each side's run starts from the same offset."""

    def __init__(self, chats: list[Messages]):
        self.chats, self.next = chats, 0

    def take(self, n: int) -> list[Messages]:
        out = [self.chats[(self.next + i) % len(self.chats)] for i in range(n)]
        self.next += n
        return out


# -- the client --------------------------------------------------------------------------


@dataclass
class Answer:
    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival times of chunks with text
    done: float = 0.0
    tokens: int = 0
    prompt_tokens: int = 0
    cached: int = 0
    text: str = ""
    error: str = ""  # why the request failed (the server's error, or the connection's)


@dataclass
class Side:
    """A server as the client sees it."""

    name: str
    url: str
    log: Path  # the server's
    model: str = ""

    def __post_init__(self) -> None:
        # A new connection a request: llama-server dropped about one in eight requests
        # sent at once on the kept-alive connection of a streamed answer just done
        # ("Server disconnected without sending a response"); on loopback a connection
        # costs well under a millisecond, the same on both sides.
        self.client = openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="none",
                                         max_retries=0, timeout=600.0,
                                         default_headers={"Connection": "close"})

    async def ask(self, messages: Messages, max_tokens: int, ignore_eos: bool = True
                  ) -> Answer:
        if not self.model:
            self.model = (await self.client.models.list()).data[0].id
        a, parts = Answer(sent=time.perf_counter()), []
        try:
            stream = await self.client.chat.completions.create(
                model=self.model, messages=messages, max_tokens=max_tokens, temperature=0,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": ignore_eos})
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices and chunk.choices[0].delta.content:
                    a.chunks.append(now)
                    parts.append(chunk.choices[0].delta.content)
                if chunk.usage:
                    u = chunk.usage
                    a.tokens, a.prompt_tokens = u.completion_tokens, u.prompt_tokens
                    a.cached = (u.prompt_tokens_details.cached_tokens or 0
                                if u.prompt_tokens_details else 0)
        except openai.APIError as e:  # counted, and left out of the figures
            a.error = f"{type(e).__name__}: {e}"
        a.done, a.text = time.perf_counter(), "".join(parts)
        return a


@dataclass
class Figures:
    """One run of one side."""

    throughput: float  # output tokens/s
    ttft: list[float]  # ms, one a request
    tpot: list[float]  # ms, one a request: first to last chunk over the tokens after the first
    itl: list[float]  # ms, every gap between chunks with text
    tokens: float  # output tokens a request, mean
    chunks: float  # chunks with text a request, mean (a chunk may carry several tokens)
    cached: float  # prompt tokens from a cache a request, mean
    errors: list[str]  # of the requests that failed

    @classmethod
    def of(cls, every: list[Answer]) -> Figures:
        answers = [a for a in every if not a.error] or [Answer(sent=0.0, done=1.0)]
        wall = max(a.done for a in answers) - min(a.sent for a in answers)
        tokens, n = sum(a.tokens for a in answers), len(answers)
        return cls(tokens / wall,
                   [(a.chunks[0] - a.sent) * 1e3 for a in answers if a.chunks],
                   [(a.chunks[-1] - a.chunks[0]) * 1e3 / (a.tokens - 1)
                    for a in answers if a.chunks and a.tokens > 1],
                   [g * 1e3 for a in answers for g in np.diff(a.chunks)],
                   tokens / n, sum(len(a.chunks) for a in answers) / n,
                   sum(a.cached for a in answers) / n, [a.error for a in every if a.error])


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


async def closed_loop(side: Side, prompts: list[Messages], clients: int,
                      max_tokens: int) -> list[Answer]:
    """`clients` clients, each sending the next prompt as soon as its last answer is done."""
    queue = list(reversed(prompts))
    answers: list[Answer] = []

    async def client() -> None:
        while queue:
            answers.append(await side.ask(queue.pop(), max_tokens))

    await asyncio.gather(*(client() for _ in range(clients)))
    return answers


async def open_loop(side: Side, prompts: list[Messages], gaps: list[float],
                    max_tokens: int) -> list[Answer]:
    """Prompt i sent at the sum of the first i+1 gaps (seconds), whatever is in flight."""
    start, at, tasks = time.perf_counter(), 0.0, []
    for p, gap in zip(prompts, gaps, strict=True):
        at += gap
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        tasks.append(asyncio.create_task(side.ask(p, max_tokens)))
    return list(await asyncio.gather(*tasks))


# -- reporting ---------------------------------------------------------------------------


METRICS: list[tuple[str, str, bool, Callable[[Figures], float]]] = [
    ("throughput", "tok/s", False, lambda f: f.throughput),
    ("TTFT p50", "ms", True, lambda f: pct(f.ttft, 50)),
    ("TTFT p99", "ms", True, lambda f: pct(f.ttft, 99)),
    ("TPOT p50", "ms", True, lambda f: pct(f.tpot, 50)),
    ("TPOT p99", "ms", True, lambda f: pct(f.tpot, 99)),
    ("ITL p50", "ms", True, lambda f: pct(f.itl, 50)),
    ("ITL p99", "ms", True, lambda f: pct(f.itl, 99)),
]


def report(label: str, runs: dict[str, list[Figures]], targets: dict[str, str] | None = None,
           metrics=METRICS, sides: tuple[str, str] = (OURS, PEER)) -> None:
    """Rows of `label`: best and median over repeats of each metric, and the ratios."""
    a, b = sides
    for name, unit, lower, fn in metrics:
        if a in runs and b in runs:
            row(f"{label} {name}", unit, [fn(f) for f in runs[a]], [fn(f) for f in runs[b]],
                lower, (targets or {}).get(name, "-"))
        else:
            for side, figs in runs.items():
                xs = sorted(fn(f) for f in figs)
                print(f"  {label + ' ' + name:<34}{side:>14}{xs[0 if lower else -1]:>10.2f}"
                      f"{float(np.median(xs)):>10.2f}  {unit}")


def failures(runs: dict[str, list[Figures]], sides: list[Side]) -> None:
    """Requests that failed, with the end of their server's log."""
    for side in sides:
        errors = [e for f in runs[side.name] for e in f.errors]
        if errors:
            print(f"  # {side.name}: {len(errors)} requests FAILED (left out above); {errors[0]}")
            for line in side.log.read_text(errors="replace").splitlines()[-8:]:
                print(f"  #   {line}")


def lengths_line(runs: dict[str, list[Figures]], want: int) -> str:
    return "; ".join(f"{s} {np.mean([f.tokens for f in fs]):.1f} tokens in "
                     f"{np.mean([f.chunks for f in fs]):.1f} chunks a request"
                     for s, fs in runs.items()) + f" (asked {want}, ignore_eos)"


# -- the sections ------------------------------------------------------------------------


async def interleaved(sides: list[Side], rep: int,
                      run: Callable[[Side], Awaitable[list[Answer]]],
                      runs: dict[str, list[Figures]]) -> None:
    """One run of each side, in an order that flips every repeat."""
    for side in sides if rep % 2 == 0 else reversed(sides):
        runs.setdefault(side.name, []).append(Figures.of(await run(side)))


async def bench_concurrent(args: argparse.Namespace, sides: list[Side], prompts: Prompts
                           ) -> None:
    print(f"\n## {'concurrent streaming clients':<32}   (max_tokens {args.max_tokens})")
    if len(sides) == 2:
        header(*[LABELS.get(s.name, s.name) for s in sides])
    for n in args.concurrency:
        runs: dict[str, list[Figures]] = {}
        for rep in range(args.repeat):
            batch = prompts.take(max(args.min_requests, 2 * n))
            await interleaved(sides, rep, lambda s, b=batch, n=n: closed_loop(
                s, b, n, args.max_tokens), runs)
        targets = {"throughput": ">= 1.0x", "TTFT p50": "<= 1.0x"} if n == 32 else None
        report(f"N={n}", runs, targets)
        failures(runs, sides)
        print(f"  # {lengths_line(runs, args.max_tokens)}")


async def bench_poisson(args: argparse.Namespace, sides: list[Side], prompts: Prompts) -> None:
    print(f"\n## {'Poisson arrivals':<32}   ({args.poisson_requests} requests a rate, "
          f"max_tokens {args.max_tokens})")
    if len(sides) == 2:
        header(*[LABELS.get(s.name, s.name) for s in sides])
    rng = random.Random(args.seed)
    for rate in args.rates:
        runs: dict[str, list[Figures]] = {}
        for rep in range(args.repeat):
            batch = prompts.take(args.poisson_requests)
            gaps = [rng.expovariate(rate) for _ in batch]
            await interleaved(sides, rep, lambda s, b=batch, g=gaps: open_loop(
                s, b, g, args.max_tokens), runs)
        report(f"{rate:g}/s", runs)
        failures(runs, sides)


NO_CACHE = "no cache"  # ours with --prefix-cache-pages 0


async def bench_prefix(args: argparse.Namespace, sides: list[Side], prompts: Prompts,
                       system: str) -> None:
    print(f"\n## {'shared system prompt':<32}   ({args.prefix_questions} questions a run, "
          f"{args.prefix_clients} client(s), max_tokens {args.prefix_max_tokens})")
    questions = [[m for m in chat if m["role"] == "user"][0]["content"]
                 for chat in prompts.chats]
    with_system = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
                   for q in questions]
    shared = Prompts(with_system)
    for side in sides:  # the system prompt into each cache, on questions not timed
        for warm in with_system[-2:]:
            await side.ask(warm, args.prefix_max_tokens)
    runs: dict[str, list[Figures]] = {}
    for rep in range(args.repeat):
        batch = shared.take(args.prefix_questions)
        await interleaved(sides, rep, lambda s, b=batch: closed_loop(
            s, b, args.prefix_clients, args.prefix_max_tokens), runs)
    ttft = METRICS[1:3]
    for a, b, targets in ((OURS, NO_CACHE, {"TTFT p50": "<= 0.20x"}), (OURS, PEER, None)):
        if a in runs and b in runs:
            header(a, LABELS.get(b, b))
            report("prefix", runs, targets, ttft, (a, b))
    if len(runs) == 1:
        report("prefix", runs, None, ttft)
    print("  # cached prompt tokens a request (usage): " + "; ".join(
        f"{name} {np.mean([f.cached for f in figs]):.0f}" for name, figs in runs.items()))
    failures(runs, sides)


async def check(sides: list[Side], chat: Messages, max_tokens: int) -> None:
    """The same greedy answer and prompt length from every side (the same model). Without
    ignore_eos: llama.cpp's masks the EOS ids out, ours only does not stop at them."""
    answers = [await s.ask(chat, max_tokens, ignore_eos=False) for s in sides]
    for s, a in zip(sides, answers, strict=True):
        print(f"# {s.name}: {a.prompt_tokens} prompt tokens, {a.tokens} out: {a.text[:60]!r}")
    same = len({a.text for a in answers}) == 1
    print(f"# greedy answers {'agree' if same else 'DIFFER'} (up to EOS or {max_tokens} tokens)")


# -- main --------------------------------------------------------------------------------


def counts(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def rates(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


async def run_all(args: argparse.Namespace, sides: list[Side], no_cache: Side | None,
                  prompts: Prompts, system: str) -> None:
    await check(sides, prompts.chats[0], 64)
    for s in sides:  # warm-up, not timed
        await closed_loop(s, prompts.chats[:4], 4, 8)
    if "concurrent" in args.only:
        await bench_concurrent(args, sides, prompts)
    if "poisson" in args.only:
        await bench_poisson(args, sides, prompts)
    if "prefix" in args.only:
        trio = [s for s in sides if s.name == OURS] + ([no_cache] if no_cache else []) + [
            s for s in sides if s.name == PEER]
        await bench_prefix(args, trio, prompts, system)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=default_model_dir(),
                    help="a GGUF file both serve, or models/tiny (default: %(default)s)")
    ap.add_argument("--prompts", type=Path, default=None,
                    help="chats, a JSON list of messages a line (default: the tiny model's "
                    f"evaluation slice for it, else {CHAT_PROMPTS.relative_to(ROOT)})")
    ap.add_argument("--context", type=int, default=2048,
                    help="llama-server's tokens a slot, at most the model's context")
    ap.add_argument("--only", type=lambda t: t.split(","), default=list(SECTIONS),
                    help="a subset of " + ",".join(SECTIONS))
    ap.add_argument("--sides", type=lambda t: t.split(","), default=[OURS, PEER],
                    help=f"{OURS},{PEER} (one alone: no ratios)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=counts, default=[1, 8, 32])
    ap.add_argument("--min-requests", type=int, default=16,
                    help="concurrent: requests a level, at least (and at least 2N)")
    ap.add_argument("--rates", type=rates, default=[2.0, 8.0, 32.0], help="requests/s")
    ap.add_argument("--poisson-requests", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=900)
    ap.add_argument("--prefix-questions", type=int, default=16)
    ap.add_argument("--prefix-clients", type=int, default=1)
    ap.add_argument("--prefix-max-tokens", type=int, default=16)
    ap.add_argument("--llama-dir", type=Path, default=ROOT.parent / "llama",
                    help="bench/llama_server.sh's LLAMA_DIR")
    ap.add_argument("--threads", type=int, default=max(1, os.cpu_count() - 1),
                    help="compute threads of both servers (default: one fewer than the cores)")
    ap.add_argument("--kernel-flags", default="", help="more flags for `symphony start`")
    ap.add_argument("--peer-flags", default="", help="more flags for llama-server")
    ap.add_argument("--data", type=Path, default=ROOT / "data", help="corpus cache")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    bad = (set(args.only) - set(SECTIONS)) | (set(args.sides) - {OURS, PEER})
    if bad:
        ap.error(f"unknown {', '.join(sorted(bad))}")
    tiny = args.model.resolve() == SHIPPED_MODEL
    if not (tiny or is_gguf(args.model)):
        ap.error(f"--model {args.model}: llama-server needs a GGUF file (or models/tiny, which "
                 "bench/llama_server.sh converts)")
    binary = args.llama_dir / "build/bin/llama-server"
    gguf = args.llama_dir / "tiny-f32.gguf" if tiny else args.model
    if PEER in args.sides and not (binary.exists() and gguf.exists()):
        ap.error(f"no {binary} or {gguf}: run bench/llama_server.sh first")

    print(machine_line())
    started = time.monotonic()
    if args.prompts is None and tiny:
        chats, docs = eval_chats(args.data)
    else:
        chats, docs = file_chats(args.prompts or CHAT_PROMPTS)
    slots = max([*args.concurrency, args.prefix_clients, 1])
    with tempfile.TemporaryDirectory(prefix="symphony-bench-") as tmp, \
            KernelDaemon(Path(tmp), "kernel", ["--model", str(args.model),
                                               *args.kernel_flags.split()],
                         {"OMP_NUM_THREADS": str(args.threads)}) as kd:
        with Kernel.connect(kd.socket) as k:
            info = k.model_info()
            system = system_prompt(k, docs, args.system_tokens)
            longest = max(len(k.tokenize(messages=[{"role": "system", "content": system},
                                                    {"role": "user", "content": c[-1]["content"]}],
                                         add_generation_prompt=True)) for c in chats)
        context = min(args.context, info.context_length)
        if longest + args.prefix_max_tokens > context:
            ap.error(f"prefix: {longest} prompt tokens + {args.prefix_max_tokens} > context "
                     f"{context}: lower --system-tokens")
        print(f"# model {args.model} (peer: {gguf}), context {info.context_length} ({context} "
              f"a llama-server slot); {len(chats)} chat prompts; shared system prompt "
              f"{args.system_tokens} tokens (prompts up to {longest}); {args.threads} compute "
              f"thread(s) a server")
        with contextlib.ExitStack() as stack:
            sides, no_cache = [], None
            if OURS in args.sides:
                ours = stack.enter_context(OurServer(kd.socket, Path(tmp) / "serve.log", []))
                sides.append(Side(OURS, ours.url, ours.log))
                print(f"# {OURS}: {' '.join(ours.cmd)} -> {ours.url}")
                if "prefix" in args.only:
                    nc = stack.enter_context(OurServer(kd.socket, Path(tmp) / "serve0.log",
                                                       ["--prefix-cache-pages", "0"]))
                    no_cache = Side(NO_CACHE, nc.url, nc.log)
            if PEER in args.sides:
                peer = stack.enter_context(LlamaServer(binary, gguf, slots, context,
                                                       args.threads, Path(tmp) / "llama.log",
                                                       args.peer_flags.split()))
                sides.append(Side(PEER, peer.url, peer.log))
                print(f"# {PEER}: {' '.join(peer.cmd)}")
            asyncio.run(run_all(args, sides, no_cache, Prompts(chats), system))
    print(f"\n# {time.monotonic() - started:.0f} s in all; load average now "
          f"{os.getloadavg()[0]:.2f} (this run's own load counts in it)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
