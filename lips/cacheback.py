"""cacheback: speculative decoding with nothing but a cache of n-grams (Cacheback, EMNLP 2025).

    python lips/cacheback.py --prompt "def fibonacci(n):" --max-new-tokens 128
    python lips/cacheback.py --prompt-ids 1,2,3 --json --temperature 0.8 --seed 0
    python lips/cacheback.py --prompt-file prompt.txt --max-depth 8 --width 2 --stats

LRU tables map each leader n-gram (the last 1 to --ngram tokens) to its most recent
followers; they learn from the prompt and from every accepted token. Each step grows a
draft tree from them (best first: a follower's rank adds to its branch's cost, up to
--width followers a node and the current depth), checks the whole tree in one pred with
tree attention, keeps the accepted branch in one call (keep, or the next pred's truncate
when the branch is the tree's first rows), and goes on from the token the model gave after
it. The depth shrinks when drafts are rejected and grows when they are accepted whole.

Greedy output is plain greedy decoding's, token for token. When sampling, the kernel
samples every tree row from the model's distribution (temperature and cut-offs included)
with independent noise; a drafted token is accepted exactly when its parent's row sampled
it (probability p(token)), and otherwise the row's sample, a draw from p without the
rejected tokens, is the next token: speculative sampling's rule for a deterministic draft,
so the output is distributed as plain sampling's. Same flags and output as complete.py;
--stats adds the preds and accepted tokens to stderr (and to --json).
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from syscalls.client import File, Kernel
from syscalls.context import TextStream
from syscalls.convert import PredOutput
from syscalls.flags import (
    add_prompt_flags,
    add_sampling_flags,
    at_least_one,
    check_context,
    lip_main,
    prompt_of,
    sampling_kwargs,
)


@dataclass
class Config:
    ngram: int = 3  # leaders of 1 .. ngram tokens
    width: int = 2  # followers tried per tree node
    max_depth: int = 8  # drafted tokens on one branch, at most
    start_depth: int = 4
    followers: int = 4  # followers remembered per leader, most recent first
    table_size: int = 1 << 16  # leaders remembered per table (LRU)


class NgramTables:
    """One LRU table per leader length: leader n-gram -> its most recent followers."""

    def __init__(self, config: Config):
        self.config = config
        self.tables: list[OrderedDict[tuple[int, ...], list[int]]] = [
            OrderedDict() for _ in range(config.ngram)
        ]

    def update(self, tokens: Sequence[int], start: int = 1) -> None:
        """Learn the transitions into tokens[start:]."""
        for i in range(max(start, 1), len(tokens)):
            for n in range(1, min(self.config.ngram, i) + 1):
                self._remember(self.tables[n - 1], tuple(tokens[i - n:i]), tokens[i])

    def _remember(self, table: OrderedDict, leader: tuple[int, ...], follower: int) -> None:
        followers = table.pop(leader, [])
        if follower in followers:
            followers.remove(follower)
        followers.insert(0, follower)
        del followers[self.config.followers:]
        table[leader] = followers
        if len(table) > self.config.table_size:
            table.popitem(last=False)

    def followers(self, tail: Sequence[int], width: int) -> list[int]:
        """Up to `width` next tokens for a context ending in `tail`: the longest leader's
        followers first, then shorter leaders' to fill up."""
        out: list[int] = []
        for n in range(min(self.config.ngram, len(tail)), 0, -1):
            table = self.tables[n - 1]
            leader = tuple(tail[-n:])
            found = table.get(leader)
            if found is None:
                continue
            table.move_to_end(leader)  # a hit is a use
            out += [t for t in found if t not in out]
            if len(out) >= width:
                break
        return out[:width]


@dataclass
class Tree:
    """A draft tree in preorder: row 0 is the root (the token the file goes on with);
    the first child of every node comes right after it, so the best chain is rows 0..d."""

    tokens: list[int]
    parents: list[int]
    children: list[list[int]] = field(default_factory=list)


def draft_tree(tables: NgramTables, seen: Sequence[int], depth: int, width: int) -> Tree:
    """Grow a tree of at most 1 + depth * width nodes under seen[-1], the token the file goes
    on with, cheapest first: a branch costs the sum of its followers' ranks, then its depth."""
    budget, keep = 1 + depth * width, tables.config.ngram
    tails = [tuple(seen[-keep:])]
    tokens, parents, ranks = [seen[-1]], [-1], [0]
    heap: list[tuple[int, int, int, int, int, int]] = []  # cost, depth, order, parent, rank, t
    order = count()

    def expand(node: int, cost: int, d: int) -> None:
        if d < depth:
            for rank, t in enumerate(tables.followers(tails[node], width)):
                heapq.heappush(heap, (cost + rank, d + 1, next(order), node, rank, t))

    expand(0, 0, 0)
    while heap and len(tokens) < budget:
        cost, d, _, parent, rank, t = heapq.heappop(heap)
        tokens.append(t)
        parents.append(parent)
        ranks.append(rank)
        tails.append((*tails[parent], t)[-keep:])
        expand(len(tokens) - 1, cost, d)
    # Rows in preorder, children by rank, so that the best chain is rows 0, 1, 2, ...
    kids: list[list[int]] = [[] for _ in tokens]
    for i in range(1, len(tokens)):
        kids[parents[i]].append(i)
    preorder, stack = [], [0]
    while stack:
        i = stack.pop()
        preorder.append(i)
        stack += sorted(kids[i], key=lambda c: ranks[c], reverse=True)
    row = {node: r for r, node in enumerate(preorder)}
    tree = Tree([tokens[i] for i in preorder], [-1] + [row[parents[i]] for i in preorder[1:]])
    tree.children = [[] for _ in preorder]
    for r in range(1, len(preorder)):
        tree.children[tree.parents[r]].append(r)
    return tree


@dataclass
class Stats:
    """What a decode cost and saved, summed over its steps."""

    preds: int = 0
    drafted: int = 0  # tree nodes sent below the root
    accepted: int = 0  # drafted tokens the model agreed with
    keeps: int = 0  # accepted branches that needed a keep call (not a prefix of the rows)


def accepted_branch(tree: Tree, outs: Sequence[PredOutput]) -> list[int]:
    """The rows from the root down while the model's token at a row is one of its children
    (greedy: the argmax; sampling: the row's draw)."""
    branch = [0]
    while True:
        said = outs[branch[-1]].token
        child = next((c for c in tree.children[branch[-1]] if tree.tokens[c] == said), None)
        if child is None:
            return branch
        branch.append(child)


def decode(f: File, prompt: Sequence[int], max_new_tokens: int, sampling: dict[str, Any],
           config: Config, stats: Stats, stop: Sequence[int] = (),
           context_length: int | None = None, written: int = 0) -> Iterator[int]:
    """Yield up to max_new_tokens tokens after `prompt`, ending after a stop token; each
    pred checks a whole draft tree. `f` holds the first `written` tokens of the prompt
    (a fork of a saved prefix; at most all but the last), and gets the rest. A seed steps
    as seed + pred, as Context's does."""
    if not prompt:
        raise ValueError("empty prompt")
    tables = NgramTables(config)
    tables.update(prompt)
    seen = list(prompt)  # the file's entries, then the token it goes on with
    if written < len(seen) - 1:
        f.pred(seen[written:-1], no_outputs=True)
    length = len(seen) - 1  # entries in the file, up to the accepted branch
    cut: int | None = None  # the next pred's truncate, when the last tree left a tail
    depth, emitted, seed = config.start_depth, 0, sampling.get("seed")
    while emitted < max_new_tokens:
        room = max_new_tokens - emitted - 1  # the token after the branch comes too
        if context_length is not None:
            room = min(room, context_length - 1 - length)
        tree = draft_tree(tables, seen, min(depth, room), config.width)
        step = sampling if seed is None else {**sampling, "seed": seed + stats.preds}
        if len(tree.tokens) == 1:  # nothing to draft: a plain decode step
            outs = f.pred(tree.tokens, truncate=cut, **step)
            branch = [0]
        else:
            outs = f.pred(tree.tokens, parents=tree.parents, outputs=range(len(tree.tokens)),
                          truncate=cut, **step)
            branch = accepted_branch(tree, outs)
        stats.preds += 1
        stats.drafted += len(tree.tokens) - 1
        stats.accepted += len(branch) - 1
        if branch == list(range(len(branch))):  # the first rows: the next pred cuts the rest
            cut = length + len(branch) if len(tree.tokens) > len(branch) else None
        else:
            f.keep(length, [length + r for r in branch])
            stats.keeps += 1
            cut = None
        length += len(branch)
        if len(tree.tokens) > 1:  # deeper after a branch accepted whole, shallower after few
            if len(branch) - 1 >= depth:
                depth = min(depth + 1, config.max_depth)
            elif len(branch) - 1 < depth // 2:
                depth = max(depth - 1, 1)
        new = [tree.tokens[r] for r in branch[1:]] + [outs[branch[-1]].token]
        for t in new:
            yield t
            emitted += 1
            if t in stop or emitted == max_new_tokens:
                return
        seen += new
        tables.update(seen, len(seen) - len(new))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cacheback", description=__doc__.split("\n")[0],
                                epilog=__doc__.split("\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_flags(p)
    add_sampling_flags(p)
    d = Config()
    p.add_argument("--max-depth", type=int, default=d.max_depth,
                   help=f"drafted tokens on one branch, at most (default {d.max_depth})")
    p.add_argument("--width", type=int, default=d.width,
                   help=f"followers tried per tree node (default {d.width}; 1: a chain)")
    p.add_argument("--ngram", type=int, default=d.ngram,
                   help=f"longest leader n-gram (default {d.ngram})")
    p.add_argument("--table-size", type=int, default=d.table_size,
                   help=f"leaders each LRU table remembers (default {d.table_size})")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--stats", action="store_true", help="preds and accepted tokens to stderr")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The drafting flags, checked (exit 2 with a message when out of range), as
    args.config."""
    at_least_one(p, args, "max_depth", "width", "ngram", "table_size")
    args.config = Config(ngram=args.ngram, width=args.width, max_depth=args.max_depth,
                         start_depth=min(Config.start_depth, args.max_depth),
                         table_size=args.table_size)


def run(k: Kernel, args: argparse.Namespace) -> int:
    config = args.config
    info = k.model_info()
    if args.prompt is not None and not info.has_tokenizer:
        raise ValueError("the model has no tokenizer; use --prompt-ids")
    prompt = prompt_of(k, args)
    check_context(prompt, args.max_new_tokens, info.context_length)
    stream = None
    if info.has_tokenizer and not args.json:
        stream = TextStream(k)
        print(args.prompt or "", end="", flush=True)
    out, stats = [], Stats()
    with k.open() as f:
        for token in decode(f, prompt, args.max_new_tokens, sampling_kwargs(args), config,
                            stats, stop=info.eos_ids, context_length=info.context_length):
            out.append(token)
            if stream:
                print(stream.push(token), end="", flush=True)
    figures = {**vars(stats), "tokens": len(out),
               "tokens_per_pred": round(len(out) / max(stats.preds, 1), 3)}
    if stream:
        print(stream.finish())
    elif args.json:
        result: dict[str, Any] = {"prompt_ids": prompt, "output_ids": out}
        if info.has_tokenizer:
            result["text"] = k.detokenize(out)
        if args.stats:
            result["stats"] = figures
        print(json.dumps(result))
    else:
        print(" ".join(map(str, out)))
    if args.stats:
        print("cacheback: " + ", ".join(f"{n} {v}" for n, v in figures.items()), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return lip_main("cacheback", build_parser(), run, argv, check_args)


if __name__ == "__main__":
    sys.exit(main())
