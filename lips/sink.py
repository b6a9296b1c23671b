"""sink: attention sinks (StreamingLLM): generate or score far past the model's context.

    python lips/sink.py --prompt "def parse(line):" --max-new-tokens 10000 --ignore-eos
    python lips/sink.py --stream book.txt --sinks 4 --window 1020 --json   # perplexity

One KV file holds the first --sinks tokens (the "attention sinks" every later token leans
on, Xiao et al. 2023) and the latest --window tokens. When a pred would overflow the window,
the oldest --slide window tokens are punched out (their whole pages freed) and the rest are
shifted down (File.shift re-rotates their keys), so positions stay cache-relative: sinks at
0..sinks-1, the window right after them, never at or past the model's context. Punched
entries keep their places in the file, so once they add up to a window the file is
compacted with keep: pages and file entries both stay bounded however long the run.
Moving part of a file is StreamingLLM's approximation (the moved entries' deeper layers
were computed next to tokens now gone); before the first slide it is plain decoding.

--stream FILE feeds the text through the sink --slide tokens per pred and prints the
perplexity of every token after the first (each scored in the pred that holds the token
before it), with pages and entries held. Without --stream it continues the prompt, as
lips/complete.py does, for any number of tokens; summaries go to stderr (--json: stdout).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from syscalls.client import File, Kernel
from syscalls.context import TextStream
from syscalls.convert import LogitControl, PredOutput
from syscalls.flags import (
    UsageError,
    add_sampling_flags,
    add_text_flags,
    lip_main,
    number,
    parse_ids,
    prompt_of,
    sampling_kwargs,
    text_file,
)

SINKS = 4
SLIDE = 64


def check_shape(sinks: int, window: int, slide: int, context: int) -> None:
    """Refuse a sink that cannot fit the model's context or cannot slide."""
    if sinks < 0 or window < 1:
        raise UsageError(f"--sinks must be >= 0 and --window >= 1, got {sinks} and {window}")
    if sinks + window > context:
        raise UsageError(f"--sinks + --window must be at most the model's context "
                         f"({context}), got {sinks} + {window}")
    if not 1 <= slide <= window:
        raise UsageError(f"--slide must be in [1, --window = {window}], got {slide}")


class Sink:
    """A KV file that holds the first `sinks` tokens fed and the latest `window` others.

    Feed it with `pred` (at most `slide` tokens at a time): it makes room first. Entries
    [0, sinks) are the sinks, [sinks, first) punched ones, [first, length) the window."""

    def __init__(self, file: File, sinks: int, window: int, slide: int, context: int):
        check_shape(sinks, window, slide, context)
        self.file, self.sinks, self.window, self.slide = file, sinks, window, slide
        self.length = 0  # entries in the file, punched ones included
        self.first = sinks  # the oldest window entry still in attention
        self.fed = 0  # tokens fed since the start
        self.slides = self.compactions = 0
        self.max_pages = self.max_entries = 0

    @property
    def live(self) -> int:
        """Window entries in attention."""
        return max(0, self.length - self.first)

    @property
    def window_start(self) -> int:
        """The index, among the tokens fed, of the oldest window token in attention."""
        return max(self.sinks, self.fed - self.live)

    def note(self) -> None:
        self.max_pages = max(self.max_pages, self.file.stat().pages)
        self.max_entries = max(self.max_entries, self.length)

    def make_room(self, n: int) -> None:
        """Evict the oldest window tokens (at least `slide`) if n more would not fit."""
        over = self.live + n - self.window
        if over <= 0:
            return
        self.note()  # the file is at its fullest just before a slide
        drop = min(self.live, max(over, self.slide))
        self.file.punch(self.first, self.first + drop)
        self.first += drop
        if self.first < self.length:  # the window goes on right after the sinks
            self.file.shift(self.first, self.length, -drop)
        self.slides += 1
        if self.first - self.sinks >= self.window:
            # Punched entries stay in the file's metadata: drop them, moving the window down.
            self.file.keep(self.sinks, range(self.first, self.length))
            self.length, self.first = self.sinks + self.live, self.sinks
            self.compactions += 1

    def pred(self, tokens: Sequence[int], **options: Any) -> list[PredOutput]:
        """File.pred of up to `slide` tokens, after making room for them."""
        if len(tokens) > self.slide:
            raise ValueError(f"sink: {len(tokens)} tokens in one pred, more than --slide")
        self.make_room(len(tokens))
        outs = self.file.pred(tokens, **options)
        self.length += len(tokens)
        self.fed += len(tokens)
        return outs

    def prefill(self, ids: Sequence[int]) -> None:
        for a in range(0, len(ids), self.slide):
            self.pred(ids[a:a + self.slide], no_outputs=True)

    def score(self, ids: Sequence[int]) -> tuple[list[float], list[int]]:
        """Feed `ids`; the logprob of each of ids[1:] given what the sink held when it came,
        and the index in `ids` of the oldest window token that was in attention then."""
        logprobs: list[float] = []
        starts: list[int] = []
        for a in range(0, len(ids), self.slide):
            chunk, b = ids[a:a + self.slide], min(a + self.slide, len(ids))
            rows = len(chunk) if b < len(ids) else len(chunk) - 1
            if rows == 0:
                self.pred(chunk, no_outputs=True)
                continue
            # The last row's next token is the next chunk's first: asked for by id.
            control = LogitControl(score=[ids[b]]) if b < len(ids) else None
            outs = self.pred(chunk, outputs=range(rows), score_next=True, control=control)
            start = self.window_start
            logprobs += [o.next_logprob if o.row + 1 < len(chunk) else o.scores[0] for o in outs]
            starts += [start] * rows
            self.note()
        return logprobs, starts

    def generate(self, prompt: Sequence[int], max_new_tokens: int, stop: Sequence[int] = (),
                 **sampling: Any) -> Iterator[int]:
        """Continue `prompt` for up to max_new_tokens tokens, ending after a stop token."""
        self.prefill(prompt[:-1])
        pending, seed = prompt[-1], sampling.get("seed")
        for i in range(max_new_tokens):
            if seed is not None:
                sampling["seed"] = seed + i
            (out,) = self.pred([pending], **sampling)
            pending = out.token
            yield pending
            if pending in stop:
                break
        self.note()

    def figures(self) -> dict[str, int]:
        return {"sinks": self.sinks, "window": self.window, "slide": self.slide,
                "tokens": self.fed, "slides": self.slides, "compactions": self.compactions,
                "max_pages": self.max_pages, "end_pages": self.file.stat().pages,
                "max_entries": self.max_entries, "end_entries": self.length}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sink", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n", 1)[1])
    src = p.add_mutually_exclusive_group(required=True)
    add_text_flags(src, "prompt", "the prompt to continue")
    src.add_argument("--prompt-ids", type=parse_ids, metavar="IDS",
                     help="the prompt as token ids: 1,2,3")
    src.add_argument("--stream", type=text_file, metavar="FILE",
                     help="score this text file through the sink and print its perplexity")
    p.add_argument("--sinks", type=number(int, 0), default=SINKS,
                   help=f"first tokens always kept (default {SINKS})")
    p.add_argument("--window", type=number(int, 1),
                   help="latest tokens kept besides the sinks (default: context - sinks)")
    p.add_argument("--slide", type=number(int, 1),
                   help=f"tokens evicted at once, and per pred with --stream (default "
                        f"{SLIDE}, at most the window)")
    p.add_argument("--limit", type=number(int, 2), metavar="N",
                   help="--stream: only the first N tokens of the file")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    add_sampling_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def open_sink(k: Kernel, args: argparse.Namespace) -> Sink:
    info = k.model_info()
    window = info.context_length - args.sinks if args.window is None else args.window
    slide = min(SLIDE, max(window, 1)) if args.slide is None else args.slide
    file = k.open()
    try:
        return Sink(file, args.sinks, window, slide, info.context_length)
    except ValueError:
        file.close()
        raise


def stream(k: Kernel, args: argparse.Namespace) -> int:
    if not k.model_info().has_tokenizer:
        raise ValueError("the model has no tokenizer: --stream needs one")
    ids = k.tokenize(args.stream, add_special=True)[:args.limit]
    if len(ids) < 2:
        raise ValueError("--stream: fewer than 2 tokens, nothing to score")
    sink = open_sink(k, args)
    with sink.file:
        logprobs, _ = sink.score(ids)
        result: dict[str, Any] = sink.figures()
    nll = -sum(logprobs) / len(logprobs)
    result.update(scored=len(logprobs), nll=nll, perplexity=math.exp(nll))
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['tokens']} tokens, {result['scored']} scored: perplexity "
              f"{result['perplexity']:.3f} ({nll:.4f} nats); pages max {result['max_pages']}, "
              f"end {result['end_pages']}; entries max {result['max_entries']}; "
              f"{result['slides']} slides, {result['compactions']} compactions")
    return 0


def generate(k: Kernel, args: argparse.Namespace) -> int:
    info = k.model_info()
    if args.prompt is not None and not info.has_tokenizer:
        raise ValueError("the model has no tokenizer; use --prompt-ids")
    prompt = prompt_of(k, args)
    stop = () if args.ignore_eos else info.eos_ids
    text = TextStream(k) if info.has_tokenizer and not args.json else None
    sink = open_sink(k, args)  # its flags checked against the model before any output
    if text:
        print(args.prompt or "", end="", flush=True)
    out: list[int] = []
    with sink.file:
        for token in sink.generate(prompt, args.max_new_tokens, stop, **sampling_kwargs(args)):
            out.append(token)
            if text:
                print(text.push(token), end="", flush=True)
        result: dict[str, Any] = sink.figures()
    if args.json:
        result = {"prompt_ids": prompt, "output_ids": out, **result}
        if info.has_tokenizer:
            result["text"] = k.detokenize(out)
        print(json.dumps(result))
        return 0
    if text:
        print(text.finish())
    else:
        print(" ".join(map(str, out)))
    print(f"sink: {len(out)} tokens; pages max {result['max_pages']}, end {result['end_pages']}; "
          f"entries max {result['max_entries']}; {result['slides']} slides, "
          f"{result['compactions']} compactions", file=sys.stderr)
    return 0


def run(k: Kernel, args: argparse.Namespace) -> int:
    return stream(k, args) if args.stream is not None else generate(k, args)


def main(argv: list[str] | None = None) -> int:
    return lip_main("sink", build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
