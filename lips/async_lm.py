"""async_lm: asynchronous function calling (AsyncLM): tools run while the model goes on writing.

    python lips/async_lm.py --prompt "def fibonacci(n):" --script calls.json --json
    python lips/async_lm.py --prompt "def fibonacci(n):" --script calls.json --sync

The protocol is text in the context (AsyncLM's markers). The model calls a tool by writing

    [CALL] ID [HEAD] TOOL: ARGS [END]

and the program starts the tool at once, as a subprocess, and lets generation go on. When
the tool returns, the program injects

    [INTR] ID [HEAD] VALUE [END]

into the KV file: one pred appends the interrupt after the last sampled token and samples
the next token after it, so the model reads the result from then on. An interrupt waits
while the model is in the middle of writing a call. A tool that fails, exits non-zero or
runs past --timeout gives the value "error: ...", never a crash.

Tools: `python: CODE` runs CODE with `python -I -c` (the value is its standard output);
`sh: COMMAND ARGS` runs a command of the --allow list, without a shell.

The model stops at --max-new-tokens (or at EOS). Calls still running are then waited for
(AsyncLM's trap), their results injected, and the model writes --answer-tokens more: its
answer, which sees every result. --sync is the baseline: generation waits for each call
and its result is injected before the next token, as synchronous function calling does.

The prompt, the script's text, --max-new-tokens and --answer-tokens must fit the model's
context together (else status 2, before anything runs). Results, whose length no one knows
in advance, may still fill it: the task then stops before the tokens that would pass it,
says so on stderr, waits for the calls still running, and prints what it has.

Scripted mode (--script FILE): a model not fine-tuned on the protocol (the models here
are not) will not write calls by itself, so a script teacher-forces the call text at given
points: FILE holds a JSON list of {"after": N, "text": "..."}, and each text goes into
the context after the model has sampled N tokens, as if the model had written it (it is
parsed the same way). The figures of a scripted run measure the system (tools, decoding
and injection overlapping), not the model's skill at calling tools. Example FILE:

    [{"after": 4, "text": " [CALL] 1 [HEAD] python: import time; time.sleep(1); print(6*7) [END]"},
     {"after": 8, "text": " [CALL] 2 [HEAD] sh: echo hello [END]"}]

Output: the text as it grows (prompt, tokens, forced text, interrupts), then a line with
the calls and the end-to-end seconds; --json prints one object with every segment of the
KV file (kind, tokens, seconds since the start) and every call (dispatch, return and
injection times, value). --save PATH names the KV file.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import json
import os
import shlex
import signal
import sys
import textwrap
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from syscalls.aio import AsyncKernel
from syscalls.context import AsyncContext
from syscalls.flags import (
    UsageError,
    add_prompt_flags,
    add_sampling_flags,
    alip_main,
    aprompt_of,
    asave_path,
    number,
    sampling_kwargs,
    text_file,
)

CALL, HEAD, END = b"[CALL]", b"[HEAD]", b"[END]"
MARKERS = ("[CALL]", "[HEAD]", "[END]", "[INTR]")
TOOLS = ("python", "sh")
DEFAULT_ALLOW = "echo,sleep,date,expr,seq,wc"


def interrupt_text(call_id: str, value: str) -> str:
    return f" [INTR] {call_id} [HEAD] {value} [END]"


@dataclass
class Call:
    """One tool call, its times in seconds since the task began."""

    id: str
    code: str  # between [HEAD] and [END]: TOOL: ARGS
    dispatched: float
    dispatched_after: int  # tokens sampled when it was dispatched
    returned: float | None = None
    injected: float | None = None
    injected_after: int | None = None
    value: str = ""
    ok: bool = False
    tokens: list[int] = field(default_factory=list, repr=False)  # the interrupt's


@dataclass
class Segment:
    """A run of entries of the KV file, in file order: prompt, generated, forced or
    interrupt; `at`: seconds since the task began, when they were decided."""

    kind: str
    tokens: list[int]
    at: float
    call: str | None = None


class ContextFull(Exception):
    """The next tokens would pass the model's context: the task stops before them."""


@dataclass(frozen=True)
class Forced:
    after: int
    text: str


class CallParser:
    """Finds `[CALL] ID [HEAD] CODE [END]` in the text the model writes (sampled and
    teacher-forced tokens, not the prompt or the interrupts), on bytes, so a marker may
    be split across tokens."""

    def __init__(self, token_bytes: list[bytes]):
        self.token_bytes = token_bytes
        self.text = bytearray()
        self.scan = 0  # no call starts before this offset
        self.count = 0

    def feed(self, tokens: list[int]) -> list[tuple[str, str]]:
        """The (id, code) of each call the tokens complete."""
        self.text += b"".join(self.token_bytes[t] for t in tokens)
        calls = []
        while (start := self.text.find(CALL, self.scan)) >= 0:
            end = self.text.find(END, start)
            if end < 0:
                break
            self.count += 1
            head, sep, code = self.text[start + len(CALL) : end].partition(HEAD)
            call_id = head.strip().decode(errors="replace") or str(self.count)
            calls.append((call_id, code.strip().decode(errors="replace") if sep else ""))
            self.scan = end + len(END)
        if start < 0:  # no call begun: only a marker's first bytes may still grow into one
            self.scan = max(self.scan, len(self.text) - len(CALL) + 1)
        return calls

    @property
    def open(self) -> bool:
        """Inside a call the model has begun and not ended."""
        return self.text.find(CALL, self.scan) >= 0


@dataclass(frozen=True)
class Tools:
    timeout: float
    allow: frozenset[str]
    enabled: frozenset[str]
    max_chars: int

    def argv(self, code: str) -> list[str]:
        """The subprocess for `TOOL: ARGS`; ValueError says why there is none."""
        tool, sep, args = code.partition(":")
        tool = tool.strip()
        if not sep or tool not in TOOLS:
            raise ValueError(f"no tool in {code[:40]!r} (want TOOL: ARGS, TOOL one of "
                             f"{', '.join(TOOLS)})")
        if tool not in self.enabled:
            raise ValueError(f"tool {tool} is not enabled (--tools)")
        if tool == "python":
            return [sys.executable, "-I", "-c", textwrap.dedent(args).strip()]
        argv = shlex.split(args)
        if not argv or argv[0] not in self.allow:
            raise ValueError(f"command {argv[0] if argv else '(none)'!r} is not allowed "
                             f"(--allow {','.join(sorted(self.allow))})")
        return argv

    async def run(self, code: str) -> tuple[str, bool]:
        """The call's value and whether it succeeded; every failure is a value."""
        try:
            argv = self.argv(code)
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, start_new_session=True)
        except (OSError, ValueError) as e:
            return f"error: {e}", False
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.timeout)
        except TimeoutError:
            return f"error: timed out after {self.timeout:g} s", False
        finally:
            if proc.returncode is None:  # timed out or cancelled: its whole session goes
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await proc.wait()
        if proc.returncode:
            lines = err.decode(errors="replace").strip().splitlines() or [""]
            return self.clip(f"error: exit {proc.returncode}: {lines[-1]}"), False
        return self.clip(out.decode(errors="replace").strip()), True

    def clip(self, value: str) -> str:
        # A value must not close or open a marker of its own.
        for m in MARKERS:
            value = value.replace(m, m.replace("[", "(").replace("]", ")"))
        return value if len(value) <= self.max_chars else value[: self.max_chars - 3] + "..."


class Task:
    """One generation with tool calls in one KV file, and its record."""

    def __init__(self, k: AsyncKernel, ctx: AsyncContext, token_bytes: list[bytes],
                 special: frozenset[int], tools: Tools, sync: bool, echo: bool, context: int):
        self.k, self.ctx, self.tools, self.sync, self.context = k, ctx, tools, sync, context
        self.parser = CallParser(token_bytes)
        self.token_bytes, self.special = token_bytes, special
        self.segments: list[Segment] = []
        self.calls: list[Call] = []
        self.ready: list[Call] = []  # returned, not injected yet
        self.running: set[asyncio.Task] = set()
        self.sampled = 0
        self.length = 0  # the segments' tokens: the file's and the pending ones
        self.full: str | None = None  # why the task stopped at the context's end
        self.start = time.monotonic()
        self.text = codecs.getincrementaldecoder("utf-8")(errors="replace") if echo else None

    def now(self) -> float:
        return time.monotonic() - self.start

    async def record(self, kind: str, tokens: list[int], call: str | None = None) -> None:
        """Note tokens that went (or go, with the next pred) into the file; dispatch the
        calls they complete."""
        self.length += len(tokens)
        last = self.segments[-1] if self.segments else None
        if kind == "generated" and last and last.kind == kind:
            last.tokens += tokens
        else:
            self.segments.append(Segment(kind, list(tokens), self.now(), call))
        if self.text:
            data = b"".join(self.token_bytes[t] for t in tokens if t not in self.special)
            print(self.text.decode(data), end="", flush=True)
        if kind in ("generated", "forced"):
            for call_id, code in self.parser.feed(tokens):
                await self.dispatch(Call(call_id, code, self.now(), self.sampled))

    def make_room(self, n: int, what: str) -> None:
        """ContextFull where `n` more tokens (`what`) would pass the model's context."""
        if self.length + n > self.context:
            raise ContextFull(f"stopped after {self.sampled} tokens sampled: the KV file's "
                              f"{self.length} tokens and {what} would pass the model's "
                              f"context of {self.context} positions")

    async def put(self, kind: str, tokens: list[int], what: str, call: str | None = None
                  ) -> None:
        """Add tokens that go in with the next pred, where they fit."""
        self.make_room(len(tokens), what)
        await self.ctx.fill(tokens)
        await self.record(kind, tokens, call)

    async def dispatch(self, call: Call) -> None:
        self.calls.append(call)
        if self.sync:
            await self.finish(call)
        else:
            task = asyncio.create_task(self.finish(call))
            self.running.add(task)
            task.add_done_callback(self.running.discard)

    async def finish(self, call: Call) -> None:
        call.value, call.ok = await self.tools.run(call.code)
        call.tokens = await self.k.tokenize(interrupt_text(call.id, call.value))
        call.returned = self.now()
        self.ready.append(call)

    async def inject_ready(self) -> None:
        """Results that came back go in with the next pred, in the order they came."""
        ready, self.ready = self.ready, []
        for call in ready:
            await self.put("interrupt", call.tokens,
                           f"call {call.id}'s result ({len(call.tokens)} tokens)", call.id)
            call.injected, call.injected_after = self.now(), self.sampled

    async def settle(self) -> None:
        """Wait for every call still running."""
        while self.running:
            await asyncio.gather(*self.running)

    async def wait_all(self) -> None:
        """AsyncLM's trap: generation waits for every call still running."""
        await self.settle()
        await self.inject_ready()

    async def sample(self, sampling: dict[str, Any]) -> int:
        if sampling.get("seed") is not None:
            sampling = {**sampling, "seed": sampling["seed"] + self.sampled}
        self.make_room(1, "a sampled token")
        out = await self.ctx.step(**sampling)  # pending tokens, interrupts included: one pred
        self.sampled += 1
        await self.record("generated", [out.token])
        return out.token

    async def run(self, prompt: list[int], script: list[tuple[int, list[int]]],
                  max_new_tokens: int, answer_tokens: int, stop: tuple[int, ...],
                  sampling: dict[str, Any]) -> None:
        """Generate, and flush the KV file; at the context's end, stop (self.full says why),
        wait for the calls still running, and flush what was written."""
        try:
            await self.generate(prompt, script, max_new_tokens, answer_tokens, stop, sampling)
        except ContextFull as e:
            self.full = str(e)
            await self.settle()  # their values are in the report, not in the file
        await self.ctx.flush()

    async def generate(self, prompt: list[int], script: list[tuple[int, list[int]]],
                       max_new_tokens: int, answer_tokens: int, stop: tuple[int, ...],
                       sampling: dict[str, Any]) -> None:
        await self.ctx.fill(prompt)  # it fits: run() checked it with the new tokens
        await self.record("prompt", prompt)
        todo = deque(script)
        limit, answering, stopped = max_new_tokens, False, False
        while True:
            while todo and todo[0][0] <= self.sampled:
                tokens = todo.popleft()[1]
                await self.put("forced", tokens, f"the script's next text ({len(tokens)} tokens)")
            if not self.parser.open:
                await self.inject_ready()
            if stopped or self.sampled >= limit:
                if answering:
                    break
                await self.wait_all()
                answering, stopped, limit = True, False, self.sampled + answer_tokens
                if answer_tokens == 0:
                    break
            token = await self.sample(sampling)
            # A scripted task is not over while calls are still to be forced.
            stopped = token in stop and not todo
        await self.wait_all()  # calls the answer made

    def report(self) -> dict[str, Any]:
        calls = [{k: v for k, v in asdict(c).items() if k != "tokens"} for c in self.calls]
        return {"mode": "sync" if self.sync else "async", "seconds": self.now(),
                "sampled": self.sampled, "context_full": self.full is not None, "calls": calls,
                "segments": [asdict(s) for s in self.segments]}


# -- the command line -----------------------------------------------------------------------


def script_file(path: str) -> list[Forced]:
    """--script FILE: a JSON list of {"after": N, "text": TEXT}."""
    try:
        entries = json.loads(text_file(path))
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{path}: not JSON: {e}") from e
    if not isinstance(entries, list):
        raise argparse.ArgumentTypeError(f"{path}: want a JSON list of {{after, text}}")
    forced = []
    for i, e in enumerate(entries):
        after, text = (e.get("after"), e.get("text")) if isinstance(e, dict) else (None, None)
        if type(after) is not int or after < 0 or not isinstance(text, str) or not text:
            raise argparse.ArgumentTypeError(
                f"{path}: entry {i} wants an integer \"after\" >= 0 and a non-empty \"text\"")
        forced.append(Forced(after, text))
    return sorted(forced, key=lambda f: f.after)


def names(text: str) -> frozenset[str]:
    return frozenset(n.strip() for n in text.split(",") if n.strip())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="async_lm", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_prompt_flags(p)
    add_sampling_flags(p)
    p.add_argument("--script", type=script_file, default=[], metavar="FILE",
                   help='teacher-force call text: a JSON list of {"after": N, "text": ...}')
    p.add_argument("--sync", action="store_true",
                   help="synchronous calling (the baseline): wait for each result")
    p.add_argument("--answer-tokens", type=int, default=16,
                   help="tokens written once every result is in (default 16)")
    p.add_argument("--timeout", type=number(float, 0, above=True), default=10.0,
                   help="seconds a tool may run, a finite number > 0 (default 10)")
    p.add_argument("--tools", type=names, default=frozenset(TOOLS),
                   help=f"tools enabled (default {','.join(TOOLS)})")
    p.add_argument("--allow", type=names, default=names(DEFAULT_ALLOW),
                   help=f"commands the sh tool may run (default {DEFAULT_ALLOW})")
    p.add_argument("--max-result-chars", type=int, default=200,
                   help="a longer value is cut (default 200)")
    p.add_argument("--save", metavar="PATH", help="name the KV file (relative: in your home)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what cannot run, before any kernel is asked (argparse's exit 2)."""
    if args.answer_tokens < 0:
        p.error(f"--answer-tokens must be >= 0, got {args.answer_tokens}")
    if args.max_result_chars < 8:
        p.error(f"--max-result-chars must be >= 8, got {args.max_result_chars}")
    if not args.tools or not args.tools <= set(TOOLS):
        p.error(f"--tools must name some of {', '.join(TOOLS)}, got "
                f"{','.join(sorted(args.tools)) or 'none'}")
    late = [f.after for f in args.script if f.after > args.max_new_tokens]
    if late:
        p.error(f"--script: text after {late[0]} tokens is never reached with "
                f"--max-new-tokens {args.max_new_tokens}")


async def run(k: AsyncKernel, args: argparse.Namespace) -> int:
    info = await k.model_info()
    if not info.has_tokenizer:
        raise ValueError("the model has no tokenizer, and the call protocol is text")
    prompt = await aprompt_of(k, args)
    vocab = await k.vocab()
    script = [(f.after, await k.tokenize(f.text)) for f in args.script]
    forced = sum(len(tokens) for _, tokens in script)
    new = args.max_new_tokens + args.answer_tokens
    if len(prompt) + forced + new > info.context_length:
        raise UsageError(f"--max-new-tokens {args.max_new_tokens} and --answer-tokens "
                         f"{args.answer_tokens}: the prompt's {len(prompt)} tokens, the "
                         f"script's {forced} and {new} new ones pass the model's context of "
                         f"{info.context_length} positions")
    tools = Tools(args.timeout, args.allow, args.tools, args.max_result_chars)
    save = await asave_path(k, args.save) if args.save else None  # before the work it keeps
    async with await AsyncContext.create(k, stop=info.eos_ids) as ctx:
        task = Task(k, ctx, vocab.tokens, vocab.special_ids, tools, args.sync,
                    echo=not args.json, context=info.context_length)
        await task.run(prompt, script, args.max_new_tokens, args.answer_tokens,
                       info.eos_ids, sampling_kwargs(args))
        result = task.report()
        if save:
            await ctx.save(save)
    if args.json:
        print(json.dumps({"prompt_ids": prompt, "scripted": bool(script), **result}))
    else:
        print(f"\n[{len(result['calls'])} calls, {result['sampled']} tokens sampled, "
              f"{result['seconds']:.2f} s end to end, {result['mode']}"
              f"{', scripted' if script else ''}]")
    if task.full:
        print(f"async_lm: {task.full}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return alip_main("async_lm", build_parser(), run, argv, check_args)


if __name__ == "__main__":
    sys.exit(main())
