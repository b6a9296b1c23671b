"""chat: a multi-turn conversation in one KV file, with the model's chat template.

    python lips/chat.py --system "You are terse." --message "Hi" --message "What is 2+2?"
    python lips/chat.py --save chats/today < questions.txt
    python lips/chat.py --system-file persona.txt --message-file long-question.txt

Each turn renders the whole conversation and sends only the tokens the file does not hold
yet, so earlier turns are never recomputed. Turns come from --message or --message-file
(a whole file, or with "--message -" all of stdin, is one turn), else from stdin lines.
Relative --save paths are under the user's home.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator

from syscalls.client import Kernel
from syscalls.context import Context, TextStream
from syscalls.flags import (
    add_sampling_flags,
    add_text_flags,
    check_flags,
    lip_main,
    sampling_kwargs,
    save_path,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="chat", description=__doc__.split("\n")[0])
    add_text_flags(p, "message", "a user turn, repeatable", action="append")
    add_text_flags(p, "system", "the system message")
    p.add_argument("--save", metavar="PATH", help="link the conversation's KV file here")
    add_sampling_flags(p)
    return p


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def turns(args: argparse.Namespace) -> Iterator[str]:
    if args.message:
        yield from args.message
        return
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        if line.strip():
            yield line.rstrip("\n")


def extend(ctx: Context, rendered: list[int]) -> None:
    """Make the context hold `rendered`: append what is new, after cutting back to the
    common prefix when the rendering does not extend what the file holds (a reply's tokens
    and the template's tokenization of the same text can differ)."""
    have = ctx.tokens
    keep = common_prefix(have, rendered)
    if keep < len(have):
        ctx.truncate(keep)
    ctx.fill(rendered[keep:])


def converse(
    k: Kernel, ctx: Context, messages: list[dict], user: Iterable[str], args: argparse.Namespace
) -> None:
    sampling = sampling_kwargs(args)
    for text in user:
        messages.append({"role": "user", "content": text})
        extend(ctx, k.tokenize(messages=messages, add_generation_prompt=True))
        stream = TextStream(k)
        for token in ctx.generate(args.max_new_tokens, **sampling):
            print(stream.push(token), end="", flush=True)
        print(stream.finish())
        messages.append({"role": "assistant", "content": stream.text})


def run(k: Kernel, args: argparse.Namespace) -> int:
    info = k.model_info()
    check_flags(args, info.has_tokenizer)
    if not info.has_tokenizer or not info.chat_template:
        raise ValueError(f"{info.name}: the model has no chat template")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    save = save_path(k, args.save) if args.save else None
    with Context(k, stop=info.eos_ids) as ctx:
        converse(k, ctx, messages, turns(args), args)
        if save:
            ctx.save(save)
    return 0


def main(argv: list[str] | None = None) -> int:
    return lip_main("chat", build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
