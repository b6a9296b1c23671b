"""Attention sinks (lips/sink.py) against recomputing the window from scratch (issue 16).

A long held-out text (the tiny model's evaluation slice, data/corpus/eval.txt; see
models/README.md) is streamed through the sink: the first --sinks tokens kept, a window of
the latest tokens slid --slide at a time with punch and shift, --slide tokens per pred.
The reference recomputes, for a sample of positions (every --every-th scored token), the
same context from scratch: a fresh file, the sinks and the window the sink held for that
token prefilled at positions 0.., and one pred scoring the token. Its perplexity is what
the sink's would be without StreamingLLM's approximation (the moved entries' deeper layers
were computed next to tokens since evicted). Printed: perplexity of both on the sampled
positions, the sink's over the whole text, window attention without sinks and plain
scoring in disjoint context-long windows for scale; time per scored token of both (best
and median over the runs); pages held by the sink's file over time; and greedy decoding
through the sink for --decode contexts against plain decoding in one file (as far as its
context goes), ms per token.

    python bench/sink.py [--tokens 10240] [--every 97] [--runs 3] [--decode 2] [--model DIR]

The sink runs as the LIP would (its Sink class, one process, the kernel a daemon started
for the run with `symphony start`).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path, and bench/kvfs.py would hide
# the kvfs package; the project root makes bench.kernel and lips.sink importable.
ROOT = Path(__file__).resolve().parents[1]
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]
sys.path[:0] = [str(ROOT), str(ROOT / "models")]

from bench.kernel import KernelDaemon, machine_line  # noqa: E402
from lips.sink import Sink  # noqa: E402
from syscalls.client import Kernel  # noqa: E402
from syscalls.context import Context  # noqa: E402
from syscalls.convert import LogitControl  # noqa: E402


class Watched(Sink):
    """A sink that records the pages its file holds each time it looks."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pages: list[tuple[int, int]] = []  # (tokens fed, pages held)

    def note(self) -> None:
        super().note()
        self.pages.append((self.fed, self.file.stat().pages))


def heldout_ids(k: Kernel, data: Path, n: int) -> list[int]:
    """The first n tokens of the evaluation slice (documents as <|bos|>...<|eos|>)."""
    corpus = data / "corpus" / "eval.txt"
    if not corpus.exists():
        from prepare_corpus import prepare

        prepare(data)
    text = corpus.read_text(encoding="utf-8")[: 12 * n]  # about 3.7 characters a token
    ids = k.tokenize(text)
    if len(ids) < n:
        raise SystemExit(f"{corpus}: only {len(ids)} tokens, fewer than --tokens {n}")
    return ids[:n]


def stream(k: Kernel, ids: list[int], sinks: int, window: int, slide: int, context: int
           ) -> tuple[list[float], list[int], Watched, float]:
    sink = Watched(k.open(), sinks, window, slide, context)
    with sink.file:
        start = time.perf_counter()
        logprobs, starts = sink.score(ids)
        seconds = time.perf_counter() - start
    return logprobs, starts, sink, seconds


def recompute(k: Kernel, ids: list[int], sinks: int, start: int, t: int) -> float:
    """log p(ids[t + 1]) given the sinks and ids[start:t + 1], computed in a fresh file."""
    context = ids[:min(sinks, t + 1)] + ids[max(start, sinks):t + 1]
    with k.open() as f:
        return f.pred(context, control=LogitControl(score=[ids[t + 1]]))[0].scores[0]


def plain_windows(k: Kernel, ids: list[int], context: int) -> list[float]:
    """Disjoint context-long windows, each scored from position 0 in its own file (as
    models/eval_default.py scores the slice): what the model does within its context."""
    logprobs = []
    for a in range(0, len(ids) - 1, context - 1):  # overlapping by one: each token once
        chunk = ids[a:a + context]
        with k.open() as f:
            outs = f.pred(chunk, outputs=range(len(chunk) - 1), score_next=True)
        logprobs += [o.next_logprob for o in outs]
    return logprobs


def decode_ms(k: Kernel, prompt: list[int], n: int, sink: Sink | None) -> float:
    """ms per greedy token: through the sink, or in a plain file (n must fit its context)."""
    start = time.perf_counter()
    if sink is None:
        with Context(k) as ctx:
            ctx.fill(prompt)
            got = len(list(ctx.generate(n, stop=())))
    else:
        with sink.file:
            got = len(list(sink.generate(prompt, n)))
    assert got == n
    return 1e3 * (time.perf_counter() - start) / n


def ppl(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny"),
                    help="checkpoint (default: models/tiny, the 5.5M test model "
                    "bench/RESULTS.md's figures were taken on)")
    ap.add_argument("--device", choices=["cpu", "cuda"], help="the kernel's (default: its own)")
    ap.add_argument("--data", type=Path, default=ROOT / "data", help="corpus cache")
    ap.add_argument("--tokens", type=int, default=10240, help="held-out tokens streamed")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, help="default: context - sinks")
    ap.add_argument("--slide", type=int, default=64)
    ap.add_argument("--every", type=int, default=97, help="reference: every N-th position")
    ap.add_argument("--runs", type=int, default=3, help="timed sink runs")
    ap.add_argument("--decode", type=int, default=2, help="contexts of greedy decoding timed")
    args = ap.parse_args()
    print(machine_line())
    flags = [f for f, v in (("--model", args.model), ("--device", args.device)) if v
             for f in (f, v)]
    with tempfile.TemporaryDirectory(prefix="symphony-bench-") as tmp, \
            KernelDaemon(Path(tmp), "sink", flags) as kernel, \
            Kernel.connect(kernel.socket, name="bench-sink") as k:
        info = k.model_info()
        context = info.context_length
        window = args.window or context - args.sinks
        ids = heldout_ids(k, args.data, args.tokens)
        print(f"# model {info.name} ({info.dtype}), context {context}, page {info.page_size}; "
              f"{len(ids)} held-out tokens ({len(ids) / context:.1f} contexts) of "
              f"{args.data / 'corpus' / 'eval.txt'}; sinks {args.sinks}, window {window}, "
              f"slide {args.slide} (tokens per pred)")

        runs = [stream(k, ids, args.sinks, window, args.slide, context)
                for _ in range(args.runs)]
        logprobs, starts, sink, _ = runs[0]
        sink_ms = [1e3 * r[3] / len(r[0]) for r in runs]
        sampled = list(range(args.every - 1, len(logprobs), args.every))
        ref_ms, ref = [], []
        for t in sampled:
            start = time.perf_counter()
            ref.append(recompute(k, ids, args.sinks, starts[t], t))
            ref_ms.append(1e3 * (time.perf_counter() - start))
        no_sinks, *_ = stream(k, ids, 0, window, args.slide, context)
        plain = plain_windows(k, ids, context)

        mine = [logprobs[t] for t in sampled]
        gap = [abs(a - b) for a, b in zip(mine, ref, strict=True)]
        print(f"\n  perplexity on {len(sampled)} sampled positions (every {args.every}-th):")
        print(f"    sink (punch + shift)              {ppl(mine):10.3f}")
        print(f"    recomputed window (reference)     {ppl(ref):10.3f}"
              f"   ratio {ppl(mine) / ppl(ref):.3f}x;"
              f" |logprob gap| mean {statistics.mean(gap):.4f}, max {max(gap):.4f} nats")
        print(f"  perplexity on all {len(logprobs)} scored tokens:")
        print(f"    sink                              {ppl(logprobs):10.3f}")
        print(f"    window, no sinks (--sinks 0)      {ppl(no_sinks):10.3f}")
        label = f"disjoint {context}-token windows"
        print(f"    {label:<34}{ppl(plain):10.3f}"
              f"   (no sliding; each window's first tokens see little context)")
        print(f"\n  {'ms per scored token':<36}{'best':>10}{'median':>10}")
        label = f"sink ({args.runs} runs of the text)"
        print(f"    {label:<32}{min(sink_ms):10.3f}{statistics.median(sink_ms):10.3f}")
        label = f"reference ({len(ref_ms)} positions)"
        print(f"    {label:<32}{min(ref_ms):10.3f}{statistics.median(ref_ms):10.3f}")
        best, median = min(ref_ms) / min(sink_ms), statistics.median(ref_ms) / statistics.median(
            sink_ms)
        print(f"    ratio reference / sink              {best:9.1f}x{median:9.1f}x")
        pages = [p for _, p in sink.pages]
        step = max(1, len(sink.pages) // 8)
        over_time = ", ".join(f"{fed}:{p}" for fed, p in sink.pages[::step])
        prompt = ids[:16]
        plain_ms, gen_ms = [], []
        for _ in range(args.runs):  # interleaved
            plain_ms.append(decode_ms(k, prompt, context - len(prompt), None))
            gen_ms.append(decode_ms(k, prompt, args.decode * context, Watched(
                k.open(), args.sinks, window, args.slide, context)))
        print(f"\n  {'ms per greedy token':<36}{'best':>10}{'median':>10}")
        label = f"sink, {args.decode * context} tokens"
        print(f"    {label:<32}{min(gen_ms):10.3f}{statistics.median(gen_ms):10.3f}")
        label = f"plain file, {context - len(prompt)} tokens"
        print(f"    {label:<32}{min(plain_ms):10.3f}{statistics.median(plain_ms):10.3f}"
              f"   (all its context holds)")
        print(f"    ratio sink / plain                  {min(gen_ms) / min(plain_ms):9.2f}x"
              f"{statistics.median(gen_ms) / statistics.median(plain_ms):9.2f}x")
        print(f"\n  pages held by the sink's file: max {max(pages)}, at the end {pages[-1]} "
              f"(the sinks and window need {-(-(args.sinks + window) // info.page_size)}); "
              f"entries max {sink.max_entries}; {sink.slides} slides, {sink.compactions} "
              f"compactions; over time (tokens fed: pages) {over_time}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
