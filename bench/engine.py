"""Engine throughput against transformers' `generate` on the same checkpoint, in one run.

Decode tokens/s at several batch sizes (time for N new tokens minus time for 1, so the
prefill is not counted) and prefill tokens/s of 512-token prompts. Prints a table of
ratios ours/transformers; figures go to bench/RESULTS.md by hand, with the machine.
`--cuda-graphs both` times our decode with and without CUDA graphs in the same run.

    python bench/engine.py [--model DIR] [--device cpu|cuda] [--batches 1,8,32]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from functools import partial
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path, and bench/kernels.py would
# hide the kernels package from the engine.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from symphony.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from symphony.engine.engine import Engine, default_model_dir  # noqa: E402
from symphony.engine.generate import generate  # noqa: E402
from symphony.engine.sampler import GREEDY  # noqa: E402


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def best_of(fns: list, repeat: int) -> list[float]:
    """Best time of each function, run in turn so that a slow spell of a shared machine
    hits every one of them alike."""
    for fn in fns:
        fn()  # warm-up: allocator, kernels' first launch
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def ours(engine: Engine, prompts: list[list[int]], new: int,
         graphs: DecodeGraphs | None = None) -> None:
    engine.decode_graphs = graphs
    generate(engine, prompts, GREEDY, new, stop_ids=())


def theirs(model, prompts: list[list[int]], new: int) -> None:
    ids = torch.tensor(prompts, device=model.device)
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                       min_new_tokens=new, do_sample=False, pad_token_id=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=str(default_model_dir()))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--prefill-batch", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cuda-graphs", choices=["on", "off", "both"],
                    help="decode through CUDA graphs (the engine's default: on for CUDA), not, "
                    "or both, timed side by side; with both on the CPU the graphs' static-buffer "
                    "steps run eagerly (nothing to capture there)")
    args = ap.parse_args()

    both = args.cuda_graphs == "both"
    engine = Engine(args.model, device=args.device, kv_pages=4096,
                    cuda_graphs=None if both else args.cuda_graphs)
    graphs = engine.decode_graphs
    if both and graphs is None:
        graphs = DecodeGraphs(engine.model, engine.pool, engine.kernels, engine.ops,
                              engine.scale, capture=False)
    variants = {", graphs": graphs, ", no graphs": None} if both else {"": graphs}
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=engine.dtype)
    model = model.to(args.device).eval()
    vocab = engine.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prompts(batch: int, length: int) -> list[list[int]]:
        return torch.randint(3, vocab, (batch, length), generator=gen).tolist()

    print(f"# {args.model} on {args.device} ({platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads), dtype {engine.dtype}, "
          f"attention {engine.kernels.name}, CUDA graphs "
          f"{'both' if both else 'on' if graphs else 'off'}"
          f"{'' if graphs is None or graphs.capture else ' (eager: no CUDA)'}")
    print(f"{'workload':<28}{'symphony tok/s':>16}{'transformers tok/s':>20}{'ratio':>8}")
    rows, speedups = [], []
    for b in [int(x) for x in args.batches.split(",")]:
        p, n = prompts(b, args.prompt_len), args.new_tokens
        fns = [partial(theirs, model, p, n), partial(theirs, model, p, 1)]
        for g in variants.values():
            fns += [partial(ours, engine, p, n, g), partial(ours, engine, p, 1, g)]
        t = best_of(fns, args.repeat)
        theirs_rate = b * (n - 1) / (t[0] - t[1])
        rates = [b * (n - 1) / (t[i] - t[i + 1]) for i in range(2, len(t), 2)]
        rows += [(f"decode batch {b}{name}", r, theirs_rate)
                 for name, r in zip(variants, rates, strict=True)]
        if both:
            speedups.append(f"batch {b} {rates[0] / rates[1]:.2f}x")
    p = prompts(args.prefill_batch, args.prefill_len)
    t = best_of([lambda: ours(engine, p, 1, graphs), lambda: theirs(model, p, 1)], args.repeat)
    tokens = args.prefill_batch * args.prefill_len
    rows.append((f"prefill {args.prefill_batch}x{args.prefill_len}", tokens / t[0],
                 tokens / t[1]))
    for name, a, b in rows:
        print(f"{name:<28}{a:>16.1f}{b:>20.1f}{a / b:>7.2f}x")
    if speedups:
        print("decode with CUDA graphs against without: " + ", ".join(speedups))


if __name__ == "__main__":
    main()
