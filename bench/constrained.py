"""Constrained decoding (lips/constrained.py) against unconstrained decoding (issue 16).

N LIPs (separate processes; 1 and 32 by default) on one kernel serving --model (default:
the tiny model, models/tiny) each prefill a prompt, then decode --tokens tokens each, timed
from one barrier:
- constrained: lips/constrained.py's decode loop, llguidance's token bitmask in every pred
  (a JSON Schema for a small record; when an output is complete, the grammar starts again
  in the same file, so every LIP decodes exactly --tokens tokens);
- fast-forward: the same with --fast-forward (tokens the grammar forces go in with the
  next pred, unsampled: fewer preds per token);
- plain: the same loop with no mask, as lips/complete.py decodes.
Greedy, rounds of the two sides interleaved; best and median of --repeat, and the ratio
constrained/plain in tokens/s (target >= 0.8x). A masked pred is never computed ahead (its
next mask is unknown; docs/architecture.md, decoding ahead), so the kernel runs with
decoding ahead on (the default) and off: off isolates the mask's own cost. The LIPs time
each token's work: in the grammar engine (mask, commit) and waiting in pred.

    python bench/constrained.py [--batches 1,32] [--tokens 128] [--repeat 3] [--ahead on,off]

The LIPs are this file run again with --lip (they import only syscalls and lips).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, this file's folder comes first on sys.path (bench/kvfs.py would hide
# the kvfs package); the project root is where `bench` and `lips` are found.
sys.path = [str(ROOT)] + [p for p in sys.path
                          if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

from bench.kernel import KernelDaemon, Lip, header, machine_line, row  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}
PROMPT = "A customer record as JSON:\n"
SIDES = ("constrained", "fast-forward", "plain")


# -- the LIP side -----------------------------------------------------------------------


def lip_main(args: argparse.Namespace) -> int:
    """Commands on stdin: `prep` (a fresh file, the prompt prefilled; answers `ready`),
    `go constrained|fast-forward|plain` (decode --tokens tokens; answers
    `done END TOKENS PREDS MATCHER_S PRED_S CPU_S`)."""
    from lips import constrained
    from syscalls.client import Kernel
    from syscalls.context import Context

    with Kernel.connect(args.socket, name="bench-constrained") as k:
        info = k.model_info()
        grammar = constrained.schema_grammar(SCHEMA)
        matchers = {}
        for side, model_split in (("constrained", False), ("fast-forward", True)):
            tokenizer = constrained.grammar_tokenizer(k.vocab(), info,
                                                      k.tokenize if model_split else None)
            matchers[side] = constrained.matcher(tokenizer, grammar)
        prompt = k.tokenize(PROMPT, add_special=True)
        print("attached", k.pid, flush=True)
        ctx = None
        for line in sys.stdin:
            cmd = line.split()
            if cmd[0] == "prep":
                if ctx is not None:
                    ctx.close()
                f = k.open()
                f.pred(prompt[:-1], no_outputs=True)  # the first decode pred samples after it
                ctx = Context(k, f, pending=prompt[-1:], stop=())
                print("ready", flush=True)
                continue
            cpu, tokens, preds, matcher_s, pred_s = time.process_time(), 0, 0, 0.0, 0.0
            if cmd[1] in matchers:
                m, tokens = matchers[cmd[1]], 0
                while tokens < args.tokens:
                    m.reset()
                    out = constrained.decode(ctx, m, args.tokens - tokens,
                                             {"temperature": 0.0}, info.eos_ids,
                                             fast_forward=cmd[1] == "fast-forward")
                    # An EOS that ended the output was a pred too: it is pending in ctx.
                    tokens += len(out.tokens) + (ctx.pending[-1] in info.eos_ids)
                    preds += out.preds
                    matcher_s += out.matcher_s
                    pred_s += out.pred_s
            else:
                for _ in range(args.tokens):
                    t = time.perf_counter()
                    ctx.step(temperature=0.0)
                    pred_s += time.perf_counter() - t
                tokens = preds = args.tokens
            print("done", time.monotonic(), tokens, preds, matcher_s, pred_s,
                  time.process_time() - cpu, flush=True)
    return 0


# -- the parent side --------------------------------------------------------------------


def decode_round(lips: list[Lip], side: str) -> tuple[float, float, float, float, float]:
    """Prefill all, then decode from one barrier: (tokens/s, preds per token, and per
    token: seconds in the grammar engine, waiting in pred, and LIP CPU)."""
    for lip in lips:
        lip.send("prep")
    for lip in lips:
        lip.expect("ready")
    start = time.monotonic()
    for lip in lips:
        lip.send(f"go {side}")
    end, tokens, preds, matcher_s, pred_s, cpu = start, 0, 0, 0.0, 0.0, 0.0
    for lip in lips:
        e, n, p, ms, ps, c = lip.expect("done")
        end, tokens, preds = max(end, float(e)), tokens + int(n), preds + int(p)
        matcher_s, pred_s, cpu = matcher_s + float(ms), pred_s + float(ps), cpu + float(c)
    return (tokens / (end - start), preds / tokens, matcher_s / tokens, pred_s / tokens,
            cpu / tokens)


def bench(args: argparse.Namespace, tmp: Path, ahead: str, batch: int) -> dict:

    flags = ["--kv-pages", str(args.kv_pages), "--decode-ahead", ahead,
             "--model", args.model]
    with KernelDaemon(tmp, f"ahead-{ahead}-{batch}", flags) as kd:
        lips = [Lip(kd.socket, "decode", attach=False, script=__file__, tokens=args.tokens)
                for _ in range(batch)]
        try:
            for lip in lips:
                lip.expect("attached")
            rounds: dict[str, list[tuple]] = {side: [] for side in SIDES}
            for side in rounds:
                decode_round(lips, side)  # warm-up
            for _ in range(args.repeat):
                for side in rounds:
                    rounds[side].append(decode_round(lips, side))
        finally:
            for lip in lips:
                lip.close()
    return rounds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "models" / "tiny"),
                    help="checkpoint (default: models/tiny, the 5.5M test model "
                    "bench/RESULTS.md's figures were taken on)")
    ap.add_argument("--batches", default="1,32", help="LIP counts")
    ap.add_argument("--tokens", type=int, default=128, help="decoded tokens per LIP a round")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ahead", default="on,off", help="the kernel's --decode-ahead settings")
    ap.add_argument("--kv-pages", type=int, default=2048)
    ap.add_argument("--lip", choices=["decode"], help=argparse.SUPPRESS)
    ap.add_argument("--socket", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.lip:
        return lip_main(args)


    print(machine_line())
    print(f"# model {args.model}; {args.tokens} greedy tokens per LIP "
          f"a round; schema {json.dumps(SCHEMA, separators=(',', ':'))}")
    started = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="symphony-bench-") as tmp:
        for ahead in args.ahead.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                results.append((ahead, batch, bench(args, Path(tmp), ahead, batch)))
    print(f"\n## constrained against plain decode: best/median of {args.repeat} rounds")
    header("constrained", "plain")
    for side in SIDES[:2]:
        for ahead, batch, rounds in results:
            row(f"{side}, {batch} LIPs, ahead {ahead}", "tokens/s",
                [r[0] for r in rounds[side]], [r[0] for r in rounds["plain"]], False, ">= 0.8x")
    print("\n## per output token, in the LIPs (medians): preds, grammar engine (mask, commit,"
          " forced tokens), waiting in pred, LIP CPU")
    for ahead, batch, rounds in results:
        for side in SIDES:
            med = lambda i: statistics.median(r[i] for r in rounds[side])  # noqa: E731,B023
            print(f"  {batch:>3} LIPs, ahead {ahead:<3} {side:<12}: {med(1):.2f} preds, "
                  f"matcher {med(2) * 1e6:6.1f} us, pred {med(3) * 1e6:9.1f} us, "
                  f"CPU {med(4) * 1e6:7.1f} us")
    print(f"\n# {time.monotonic() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
