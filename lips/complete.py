"""complete: continue a prompt, as `symphony generate` does, through the kernel.

    python lips/complete.py --prompt "def fibonacci(n):" --max-new-tokens 64
    python lips/complete.py --prompt-ids 1,2,3 --json --temperature 0.8 --seed 0
    python lips/complete.py --prompt - < prompt.txt      # or --prompt-file prompt.txt

Same flags and output as `symphony generate`: text mode streams the prompt and then each
token's text as it comes; --json prints {"prompt_ids", "output_ids", "text"}; a model
without a tokenizer prints ids. A prompt on the command line is in every user's ps(1):
a private one comes from standard input (--prompt -) or a file (--prompt-file).
"""

from __future__ import annotations

import argparse
import json
import sys

from syscalls.client import Kernel
from syscalls.context import Context, TextStream
from syscalls.flags import (
    add_prompt_flags,
    add_sampling_flags,
    check_context,
    check_flags,
    lip_main,
    prompt_of,
    sampling_kwargs,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="complete", description=__doc__.split("\n")[0])
    add_prompt_flags(p)
    add_sampling_flags(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def run(k: Kernel, args: argparse.Namespace) -> int:
    info = k.model_info()
    check_flags(args, info.has_tokenizer)
    prompt = prompt_of(k, args)
    check_context(prompt, args.max_new_tokens, info.context_length)
    stream = None
    if info.has_tokenizer and not args.json:
        stream = TextStream(k)
    out = []
    shown = ""  # the end of the text streamed so far: an error first ends its line
    try:
        if stream:
            shown = args.prompt or ""
            print(shown, end="", flush=True)
        with Context(k, stop=info.eos_ids) as ctx:
            ctx.fill(prompt)
            for token in ctx.generate(args.max_new_tokens, **sampling_kwargs(args)):
                out.append(token)
                if stream:
                    piece = stream.push(token)
                    shown = (shown + piece)[-1:]
                    print(piece, end="", flush=True)
    except BaseException:
        if shown and not shown.endswith("\n"):
            print(flush=True)
        raise
    if stream:
        print(stream.finish())
    elif args.json:
        result = {"prompt_ids": prompt, "output_ids": out}
        if info.has_tokenizer:
            result["text"] = k.detokenize(out)
        print(json.dumps(result))
    else:
        print(" ".join(map(str, out)))
    return 0


def main(argv: list[str] | None = None) -> int:
    return lip_main("complete", build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
