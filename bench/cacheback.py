"""Cacheback (lips/cacheback.py) against plain decoding, beside transformers' n-gram
speculation against its plain generate (issue 16).

Prompts: the first --prompt-tokens tokens of --prompts documents spread evenly over the
tiny model's held-out evaluation slice (data/corpus/eval.txt, models/README.md; fetched
if missing). Each prompt is decoded greedily for --new-tokens tokens four ways:

- plain: one pred per token through the kernel (Context.generate, the kernel's default
  flags, decoding ahead on);
- cacheback: lips/cacheback.py's decode through the same kernel, the LIP's defaults;
- transformers: `model.generate` on the same checkpoint (a Llama, fp32, as the kernel runs
  it on the CPU), plain and with `prompt_lookup_num_tokens=--lookup-tokens`.

Times include each prompt's prefill; tokens/s is the round's new tokens over its seconds.
The rounds (--rounds) interleave the sides; best and median over rounds are printed with
the ratios. Tokens per pred (per forward, for transformers) say how much each draft saved.
An output is degenerate repetition when its last 32 tokens repeat with a period of at most
8 (the tiny model loops, which flatters any n-gram method): the figures are given for all
prompts and for the others alone.

    python bench/cacheback.py [--prompts 16] [--new-tokens 128] [--rounds 2] [--model DIR]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path, and bench/kvfs.py would hide
# the kvfs package; the project root makes bench.kernel and lips.cacheback importable.
ROOT = Path(__file__).resolve().parents[1]
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]
sys.path[:0] = [str(ROOT), str(ROOT / "models")]

from bench.kernel import KernelDaemon, header, machine_line, row  # noqa: E402
from lips import cacheback  # noqa: E402
from syscalls.client import Kernel  # noqa: E402
from syscalls.context import Context  # noqa: E402

TAIL, PERIOD = 32, 8


def degenerate(out: list[int]) -> bool:
    """The last 32 tokens repeat with a period of at most 8."""
    tail = out[-TAIL:]
    return len(tail) == TAIL and any(
        all(tail[i] == tail[i - p] for i in range(p, TAIL)) for p in range(1, PERIOD + 1))


def heldout_prompts(k: Kernel, data: Path, n: int, length: int) -> list[list[int]]:
    """The first `length` tokens of n documents spread over the evaluation slice (documents
    long enough only), each from its <|bos|>."""
    corpus = data / "corpus" / "eval.txt"
    if not corpus.exists():
        from prepare_corpus import prepare

        prepare(data)
    docs = [d.split("<|eos|>")[0] for d in corpus.read_text(encoding="utf-8").split("<|bos|>")]
    prompts = []
    for d in docs:
        ids = k.tokenize(d[: 8 * length], add_special=True)
        if len(ids) >= length:
            prompts.append(ids[:length])
    if len(prompts) < n:
        raise SystemExit(f"{corpus}: only {len(prompts)} documents of {length} tokens")
    step = len(prompts) / n
    return [prompts[int(i * step)] for i in range(n)]


@dataclass
class Side:
    """One way of decoding: per round, per prompt, (tokens, seconds); and its outputs."""

    name: str
    runs: list[list[tuple[int, float]]] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # per prompt: preds (forwards), round 1

    def per_step(self, keep: list[bool]) -> float:
        """New tokens per pred (forward pass) over the prompts kept, first round."""
        tokens = sum(len(o) for o, k in zip(self.outputs, keep, strict=True) if k)
        return tokens / max(1, sum(s for s, k in zip(self.steps, keep, strict=True) if k))

    def rates(self, keep: list[bool]) -> list[float]:
        """Tokens/s of each round over the prompts kept."""
        return [sum(t for (t, _), k in zip(r, keep, strict=True) if k)
                / sum(s for (_, s), k in zip(r, keep, strict=True) if k) for r in self.runs]


def timed(fn) -> tuple[list[int], float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def ours(k: Kernel, prompts: list[list[int]], new: int, rounds: int) -> tuple[Side, Side]:
    eos = k.model_info().eos_ids
    plain, spec = Side("plain"), Side("cacheback")

    def one_by_one(ids: list[int]) -> list[int]:
        with Context(k, stop=eos) as ctx:
            ctx.fill(ids)
            return list(ctx.generate(new))

    for r in range(rounds):
        for side in (plain, spec):
            side.runs.append([])
        for i, ids in enumerate(prompts):
            stats = cacheback.Stats()

            def speculate(ids=ids, stats=stats) -> list[int]:
                with k.open() as f:
                    return list(cacheback.decode(f, ids, new, {}, cacheback.Config(), stats,
                                                 stop=eos))

            order = [(plain, one_by_one), (spec, speculate)]
            for side, fn in order if (r + i) % 2 == 0 else order[::-1]:
                out, seconds = timed(lambda fn=fn, ids=ids: fn(ids))
                side.runs[-1].append((len(out), seconds))
                if r == 0:
                    side.outputs.append(out)
                    side.steps.append(stats.preds if side is spec else len(out))
    return plain, spec


def theirs(model_dir: Path, prompts: list[list[int]], new: int, rounds: int,
           lookup: int) -> tuple[Side, Side]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    calls = [0]
    model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    plain, spec = Side("generate"), Side(f"prompt lookup {lookup}")
    options = {plain.name: {}, spec.name: {"prompt_lookup_num_tokens": lookup}}
    with torch.inference_mode():
        for r in range(rounds):
            for side in (plain, spec):
                side.runs.append([])
            for i, ids in enumerate(prompts):
                x = torch.tensor([ids])
                order = [plain, spec] if (r + i) % 2 == 0 else [spec, plain]
                for side in order:
                    calls[0] = 0
                    y, seconds = timed(lambda x=x, side=side: model.generate(
                        x, attention_mask=torch.ones_like(x), max_new_tokens=new,
                        do_sample=False, pad_token_id=0, **options[side.name]))
                    out = y[0, len(ids):].tolist()
                    side.runs[-1].append((len(out), seconds))
                    if r == 0:
                        side.outputs.append(out)
                        side.steps.append(calls[0])
    return plain, spec


def report(label: str, plain: Side, spec: Side, keep: list[bool]) -> float:
    """Print the rows of one pair; the median speedup."""
    fast, slow = spec.rates(keep), plain.rates(keep)
    row(label, "tokens/s", fast, slow, False, "faster")
    print(f"  {'':<34}new tokens per pred/forward: {spec.name} {spec.per_step(keep):.2f}, "
          f"{plain.name} {plain.per_step(keep):.2f}")
    return statistics.median(fast) / statistics.median(slow)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lookup-tokens", type=int, default=10,
                    help="transformers' prompt_lookup_num_tokens (default 10)")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "tiny",
                    help="checkpoint directory (default: models/tiny, the 5.5M test model "
                    "bench/RESULTS.md's figures were taken on)")
    ap.add_argument("--data", type=Path, default=ROOT / "data")
    args = ap.parse_args()

    print(machine_line())
    print(f"# {args.prompts} held-out prompts x {args.prompt_tokens} tokens, "
          f"{args.new_tokens} new tokens greedy, {args.rounds} rounds, model {args.model}")
    with tempfile.TemporaryDirectory() as tmp, \
            KernelDaemon(Path(tmp), "cacheback", ["--model", str(args.model)]) as kd, \
            Kernel.connect(kd.socket, name="bench-cacheback") as k:
        prompts = heldout_prompts(k, args.data, args.prompts, args.prompt_tokens)
        plain, spec = ours(k, prompts, args.new_tokens, args.rounds)
    hf_plain, hf_spec = theirs(args.model, prompts, args.new_tokens, args.rounds,
                               args.lookup_tokens)

    loops = [degenerate(out) for out in plain.outputs]
    same = sum(a == b for a, b in zip(plain.outputs, spec.outputs, strict=True))
    hf_same = sum(a == b for a, b in zip(plain.outputs, hf_plain.outputs, strict=True))
    print(f"# cacheback output = plain output on {same}/{len(prompts)} prompts; transformers' "
          f"greedy = ours on {hf_same}; degenerate repetition (last {TAIL} tokens of period "
          f"<= {PERIOD}): {sum(loops)}/{len(prompts)} prompts")
    for label, keep in (("all prompts", [True] * len(loops)),
                        ("without degenerate", [not x for x in loops])):
        if not any(keep):
            continue
        print(f"\n## {label} ({sum(keep)} prompts)")
        header("spec", "plain")
        mine = report("cacheback vs plain pred", plain, spec, keep)
        peer = report("transformers lookup vs generate", hf_plain, hf_spec, keep)
        print(f"  speedup (medians): ours {mine:.2f}x, transformers {peer:.2f}x; "
              f"ours / theirs {mine / peer:.2f}")


if __name__ == "__main__":
    main()
