"""Tensor parallelism on this machine: the engine at N=2 ranks (gloo) against N=1, in one run.

Decode steps at batch 1 and 32 (each sequence 128 tokens deep) and a 512-token prefill,
timed on rank 0 with the two ranks' threads and the one rank's adding up to the same cores
(N=1: all of them; N=2: half each; and N=1 on half of them, for reference), N=1 and N=2 in
turn so that a slow spell of a shared machine hits both. Then a torch.profiler profile of
the N=2 steps on rank 0: the share of a step spent in the all-reduces (two a layer) and in
the LM head's gather. Prints a table of milliseconds and ratios; figures go to
bench/RESULTS.md by hand, with the machine.

    python bench/tensor_parallel.py [--model DIR] [--batches 1,32] [--prefill-len 512]

With no --model, a random Llama of about 0.1B parameters whose heads split over 2 ranks
(SmolLM2-135M's 9 heads do not) is made in a temporary directory.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this file's folder comes first on sys.path, and bench/kernels.py would
# hide the kernels package from the engine.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from symphony.engine.config import ModelConfig  # noqa: E402
from symphony.engine.engine import Batch, Engine  # noqa: E402
from symphony.engine.tensor_parallel import Group, shard_of  # noqa: E402
from symphony.ranks import Rendezvous  # noqa: E402

SHAPE = dict(
    vocab_size=32768,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
PAGE = 16
# The profiler's events of a collective's whole wait (gloo:all_reduce, nccl:all_reduce, ...):
# from its start to the last rank's part arriving.
COLLECTIVES = (":all_reduce", ":gather")


def make_llama(out: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).save_pretrained(out)


class Cases:
    """The steps timed, the same on every engine: batch-B decodes over contexts written
    once, and a fresh prefill."""

    def __init__(self, engine: Engine, batches: list[int], context: int, prefill: int):
        self.engine, self.context, self.prefill_len = engine, context, prefill
        per_seq = -(-(context + 1) // PAGE)
        self.tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(max(batches))]
        start = max(batches) * per_seq
        self.prefill_pages = list(range(start, start + -(-prefill // PAGE)))
        g = torch.Generator().manual_seed(0)
        vocab = engine.config.vocab_size
        self.ids = torch.randint(0, vocab, (max(batches), context + 1), generator=g).tolist()
        self.prompt = torch.randint(0, vocab, (prefill,), generator=g).tolist()
        self.names = [f"decode batch {b}" for b in batches] + [f"prefill {prefill}"]
        self.batches = batches

    def fill(self) -> None:
        """Every decode sequence's context, once."""
        for ids, pages in zip(self.ids, self.tables, strict=False):
            c = self.context
            self.engine.forward(Batch(ids[:c], list(range(c)), [c], [c], [pages], [c - 1]))

    def run(self, name: str) -> None:
        if name.startswith("prefill"):
            n = self.prefill_len
            self.engine.forward(
                Batch(self.prompt, list(range(n)), [n], [n], [self.prefill_pages], [n - 1])
            )
            return
        b, c = int(name.split()[-1]), self.context
        self.engine.forward(
            Batch(
                [ids[c] for ids in self.ids[:b]],
                [c] * b,
                [1] * b,
                [c + 1] * b,
                self.tables[:b],
                list(range(b)),
            )
        )

    @staticmethod
    def pages_needed(batches: list[int], context: int, prefill: int) -> int:
        return max(batches) * -(-(context + 1) // PAGE) + -(-prefill // PAGE)


def timed(fn, repeat: int) -> float:
    """The best of `repeat` runs, seconds."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _rank(rank: int, port: int, args: argparse.Namespace, out: str) -> None:
    cores = os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // 2))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cfg = ModelConfig.from_file(Path(args.model) / "config.json")
    batches = [int(b) for b in args.batches.split(",")]
    pages = Cases.pages_needed(batches, args.context, args.prefill_len)
    group = Group(shard_of(cfg, rank, 2))
    two = Cases(
        Engine(args.model, kv_pages=pages, group=group), batches, args.context, args.prefill_len
    )
    two.fill()
    if rank == 1:  # follow rank 0's orders until it says stop
        while (name := group.broadcast(None)) is not None:
            two.run(name)
        dist.destroy_process_group()
        return
    one = Cases(Engine(args.model, kv_pages=pages), batches, args.context, args.prefill_len)
    torch.set_num_threads(cores)
    one.fill()

    def on_two(name: str) -> None:
        group.broadcast(name)
        two.run(name)

    rows = []
    for name in two.names:
        reps = args.repeat * (4 if name.startswith("decode") else 1)
        t1 = t1_half = t2 = float("inf")
        for _ in range(args.rounds):
            torch.set_num_threads(cores)
            t1 = min(t1, timed(lambda n=name: one.run(n), reps))
            torch.set_num_threads(max(1, cores // 2))
            t1_half = min(t1_half, timed(lambda n=name: one.run(n), reps))
            t2 = min(t2, timed(lambda n=name: on_two(n), reps))
        rows.append((name, t1, t1_half, t2, *shares(lambda n=name: on_two(n), reps)))
    group.broadcast(None)
    dist.destroy_process_group()
    with open(out, "w") as f:
        for row in rows:
            f.write("\t".join(map(str, row)) + "\n")


def shares(fn, repeat: int) -> list[float]:
    """The shares of fn's wall time that rank 0 spends in each of COLLECTIVES, from a
    profile (its waits for the other rank included: the ranks' imbalance shows there)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(repeat):
            fn()
        wall = time.perf_counter() - t
    events = prof.key_averages()
    return [
        sum(e.cpu_time_total for e in events if e.key.endswith(c)) / 1e6 / wall for c in COLLECTIVES
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a checkpoint directory (default: a random 0.1B Llama)")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            args.model = str(Path(tmp) / "llama")
            make_llama(Path(args.model))
        cfg = ModelConfig.from_file(Path(args.model) / "config.json")
        params = sum(p.numel() for p in Engine(args.model, kv_pages=1).model.parameters())
        out = Path(tmp) / "rows.tsv"
        port = Rendezvous(2).with_port().master_port
        mp.spawn(_rank, (port, args, str(out)), nprocs=2)
        rows = [line.split("\t") for line in out.read_text().splitlines()]
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"{cfg.architecture} {params / 1e6:.0f}M parameters, {cfg.num_layers} layers, "
        f"fp32, C kernels; N=1 on {os.cpu_count()} threads, N=2 on "
        f"{max(1, (os.cpu_count() or 1) // 2)} each"
    )
    half = max(1, (os.cpu_count() or 1) // 2)
    print(
        f"{'step':<18}{'N=1 ms':>9}{f'N=1 {half}t ms':>12}{'N=2 ms':>9}{'N=1/N=2':>9}"
        f"{'all-reduce':>12}{'gather':>8}"
    )
    for name, *figures in rows:
        t1, t1_half, t2, reduce, gather = map(float, figures)
        print(
            f"{name:<18}{t1 * 1e3:>9.2f}{t1_half * 1e3:>12.2f}{t2 * 1e3:>9.2f}"
            f"{t1 / t2:>9.2f}{reduce:>12.2f}{gather:>8.2f}"
        )


if __name__ == "__main__":
    main()
