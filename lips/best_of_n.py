"""best_of_n: sample n continuations of one prompt in parallel and keep the most likely.

    python lips/best_of_n.py --prompt "def parse(line):" --n 8 --seed 1
    python lips/best_of_n.py --prompt-file prompt.txt --n 8       # or --prompt - < prompt.txt

The prompt is computed once; its KV file is forked n ways (copy-on-write, so the branches
share its pages) and the branches decode concurrently, which the kernel batches. The pick
is the highest mean logprob per token. Sampling defaults to temperature 1.0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from dataclasses import dataclass

from syscalls.aio import AsyncKernel
from syscalls.context import AsyncContext
from syscalls.flags import (
    add_prompt_flags,
    add_sampling_flags,
    alip_main,
    aprompt_of,
    check_context,
    check_flags,
    number,
    sampling_kwargs,
)
from syscalls.session import FD_MAX


@dataclass
class Candidate:
    output_ids: list[int]
    mean_logprob: float
    text: str | None = None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="best_of_n", description=__doc__.split("\n")[0])
    add_prompt_flags(p)
    # Each branch is a KV file the process holds open, besides the prompt's.
    p.add_argument("--n", type=number(int, 1, FD_MAX - 1), default=4,
                   help=f"continuations to sample (default 4, at most {FD_MAX - 1})")
    add_sampling_flags(p)
    p.set_defaults(temperature=1.0)
    p.add_argument("--json", action="store_true", help="all candidates, their scores, the pick")
    return p


def branch_seeds(seed: int | None, n: int) -> list[int | None]:
    """Independent, reproducible seeds, one per branch (each then steps as seed + i)."""
    if seed is None:
        return [None] * n
    rng = random.Random(seed)
    return [rng.getrandbits(32) for _ in range(n)]


async def decode(branch: AsyncContext, max_new_tokens: int, sampling: dict) -> Candidate:
    async with branch:
        outs = [o async for o in branch.samples(max_new_tokens, **sampling)]
    return Candidate([o.token for o in outs], sum(o.logprob for o in outs) / len(outs))


async def run(k: AsyncKernel, args: argparse.Namespace) -> int:
    info = await k.model_info()
    check_flags(args, info.has_tokenizer)
    prompt = await aprompt_of(k, args)
    check_context(prompt, args.max_new_tokens, info.context_length)
    sampling = sampling_kwargs(args)
    async with await AsyncContext.create(k, stop=info.eos_ids) as root:
        await root.fill(prompt)
        branches = await asyncio.gather(*(root.fork() for _ in range(args.n)))
    candidates = await asyncio.gather(
        *(
            decode(b, args.max_new_tokens, {**sampling, "seed": seed})
            for b, seed in zip(branches, branch_seeds(args.seed, args.n), strict=True)
        )
    )
    if info.has_tokenizer:
        for c in candidates:
            c.text = await k.detokenize(c.output_ids)
    pick = max(range(args.n), key=lambda i: candidates[i].mean_logprob)
    if args.json:
        shown = [{f: v for f, v in vars(c).items() if v is not None} for c in candidates]
        print(json.dumps({"prompt_ids": prompt, "candidates": shown, "pick": pick}))
    elif candidates[pick].text is None:
        print(" ".join(map(str, candidates[pick].output_ids)))
    else:
        print((args.prompt or "") + candidates[pick].text)
    return 0


def main(argv: list[str] | None = None) -> int:
    return alip_main("best_of_n", build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
