"""agent: a ReAct-style tool-using agent whose conversation lives in one KV file.

    python lips/agent.py --question "What is 6 * 7?" --script task.jsonl --root notes/
    python lips/agent.py --question-file q.txt --root notes/ --tries 4 --seed 1 --json
    python lips/agent.py --question "..." --script task.jsonl --resend --json  # comparison

The transcript is plain text: a preamble naming the tools, "Question: ...", then turns of
"Thought: ...", "Action: TOOL[INPUT]", "Observation: ...", until "Action: finish[ANSWER]".
The program runs the tools itself:

    python[CODE]   CODE in a fresh Python subprocess (`python -I -c CODE`, cwd --root), killed
                   after --tool-timeout seconds; the observation is what it printed
    lookup[PATH]   the text of PATH under --root; a path that leads outside it is refused
    finish[ANSWER] ends the run

Each observation is appended to the same KV file as the model's tokens: the conversation is
computed once, never sent again. With --tries N, each thought is a decision point: the file
is forked N ways (copy-on-write), N thoughts are sampled concurrently (temperature 1.0
unless given), the one of the best mean logprob (in free mode, one that names an action
first) goes on in its fork, and the others and the old file are closed.

The small models here are not tuned for ReAct, so --script FILE teacher-forces the actions:
JSON lines {"action": "python"|"lookup"|"finish", "input": "..."}, one per turn. The model
still writes each thought (up to a newline or --max-new-tokens), then the script's action is
appended. Without --script the model must write "Action: TOOL[INPUT]" itself.

--resend runs the same agent the way a client of a prompt-based server must: every turn
the whole conversation so far is prefilled into a fresh file. --json prints the turns and
the token counts of the run: computed_tokens (the kernel's count for this process),
prefill_tokens (those not fed back while decoding), conversation_tokens, and the kernel's
accel_seconds (forward-pass time charged to the process).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from syscalls.client import Kernel
from syscalls.context import Context
from syscalls.convert import proc_fields
from syscalls.flags import (
    add_sampling_flags,
    add_text_flags,
    at_least_one,
    check_context,
    lip_main,
    number,
    sampling_kwargs,
    save_path,
    text_file,
)

TOOLS = ("python", "lookup", "finish")
# The longest --tool-timeout: a day (subprocess waits fail past about 24 days).
MAX_TOOL_TIMEOUT = 86400
PREAMBLE = ("Answer the question. After each Thought comes one Action: python[code] runs "
            "Python and shows what it prints, lookup[path] shows a file, finish[answer] "
            "gives the answer. An Observation follows each other action.\n")
ACTION = re.compile(r"Action:\s*(\w+)\[(.*)\]", re.S)


@dataclass
class Action:
    tool: str
    input: str


@dataclass
class Thought:
    tokens: list[int]
    text: str
    mean_logprob: float
    fed: int  # sampled tokens sent back one per pred (decoding, not prefill)
    action: Action | None = None  # free mode: what the model wrote


@dataclass
class Turn:
    context_tokens: int  # the conversation's length when the thought began
    thought: str
    tool: str
    input: str
    observation: str | None = None
    tries: list[float] = field(default_factory=list)  # each try's mean logprob


def read_script(path: str) -> list[Action]:
    """The actions of a --script file; ValueError names the line that is wrong."""
    try:
        lines = text_file(path).splitlines()
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"--script {e}") from e
    actions = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--script {path}:{n}: not JSON: {e.msg}") from e
        if (not isinstance(entry, dict) or entry.get("action") not in TOOLS
                or not isinstance(entry.get("input"), str)):
            raise ValueError(f"--script {path}:{n}: want {{\"action\": one of {TOOLS}, "
                             f"\"input\": text}}, got {line.strip()}")
        actions.append(Action(entry["action"], entry["input"]))
    if not actions:
        raise ValueError(f"--script {path}: no actions")
    return actions


@dataclass
class Tools:
    root: Path  # resolved
    timeout: float
    limit: int  # characters of an observation

    def run(self, action: Action) -> str:
        if action.tool == "python":
            text = self.python(action.input)
        elif action.tool == "lookup":
            text = self.lookup(action.input)
        else:
            text = f"no tool {action.tool!r}: use python, lookup or finish"
        text = text.strip()
        return text if len(text) <= self.limit else text[: self.limit] + " ..."

    def python(self, code: str) -> str:
        # A session of its own, so that the timeout kills whatever the snippet started.
        proc = subprocess.Popen([sys.executable, "-I", "-c", code], cwd=self.root,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace",
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return f"timed out after {self.timeout:g} s"
        return out if proc.returncode == 0 else f"{out}(exit status {proc.returncode})"

    def lookup(self, name: str) -> str:
        path = (self.root / name.strip()).resolve()  # symlinks too: no way out through one
        if not path.is_relative_to(self.root):
            return f"refused: {name} is outside the root"
        try:
            return path.read_text(errors="replace")
        except OSError as e:
            return f"{name}: {e.strerror}"


class Agent:
    """The loop: think, act, observe, append. Subclasses say where the conversation lives."""

    def __init__(self, k: Kernel, args: argparse.Namespace, script: list[Action] | None):
        self.k, self.args, self.script = k, args, script
        self.info = k.model_info()
        self.pieces = k.vocab().tokens  # each token's bytes: stop checks need no syscall
        self.tools = Tools(Path(args.root).resolve(), args.tool_timeout, args.max_observation)
        self.sampling = sampling_kwargs(args)
        self.decode_tokens = 0  # tokens fed back one per pred while sampling
        self.generated_tokens = 0  # of the thoughts kept
        self.forced_tokens = 0

    def think(self, ctx: Context, seed: int | None) -> Thought:
        """Sample one thought: up to a newline (scripted) or a whole action line (free)."""
        tokens: list[int] = []
        logprob, text, fed = 0.0, "", 0
        sampling = {**self.sampling, "seed": seed}
        for step, out in enumerate(ctx.samples(self.args.max_new_tokens, **sampling)):
            fed = step
            if out.token in ctx.stop:  # no end of text inside the transcript
                del ctx.pending[-1]
                break
            tokens.append(out.token)
            logprob += out.logprob
            text = b"".join(self.pieces[t] for t in tokens).decode(errors="replace")
            if self.done(text):
                break
        thought = Thought(tokens, text, logprob / max(1, len(tokens)), fed)
        if self.script is None and (m := ACTION.search(text)):
            thought.action = Action(m.group(1), m.group(2))
        return thought

    def done(self, text: str) -> bool:
        if self.script is not None:
            return "\n" in text.lstrip()  # a thought, not an empty line
        return "\n" in text.partition("Action:")[2]

    def seed(self, turn: int, branch: int) -> int | None:
        if self.sampling["seed"] is None:
            return None
        return random.Random(f"{self.sampling['seed']}/{turn}/{branch}").getrandbits(32)

    def append(self, ids: list[int]) -> None:
        raise NotImplementedError

    def length(self) -> int:
        raise NotImplementedError

    def decide(self, turn: int) -> tuple[Thought, list[float]]:
        raise NotImplementedError

    def show(self, text: str) -> None:
        if not self.args.json:
            print(text, end="", flush=True)

    def run(self) -> tuple[list[Turn], str | None]:
        """The turns and the answer (None: no finish). A question too long for the model's
        context is a usage error; the run stops before a turn or an observation that would
        pass it, saying so on stderr."""
        question = self.args.question.strip()
        ids = self.k.tokenize(f"{PREAMBLE}Question: {question}\nThought:", add_special=True)
        check_context(ids, self.args.max_new_tokens, self.info.context_length)
        self.forced_tokens += len(ids)
        self.append(ids)
        self.show(f"Question: {question}\n")
        turns: list[Turn] = []
        for turn in range(self.args.max_turns):
            if self.script is not None and turn == len(self.script):
                break
            context = self.length()
            if context + self.args.max_new_tokens > self.info.context_length:
                self.full(len(turns), "a thought of --max-new-tokens "
                          f"{self.args.max_new_tokens}")
                break
            self.show("Thought:")  # the cue is in the conversation; shown where one follows
            thought, tries = self.decide(turn)
            self.generated_tokens += len(thought.tokens)
            self.show(thought.text)
            action = thought.action if self.script is None else self.script[turn]
            forced = "" if thought.text.rstrip(" \t").endswith("\n") else "\n"
            if self.script is not None:
                forced += f"Action: {action.tool}[{action.input}]\n"
            if action is None:
                action = Action("none", "")
                observation = "no action: write Action: python[code], lookup[path] or " \
                              "finish[answer]"
            elif action.tool == "finish":
                turns.append(Turn(context, thought.text, action.tool, action.input,
                                  tries=tries))
                self.force(forced, len(turns))
                return turns, action.input
            else:
                observation = self.tools.run(action)
            turns.append(Turn(context, thought.text, action.tool, action.input, observation,
                              tries))
            if not self.force(f"{forced}Observation: {observation}\nThought:", len(turns)):
                break
        return turns, None

    def force(self, text: str, turns: int) -> bool:
        """Append text the program writes, and show it (but a closing "Thought:" cue);
        False, with nothing appended, where it would pass the model's context."""
        ids = self.k.tokenize(text)
        if self.length() + len(ids) > self.info.context_length:
            self.full(turns, f"the next {len(ids)} tokens of forced text")
            return False
        self.forced_tokens += len(ids)
        self.append(ids)
        self.show(text.removesuffix("Thought:"))
        return True

    def full(self, turns: int, what: str) -> None:
        print(f"agent: stopped after {turns} turns: the conversation's {self.length()} tokens "
              f"and {what} would pass the model's context of {self.info.context_length} "
              f"positions", file=sys.stderr)


class KeptAgent(Agent):
    """The conversation in one KV file: every turn appends only its new tokens."""

    def __init__(self, k: Kernel, args: argparse.Namespace, script: list[Action] | None):
        super().__init__(k, args, script)
        self.save = save_path(k, args.save) if args.save else None  # checked before the run
        self.ctx = Context(k, stop=self.info.eos_ids)
        self.discarded_tokens = 0  # computed by the tries that lost

    def append(self, ids: list[int]) -> None:
        self.ctx.fill(ids)  # written with the pred that samples the next thought

    def length(self) -> int:
        return self.ctx.file.stat().tokens + len(self.ctx.pending)

    def decide(self, turn: int) -> tuple[Thought, list[float]]:
        tries = self.args.tries
        if tries == 1:
            thought = self.think(self.ctx, self.seed(turn, 0))
            self.decode_tokens += thought.fed
            return thought, [thought.mean_logprob]
        branches = [self.ctx.fork() for _ in range(tries)]
        base = self.ctx.file.stat().tokens
        with ThreadPoolExecutor(tries) as pool:  # their preds share forward passes
            thoughts = list(pool.map(lambda i: self.think(branches[i], self.seed(turn, i)),
                                     range(tries)))
        self.decode_tokens += sum(t.fed for t in thoughts)
        best = max(range(tries),
                   key=lambda i: (thoughts[i].action is not None, thoughts[i].mean_logprob))
        for i, branch in enumerate(branches):
            if i != best:
                self.discarded_tokens += branch.file.stat().tokens - base
                branch.close()
        self.ctx.close()
        self.ctx = branches[best]
        return thoughts[best], [t.mean_logprob for t in thoughts]

    def finish(self) -> dict[str, Any]:
        self.ctx.flush()
        if self.save:
            self.ctx.save(self.save)
        return {"conversation_tokens": self.ctx.file.stat().tokens,
                "discarded_tokens": self.discarded_tokens}


class ResentAgent(Agent):
    """For comparison, a prompt-based server's client: the conversation is kept as token
    ids and prefilled into a fresh file every turn."""

    def __init__(self, k: Kernel, args: argparse.Namespace, script: list[Action] | None):
        super().__init__(k, args, script)
        self.ids: list[int] = []

    def append(self, ids: list[int]) -> None:
        self.ids += ids

    def length(self) -> int:
        return len(self.ids)

    def decide(self, turn: int) -> tuple[Thought, list[float]]:
        with Context(self.k, stop=self.info.eos_ids) as ctx:
            ctx.fill(self.ids)
            thought = self.think(ctx, self.seed(turn, 0))
        self.decode_tokens += thought.fed
        self.ids += thought.tokens
        return thought, [thought.mean_logprob]

    def finish(self) -> dict[str, Any]:
        return {"conversation_tokens": len(self.ids), "discarded_tokens": 0}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agent", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    add_text_flags(src, "question", "the task")
    p.add_argument("--script", metavar="PATH",
                   help="teacher-forced actions, JSON lines {\"action\", \"input\"}")
    p.add_argument("--root", default=".", metavar="DIR",
                   help="lookup's root and python's working directory (default .)")
    p.add_argument("--tool-timeout", type=number(float, 0, MAX_TOOL_TIMEOUT, above=True),
                   default=10.0, metavar="S",
                   help=f"seconds a python snippet may run, in (0, {MAX_TOOL_TIMEOUT}] "
                        "(default 10)")
    p.add_argument("--max-observation", type=int, default=2000, metavar="CHARS",
                   help="observations are cut to this many characters (default 2000)")
    p.add_argument("--max-turns", type=int, default=8, metavar="N", help="default 8")
    p.add_argument("--tries", type=int, default=1, metavar="N",
                   help="fork each decision point N ways and keep the best thought")
    p.add_argument("--resend", action="store_true",
                   help="resend the whole conversation every turn (the comparison)")
    p.add_argument("--save", metavar="PATH", help="link the conversation's KV file here")
    add_sampling_flags(p)
    p.add_argument("--json", action="store_true", help="the turns and the token counts")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Bad flags end the program with usage and status 2, before the kernel is asked; the
    script's actions go to args.actions."""
    at_least_one(p, args, "tries", "max_turns", "max_observation", "max_new_tokens")
    if not Path(args.root).is_dir():
        p.error(f"--root {args.root}: not a directory")
    if args.tries > 1:
        if args.resend:
            p.error("--tries forks the KV file; --resend keeps none")
        if args.greedy:
            p.error("--tries > 1 samples: drop --greedy")
        if args.temperature is None:
            args.temperature = 1.0
    if args.resend and args.save:
        p.error("--resend keeps no KV file to --save")
    try:
        args.actions = None if args.script is None else read_script(args.script)
    except ValueError as e:
        p.error(str(e))


def run(k: Kernel, args: argparse.Namespace) -> int:
    script = args.actions
    start = time.perf_counter()
    if not k.model_info().has_tokenizer:
        raise ValueError("the model has no tokenizer")
    agent = (ResentAgent if args.resend else KeptAgent)(k, args, script)
    turns, answer = agent.run()
    counts = agent.finish()
    status = proc_fields(k.procfs(f"{k.pid}/status"))  # the kernel's own count
    computed = int(status["tokens"])
    result = {
        "question": args.question, "mode": "free" if script is None else "scripted",
        "resend": args.resend, "answer": answer, "turns": [vars(t) for t in turns],
        "computed_tokens": computed, "prefill_tokens": computed - agent.decode_tokens,
        "generated_tokens": agent.generated_tokens, "forced_tokens": agent.forced_tokens,
        **counts, "open_files": int(status["fds"]), "pages": int(status["pages"]),
        "accel_seconds": float(status["accel_seconds"]),
        "wall_s": round(time.perf_counter() - start, 4),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"\nAnswer: {answer}" if answer is not None else "\n(no answer)")
    return 0


def main(argv: list[str] | None = None) -> int:
    return lip_main("agent", build_parser(), run, argv, check_args)


if __name__ == "__main__":
    sys.exit(main())
