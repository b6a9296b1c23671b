"""prompt_cache: answer questions about a document whose attention state is kept in a KV file.

    python lips/prompt_cache.py --document notes.txt --cache notes.kv --question "Why?"
    python lips/prompt_cache.py --document notes.txt --cache notes.kv --question-file q.txt

The first run computes the document once and names its KV file PATH (relative paths are
under the user's home); the kernel keeps it across runs and restarts. Every question then
forks the cached file (copy-on-write: nothing of the document is recomputed or copied) and
computes only its own tokens, which is what its time to first token shows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from syscalls.client import Kernel
from syscalls.context import Context
from syscalls.flags import (
    add_sampling_flags,
    add_text_flags,
    check_flags,
    kv_path,
    lip_main,
    sampling_kwargs,
)

QUESTION = "\n\nQ: {question}\nA:"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prompt_cache", description=__doc__.split("\n")[0])
    p.add_argument("--document", required=True, type=Path, help="a text file")
    p.add_argument("--cache", required=True, metavar="PATH", help="the document's KV file")
    add_text_flags(p, "question", "a question, repeatable", action="append")
    add_sampling_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def ensure_cache(k: Kernel, path: str, document: list[int]) -> bool:
    """Make the KV file of `document` at `path` unless it is there; whether it was made.

    It is computed in an anonymous file and named once whole, so no reader ever sees a
    half-computed cache."""
    try:
        with k.open(path) as f:
            if f.read()[0] != document:
                raise ValueError(f"{path}: holds another document; unlink it to rebuild")
        return False
    except FileNotFoundError:
        pass
    with Context(k) as ctx:
        ctx.fill(document)
        try:
            ctx.save(path)
        except FileExistsError:  # another process made it meanwhile
            return False
        ctx.file.fsync()
    return True


def answer(k: Kernel, path: str, question: str, max_new_tokens: int, sampling: dict) -> dict:
    start = time.perf_counter()
    ttft, ids = None, []
    with k.open(path) as cached, Context(k, cached.fork()) as ctx:
        ctx.fill(QUESTION.format(question=question))
        for token in ctx.generate(max_new_tokens, **sampling):
            if ttft is None:
                ttft = time.perf_counter() - start
            ids.append(token)
    return {"question": question, "output_ids": ids, "text": k.detokenize(ids), "ttft": ttft}


def run(k: Kernel, args: argparse.Namespace) -> int:
    info = k.model_info()
    check_flags(args, info.has_tokenizer)
    if not info.has_tokenizer:
        raise ValueError("the model has no tokenizer")
    if not args.question:
        raise ValueError("no question: give --question or --question-file")
    path = kv_path(k.home, args.cache)
    document = k.tokenize(args.document.read_text(), add_special=True)
    start = time.perf_counter()
    built = ensure_cache(k, path, document)
    result = {
        "cache": path,
        "built": built,
        "build_seconds": time.perf_counter() - start if built else 0.0,
        "document_tokens": len(document),
        "answers": [],
    }
    for q in args.question:
        a = answer(k, path, q, args.max_new_tokens, sampling_kwargs(args))
        result["answers"].append(a)
        if not args.json:
            print(f"Q: {q}\nA:{a['text']}\n(time to first token {a['ttft']:.4f} s)\n")
    if args.json:
        print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    return lip_main("prompt_cache", build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
