"""constrained: generate only output that conforms to a JSON Schema or a regular expression.

    python lips/constrained.py --prompt 'A user: ' --schema user.schema.json
    python lips/constrained.py --prompt 'A user: ' --json \\
        --schema '{"type": "object", "properties": {"age": {"type": "integer"}}}'
    python lips/constrained.py --prompt 'Date: ' --regex '20[0-9]{2}-[01][0-9]-[0-3][0-9]'

The grammar engine is llguidance. Its tokenizer is built from the kernel's vocabulary
(k.vocab(): every token's bytes and the special ids), so no tokenizer file is read here.
Each step, llguidance computes the bitmask of the tokens the grammar allows next, and the
mask goes to pred as it is (LogitControl(allowed=...)): the kernel samples only among those
tokens, greedy or with --temperature/--seed; the sampled token is committed to the grammar.
Generation ends when the grammar is complete (nothing more may follow, or the model samples
an EOS the grammar allows). A JSON Schema is compiled without free whitespace (compact JSON)
unless its "x-guidance" says otherwise; a regular expression must match the whole output.

--fast-forward: where the grammar forces what comes next (a JSON object's keys and
punctuation), those tokens go into the KV file with the next pred without being sampled,
split as the model's tokenizer splits them (k.tokenize): fewer preds for the same output.

Prints the output: the generated tokens' bytes, exactly what the grammar matched. --json
prints {"prompt_ids", "output_ids", "text", "complete", "preds", "matcher_us", "pred_us"}
(the last two: the LIP's time per output token in the grammar engine and in pred).
Exit status: 0 when the output conforms; 2 for bad flags, a bad schema or regular
expression (one that matches no string too); 3 when --max-new-tokens ran out, or the grammar
allowed no next token, before the output conformed (what there was is printed, and the
reason on stderr); 1 for other errors (a kernel error, no kernel).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import llguidance

from syscalls.client import Kernel
from syscalls.context import Context
from syscalls.convert import LogitControl, ModelInfo, Vocabulary
from syscalls.flags import (
    UsageError,
    add_prompt_flags,
    add_sampling_flags,
    check_context,
    check_flags,
    lip_main,
    prompt_of,
    sampling_kwargs,
    text_file,
)

PROG = "constrained"
INCOMPLETE = 3


class GrammarError(UsageError):
    """A schema or regular expression llguidance refuses (exit status 2)."""


# Compact JSON: free whitespace only gives a weak model room to wander (a schema's own
# "x-guidance" settings still win).
JSON_DEFAULTS = {"whitespace_flexible": False}


def _checked(grammar: str, what: str) -> str:
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"bad {what}: {error.strip()}")
    return grammar


def schema_grammar(schema: Any) -> str:
    """llguidance's grammar for a JSON Schema (an object or a boolean); GrammarError if bad."""
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"bad schema: a JSON Schema is an object or a boolean, "
                           f"not {type(schema).__name__}")
    if schema is False:
        raise GrammarError("bad schema: false allows no value at all")
    if schema is True:  # any value: the empty schema (llguidance takes options on objects)
        schema = {}
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, JSON_DEFAULTS)
    except ValueError as e:
        raise GrammarError(f"bad schema: {e}") from e
    return _checked(grammar, "schema")


@lru_cache(maxsize=1)
def _byte_tokenizer() -> llguidance.LLTokenizer:
    """The 256 bytes and an EOS: a vocabulary that can spell any output, to ask a grammar
    before the model's vocabulary is known whether it allows any output at all."""
    class Vocab:  # what llguidance.TokenizerWrapper reads
        tokens = [bytes([b]) for b in range(256)] + [b"</s>"]
        eos_token_id = 256
        bos_token_id = None
        special_token_ids = [256]

        def __call__(self, text: str) -> list[int]:
            return list(text.encode())

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocab()), n_vocab=257,
                                  eos_token=[256])


def regex_grammar(regex: str) -> str:
    """llguidance's grammar for a regular expression matching the whole output;
    GrammarError if bad, or if it matches no string (llguidance compiles those)."""
    grammar = _checked(llguidance.LLMatcher.grammar_from_regex(regex), "regex")
    m = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    mask = m.compute_bitmask()  # a dead grammar shows as an error only after this
    if m.is_error() or not m.is_accepting() and not any(mask):
        raise GrammarError("bad regex: it matches no string")
    return grammar


def schema_arg(value: str) -> str:
    """--schema: the schema itself when it starts with "{", else a file holding it."""
    inline = value.lstrip().startswith("{")
    try:
        return schema_grammar(json.loads(value if inline else text_file(value)))
    except json.JSONDecodeError as e:
        where = "" if inline else f"{value}: "
        raise argparse.ArgumentTypeError(f"{where}not JSON ({e})") from e
    except GrammarError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def regex_arg(value: str) -> str:
    try:
        return regex_grammar(value)
    except GrammarError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0],
                                epilog=__doc__.split("\n", 2)[2],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_flags(p)
    grammar = p.add_mutually_exclusive_group(required=True)
    grammar.add_argument("--schema", dest="grammar", type=schema_arg, metavar="FILE_OR_JSON",
                         help="a JSON Schema: a file, or the schema itself")
    grammar.add_argument("--regex", dest="grammar", type=regex_arg, metavar="REGEX",
                         help="a regular expression the whole output must match")
    add_sampling_flags(p)
    p.set_defaults(max_new_tokens=256)
    p.add_argument("--fast-forward", action="store_true",
                   help="tokens the grammar forces (a JSON object's keys) go in with the next "
                        "pred without being sampled: fewer preds; split by the model's tokenizer")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def grammar_tokenizer(
    vocab: Vocabulary, info: ModelInfo, model_split: Callable[[str], list[int]] | None = None
) -> llguidance.LLTokenizer:
    """llguidance's tokenizer from the kernel's vocabulary (k.vocab(), k.model_info()): every
    token's bytes, the special ids and the EOS ids; no tokenizer file is read. Text
    llguidance tokenizes itself (forced bytes; the masks do not depend on it) is split by
    longest match over the same bytes, or with `model_split` (k.tokenize, for fast-forward
    tokens, which go into the KV file) as the model splits it."""
    if not info.eos_ids:
        raise ValueError(f"the model {info.name} names no EOS token to end an output with")
    built: list[llguidance.LLTokenizer] = []

    @lru_cache(maxsize=4096)
    def tokenize(text: str) -> tuple[int, ...]:
        return tuple(model_split(text))

    class Vocab:  # what llguidance.TokenizerWrapper reads
        tokens = vocab.tokens
        eos_token_id = info.eos_ids[0]
        bos_token_id = info.bos_id if info.bos_id >= 0 else None
        special_token_ids = sorted(vocab.special_ids)

        def __call__(self, text: str | bytes) -> list[int]:
            if isinstance(text, bytes) or not built:  # the wrapper then hands us str
                raise TypeError("text only")
            return list(tokenize(text)) if model_split else built[0].greedy_tokenize(text)

    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocab()),
                                       n_vocab=len(vocab.tokens), eos_token=list(info.eos_ids))
    built.append(tokenizer)
    return tokenizer


def matcher(tokenizer: llguidance.LLTokenizer, grammar: str) -> llguidance.LLMatcher:
    m = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if m.is_error():
        raise GrammarError(f"bad grammar: {m.get_error().strip()}")
    return m


@dataclass
class Output:
    tokens: list[int] = field(default_factory=list)
    complete: bool = False
    preds: int = 0  # sampled tokens, and an EOS that ended them (forced ones are not)
    matcher_s: float = 0.0  # computing masks and committing tokens
    pred_s: float = 0.0  # waiting for pred


def decode(ctx: Context, m: llguidance.LLMatcher, max_new_tokens: int,
           sampling: dict[str, Any], eos_ids: tuple[int, ...],
           fast_forward: bool = False) -> Output:
    """Sample after ctx's pending tokens under the grammar until it is complete or
    max_new_tokens are out; the last tokens stay pending in ctx, as after Context.step.
    fast_forward: the tokens the grammar forces go in with the next pred, unsampled."""
    out, seed = Output(), sampling.get("seed")
    clock = time.perf_counter
    while len(out.tokens) < max_new_tokens:
        t0 = clock()
        if m.is_stopped():  # nothing may follow: no need to ask the model for EOS
            break
        if fast_forward and (forced := m.compute_ff_tokens()):
            forced = forced[: max_new_tokens - len(out.tokens)]
            if not m.consume_tokens(forced):
                raise ValueError(f"the grammar refused its own forced tokens {forced}: "
                                 f"{m.get_error()}")
            ctx.pending += forced
            out.tokens += forced
            if m.is_stopped() or len(out.tokens) == max_new_tokens:
                out.matcher_s += clock() - t0
                break
        mask = m.compute_bitmask()  # llguidance's packed int32 words: pred's layout
        # A dead end (llguidance then allows only EOS, as an error): the output cannot conform.
        if m.is_error() or not any(mask):
            out.matcher_s += clock() - t0
            break
        t1 = clock()
        step = ctx.step(control=LogitControl(allowed=mask),
                        **{**sampling, "seed": None if seed is None else seed + out.preds})
        t2 = clock()
        out.matcher_s += t1 - t0
        out.pred_s += t2 - t1
        out.preds += 1
        if step.token in eos_ids:  # allowed only where the grammar may end
            break
        if not m.consume_token(step.token):
            raise ValueError(f"the grammar refused token {step.token}, which its mask "
                             f"allowed: {m.get_error()}")
        out.tokens.append(step.token)
        out.matcher_s += clock() - t2
    out.complete = m.is_accepting() and not m.is_error()
    return out


def run(k: Kernel, args: argparse.Namespace) -> int:
    info = k.model_info()
    check_flags(args, info.has_tokenizer)
    prompt = prompt_of(k, args)
    check_context(prompt, args.max_new_tokens, info.context_length)
    tokenizer = grammar_tokenizer(k.vocab(), info, k.tokenize if args.fast_forward else None)
    m = matcher(tokenizer, args.grammar)
    with Context(k, stop=info.eos_ids) as ctx:
        ctx.fill(prompt)
        out = decode(ctx, m, args.max_new_tokens,
                     sampling_kwargs(args), info.eos_ids, args.fast_forward)
    text = tokenizer.decode_bytes(out.tokens).decode("utf-8", errors="replace")
    if args.json:
        n = max(len(out.tokens), 1)
        print(json.dumps({"prompt_ids": prompt, "output_ids": out.tokens, "text": text,
                          "complete": out.complete, "preds": out.preds,
                          "matcher_us": round(out.matcher_s / n * 1e6, 1),
                          "pred_us": round(out.pred_s / n * 1e6, 1)}))
    else:
        print(text)
    if not out.complete:
        why = (f"--max-new-tokens {args.max_new_tokens} ran out" if len(out.tokens)
               == args.max_new_tokens else "the grammar allowed no next token")
        print(f"{PROG}: incomplete: {why} before the output conformed", file=sys.stderr)
        return INCOMPLETE
    return 0


def main(argv: list[str] | None = None) -> int:
    return lip_main(PROG, build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
