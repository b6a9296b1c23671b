"""beam: beam search over forked KV files.

    python lips/beam.py --prompt "def fibonacci(n):" --width 4 --max-new-tokens 32
    python lips/beam.py --prompt-ids 1,2,3 --width 3 --length-penalty 0.6 --json

Each live beam is a KV file. The prompt is computed once. At every step each beam's file
takes the beam's last token in one pred that returns the 2W most likely next tokens
(top_logprobs), every beam's pred in flight at once, so the kernel batches them into one
forward pass. The W extensions with the highest total logprob live on: a beam with one
surviving extension keeps its file, one with several forks it (copy-on-write: beams share
their common pages), and one with none closes it, which frees its pages. So at most W
files are open, and the pages held are bounded by the width.

An extension by an end-of-sequence token that ranks among the W best is a finished
hypothesis; the search stops when W have finished or after --max-new-tokens steps. The pick
is the hypothesis, finished or still live, of the best score: its total logprob divided by
GNMT's length penalty ((5 + n) / 6) ** alpha, n its tokens (EOS included), alpha the
--length-penalty (default 0: the total logprob). Width 1 is greedy decoding.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass

from syscalls.aio import AsyncFile, AsyncKernel
from syscalls.convert import proc_fields
from syscalls.flags import (
    add_prompt_flags,
    alip_main,
    aprompt_of,
    at_least_one,
    check_context,
    check_flags,
    number,
)


@dataclass
class Beam:
    file: AsyncFile
    pending: int  # the beam's last token, not in the file yet: the next pred sends it
    output_ids: list[int]
    logprob: float


@dataclass
class Hypothesis:
    output_ids: list[int]
    logprob: float
    finished: bool  # ends with an end-of-sequence token
    score: float = 0.0
    text: str | None = None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="beam", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_flags(p)
    p.add_argument("--width", type=int, default=4, help="beams kept per step (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--length-penalty", type=number(float, 0), default=0.0, metavar="ALPHA",
                   help="GNMT length normalisation: score = logprob / ((5 + n) / 6) ** ALPHA "
                        "(default 0: total logprob)")
    p.add_argument("--json", action="store_true", help="every hypothesis, best first")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Bad flags end the program with usage and status 2, before the kernel is asked."""
    at_least_one(p, args, "width", "max_new_tokens")


def gnmt_score(logprob: float, length: int, alpha: float) -> float:
    """Wu et al. 2016 (GNMT): logprob / ((5 + length) / 6) ** alpha."""
    return logprob / ((5 + length) / 6) ** alpha


def select(candidates: Iterable[tuple[float, int, int]], width: int, eos: Iterable[int]
           ) -> tuple[list[tuple[float, int, int]], list[tuple[float, int, int]]]:
    """Of (total logprob, beam, token) candidates in beam order, then each beam's rank: the
    live extensions (at most width) and the finished ones (EOS among the width best)."""
    eos = set(eos)
    ranked = sorted(candidates, key=lambda c: -c[0])  # stable: ties keep beam, rank order
    live, finished = [], []
    for rank, c in enumerate(ranked):
        if len(live) == width:
            break
        if c[2] in eos:
            if rank < width:
                finished.append(c)
        else:
            live.append(c)
    return live, finished


async def pages_held(k: AsyncKernel) -> int:
    return int(proc_fields(await k.procfs(f"{k.pid}/status"))["pages"])


async def search(k: AsyncKernel, prompt: list[int], width: int, max_new_tokens: int,
                 eos: tuple[int, ...], stats: dict[str, int]) -> list[Hypothesis]:
    """The hypotheses of a beam search after `prompt`, unscored, finished ones first."""
    root = await k.open()
    if len(prompt) > 1:
        await root.pred(prompt[:-1], no_outputs=True)
    beams = [Beam(root, prompt[-1], [], 0.0)]
    finished: list[Hypothesis] = []
    top = min(2 * width, (await k.model_info()).vocab_size)
    stats.update(peak_files=1, peak_pages=0)
    for _ in range(max_new_tokens):
        outs = await asyncio.gather(
            *(b.file.pred([b.pending], top_logprobs=top) for b in beams))
        candidates = [(b.logprob + lp, i, token)
                      for i, (b, (out,)) in enumerate(zip(beams, outs, strict=True))
                      for token, lp in out.top]
        live, ended = select(candidates, width, eos)
        finished += [Hypothesis(beams[i].output_ids + [t], lp, True) for lp, i, t in ended]
        beams = await advance(beams, live)
        stats["peak_files"] = max(stats["peak_files"], len(beams))
        stats["peak_pages"] = max(stats["peak_pages"], await pages_held(k))
        if len(finished) >= width or not beams:
            break
    await asyncio.gather(*(b.file.close() for b in beams))
    return finished + [Hypothesis(b.output_ids, b.logprob, False) for b in beams]


async def advance(beams: list[Beam], live: list[tuple[float, int, int]]) -> list[Beam]:
    """The next beams: a parent's first surviving child takes its file, the others fork it,
    and a parent with none closes it (its private pages go back to the pool)."""
    first = {}
    for n, (_, i, _) in enumerate(live):
        first.setdefault(i, n)
    files = await asyncio.gather(*(
        _file(beams[i].file, first[i] == n) for n, (_, i, _) in enumerate(live)))
    await asyncio.gather(*(b.file.close() for i, b in enumerate(beams) if i not in first))
    return [Beam(f, t, beams[i].output_ids + [t], lp)
            for f, (lp, i, t) in zip(files, live, strict=True)]


async def _file(parent: AsyncFile, take: bool) -> AsyncFile:
    return parent if take else await parent.fork()


async def run(k: AsyncKernel, args: argparse.Namespace) -> int:
    info = await k.model_info()
    check_flags(args, info.has_tokenizer)
    prompt = await aprompt_of(k, args)
    check_context(prompt, args.max_new_tokens, info.context_length)
    stats: dict[str, int] = {}
    hyps = await search(k, prompt, args.width, args.max_new_tokens, info.eos_ids, stats)
    for h in hyps:
        h.score = gnmt_score(h.logprob, len(h.output_ids), args.length_penalty)
    hyps.sort(key=lambda h: -h.score)
    if info.has_tokenizer:
        for h in hyps:
            h.text = await k.detokenize(h.output_ids)
    if args.json:
        shown = [{f: v for f, v in vars(h).items() if v is not None} for h in hyps]
        print(json.dumps({"prompt_ids": prompt, "width": args.width,
                          "length_penalty": args.length_penalty, "hypotheses": shown,
                          **stats}))
    elif hyps[0].text is None:
        print(" ".join(map(str, hyps[0].output_ids)))
    else:
        print((args.prompt or "") + hyps[0].text)
    return 0


def main(argv: list[str] | None = None) -> int:
    return alip_main("beam", build_parser(), run, argv, check_args)


if __name__ == "__main__":
    sys.exit(main())
