"""Command-line pieces shared by the LIPs and `symphony generate`.

They live here, not in the daemon's package, because LIPs may import only `syscalls`.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import math
import os
import select
import signal
import sys
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from syscalls.aio import AsyncKernel
    from syscalls.client import Kernel


def number(kind: type, low: float, high: float | None = None, *,
           above: bool = False) -> Callable[[str], Any]:
    """An argparse type: a `kind` (int or float) in [low, high] ((low, high] when `above`:
    low itself refused; no bound above when high is None), finite, else the flag's usage
    error (exit status 2) saying the range, and for a float that it must be finite ("must
    be a finite number >= 0, got nan"; "> 0" when `above`)."""
    def parse(text: str) -> Any:
        value = kind(text)  # a ValueError is argparse's "invalid int value: ..."
        if (kind is float and not math.isfinite(value) or value < low
                or above and value == low or high is not None and value > high):
            if high is None:
                bound = f"{'>' if above else '>='} {low}"
            else:
                bound = f"in {'(' if above else '['}{low}, {high}]"
            what = "a finite number " if kind is float else ""
            raise argparse.ArgumentTypeError(f"must be {what}{bound}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """The sampling flags, each checked as the kernel checks it (but top-k against the
    vocabulary, which only the kernel knows): a bad value is a usage error, exit status 2,
    before the kernel is asked."""
    p.add_argument("--max-new-tokens", type=number(int, 1), default=64,
                   help="default %(default)s")
    p.add_argument("--greedy", action="store_true", help="argmax decoding (the default)")
    p.add_argument("--temperature", type=number(float, 0),
                   help="sample at this temperature")
    p.add_argument("--top-k", type=number(int, 0), default=0,
                   help="default %(default)s: no limit")
    p.add_argument("--top-p", type=number(float, 0, 1), default=1.0,
                   help="default %(default)s: no limit")
    p.add_argument("--min-p", type=number(float, 0, 1), default=0.0,
                   help="default %(default)s: no limit")
    p.add_argument("--seed", type=number(int, -(1 << 63), (1 << 63) - 1),
                   help="a reproducible sample (default: none)")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags as keyword arguments: `Kernel.pred`, `Context.generate` and the
    engine's SamplingParams all take these names."""
    sampled = args.temperature is not None and not args.greedy
    return {
        "temperature": args.temperature if sampled else 0.0,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "min_p": args.min_p,
        "seed": args.seed,
    }


def at_least_one(p: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """Exit 2 with usage (parser.error) when one of the integer flags `names` (attribute
    names, max_new_tokens for --max-new-tokens) is below 1."""
    for name in names:
        value = getattr(args, name)
        if value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def check_flags(args: argparse.Namespace, has_tokenizer: bool) -> None:
    """Refuse what cannot run: a text prompt for a model without a tokenizer (as
    `symphony generate` does)."""
    if getattr(args, "prompt", None) is not None and not has_tokenizer:
        raise ValueError("the model has no tokenizer; use --prompt-ids")


class UsageError(ValueError):
    """A bad flag that only the kernel's (or the model's) answers show: a prompt with no
    tokens, or one too long for the model's context. Exit status 2, as argparse's."""


def nonempty(prompt: list[int]) -> list[int]:
    """The prompt, else UsageError: a prompt must have a token to go on from."""
    if not prompt:
        raise UsageError("empty prompt: --prompt or --prompt-file gave no tokens")
    return prompt


def in_vocabulary(ids: list[int], vocab_size: int) -> list[int]:
    """--prompt-ids' ids, else UsageError naming the flag and an id the model's vocabulary
    lacks (the kernel's EINVAL names no flag)."""
    for token in ids:
        if not 0 <= token < vocab_size:
            raise UsageError(f"--prompt-ids: token {token} is outside [0, {vocab_size}), "
                             "the vocabulary")
    return ids


def prompt_of(k: Kernel, args: argparse.Namespace) -> list[int]:
    """The prompt flags' token ids: text gets the tokenizer's own BOS handling, as in
    `symphony generate`. UsageError for a prompt with no tokens, or an id outside the
    vocabulary."""
    if args.prompt is None:
        return in_vocabulary(args.prompt_ids, k.model_info().vocab_size)
    return nonempty(k.tokenize(args.prompt, add_special=True))


async def aprompt_of(k: AsyncKernel, args: argparse.Namespace) -> list[int]:
    """prompt_of for an asyncio LIP."""
    if args.prompt is None:
        return in_vocabulary(args.prompt_ids, (await k.model_info()).vocab_size)
    return nonempty(await k.tokenize(args.prompt, add_special=True))


def check_context(prompt: list[int], max_new_tokens: int, context: int) -> None:
    """UsageError where the prompt and --max-new-tokens together pass the model's context:
    refused before anything is generated, as OpenAI's API does, rather than cut short (or
    failed with EOVERFLOW) part way."""
    if len(prompt) + max_new_tokens > context:
        raise UsageError(f"--max-new-tokens {max_new_tokens}: the prompt's {len(prompt)} "
                         f"tokens and {max_new_tokens} new ones pass the model's context of "
                         f"{context} positions")


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(",", " ").split()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--prompt-ids wants integers: {e}") from e
    if not ids:
        raise argparse.ArgumentTypeError("no token ids (the prompt would be empty)")
    return ids


def stdin_text(data: bytes, offset: int = 0) -> str:
    """`data`, read from standard input at byte `offset`, as text: UTF-8 whatever the locale
    (as --NAME-file reads a file), newlines as text mode reads them; else UsageError naming
    standard input and the offset of the first byte that is not UTF-8."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"standard input: not UTF-8 text (byte {e.object[e.start]:#04x} at "
                         f"offset {offset + e.start})") from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def text_arg(value: str) -> str:
    """A text flag's value; "-" reads the text from standard input (stdin_text), bytes that
    are not UTF-8 being the flag's usage error."""
    if value != "-":
        return value
    try:
        return stdin_text(sys.stdin.buffer.read())
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def text_file(path: str) -> str:
    """An argparse type: the UTF-8 text of the file at `path`; a file that cannot be read,
    or is not UTF-8, is the flag's usage error naming the file and why."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{path}: {e.strerror}") from e
    except UnicodeDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})"
        ) from e


def add_text_flags(p: argparse._ActionsContainer, flag: str, what: str, **kw: Any) -> None:
    """--FLAG TEXT ("-": standard input) and --FLAG-file PATH, either one giving args.FLAG
    the text. A prompt need not be on the command line, which every user's ps shows."""
    dest = flag.replace("-", "_")
    p.add_argument(f"--{flag}", dest=dest, type=text_arg, metavar="TEXT",
                   help=f"{what} (- reads it from standard input)", **kw)
    p.add_argument(f"--{flag}-file", dest=dest, type=text_file, metavar="PATH",
                   help=f"{what}, read from a file", **kw)


def add_prompt_flags(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    add_text_flags(src, "prompt", "the prompt")
    src.add_argument("--prompt-ids", type=parse_ids, metavar="IDS",
                     help="the prompt as token ids: 1,2,3")


def kv_path(home: str, path: str) -> str:
    """A KV file path from the command line: relative ones are taken from the user's home,
    since the kernel's namespace has no working directory."""
    return path if path.startswith("/") else f"{home.rstrip('/')}/{path}"


def _exists(path: str) -> FileExistsError:
    """As the kernel says it of a path: quoted ("'/home/u/x': File exists")."""
    return FileExistsError(errno.EEXIST, f"{path!r}: {os.strerror(errno.EEXIST)}")


def save_path(k: Kernel, path: str) -> str:
    """kv_path for --save, checked before the work it is to keep: OSError where a link there
    would fail now (the path exists, its directory does not or is not writable); the link
    at the end still reports what changed meanwhile."""
    path = kv_path(k.home, path)
    k.access(path.rpartition("/")[0] or "/", os.W_OK | os.X_OK)
    try:
        k.access(path)
    except FileNotFoundError:
        return path
    raise _exists(path)


async def asave_path(k: AsyncKernel, path: str) -> str:
    """save_path for an asyncio LIP."""
    path = kv_path(k.home, path)
    await k.access(path.rpartition("/")[0] or "/", os.W_OK | os.X_OK)
    try:
        await k.access(path)
    except FileNotFoundError:
        return path
    raise _exists(path)


def reader_gone(e: BaseException) -> bool:
    """Whether `e` is stdout's reader having gone (`symphony ps | head -1`), not a kernel's
    EPIPE: a BrokenPipeError while stdout is a pipe with no reader (poll says POLLERR)."""
    if not isinstance(e, BrokenPipeError):
        return False
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # None, closed, or not a file (pytest's)
        return False
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    return any(events & select.POLLERR for _, events in poll.poll(0))


def report(prog: str, e: BaseException) -> int:
    """Print `prog: message` to stderr and give the exit status for it. When stdout's
    reader has gone (reader_gone) nothing is printed: the status is 141 (128 + SIGPIPE), a
    shell's for a program killed by SIGPIPE, as git and coreutils end, and the rest of
    stdout goes to /dev/null (flushed at exit, it would fail again)."""
    if reader_gone(e):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 128 + signal.SIGPIPE
    if isinstance(e, UsageError):
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    message = str(e)
    if isinstance(e, OSError) and e.strerror:
        # Kernel messages often name only the object ("'/home/u/x'"): add what went wrong.
        reason = os.strerror(e.errno) if e.errno else ""
        said = e.strerror.lower()
        message = e.strerror if reason.lower() in said else f"{e.strerror}: {reason}"
        # A local file's error names it (open("-") says only "No such file or directory").
        if e.filename is not None and str(e.filename) not in message:
            message = f"{e.filename}: {message}"
    print(f"{prog}: {message}", file=sys.stderr)
    return 1


def each(what: str, items: Iterable[Any], act: Callable[[Any], None]) -> int:
    """act(item) for every item, as rm(1), cat(1) and kill(1) go on: one that fails
    (OSError) does not stop the others; each failure is said, `symphony: WHAT: ITEM:
    REASON`; the status is 1 if any failed. A reader gone from stdout stops it (report)."""
    status = 0
    for item in items:
        try:
            act(item)
        except OSError as e:
            if reader_gone(e):
                raise
            reason = os.strerror(e.errno) if e.errno else str(e)
            print(f"symphony: {what}: {item}: {reason}", file=sys.stderr)
            status = 1
    return status


def stdout_flushed(prog: str, main: Callable[[], int]) -> int:
    """main()'s exit status, stdout flushed before it is returned (or before argparse's
    exit, --help's, goes on): not at the interpreter's exit, where a reader gone would be
    Python's "Exception ignored ... BrokenPipeError". Such a BrokenPipeError, there or in a
    write that main did not catch, is report's: quiet, 141. Ctrl-C (KeyboardInterrupt that
    main did not catch) is 130, quietly, as a shell's own commands end: no traceback (the
    kernel frees what the program held as it exits)."""
    try:
        try:
            return main()
        finally:
            sys.stdout.flush()
    except BrokenPipeError as e:
        return report(prog, e)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


def lip_main(
    prog: str,
    parser: argparse.ArgumentParser,
    run: Callable[[Kernel, argparse.Namespace], int],
    argv: list[str] | None,
    check: Callable[[argparse.ArgumentParser, argparse.Namespace], None] | None = None,
) -> int:
    """What a synchronous LIP's main does: parse, check (a bad flag exits 2 through
    parser.error), connect, run, and report a failure; stdout_flushed."""
    from syscalls.client import Kernel

    def main() -> int:
        args = parser.parse_args(argv)
        if check is not None:
            check(parser, args)
        try:
            with Kernel.connect() as k:
                return run(k, args)
        except (OSError, ValueError) as e:
            return report(prog, e)

    return stdout_flushed(prog, main)


def alip_main(
    prog: str,
    parser: argparse.ArgumentParser,
    run: Callable[[AsyncKernel, argparse.Namespace], Awaitable[int]],
    argv: list[str] | None,
    check: Callable[[argparse.ArgumentParser, argparse.Namespace], None] | None = None,
) -> int:
    """lip_main for an asyncio LIP: `run` is a coroutine function."""
    from syscalls.aio import AsyncKernel

    def main() -> int:
        args = parser.parse_args(argv)
        if check is not None:
            check(parser, args)

        async def session() -> int:
            async with await AsyncKernel.connect() as k:
                return await run(k, args)

        try:
            return asyncio.run(session())
        except (OSError, ValueError) as e:
            return report(prog, e)

    return stdout_flushed(prog, main)
