"""chat: a multi-turn conversation in one KV file, with the model's chat template.

    python lips/chat.py --system "You are terse." --message "Hi" --message "What is 2+2?"
    python lips/chat.py --save chats/today < questions.txt
    python lips/chat.py --system-file persona.txt --message-file long-question.txt

Each turn renders the whole conversation and sends only the tokens the file does not hold
yet, so earlier turns are never recomputed. Turns come from --message or --message-file
(a whole file, or with "--message -" all of stdin, is one turn), else from stdin lines.
Relative --save paths are under the user's home. A turn that with --max-new-tokens would
pass the model's context ends the conversation before it; --save keeps the turns answered.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator

from syscalls.client import Kernel
from syscalls.context import Context, TextStream
from syscalls.flags import (
    UsageError,
    add_sampling_flags,
    add_text_flags,
    check_flags,
    lip_main,
    sampling_kwargs,
    save_path,
    stdin_text,
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
    """The user's turns: --message's, else stdin's lines (UsageError at one that is not
    UTF-8, naming its offset)."""
    if args.message:
        yield from args.message
        return
    interactive = sys.stdin.isatty()
    offset = 0
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        raw = sys.stdin.buffer.readline()
        if not raw:
            return
        line = stdin_text(raw, offset)
        offset += len(raw)
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


class ContextFull(ValueError):
    """A turn and --max-new-tokens would pass the model's context: the conversation stops
    before it (a pred past the context fails EOVERFLOW part way through a reply)."""


def converse(
    k: Kernel,
    ctx: Context,
    messages: list[dict],
    user: Iterable[str],
    args: argparse.Namespace,
    context: int,
) -> None:
    """Answer each user turn, streaming the replies. ContextFull before a turn that would
    pass the context, nothing of it sent: the file holds the turns answered."""
    sampling = sampling_kwargs(args)
    for answered, text in enumerate(user):
        asked = [*messages, {"role": "user", "content": text}]
        rendered = k.tokenize(messages=asked, add_generation_prompt=True)
        if len(rendered) + args.max_new_tokens > context:
            raise ContextFull(
                f"stopped after {answered} turn{'' if answered == 1 else 's'}: the "
                "conversation with the next turn is "
                f"{len(rendered)} tokens, and with --max-new-tokens {args.max_new_tokens} it "
                f"would pass the model's context of {context} positions; start a new "
                "conversation")
        extend(ctx, rendered)
        stream = TextStream(k)
        for token in ctx.generate(args.max_new_tokens, **sampling):
            print(stream.push(token), end="", flush=True)
        print(stream.finish())
        messages = [*asked, {"role": "assistant", "content": stream.text}]


def run(k: Kernel, args: argparse.Namespace) -> int:
    info = k.model_info()
    check_flags(args, info.has_tokenizer)
    if not info.has_tokenizer or not info.chat_template:
        raise ValueError(f"{info.name}: the model has no chat template")
    messages = [{"role": "system", "content": args.system}] if args.system else []
    save = save_path(k, args.save) if args.save else None
    stopped = None
    with Context(k, stop=info.eos_ids) as ctx:
        try:
            converse(k, ctx, messages, turns(args), args, info.context_length)
        except (ContextFull, UsageError) as e:  # --save keeps the turns answered before it
            stopped = e
        if save:
            ctx.save(save)
    if stopped is not None:
        raise stopped
    return 0


def main(argv: list[str] | None = None) -> int:
    return lip_main("chat", build_parser(), run, argv)


if __name__ == "__main__":
    sys.exit(main())
