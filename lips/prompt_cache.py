"""prompt_cache: Prompt Cache (Gim et al., MLSys 2024) as a program: prompts assembled from
modules whose attention states are computed once and kept in KV files.

    python lips/prompt_cache.py --schema lips/schemas/travel.xml --prompt-file ask.xml
    python lips/prompt_cache.py --schema lips/schemas/travel.xml \\
        --prompt '<prompt><system/><tokyo/><plan days="3" likes="temples"/>Where first?</prompt>'
    python lips/prompt_cache.py --document notes.txt --cache notes.kv --question "Why?"

With --schema (lips/pml.py: the paper's Prompt Markup Language), every module of the schema
has a KV file under the user's DIR/SCHEMA_NAME/ (--cache DIR, default prompt-cache), computed
the first time and never again: each module at its fixed positions, attending to the BOS and
to itself only, its entries padded to a whole number of pages. A prompt forks the BOS file,
splices in the modules it names (whole pages shared, no row copied, positions kept, gaps
where modules are left out), and computes in one pred only its parameters' arguments at
their slots and its question after the schema's last position. A file's name holds a digest
of what it holds (model, tokens, positions), so a module whose text or place changes gets a
new file and the stale one is unlinked.

With --document, the document's KV file is PATH (--cache; relative paths are under the
user's home): computed once, then every question forks it and computes only its own tokens.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

from lips.pml import Module, Parameter, PMLError, Prompt, Schema, parse_prompt, parse_schema
from syscalls.client import File, Kernel
from syscalls.context import Context
from syscalls.convert import proc_fields
from syscalls.flags import (
    add_sampling_flags,
    add_text_flags,
    kv_path,
    lip_main,
    sampling_kwargs,
    text_file,
)

QUESTION = "\n\nQ: {question}\nA:"
ROOT = ".root"  # the BOS file's name: a leading dot, so no module (an XML name) has it
FILE_NAME = re.compile(rf"({re.escape(ROOT)}|[A-Za-z_][A-Za-z0-9_.-]*)\.[0-9a-f]{{16}}\.kv\Z")


@dataclass(frozen=True)
class Placed:
    """A module laid out: its text's tokens at their positions, its parameters' slots."""

    module: Module
    tokens: list[int]
    positions: list[int]
    slots: dict[str, range]  # parameter -> the positions reserved for its argument
    file: str  # NAME.DIGEST.kv


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def _seeded(sampling: dict[str, Any], step: int) -> dict[str, Any]:
    seed = sampling.get("seed")
    return sampling if seed is None else {**sampling, "seed": seed + step}


def _makedirs(k: Kernel, path: str) -> None:
    try:
        k.mkdir(path)
    except FileExistsError:
        pass
    except FileNotFoundError:
        _makedirs(k, path.rsplit("/", 1)[0])
        k.mkdir(path)


class ModuleCache:
    """A schema laid out on a model, and its module files under `directory`."""

    def __init__(self, k: Kernel, schema: Schema, directory: str):
        info = k.model_info()
        self.k, self.schema, self.directory = k, schema, directory
        self.page_size = info.page_size
        self.root = k.tokenize("", add_special=True)  # the BOS, where the tokenizer adds one
        self.base = -(-len(self.root) // self.page_size) * self.page_size  # root file's length
        self.root_file = f"{ROOT}.{_digest(info.fingerprint, self.page_size, self.root)}.kv"
        self.placed: dict[str, Placed] = {}
        position = len(self.root)
        for item in schema.items:
            members = item if isinstance(item, tuple) else (item,)
            ends = [self._place(m, position, info.fingerprint) for m in members]
            position = max(ends)
        self.end = position  # the question's first position
        if self.end > info.context_length:
            raise PMLError(
                f"schema {schema.name!r} needs {self.end} positions, the model "
                f"has {info.context_length}"
            )

    def _place(self, module: Module, position: int, fingerprint: str) -> int:
        """Lay `module` out from `position`; the position after it."""
        tokens, positions, slots = [], [], {}
        for piece in module.pieces:
            if isinstance(piece, Parameter):
                slots[piece.name] = range(position, position + piece.length)
                position += piece.length
            else:
                ids = self.k.tokenize(piece)
                tokens += ids
                positions += range(position, position + len(ids))
                position += len(ids)
        digest = _digest(fingerprint, self.page_size, self.root, tokens, positions)
        self.placed[module.name] = Placed(
            module, tokens, positions, slots, f"{module.name}.{digest}.kv"
        )
        return position

    def path(self, name: str) -> str:
        return f"{self.directory}/{name}"

    def _padded(self, tokens: list[int], positions: list[int], at: int) -> tuple[list, list]:
        """Entries written from entry `at`: the tokens, then copies of the last up to a page
        boundary (punched once written), so that a splice of them shares whole pages."""
        pad = -(at + len(tokens)) % self.page_size if tokens else 0
        return tokens + tokens[-1:] * pad, positions + positions[-1:] * pad

    def _ensure(self, name: str, tokens: list[int], positions: list[int]) -> str | None:
        """Make the file `name` unless it is there: "built", "dropped" (computed, but another
        run linked the file first), or None (there, nothing computed). It is computed in an
        anonymous file and named once whole, so no reader sees a half-computed module."""
        is_root = name == self.root_file
        at = 0 if is_root else self.base
        ids, pos = self._padded(tokens, positions, at)
        try:
            with self.k.open(self.path(name)) as f:
                if f.read(at) != (ids, pos):
                    raise ValueError(
                        f"{self.path(name)}: holds other entries than its name "
                        "says; unlink it to rebuild"
                    )
            return None
        except FileNotFoundError:
            pass
        with self.k.open() if is_root else self._start() as f:
            if ids:
                f.pred(ids, pos, no_outputs=True)
                f.punch(at + len(tokens), at + len(ids))
            try:
                f.link(self.path(name))
            except FileExistsError:  # another process made it meanwhile
                return "dropped"
            f.fsync()
        return "built"

    def _start(self) -> File:
        """A new anonymous file holding the BOS's page (a fork of its file), or empty."""
        if not self.root:
            return self.k.open()
        with self.k.open(self.path(self.root_file)) as root:
            return root.fork()

    def ensure(self) -> dict[str, Any]:
        """Every module's file, made where missing; stale files of this directory unlinked.
        What was built and what was computed but dropped (each with seconds), and what was
        removed."""
        _makedirs(self.k, self.directory)
        made: dict[str, dict[str, float]] = {"built": {}, "dropped": {}}
        wanted = [(self.root_file, self.root, list(range(len(self.root))))] if self.root else []
        wanted += [(p.file, p.tokens, p.positions) for p in self.placed.values()]
        for name, tokens, positions in wanted:
            start = time.perf_counter()
            outcome = self._ensure(name, tokens, positions)
            if outcome is not None:
                made[outcome][name] = time.perf_counter() - start
        keep = {name for name, _, _ in wanted}
        removed = [
            name
            for name, _ in self.k.readdir(self.directory)
            if FILE_NAME.match(name) and name not in keep
        ]
        for name in removed:
            self.k.unlink(self.path(name))
        return {**made, "removed": removed}

    def inputs(self, prompt: Prompt) -> tuple[list[int], list[int]]:
        """What a prompt computes: its arguments at their slots, then its question after the
        schema's last position."""
        tokens, positions = [], []
        for name in prompt.modules:
            for param, slot in self.placed[name].slots.items():
                ids = self.k.tokenize(prompt.arguments[name][param])
                if len(ids) > len(slot):
                    raise PMLError(
                        f"prompt: <{name} {param}=...> is {len(ids)} tokens, the "
                        f"parameter holds {len(slot)}"
                    )
                tokens += ids
                positions += slot[: len(ids)]
        question = self.k.tokenize(prompt.question)
        return tokens + question, positions + list(range(self.end, self.end + len(question)))

    def as_tree(self, prompt: Prompt) -> tuple[list[int], list[int], list[int]]:
        """The prompt's modules as one tree pred after the BOS (tokens, positions, parents),
        each module a branch of its own: the attention pattern compose() gives, computed
        without the cache (what the tests and the benchmark compare it with)."""
        tokens, positions, parents = [], [], []
        for name in prompt.modules:
            placed = self.placed[name]
            parents += [-1, *range(len(tokens), len(tokens) + len(placed.tokens) - 1)]
            tokens += placed.tokens
            positions += placed.positions
        return tokens, positions, parents

    def compose(self, prompt: Prompt) -> File:
        """A new anonymous file: the BOS, then the prompt's modules' entries, pages shared."""
        f = self._start()
        try:
            for name in prompt.modules:
                with self.k.open(self.path(self.placed[name].file)) as module:
                    f.splice_from(module, self.base, module.stat().tokens)
        except BaseException:
            f.close()
            raise
        return f

    def answer(self, prompt: Prompt, max_new_tokens: int, sampling: dict) -> dict[str, Any]:
        start = time.perf_counter()
        tokens, positions = self.inputs(prompt)
        with Context(self.k, self.compose(prompt)) as ctx:
            spliced = ctx.file.stat().tokens
            (first,) = ctx.file.pred(tokens, positions, **_seeded(sampling, 0))
            ttft = time.perf_counter() - start
            outs = [first]
            if first.token not in ctx.stop and max_new_tokens > 1:
                ctx.pending = [first.token]
                outs += ctx.samples(max_new_tokens - 1, **_seeded(sampling, 1))
        ids = [o.token for o in outs]
        return {
            "modules": list(prompt.modules),
            "spliced_entries": spliced,
            "input_tokens": len(tokens),
            "input_ids": tokens,
            "positions": positions,
            "output_ids": ids,
            "logprobs": [o.logprob for o in outs],
            "text": self.k.detokenize(ids),
            "ttft": ttft,
        }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="prompt_cache",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--schema", type=text_file, metavar="FILE", help="a Prompt Markup Language schema (XML)"
    )
    source.add_argument("--document", type=text_file, metavar="FILE", help="a text file")
    p.add_argument(
        "--cache",
        metavar="PATH",
        help="with --schema, the directory of the "
        "schemas' module files (default prompt-cache); with --document, the "
        "document's KV file (required)",
    )
    add_text_flags(p, "prompt", "a prompt of the schema (XML), repeatable", action="append")
    add_text_flags(p, "question", "a question about the document, repeatable", action="append")
    add_sampling_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse flags of the other mode, and schemas and prompts the markup does not allow,
    before the kernel is asked."""
    if args.schema is None:
        if args.prompt:
            p.error("--prompt goes with --schema; --document takes --question")
        if args.cache is None:
            p.error("--document needs --cache PATH, the document's KV file")
        if not args.question:
            p.error("--document needs a --question or --question-file")
        return
    if args.question:
        p.error("--question goes with --document; a schema's prompt holds its question")
    if not args.prompt:
        p.error("--schema needs a --prompt or --prompt-file")
    try:
        args.schema = parse_schema(args.schema)
        args.prompt = [parse_prompt(text, args.schema) for text in args.prompt]
    except PMLError as e:
        p.error(str(e))


def ensure_cache(k: Kernel, path: str, document: list[int]) -> str | None:
    """Make the KV file of `document` at `path` unless it is there: "built", "dropped"
    (computed, but another process named its copy first), or None (there already).

    It is computed in an anonymous file and named once whole, so no reader ever sees a
    half-computed cache."""
    try:
        with k.open(path) as f:
            if f.read()[0] != document:
                raise ValueError(f"{path}: holds another document; unlink it to rebuild")
        return None
    except FileNotFoundError:
        pass
    with Context(k) as ctx:
        ctx.fill(document)
        try:
            ctx.save(path)
        except FileExistsError:  # another process made it meanwhile
            return "dropped"
        ctx.file.fsync()
    return "built"


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


def run_document(k: Kernel, args: argparse.Namespace) -> int:
    path = kv_path(k.home, args.cache)
    document = k.tokenize(args.document, add_special=True)
    start = time.perf_counter()
    made = ensure_cache(k, path, document)
    result = {
        "cache": path,
        "built": made == "built",
        "dropped": made == "dropped",
        "build_seconds": time.perf_counter() - start if made else 0.0,
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


def run_schema(k: Kernel, args: argparse.Namespace) -> int:
    schema: Schema = args.schema
    directory = f"{kv_path(k.home, args.cache or 'prompt-cache')}/{schema.name}"
    cache = ModuleCache(k, schema, directory)
    result: dict[str, Any] = {
        "schema": schema.name,
        "directory": directory,
        "positions": cache.end,
        **cache.ensure(),
        "answers": [],
    }
    if not args.json:
        for name, seconds in result["built"].items():
            print(f"built {directory}/{name} in {seconds:.3f} s")
        for name, seconds in result["dropped"].items():
            print(f"dropped {directory}/{name}, computed in {seconds:.3f} s: another run "
                  "linked it first")
    for prompt in args.prompt:
        a = cache.answer(prompt, args.max_new_tokens, sampling_kwargs(args))
        result["answers"].append(a)
        if not args.json:
            print(
                f"[{' '.join(prompt.modules)}] {prompt.question}\n{a['text']}\n"
                f"(computed {a['input_tokens']} tokens, {a['spliced_entries']} spliced; "
                f"time to first token {a['ttft']:.4f} s)\n"
            )
    # The kernel's own count of the tokens this process's preds computed.
    result["computed_tokens"] = int(proc_fields(k.procfs(f"{k.pid}/status"))["tokens"])
    if args.json:
        print(json.dumps(result))
    return 0


def run(k: Kernel, args: argparse.Namespace) -> int:
    if not k.model_info().has_tokenizer:
        raise ValueError("the model has no tokenizer")
    return run_schema(k, args) if args.schema is not None else run_document(k, args)


def main(argv: list[str] | None = None) -> int:
    return lip_main("prompt_cache", build_parser(), run, argv, check)


if __name__ == "__main__":
    sys.exit(main())
