"""Fuzz the kernel (issue 13): random syscalls from several root and unprivileged processes,
some killed mid-call, for a bounded time; then look for what must never happen.

    python bench/fuzz.py [--seconds 60] [--workers 6] [--seed 0] [--model DIR | --socket S]
                         [--ops pred,kill,...] [--kill-every 3] [--ignore KIND] [--json F]

It starts a kernel daemon on a small random-weight checkpoint (or on --model; or it talks to
the kernel at --socket, which must have no other clients), then runs --workers OS processes
until --seconds are up: root and uids 60001/60002 (they drop privileges after importing, so
Python may live where those users cannot read; without root every worker runs as the
caller). Workers use the sync client (pred through the syscall rings or over gRPC, one to
three threads) or the asyncio client (many calls in flight, preds cancelled mid-flight). Each
makes random calls from the whole syscall table with a seeded RNG, valid-looking ones and
deliberately bad ones: bad and closed fds; negative and huge ranges, counts, positions,
tokens, sampler values and seeds; relative, empty, long, deep, non-ASCII and other users'
paths, /tmp, /home; mode, flag and id garbage; links and renames of others' files and of
the namespace's skeleton; imports of mutated exports; /proc names with odd digits; kills of
any pid, its own included; nice extremes; raw request bytes, lifeline frames, scribbles on
a syscall ring of their own (a tail or head that cannot be, records that do not parse, of
unknown kinds, FRAMED with no frame, random bytes) and `symphony-as` values. The first
worker also grows directory trees past a thousand levels (mkdir chains in /tmp grafted by
rename onto one in its home). Meanwhile the parent SIGKILLs random workers and starts them
again (bounded).

A FINDING is: an EIO (a kernel fault: no client mistake may cause one); an exception that is
not an OSError with an errno (client-range: the library let an int too big for its field
escape as ValueError); a call that hangs; a wrong answer; a traceback in the kernel's log; a
process not reaped, or a page not freed, once every worker is gone (meminfo's used pages
against the pages the named files hold, shared pages once, and the pages charged to users
against the pages each user's named files hold, a page once per user holding it); a stop
(SIGTERM) that does not exit 0; a restart that does not bring the named files back. Each
comes with a reproducer line: the call, its arguments, its fds' story and who made it (the
seed fixes every worker's choices, though not how the workers interleave); a finding about
the whole run names the command. The summary lists calls per (call, errno)
and the findings, grouped; the exit status is 1 when any was found (but --ignore'd kinds).
--ops narrows the calls to find which ones a finding needs.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures.thread  # noqa: F401  (asyncio.to_thread's, before setuid)
import copy
import errno
import json
import math
import os
import posixpath
import random
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Run as a script, this file's folder comes first on sys.path, and bench/kvfs.py would hide
# the kvfs package from anything imported here.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import grpc.aio  # noqa: E402,F401  (imported before a worker drops its privileges)

from syscalls import convert, errors, ring, wire  # noqa: E402
from syscalls import symphony_pb2 as pb  # noqa: E402
from syscalls.aio import AsyncKernel  # noqa: E402
from syscalls.client import Kernel  # noqa: E402
from syscalls.convert import LogitControl, proc_fields  # noqa: E402
from syscalls.session import AS_KEY, SESSION_KEY, hello, open_session  # noqa: E402

USERS = (60001, 60002)
PATH_BUDGET = 4000  # grafts keep every chain's path under PATH_MAX, so a walk reaches all
HOISTS = 64  # at most so many walks that move trees up before the leak check gives up
HANG_S = 30.0  # a call that takes longer is reported as a hang
COUNT_EVERY_S = 0.5  # how often a worker sends its counts to the parent
ANY_OSERROR = "-"  # the errno column of an OSError without one (a finding)


# -- arguments that say how they were made -----------------------------------------------


class Shown(str):
    """A string argument that reprs as the expression that made it: `'/tmp/' + 'd/' * 900`."""

    text: str

    def __new__(cls, value: str, text: str) -> Shown:
        s = super().__new__(cls, value)
        s.text = text
        return s

    def __repr__(self) -> str:
        return self.text


class ShownBytes(bytes):
    """Bytes that repr as how they were made: `<flip bits of export('/tmp/fz/a'), 812 bytes>`
    (an import's data is not worth printing)."""

    text: str

    def __new__(cls, value: bytes, text: str) -> ShownBytes:
        s = super().__new__(cls, value)
        s.text = text
        return s

    def __repr__(self) -> str:
        return self.text


def join(base: str, name: str) -> str:
    """base/name, still short in a reproducer when either part is long."""
    if isinstance(base, Shown) or isinstance(name, Shown):
        return Shown(f"{base}/{name}", f"{base!r} + '/' + {name!r}")
    return f"{base}/{name}"


def compact(path: str) -> Shown:
    """The path, shown with its runs of a repeated name as products:
    `'/tmp/fz/deep-w0a' + '/d' * 300 + '/g17' + '/d' * 12`."""
    runs: list[list] = []
    for name in path.split("/")[1:]:
        if runs and runs[-1][0] == name:
            runs[-1][1] += 1
        else:
            runs.append([name, 1])
    exprs, literal = [], "" if path.startswith("/") or not path else path.split("/")[0]
    for name, n in runs:
        if n >= 4:
            if literal:
                exprs.append(repr(literal))
                literal = ""
            exprs.append(f"{'/' + name!r} * {n}")
        else:
            literal += f"/{name}" * n
    if literal:
        exprs.append(repr(literal))
    return Shown(path, " + ".join(exprs) or repr(path))


class ShownList(list):
    """A list that reprs as the expression that made it: `[7] * 5000`."""

    text: str

    def __init__(self, value: list, text: str):
        super().__init__(value)
        self.text = text

    def __repr__(self) -> str:
        return self.text


def short(value: Any, limit: int = 160) -> str:
    """repr, cut to `limit`, except for values that say how they were made (always short
    enough, and needed whole to reproduce)."""
    text = repr(value)
    if isinstance(value, Shown | ShownBytes | ShownList):
        return text
    return text if len(text) <= limit else f"{text[:limit]}...<{len(text)} chars>"


# -- one call ----------------------------------------------------------------------------


@dataclass
class Op:
    """One syscall as a worker makes it: `k.<method>(*args, **kwargs)`, or a raw_* method of
    the worker, or a sequence of steps (stopping at the first error)."""

    method: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    then: Callable[[Any], None] | None = None  # on success, with the result
    check: Callable[[Any], str | None] | None = None  # a wrong answer, described
    as_value: str | None = None  # the raw `symphony-as` metadata value to send
    steps: list[Op] = field(default_factory=list)
    fds: dict[int, str] = field(default_factory=dict)  # the fds it names, and their story
    ends_session: bool = False
    tolerate: tuple[int, ...] = ()  # errnos that do not end a sequence of steps
    failed: Callable[[OSError], None] | None = None  # on an OSError
    done: Callable[[], None] | None = None  # at the end, whatever happened
    cancel_after: float | None = None  # asyncio: cancel the call after this many seconds

    @property
    def name(self) -> str:
        """What the counts call it."""
        if self.as_value is not None:
            return f"as:{self.method}"
        if self.method == "raw_bytes":
            return f"raw:{self.args[0]}"
        return self.method.removeprefix("raw_")

    def repro(self) -> str:
        parts = [short(a) for a in self.args] + [f"{k}={short(v)}" for k, v in self.kwargs.items()]
        who = "k" if self.as_value is None else f"k.acting_as_raw({self.as_value!r})"
        return f"{who}.{self.method}({', '.join(parts)})"


@dataclass(frozen=True)
class Role:
    uid: int
    kind: str  # "sync" or "async"
    lifeline_pred: bool
    threads: int  # sync: threads sharing the session; async: tasks
    builder: bool = False  # makes deep directory trees more often than the others

    def describe(self) -> str:
        how = "rings" if self.lifeline_pred else "grpc"
        return (f"uid {self.uid} {self.kind} x{self.threads} pred on {how}"
                + (", deep trees" if self.builder else ""))


ROLES = (  # the first N are used: the first five cover every kind of client
    Role(0, "sync", True, 3, builder=True),
    Role(60001, "sync", False, 2),
    Role(0, "async", True, 8),
    Role(60002, "sync", True, 1),
    Role(60001, "async", False, 8),
    Role(0, "sync", False, 2),
)


# -- what a worker knows ---------------------------------------------------------------


@dataclass
class Chain:
    """A chain of nested directories from `head`: head/d/d/..., with other chains grafted
    on (.../g17/d/d/...). `path` is its deepest directory, `depth` levels below the head
    (None and -1: not even the head is there, as far as known)."""

    head: str
    path: str | None = None
    depth: int = -1
    busy: bool = False  # a call or sequence is making it deeper

    def reset(self) -> None:
        self.path, self.depth = None, -1

    def inside(self, rng: random.Random) -> Shown:
        """One of its directories."""
        names = (self.path or self.head).split("/")
        return compact("/".join(names[: len(names) - rng.randint(0, max(self.depth, 0))]))


class State:
    """A worker's view: its open fds (and how each was made), paths it made or saw,
    exports to mutate, kernel pids seen. Threads and tasks share it; a stale choice only
    makes a call fail, which is fine."""

    def __init__(self, k: Any, info: Any, index: int):
        self.index = index
        self.uid, self.user, self.home = k.uid, k.user, k.home
        self.vocab, self.ctx, self.page = info.vocab_size, info.context_length, info.page_size
        self.fds: dict[int, str] = {}
        self.writable: set[int] = set()
        self.lengths: dict[int, int] = {}
        self.closed: collections.deque[int] = collections.deque(maxlen=16)
        self.paths: list[str] = []
        self.dirs: list[str] = []
        self.blobs: collections.deque[tuple[str, bytes]] = collections.deque(maxlen=4)
        self.pid = k.pid  # the kernel's pid of this process
        self.pids: list[int] = []  # every pid the last ps showed
        # Chains of nested directories. They outlive a worker's incarnation (the parent
        # hands them to the next), so that trees grow past where a recursive walk breaks.
        self.deep: list[Chain] = []

    def add_fd(self, fd: int, story: str, writable: bool, length: int = 0) -> None:
        self.fds[fd] = story
        self.lengths[fd] = length
        if writable:
            self.writable.add(fd)

    def drop_fd(self, fd: int) -> None:
        if self.fds.pop(fd, None) is not None:
            self.closed.append(fd)
        self.writable.discard(fd)
        self.lengths.pop(fd, None)

    def remember(self, bag: list, item: str, cap: int = 64) -> None:
        bag.append(item)
        if len(bag) > cap:
            del bag[: len(bag) - cap]


# -- random calls ----------------------------------------------------------------------

NAMES = ("a", "b.kv", "c", "doc.kv", "x y", "é", "日本語", "-", " ", ".hidden", "💥",
         "sub", "d1", "d2", Shown("a" * 255, "'a' * 255"))
ODD_PATHS = (
    "", "relative", "a/b", "./x", "/", "//", "/tmp", "/tmp/", "/home", "/home/", "/proc",
    "/proc/meminfo", "/..", "/tmp/..", "/tmp/../home", "/tmp/./fz/a", "//tmp//fz//a",
    "/tmp/fz/", "/tmp/fz/a/", "/tmp/\x00x", "/tmp/fz/\n", "/home/root", "/home/uid60001",
    "/home/uid60002", "/home/nobody", "/home/uid60001/secret", "/tmp/fz/..", "/tmp/fz/.",
    "/home/uid60001/..", "/tmp/fz/\u202e", "/tmp/fz/\ufeff", "/etc/passwd", "/dev/null",
)
OPEN_FLAGS = (os.O_RDONLY, os.O_RDWR, os.O_WRONLY, os.O_CREAT | os.O_RDWR,
              os.O_CREAT | os.O_EXCL | os.O_RDWR, os.O_TRUNC | os.O_RDWR,
              os.O_CREAT | os.O_TRUNC | os.O_WRONLY, os.O_CREAT | os.O_RDONLY)
BAD_FLAGS = (os.O_APPEND | os.O_RDWR, os.O_DIRECTORY, os.O_ACCMODE, -1, 2**31 - 1, -2**31,
             os.O_NONBLOCK, os.O_CREAT | os.O_ACCMODE)
MODES = (0o600, 0o644, 0o666, 0o700, 0o755, 0o777, 0o1777, 0o400, 0o000)
BAD_MODES = (0o4755, 0o7777, 0o177777, -1, 2**31 - 1, -2**31, 0o170000, 0o40755)
IDS = (-1, 0, 60001, 60002, 65534, 1, 2**31 - 1, -2, -2**31)
BIG = (2**31 - 1, 2**31, 2**62, 2**63 - 1, -1, -2**31, -2**63)
BAD_FDS = (-1, 0, 1, 2, 3, 1000, 2**31 - 1, -2**31)
AS_VALUES = ("0:0", "60001:60001", "60002:60002", "60001:0", "a:b", "", ":", "1", "1:2:3",
             "99999999999999999999:0", "0:99999999999999999999", "-1:-1",
             "4294967295:4294967295", "2147483648:0", " 0:0", "0 : 0", "0x10:0", "1_000:0",
             "65534:65534", "-99999999999999999999:0")
PROCFS = ("meminfo", "/proc/meminfo", "sched", "kv", "", "/", "proc", "/proc", "/proc/",
          "proc/kv", "1/status", "1/fds", "1/syscalls", "²", "²/status", "٣/status", "١",
          "99999999999999999999/status", "-1/status", "0/status", "1/../meminfo",
          "meminfo/x", "1/status/x", "+1/status", " 1/status", "1 /status", "01/status",
          "1_0/status", "\x00", "meminfo\x00", "ｍｅｍｉｎｆｏ", Shown("x" * 5000, "'x' * 5000"),
          "/proc/1/nope",
          "𝟙/status", "①/status", "1/", "//proc//meminfo", "..", "../etc/passwd")
TEXTS = ("", "def fibonacci(n):", "é日本語💥", "\x00\x01\x02", Shown("a" * 4000, "'a' * 4000"),
         "<|bos|>", "<|eos|>", "\ud7ff", "The quick brown fox", Shown(" " * 100, "' ' * 100"),
         "<|user|>hi<|end|>")


class Gen:
    """Random calls for one thread or task of a worker: mostly valid-looking, with one bad
    argument at a time, so that the checks past the first are reached too."""

    WEIGHTS = {
        "getpid": 1, "ps": 2, "kill": 2, "nice": 2, "attach": 1, "exit": 0.3,
        "model_info": 1, "tokenize": 2, "detokenize": 2, "pred": 14, "anon": 5, "open": 7,
        "close": 5, "fork": 4, "link": 3, "read": 3, "splice": 4, "truncate": 3, "punch": 3,
        "keep": 2, "shift": 2, "vocab": 0.3,
        "stat": 3, "readdir": 2, "mkdir": 3, "deep": 2, "rmdir": 2, "unlink": 3,
        "rename": 3, "access": 2, "chmod": 2, "chown": 2, "fsync": 2, "export": 2,
        "import": 3, "procfs": 4, "raw_as": 4, "raw_bytes": 3, "raw_frame": 1,
        "raw_ring": 1,
    }
    SYNC_ONLY = ("raw_as", "raw_bytes", "raw_frame", "raw_ring")

    def __init__(self, rng: random.Random, state: State, *, exits: bool, raw: bool,
                 cancels: bool, builder: bool = False, only: list[str] | None = None):
        self.rng, self.s = rng, state
        self.cancels = cancels
        self.pending: list[Callable[[], Op | None]] = []
        names = [n for n in self.WEIGHTS if (raw or n not in self.SYNC_ONLY)
                 and (exits or n != "exit") and (not only or n in only)]
        weights = dict(self.WEIGHTS, deep=self.WEIGHTS["deep"] * (40 if builder else 1))
        self.names, self.weights = names, [weights[n] for n in names]

    def next(self) -> Op:
        s = self.s
        while self.pending:  # what a call before asked for next
            op = self.pending.pop()()
            if op is not None:
                return op
        if len(s.fds) > 24:  # keep the fd table (and the pages it holds) bounded
            return self.op_close()
        name = self.rng.choices(self.names, self.weights)[0]
        return getattr(self, "op_" + name)()

    # -- argument makers -------------------------------------------------------------

    def p(self, chance: float) -> bool:
        return self.rng.random() < chance

    def pick(self, seq: Any) -> Any:
        return self.rng.choice(list(seq))

    def fd(self, writable: bool = False) -> int:
        s, r = self.s, self.rng.random()
        pool = sorted(s.writable if writable and s.writable else s.fds)
        if r < 0.85 and pool:
            return self.pick(pool)
        if r < 0.93 and s.closed:
            return self.pick(s.closed)
        return self.pick(BAD_FDS)

    def length_of(self, fd: int) -> int:
        return self.s.lengths.get(fd, 0)

    def index(self, n: int) -> int:
        """A token index for a file of about n entries: mostly inside, sometimes not."""
        r = self.rng.random()
        if r < 0.75:
            return self.rng.randint(0, max(n, 0))
        if r < 0.85:
            return self.pick((0, n - 1, n + 1, n + self.s.page, self.s.page, 2 * self.s.page))
        return self.pick(BIG)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.s.vocab) for _ in range(n)]

    def name(self) -> str:
        if self.p(0.05):
            n = self.pick((256, 1000, 70000))
            return Shown("n" * n, f"'n' * {n}")
        return self.pick(NAMES)

    def path(self) -> str:
        s, r = self.s, self.rng.random()
        if r < 0.30:
            return join("/tmp/fz", self.name())
        if r < 0.42:
            return join(s.home, self.name())
        if r < 0.50:
            return join(f"/home/{self.pick(('uid60001', 'uid60002', 'root'))}", self.name())
        if r < 0.68 and (s.paths or s.dirs):
            base = self.pick(s.paths + s.dirs)
            return base if self.p(0.7) else join(base, self.name())
        if r < 0.75 and s.deep:
            return join(self.pick(s.deep).inside(self.rng), self.name())
        if r < 0.80:
            depth = self.rng.randint(50, 3000)
            return Shown("/tmp/fz/" + "d/" * depth + "x", f"'/tmp/fz/' + 'd/' * {depth} + 'x'")
        if r < 0.83:
            n = self.pick((4096, 5000, 70000))
            return Shown("/tmp/fz/" + "p" * n, f"'/tmp/fz/' + 'p' * {n}")
        return self.pick(ODD_PATHS)

    def mode(self) -> int:
        return self.pick(BAD_MODES) if self.p(0.2) else self.pick(MODES)

    def sampling(self) -> tuple[dict, bool]:
        """Sampler keywords, and whether they are valid."""
        kw: dict[str, Any] = {}
        if self.p(0.5):
            kw["temperature"] = self.pick((0.0, 0.7, 1.0, 1.5))
            kw["seed"] = self.pick((None, 0, 1, 12345))
        if self.p(0.3):
            kw["top_k"] = self.pick((0, 1, 5, 50))
        if self.p(0.2):
            kw["top_p"] = self.pick((0.0, 0.5, 0.9, 1.0))
        if self.p(0.2):
            kw["min_p"] = self.pick((0.0, 0.05, 0.5))
        if self.p(0.4):
            kw["top_logprobs"] = self.pick((1, 3, 5, 20))
        if not self.p(0.15):
            return kw, True
        bad = self.pick(("temperature", "top_k", "top_p", "min_p", "seed", "top_logprobs"))
        kw[bad] = self.pick({
            "temperature": (math.nan, math.inf, -math.inf, -1.0, 1e38, 1e-38, 3.4e38),
            "top_k": (-1, self.s.vocab + 1, 2**31 - 1, -2**31),
            "top_p": (math.nan, -0.5, 2.0, math.inf, 1e-38),
            "min_p": (math.nan, -1.0, 2.0, math.inf, 1.0),
            "seed": (-1, 2**63 - 1, -2**63, 2**62, -(2**62)),
            "top_logprobs": (-1, self.s.vocab, self.s.vocab + 1, 2**31 - 1),
        }[bad])
        return kw, False

    def story(self, *fds: int) -> dict[int, str]:
        return {fd: self.s.fds.get(fd, "closed" if fd in self.s.closed else "never opened")
                for fd in fds}

    # -- process and model -----------------------------------------------------------

    def op_getpid(self) -> Op:
        return Op("getpid")

    def op_ps(self) -> Op:
        def seen(procs: list) -> None:
            self.s.pids = [p.pid for p in procs]

        return Op("ps", then=seen)

    def op_kill(self) -> Op:
        s = self.s
        others = [p for p in s.pids if p != s.pid]
        if others and self.p(0.3):
            pid = self.pick(others)
        else:
            pid = self.pick((0, -1, 1, 2**31 - 1, -2**31, 99999, max(s.pids or [1]) + 1))
        if self.p(0.01):  # now and then a process kills itself
            pid = s.pid
        return Op("kill", (pid,))

    def op_nice(self) -> Op:
        return Op("nice", (self.pick((1, 5, 19, 20, 39, -1, -20, -40, 0, 2**31 - 1, -2**31,
                                      100, -100)),))

    def op_attach(self) -> Op:
        name = self.pick(("fuzz", "", "é日本", Shown("x" * 10000, "'x' * 10000"), "\x00",
                          "a\nb"))
        argv = self.pick(([], ["a"], ["\x00"] * 3,
                          ShownList(["x" * 5000] * 20, "['x' * 5000] * 20")))
        return Op("attach", (name, argv))

    def op_exit(self) -> Op:
        return Op("exit", (self.pick((0, 1, -1, 255, 256, 2**31 - 1, -2**31)),),
                  ends_session=True)

    def op_model_info(self) -> Op:
        def check(info: Any) -> str | None:
            if info.vocab_size != self.s.vocab:
                return f"vocab_size {info.vocab_size}, was {self.s.vocab}"
            return None

        return Op("model_info", check=check)

    def op_tokenize(self) -> Op:
        if self.p(0.3):
            messages = [{"role": self.pick(("user", "system", "assistant", "", "é", "{{")),
                         "content": self.pick(TEXTS)} for _ in range(self.rng.randint(0, 4))]
            return Op("tokenize", kwargs={"messages": messages,
                                          "add_generation_prompt": self.p(0.5)})
        text = self.pick(TEXTS)
        return Op("tokenize", (text,), {"add_special": self.p(0.5)})

    def op_detokenize(self) -> Op:
        ids = self.tokens(self.rng.randint(0, 20))
        if self.p(0.3):
            ids.append(self.pick((-1, self.s.vocab, 2**31 - 1, -2**31)))
        return Op("detokenize", (ids,), {"keep_special": self.p(0.5)})

    # -- pred --------------------------------------------------------------------------

    def op_pred(self) -> Op:
        s = self.s
        fd = self.fd(writable=True)
        n = self.pick((1, 1, 1, 2, 3, 8, 16, 17, 40, 100, 300))
        tokens: list[int] = self.tokens(n)
        kw, valid = self.sampling()
        positions = outputs = None
        no_outputs = self.p(0.2)
        if no_outputs:
            kw.pop("top_logprobs", None)
        elif self.p(0.2):
            outputs = sorted(self.rng.sample(range(n), self.rng.randint(1, min(n, 4))))
        if self.p(0.15):
            base = self.length_of(fd)
            positions = [base + i for i in range(n)]
            if self.p(0.5):  # Prompt-Cache-style: a gap
                positions = [p + self.rng.randint(0, 64) for p in positions]
        if valid and self.p(0.25):
            valid = False
            what = self.pick(("tokens", "empty", "positions", "outputs", "both", "long"))
            if what == "tokens":
                tokens[self.rng.randrange(n)] = self.pick((-1, s.vocab, 2**31 - 1, -2**31))
            elif what == "empty":
                tokens = []
            elif what == "positions":
                positions = [self.pick((-1, s.ctx - 1, s.ctx, 2**62, 2**63 - 1, -2**63, 0))
                             for _ in range(self.pick((n, n, n + 1, max(n - 1, 0))))]
            elif what == "outputs":
                outputs = [self.pick((-1, n, n - 1, 0, 2**31 - 1)) for _ in range(2)]
            elif what == "both":
                no_outputs, outputs = True, [0]
            else:
                m = self.pick((600, 2000, 5000))
                tokens = ShownList(tokens[:1] * m, f"[{tokens[0]}] * {m}")
        kwargs: dict[str, Any] = dict(kw)
        if self.p(0.3):
            extras_valid = self.pred_extras(kwargs, fd, n, no_outputs, outputs)
            valid = valid and extras_valid
        if positions is not None:
            kwargs["positions"] = positions
        if outputs is not None:
            kwargs["outputs"] = outputs
        if no_outputs:
            kwargs["no_outputs"] = True
        rows = [] if no_outputs else sorted(outputs or [len(tokens) - 1])
        want_top = kw.get("top_logprobs", 0)

        def then(out: list) -> None:
            if fd in s.lengths:
                s.lengths[fd] = kwargs.get("truncate", s.lengths[fd]) + len(tokens)

        def check(out: list) -> str | None:
            if not valid:
                return None
            if [o.row for o in out] != rows:
                return f"rows {[o.row for o in out]}, asked {rows}"
            for o in out:
                if not 0 <= o.token < s.vocab:
                    return f"token {o.token} outside the vocabulary"
                if not (o.logprob <= 1e-3) or len(o.top) != want_top:
                    return f"logprob {o.logprob}, {len(o.top)} top for {want_top}"
            return None

        cancel = self.rng.uniform(0, 0.05) if self.cancels and self.p(0.1) else None
        return Op("pred", (fd, tokens), kwargs, then=then, check=check, fds=self.story(fd),
                  cancel_after=cancel)

    def pred_extras(self, kwargs: dict, fd: int, n: int, no_outputs: bool,
                    outputs: list[int] | None) -> bool:
        """pred's extras (logit control, score_next, parents, truncate) into kwargs; whether
        they are valid."""
        vocab = self.s.vocab
        words = -(-vocab // 32)
        what = self.pick(("mask", "bias", "score", "rows", "next", "parents", "truncate"))
        if what == "mask":
            choice = self.pick(("some", "some", "none", "short", "odd"))
            allowed = {
                "some": LogitControl.allowing(self.tokens(self.pick((1, 5, 100))), vocab).allowed,
                "none": bytes(4 * words),
                "short": b"\xff" * (4 * words - 4),
                "odd": b"\xff" * (4 * words + 1),
            }[choice]
            kwargs["control"] = LogitControl(allowed=allowed)
            return choice == "some" and not no_outputs
        if what == "bias":
            ids = self.tokens(3) + ([self.pick((-1, vocab, 2**31 - 1))] if self.p(0.3) else [])
            value = self.pick((1.0, -100.0, 5.0, math.inf, math.nan))
            kwargs["control"] = LogitControl(bias=dict.fromkeys(ids, value))
            return all(0 <= t < vocab for t in ids) and math.isfinite(value) and not no_outputs
        if what == "score":
            ids = self.tokens(self.pick((1, 4))) + ([vocab] if self.p(0.2) else [])
            kwargs["control"] = LogitControl(score=ids)
            return ids[-1] < vocab and not no_outputs
        if what == "rows":  # a control per row, sometimes one too many
            rows = len(outputs) if outputs else 1
            count = rows + (1 if self.p(0.5) else 0)
            kwargs["control"] = [LogitControl(score=self.tokens(1)) for _ in range(count)]
            return count == rows and not no_outputs
        if what == "next":
            kwargs["score_next"] = True
            return not no_outputs
        if what == "parents":
            parents = [self.rng.randint(-1, i - 1) for i in range(n)]
            if self.p(0.3):
                parents[self.rng.randrange(n)] = self.pick((n, n + 5, -2, 2**31 - 1))
                kwargs["parents"] = parents
                return False
            if self.p(0.2):
                parents = parents[:-1]
            kwargs["parents"] = parents
            return len(parents) == n
        length = self.length_of(fd)
        kwargs["truncate"] = self.index(length)
        return kwargs["truncate"] <= length

    # -- files -------------------------------------------------------------------------

    def opened(self, story: str, writable: bool) -> Callable[[Any], None]:
        def then(f: Any) -> None:
            fd = int(f)
            self.s.add_fd(fd, story, writable)
        return then

    def op_anon(self) -> Op:
        return Op("open", ("",), {"flags": self.pick((os.O_RDWR, os.O_RDONLY, os.O_CREAT))},
                  then=self.opened("anonymous", True))

    def op_open(self) -> Op:
        path = self.path()
        flags = self.pick(BAD_FLAGS) if self.p(0.1) else self.pick(OPEN_FLAGS)
        mode = self.mode()
        writable = flags & os.O_ACCMODE != os.O_RDONLY

        def then(f: Any) -> None:
            # The length is a guess (the file may have any); ranges past it are fine too.
            length = 0 if flags & os.O_TRUNC else 64
            self.s.add_fd(int(f), f"open({short(path, 60)}, {flags:#o})", writable, length)
            if flags & os.O_CREAT:
                self.s.remember(self.s.paths, path)

        return Op("open", (path,), {"flags": flags, "mode": mode}, then=then)

    def op_close(self) -> Op:
        fd = self.fd()
        return Op("close", (fd,), then=lambda _: self.s.drop_fd(fd), fds=self.story(fd))

    def op_fork(self) -> Op:
        fd = self.fd()
        length = self.length_of(fd)

        def then(f: Any) -> None:
            self.s.add_fd(int(f), f"fork({fd})", True, length)

        return Op("fork", (fd,), then=then, fds=self.story(fd))

    def op_link(self) -> Op:
        fd, path = self.fd(), self.path()

        def then(_: Any) -> None:
            self.s.remember(self.s.paths, path)

        return Op("link", (fd, path), then=then, fds=self.story(fd))

    def op_read(self) -> Op:
        fd = self.fd()
        n = self.length_of(fd)
        count = None if self.p(0.2) else self.index(n)

        def check(result: tuple) -> str | None:
            tokens, positions = result
            return None if len(tokens) == len(positions) else "tokens and positions differ"

        return Op("read", (fd, self.index(n), count), check=check, fds=self.story(fd))

    def op_splice(self) -> Op:
        src, dst = self.fd(), self.fd(writable=True)
        if self.p(0.15):
            dst = src
        n = self.length_of(src)
        start = self.index(n)
        end = start + self.pick((0, 1, self.s.page, 2 * self.s.page, 5)) if self.p(0.6) \
            else self.index(n)

        def then(_: Any) -> None:
            if dst in self.s.lengths and 0 <= start <= end:
                self.s.lengths[dst] += end - start

        return Op("splice", (src, start, end, dst), then=then, fds=self.story(src, dst))

    def op_truncate(self) -> Op:
        fd = self.fd(writable=True)
        length = self.index(self.length_of(fd))

        def then(_: Any) -> None:
            self.s.lengths[fd] = length

        return Op("truncate", (fd, length), then=then, fds=self.story(fd))

    def op_punch(self) -> Op:
        fd = self.fd(writable=True)
        n = self.length_of(fd)
        start = self.index(n)
        end = start + self.pick((self.s.page, 2 * self.s.page, 1, 0, -1)) if self.p(0.6) \
            else self.index(n)
        return Op("punch", (fd, start, end), fds=self.story(fd))

    def op_keep(self) -> Op:
        fd = self.fd(writable=True)
        n = self.length_of(fd)
        start = self.index(n)
        span = max(n - start, 0) + 3 if 0 <= start <= n else 3  # some past the end
        entries = sorted(self.rng.sample(range(start, start + span),
                                         min(span, self.rng.randint(0, 3))))
        if self.p(0.2):
            entries = entries[::-1] + [self.pick((-1, n, 2**62))]

        def then(_: Any) -> None:
            self.s.lengths[fd] = start + len(entries)

        return Op("keep", (fd, start, entries), then=then, fds=self.story(fd))

    def op_shift(self) -> Op:
        fd = self.fd(writable=True)
        n = self.length_of(fd)
        start = self.index(n)
        end = start + self.pick((1, 5, self.s.page)) if self.p(0.6) else self.index(n)
        delta = self.pick((1, -1, 7, -start, self.s.ctx, -(2**40), 2**62))
        return Op("shift", (fd, start, end, delta), fds=self.story(fd))

    def op_vocab(self) -> Op:
        return Op("vocab")

    def op_stat(self) -> Op:
        if self.p(0.4):
            fd = self.fd()
            return Op("stat", (fd,), fds=self.story(fd))
        return Op("stat", (self.path(),))

    def op_readdir(self) -> Op:
        path = self.pick(("/", "/tmp", "/tmp/fz", "/home", self.s.home)) if self.p(0.5) \
            else self.path()

        def then(entries: list) -> None:
            for name, st in entries[:8]:
                child = f"{path.rstrip('/')}/{name}"
                self.s.remember(self.s.dirs if st.is_dir else self.s.paths, child)

        return Op("readdir", (path,), then=then)

    def op_mkdir(self) -> Op:
        path = self.path() if self.p(0.7) else "/tmp/fz"
        mode = self.pick((0o1777, 0o777)) if path == "/tmp/fz" else self.mode()
        return Op("mkdir", (path,), {"mode": mode},
                  then=lambda _: self.s.remember(self.s.dirs, path))

    def op_deep(self) -> Op:
        """Deepen a chain of nested directories (trees a thousand deep are where recursive
        walks break): 50 to 150 more levels of mkdir in /tmp (cheap: nothing persists
        there), then (the thread's next call) a graft: the rename of the whole chain onto
        the end of the one in the home, which persists, so that one grows by all of it in
        one call. A chain is worked on by one sequence at a time. An EEXIST on the way is
        the work of a killed incarnation: the sequence goes on; an ENOENT at its start
        means someone moved the chain: it starts over."""
        s = self.s
        if not s.deep:
            s.deep = [Chain(f"{s.home}/deep-w{s.index}")] + [
                Chain(f"/tmp/deep-w{s.index}{x}") for x in "abc"]
        home, free = s.deep[0], [c for c in s.deep[1:] if not c.busy]
        if not free:
            return self.op_mkdir()
        chain = self.pick(free)
        chain.busy = True
        steps, path, depth = [], chain.path, chain.depth
        for _ in range(self.rng.randint(50, 150)):
            path, depth = (chain.head, 0) if path is None else (path + "/d", depth + 1)
            if len(path) >= PATH_BUDGET:
                break

            def grew(_: Any, path: str = path, depth: int = depth) -> None:
                if depth > chain.depth:
                    chain.path, chain.depth = path, depth

            steps.append(Op("mkdir", (compact(path),), {"mode": 0o755}, then=grew,
                            tolerate=(errno.EEXIST,)))
        if not steps:  # as long as a path may be: start it over
            chain.reset()
            chain.busy = False
            return self.op_mkdir()

        def moved(e: OSError) -> None:
            if e.errno == errno.ENOENT:
                chain.reset()

        def done() -> None:
            chain.busy = False

        steps[0].failed = moved
        self.pending.append(lambda: self.graft(chain, home))  # this thread's next call
        return Op("deep", steps=steps, done=done)

    def graft(self, src: Chain, dst: Chain) -> Op | None:
        """rename(src's head, a new name in dst's deepest directory): dst gains src's
        levels plus one (None when either is busy, src is not there, or the result would
        be longer than a path may be)."""
        if src.busy or dst.busy or src.path is None or src.depth < 1:
            return None
        if len(dst.path or dst.head) + len(src.path) >= PATH_BUDGET:
            return None
        target = dst.head if dst.path is None else f"{dst.path}/g{self.rng.randrange(1000)}"
        new_path = target + src.path[len(src.head):]
        new_depth = (0 if dst.path is None else dst.depth + 1) + src.depth
        src.busy = dst.busy = True

        def then(_: Any) -> None:
            dst.path, dst.depth = new_path, new_depth
            src.reset()

        def failed(e: OSError) -> None:
            if e.errno == errno.ENOENT:  # one of them was moved away: which one?
                self.pending.append(lambda: Op("stat", (compact(src.head),),
                                               then=lambda _: dst.reset(),
                                               failed=lambda _: src.reset()))
            elif e.errno in (errno.EEXIST, errno.ENOTEMPTY) and dst.path is None:
                dst.path, dst.depth = dst.head, 0  # it is there after all: graft into it

        def done() -> None:
            src.busy = dst.busy = False

        return Op("rename", (compact(src.head), compact(target)), then=then, failed=failed,
                  done=done)

    def op_rmdir(self) -> Op:
        path = self.pick(s.dirs) if (s := self.s).dirs and self.p(0.5) else self.path()
        if self.p(0.05):
            path = self.pick(SKELETON)
        return Op("rmdir", (path,), check=skeleton_kept(path))

    def op_unlink(self) -> Op:
        path = self.pick(self.s.paths) if self.s.paths and self.p(0.5) else self.path()
        return Op("unlink", (path,))

    def op_rename(self) -> Op:
        s = self.s
        old = self.pick(s.paths + s.dirs) if (s.paths or s.dirs) and self.p(0.5) else self.path()
        if self.p(0.1):
            old = self.pick((*SKELETON, s.home, "/tmp/fz", "/home/uid60001"))
        new = self.path()
        if self.p(0.1):
            new = join(old, self.name())  # into itself
        return Op("rename", (old, new), then=lambda _: s.remember(s.paths, new),
                  check=skeleton_kept(old, new))

    def op_access(self) -> Op:
        mode = self.pick((os.F_OK, os.R_OK, os.W_OK, os.X_OK, 7, 8, -1, 2**31 - 1))
        return Op("access", (self.path(), mode))

    def op_chmod(self) -> Op:
        return Op("chmod", (self.path(), self.mode()))

    def op_chown(self) -> Op:
        return Op("chown", (self.path(), self.pick(IDS), self.pick(IDS)))

    def op_fsync(self) -> Op:
        fd = self.fd()
        return Op("fsync", (fd,), fds=self.story(fd))

    def op_export(self) -> Op:
        target: Any = self.fd() if self.p(0.5) else self.path()
        offset = length = 0
        if self.p(0.3):
            offset = self.pick((0, 1, 7, 100, 4096, -1, 2**62, 2**63 - 1, -2**63))
            length = self.pick((0, 1, 16, 1000, -1, 2**63 - 1))

        def then(data: bytes) -> None:
            if offset == 0 and length == 0 and data:
                self.s.blobs.append((f"export({short(target, 60)})", data))

        fds = self.story(target) if isinstance(target, int) else {}
        return Op("export", (target,), {"offset": offset, "length": length}, then=then, fds=fds)

    def mutated(self) -> bytes:
        """An export, whole or mutated, or junk."""
        s = self.s
        if not s.blobs or self.p(0.1):
            n = self.pick((0, 1, 16, 4096))
            junk = bytes(self.rng.getrandbits(8) for _ in range(n))
            return ShownBytes(junk, f"random.Random(...).randbytes({n})")
        story, blob = self.pick(s.blobs)
        how = self.pick(("whole", "flip", "cut", "grow", "zero", "swap", "double"))
        data = bytearray(blob)
        if how == "flip" and data:
            for _ in range(self.rng.randint(1, 4)):
                i = self.rng.randrange(len(data))
                data[i] ^= 1 << self.rng.randrange(8)
            how = "flip bits"
        elif how == "cut" and data:
            data = data[: self.rng.randrange(len(data))]
        elif how == "grow":
            data += bytes(self.rng.randrange(1, 5000))
        elif how == "zero" and data:
            i = self.rng.randrange(len(data))
            data[i: i + 64] = bytes(len(data[i: i + 64]))
        elif how == "swap" and len(s.blobs) > 1:
            other = self.pick(s.blobs)[1]
            data = data[: len(data) // 2] + other[len(other) // 2:]
        elif how == "double":
            data = data + data
        return ShownBytes(bytes(data), f"<{how} of {story}, {len(data)} bytes>")

    def op_import(self) -> Op:
        path = self.path()
        data = self.mutated()
        return Op("import_file", (path, data), {"mode": self.mode()},
                  then=lambda _: self.s.remember(self.s.paths, path))

    def op_procfs(self) -> Op:
        r = self.rng.random()
        if r < 0.5:
            pid = self.pick(self.s.pids or [self.s.pid])
            path = f"{pid}/{self.pick(('status', 'fds', 'syscalls', 'nope', ''))}"
        else:
            path = self.pick(PROCFS)
        return Op("procfs", (path,))

    # -- raw requests (sync workers) ---------------------------------------------------

    def op_raw_as(self) -> Op:
        inner = self.pick(("op_stat", "op_open", "op_readdir", "op_mkdir", "op_unlink",
                           "op_chmod", "op_chown", "op_procfs", "op_import", "op_export",
                           "op_rename", "op_anon"))
        op = getattr(self, inner)()
        op.as_value = self.pick(AS_VALUES)
        return op

    def op_raw_bytes(self) -> Op:
        rpc = self.pick(RAW_REPLIES)
        r = self.rng.random()
        if r < 0.3:
            n = self.rng.randint(0, 64)
            data = ShownBytes(self.rng.randbytes(n), f"<{n} random bytes>")
        elif r < 0.6:  # another call's request: fields of the wrong types
            other = self.pick((pb.PredRequest(fd=3, tokens=[1, 2], positions=[2**62]),
                               pb.RenameRequest(old="/tmp", new="/tmp/x"),
                               pb.ReadRequest(fd=-1, start=-5, count=2**62),
                               pb.ChownRequest(path="/", uid=-7, gid=-9)))
            raw = other.SerializeToString()
            data = ShownBytes(raw, f"{type(other).__name__}(...).SerializeToString()")
        else:  # a valid request cut short, or with bytes after it
            good = pb.OpenRequest(path="/tmp/fz/a", flags=os.O_RDWR).SerializeToString()
            cut = self.rng.randrange(len(good) + 8)
            raw = good[:cut] if cut < len(good) else good + b"\xff" * (cut - len(good))
            data = ShownBytes(raw, f"OpenRequest bytes cut/padded to {len(raw)}")
        return Op("raw_bytes", (rpc, data))

    def op_raw_frame(self) -> Op:
        kind = self.pick((wire.PRED, wire.PRED, wire.REPLY, wire.SHUTDOWN, 0, 7, 255))
        payload = self.pick((b"", b"\xff\xff", pb.PredRequest(fd=3, tokens=[1]).SerializeToString(),
                             b"\x08" * 9, bytes(100)))
        huge = self.p(0.1)
        return Op("raw_frame", (kind, ShownBytes(payload, short(payload, 40)), huge))

    def op_raw_ring(self) -> Op:
        damage = self.pick(RING_DAMAGE)
        return Op("raw_ring", (damage, self.rng.randrange(1 << 32)))


# What a worker does to a ring of its own: the first three must make the kernel hang up, the
# next two get an EINVAL completion; FRAMED with no frame gets nothing (only that ring
# stalls); random bytes get either.
RING_DAMAGE = ("tail past the ring", "head past the tail", "payload past the tail",
               "unknown kind", "not a PredRequest", "framed with no frame", "random bytes")


SKELETON = ("/", "/tmp", "/home", "/tmp/", "//home", "/tmp/../home", "/home/./")


def skeleton_kept(path: str, new: str | None = None) -> Callable[[Any], str | None]:
    """A check: moving or removing /, /tmp or /home must not succeed (EBUSY); a rename
    onto itself may (it does nothing)."""
    def norm(p: str) -> str:
        return posixpath.normpath("/" + p.lstrip("/"))

    def check(_: Any) -> str | None:
        if norm(path) in ("/", "/tmp", "/home") and (new is None or norm(new) != norm(path)):
            return f"{path!r}, part of the namespace's skeleton, was moved or removed"
        return None
    return check


RAW_REPLIES = {
    "Open": pb.FdReply, "Stat": pb.StatReply, "Pred": pb.PredReply, "Read": pb.ReadReply,
    "Procfs": pb.ProcfsReply, "Kill": pb.Empty, "Splice": pb.Empty, "Rename": pb.Empty,
    "Chown": pb.Empty, "Nice": pb.NiceReply, "Tokenize": pb.TokenizeReply,
    "Detokenize": pb.DetokenizeReply, "Punch": pb.Empty, "Truncate": pb.Empty,
    "Mkdir": pb.Empty, "Attach": pb.AttachReply,
}


def first_op() -> Op:
    """What every worker does first: make the shared playground (it may be there)."""
    return Op("mkdir", ("/tmp/fz",), {"mode": 0o1777})


class NoReply(Exception):
    """The kernel neither answered a raw frame nor hung up."""


# -- a worker process --------------------------------------------------------------------


class Worker:
    """One fuzzing OS process: its counts and findings go to stdout as JSON lines."""

    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.index, self.incarnation = cfg["index"], cfg["incarnation"]
        self.role = Role(**cfg["role"])
        self.sock = Path(cfg["socket"])
        self.until = cfg["until"]
        self.seed = f"{cfg['seed']}:{self.index}:{self.incarnation}"
        self.out = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        self.current: dict[int, tuple[Op, float, str]] = {}
        self.hung: set[int] = set()
        self.calls = 0

    # -- reporting ----------------------------------------------------------------------

    def emit(self, obj: dict) -> None:
        line = (json.dumps(obj) + "\n").encode()
        with self.out:
            os.write(1, line)

    def flush_counts(self) -> None:
        with self.out:
            counts = dict(self.counts)
        state = getattr(self, "state", None)
        deep = [[c.head, c.path, c.depth] for c in state.deep] if state is not None else None
        self.emit({"t": "counts", "counts": counts, "deep": deep})

    def finding(self, kind: str, op: Op, error: str, where: str) -> None:
        self.emit({"t": "finding", "at": time.time(), "kind": kind, "call": op.name,
                   "error": error,
                   "repro": op.repro(), "fds": {str(k): v for k, v in op.fds.items()},
                   "uid": self.role.uid, "who": where, "seed": self.seed})

    def outcome(self, op: Op, exc: BaseException | None, where: str) -> None:
        """Count the call by errno; report what may never happen."""
        self.calls += 1
        if exc is None:
            key = f"{op.name}:0"
        elif isinstance(exc, OSError) and exc.errno is not None:
            key = f"{op.name}:{exc.errno}"
            if exc.errno == errno.EIO:
                self.finding("EIO", op, f"{type(exc).__name__}: {exc}", where)
        else:
            key = f"{op.name}:{ANY_OSERROR}"
            # The library refuses an int its message field cannot hold before sending it.
            kind = "client-range" if isinstance(exc, ValueError) and "out of range" in str(
                exc) else "exception"
            tb = "".join(traceback.format_exception(exc)[-3:])
            self.finding(kind, op, f"{type(exc).__name__}: {exc}\n{tb}", where)
        with self.out:
            self.counts[key] += 1

    def watchdog(self) -> None:
        """Report calls that take longer than HANG_S; send counts now and then."""
        while True:
            time.sleep(COUNT_EVERY_S)
            self.flush_counts()
            now = time.monotonic()
            for op, start, where in list(self.current.values()):
                if now - start > HANG_S and id(op) not in self.hung:
                    self.hung.add(id(op))
                    self.finding("hang", op, f"no answer after {now - start:.0f} s", where)

    # -- sessions -----------------------------------------------------------------------

    def view(self, k: Kernel, value: str) -> Kernel:
        """The session with a raw `symphony-as` value (acting_as takes only ints)."""
        v = copy.copy(k)
        v._metadata = [(SESSION_KEY, k._metadata[0][1]), (AS_KEY, value)]
        v._line = None
        return v

    def connect(self) -> Kernel:
        return Kernel.connect(self.sock, name=f"fuzz-w{self.index}",
                              lifeline_pred=self.role.lifeline_pred)

    # -- sync ---------------------------------------------------------------------------

    def run_sync(self) -> None:
        self.k = self.connect()
        self.state = State(self.k, self.k.model_info(), self.index)
        self.state.deep = [Chain(*chain) for chain in self.cfg["deep"]]
        self.session_lock = threading.Lock()
        self.run_op(first_op(), 0, f"w{self.index}.{self.incarnation} start")
        threads = [threading.Thread(target=self.sync_loop, args=(t,), daemon=True)
                   for t in range(self.role.threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def sync_loop(self, tid: int) -> None:
        rng = random.Random(f"{self.seed}:{tid}")
        single = self.role.threads == 1
        gen = Gen(rng, self.state, exits=single, raw=True, cancels=False,
                  builder=self.role.builder, only=self.cfg["ops"])
        n = 0
        while time.time() < self.until:
            op = gen.next()
            n += 1
            self.run_op(op, tid, f"w{self.index}.{self.incarnation} t{tid} #{n}")

    def run_op(self, op: Op, tid: int, where: str) -> bool:
        try:
            if op.steps:
                return all(time.time() < self.until and self.run_op(step, tid, where)
                           for step in op.steps)
            return self.run_call(op, tid, where)
        finally:
            if op.done is not None:
                op.done()

    def run_call(self, op: Op, tid: int, where: str) -> bool:
        k = self.k
        target = k if op.as_value is None else self.view(k, op.as_value)
        self.current[tid] = (op, time.monotonic(), where)
        try:
            if op.method.startswith("raw_"):
                result = getattr(self, op.method)(k, *op.args, **op.kwargs)
            else:
                result = getattr(target, op.method)(*op.args, **op.kwargs)
        except Exception as e:
            self.outcome(op, e, where)
            if op.ends_session or (isinstance(e, PermissionError) and "no session" in str(e)):
                self.reconnect()
            return self.tolerated(op, e)
        finally:
            self.current.pop(tid, None)
        self.outcome(op, None, where)
        self.after(op, result, where)
        if op.ends_session:
            self.reconnect()
        return True

    @staticmethod
    def tolerated(op: Op, e: Exception) -> bool:
        """Whether a sequence goes on after this error (then the step counts as done)."""
        if isinstance(e, OSError) and op.failed is not None:
            op.failed(e)
        if isinstance(e, OSError) and e.errno in op.tolerate:
            if op.then is not None:
                op.then(None)
            return True
        return False

    def after(self, op: Op, result: Any, where: str) -> None:
        if op.then is not None:
            op.then(result)
        wrong = op.check(result) if op.check is not None else None
        if wrong:
            self.finding("wrong", op, wrong, where)

    def reconnect(self) -> None:
        with self.session_lock:
            self.k.close()
            try:
                self.k = self.connect()
            except OSError as e:  # as worker_main's: there is no going on without a session
                if e.errno == errno.EIO:
                    self.outcome(Op("connect", (str(self.sock),)), e, f"w{self.index}")
                self.emit({"t": "note", "text": f"a worker could not connect: {e}"})
                self.flush_counts()
                os._exit(3)
            s = self.state
            s.fds.clear()
            s.writable.clear()
            s.lengths.clear()
            s.pid, s.pids = self.k.pid, []

    # -- raw requests -----------------------------------------------------------------

    def raw_bytes(self, k: Kernel, rpc: str, data: bytes) -> None:
        call = k._channel.unary_unary(f"/symphony.Kernel/{rpc}")  # bytes in, bytes out
        try:
            raw = call(bytes(data), metadata=k._metadata)
        except grpc.RpcError as e:
            raise convert.transport_error(e, k.socket) from e
        errors.check(RAW_REPLIES[rpc].FromString(raw))

    def raw_frame(self, k: Kernel, kind: int, payload: bytes, huge: bool) -> None:
        """A second lifeline (a new kernel process of this uid) fed a frame it must refuse
        (EINVAL), or a header too long to be a frame (the kernel hangs up)."""
        line, _token = hello(self.sock)
        try:
            line.settimeout(HANG_S)
            if huge:
                line.sendall(wire.HEADER.pack(wire.MAX_PAYLOAD + 1, 1, wire.PRED))
                if line.recv(1 << 16):
                    raise NoReply("the kernel answered a frame header of 64 MiB + 1")
                return
            line.sendall(wire.frame(kind, 7, payload))
            frames, got = wire.Frames(), []
            while not got:
                try:
                    data = line.recv(1 << 16)
                except TimeoutError:
                    raise NoReply(f"no reply to a frame of kind {kind}") from None
                if not data:
                    raise OSError(errno.EPIPE, "the kernel hung up on a frame it should refuse")
                got = frames.feed(data)
            reply_kind, call, body = got[0]
            if (reply_kind, call) != (wire.REPLY, 7):
                raise NoReply(f"answered with frame kind {reply_kind} call {call}")
            errors.check(pb.PredReply.FromString(body))
        finally:
            line.close()

    def raw_ring(self, k: Kernel, damage: str, salt: int) -> None:
        """A second session (a new kernel process of this uid) with rings, which it
        scribbles on; then the kernel must hang up, or answer EINVAL, as RING_DAMAGE says."""
        line, _token, rings = open_session(self.sock, True)
        try:
            line.settimeout(HANG_S)
            rings.sleeping(True)  # before anything is submitted: answers may come at once
            rng, mem = random.Random(salt), rings.mem
            must_hang_up = damage in RING_DAMAGE[:3]
            if damage == "tail past the ring":
                mem.set(ring.SQ_TAIL, ring.SQ_BYTES + 16 * rng.randrange(1, 1 << 20))
            elif damage == "head past the tail":
                mem.set(ring.CQ_HEAD, rng.randrange(1, 1 << 62))
                rings.submit(ring.PRED, 1, pb.PredRequest(fd=3, tokens=[1]).SerializeToString())
            elif damage == "payload past the tail":
                mem.sq[:ring.RECORD.size] = ring.RECORD.pack(1 << 20, 1, ring.PRED, 0)
                mem.set(ring.SQ_TAIL, ring.RECORD.size + 16)
            elif damage == "unknown kind":
                rings.submit(rng.choice((0, 3, 5, 6, 255, 1 << 31)), 1, b"")
            elif damage == "not a PredRequest":
                rings.submit(ring.PRED, 1, rng.randbytes(rng.randrange(1, 64)))
            elif damage == "framed with no frame":
                rings.submit(ring.FRAMED, 1)
            else:
                size = 16 * rng.randrange(1, 256)
                mem.sq[:size] = rng.randbytes(size)
                mem.set(ring.SQ_TAIL, size)
            os.eventfd_write(rings.kernel_bell, 1)
            if damage == "framed with no frame":
                return
            answered = rings.ready()
            ready = [] if answered else select.select([rings.process_bell, line], [], [],
                                                      HANG_S)[0]
            if not ready and not answered:
                raise NoReply(f"no reply and no hang-up after a ring with {damage}")
            if line in ready and line.recv(1 << 16) == b"":
                return  # the kernel hung up: right for a broken ring
            if must_hang_up:
                raise NoReply(f"the kernel kept a ring with {damage}")
            for kind, _call, body in rings.completions():
                if kind == wire.REPLY:
                    errors.check(pb.PredReply.FromString(body))
        finally:
            line.close()
            rings.close()

    # -- asyncio -----------------------------------------------------------------------

    async def run_async(self) -> None:
        self.ak = await AsyncKernel.connect(self.sock, name=f"fuzz-w{self.index}",
                                            lifeline_pred=self.role.lifeline_pred)
        self.state = State(self.ak, await self.ak.model_info(), self.index)
        self.state.deep = [Chain(*chain) for chain in self.cfg["deep"]]
        await self.async_op(first_op(), 0, f"w{self.index}.{self.incarnation} start")
        await asyncio.gather(*(self.task(t) for t in range(self.role.threads)))
        await self.ak.close()

    async def task(self, tid: int) -> None:
        gen = Gen(random.Random(f"{self.seed}:{tid}"), self.state, exits=False, raw=False,
                  cancels=True, builder=self.role.builder, only=self.cfg["ops"])
        n = 0
        while time.time() < self.until:
            op = gen.next()
            n += 1
            await self.async_op(op, tid, f"w{self.index}.{self.incarnation} task{tid} #{n}")

    async def async_op(self, op: Op, tid: int, where: str) -> bool:
        try:
            if op.steps:
                for step in op.steps:
                    if time.time() >= self.until or not await self.async_op(step, tid, where):
                        return False
                return True
            return await self.async_call(op, tid, where)
        finally:
            if op.done is not None:
                op.done()

    async def async_call(self, op: Op, tid: int, where: str) -> bool:
        self.current[tid] = (op, time.monotonic(), where)
        try:
            call = getattr(self.ak, op.method)(*op.args, **op.kwargs)
            if op.cancel_after is None:
                result = await call
            else:
                try:
                    result = await asyncio.wait_for(call, op.cancel_after)
                except TimeoutError:
                    with self.out:
                        self.counts[f"{op.name}:cancelled"] += 1
                    return False
        except Exception as e:
            self.outcome(op, e, where)
            return self.tolerated(op, e)
        finally:
            self.current.pop(tid, None)
        self.outcome(op, None, where)
        self.after(op, result, where)
        return True


def become(uid: int) -> None:
    """Drop root for uid (its own group), as tests/test_kernel.py's AS_USER does."""
    if uid == os.geteuid():
        return
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def worker_main(cfg: dict) -> int:
    worker = Worker(cfg)
    if os.geteuid() == 0:
        become(worker.role.uid)
    threading.Thread(target=worker.watchdog, daemon=True).start()
    try:
        if worker.role.kind == "async":
            asyncio.run(worker.run_async())
        else:
            worker.run_sync()
    except OSError as e:  # no session (the kernel died, was stopped, or refused attach)
        if e.errno == errno.EIO:
            worker.outcome(Op("connect", (str(worker.sock),)), e, f"w{worker.index}")
        worker.emit({"t": "note", "text": f"a worker could not connect: {e}"})
        worker.flush_counts()
        time.sleep(1)  # not a tight loop of restarts
        return 3
    worker.flush_counts()
    # Half the workers leave without a word: the kernel must reap them from the lifeline.
    if random.Random(worker.seed).random() < 0.5 and worker.role.kind == "sync":
        worker.k.close()
    return 0


# -- the parent ------------------------------------------------------------------------


@dataclass
class Slot:
    """One worker position: the process in it now, and how many came before."""

    index: int
    role: Role
    proc: subprocess.Popen | None = None
    incarnation: int = -1
    killed: bool = False  # SIGKILLed by the parent
    reaped: bool = False  # its end is accounted for
    deep: list = field(default_factory=list)  # its chains of directories, for the next one
    stderr: Path | None = None
    reader: threading.Thread | None = None


@dataclass
class Report:
    counts: dict[tuple[int, int], dict[str, int]] = field(default_factory=dict)
    findings: list[dict] = field(default_factory=list)
    notes: collections.Counter[str] = field(default_factory=collections.Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, call: str, error: str, repro: str, **extra: Any) -> None:
        with self.lock:
            self.findings.append({"at": time.time(), "kind": kind, "call": call,
                                  "error": error, "repro": repro, **extra})

    def note(self, text: str) -> None:
        with self.lock:
            self.notes[text] += 1

    def totals(self) -> dict[str, collections.Counter[str]]:
        out: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for counts in self.counts.values():
            for key, n in counts.items():
                call, _, err = key.rpartition(":")
                out[call][err] += n
        return out


def errname(code: str) -> str:
    return errno.errorcode.get(int(code), code) if code.lstrip("-").isdigit() else code


def group_key(f: dict) -> tuple:
    """Findings that are the same bug: kind, call, and the error without its numbers,
    paths and quoted values."""
    first = f["error"].splitlines()[0] if f["error"] else ""
    first = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", first)
    first = re.sub(r"-?\d+", "N", first)
    # One bug may show through many calls (an int too big for its field, a bad
    # `symphony-as` value): the calls are listed, not told apart.
    return f["kind"], first[:160]


class Fuzz:
    def __init__(self, args: argparse.Namespace, argv: list[str]):
        self.args = args
        self.command = "python bench/fuzz.py " + shlex.join(argv)  # the run-level reproducer
        self.rng = random.Random(f"{args.seed}:parent")
        self.report = Report()
        self.root = Path(tempfile.mkdtemp(prefix="symphony-fuzz-"))
        self.root.chmod(0o755)  # the workers of other uids reach the socket through it
        self.daemon: subprocess.Popen | None = None
        self.log: Path | None = Path(args.log) if args.log else None
        self.restarts = 0
        self.role_list: list[Role] = []
        self.walk_incomplete = False  # some tree was out of a path's reach
        self.hoists = 0  # trees the walk moved up (walk-N)

    def found(self, kind: str, call: str, error: str, what: str) -> None:
        """A finding of the run as a whole: `what` was checked, the command reproduces it."""
        self.report.add(kind, call, error, f"{what}  [run: {self.command}]")

    # -- the kernel -------------------------------------------------------------------

    def model(self) -> Path:
        if self.args.model:
            return Path(self.args.model)
        sys.path.insert(0, str(ROOT / "tests"))
        from checkpoints import add_tokenizer, make_checkpoint  # the tests' small model

        directory = self.root / "model"
        directory.mkdir()
        make_checkpoint(directory, "llama", weight_scale=4.0, seed=7)
        add_tokenizer(directory)
        return directory

    def start_kernel(self, model: Path) -> None:
        self.sock, self.state = self.root / "kernel.sock", self.root / "state"
        self.log = self.root / "kernel.log"
        flags = ["--kv-pages", str(self.args.kv_pages), "--host-pages",
                 str(self.args.kv_pages // 2), "--disk-pages", str(self.args.kv_pages // 4),
                 "--quota", str(self.args.quota), *self.args.kernel_arg]
        self.cmd = [sys.executable, "-m", "symphony.cli", "kernel", "--model", str(model),
                    "--socket", str(self.sock), "--state-dir", str(self.state), *flags]
        self.launch()

    def launch(self) -> None:
        with open(self.log, "ab") as out:
            self.daemon = subprocess.Popen(self.cmd, stdout=out, stderr=out,
                                           stdin=subprocess.DEVNULL, cwd=ROOT)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.daemon.poll() is not None:
                raise RuntimeError(f"the kernel exited ({self.daemon.returncode}):\n"
                                   f"{self.log.read_text(errors='replace')[-4000:]}")
            try:
                with Kernel.connect(self.sock, name="fuzz-probe") as k:
                    k.model_info()
                return
            except OSError as e:
                if e.errno not in (errno.ENOENT, errno.ECONNREFUSED, errno.EPIPE):
                    raise RuntimeError(f"the kernel refused a session: {e}") from e
                time.sleep(0.2)
        raise RuntimeError("the kernel did not answer in 120 s")

    def stop_kernel(self) -> int | None:
        if self.daemon is None or self.daemon.poll() is not None:
            return None if self.daemon is None else self.daemon.returncode
        self.daemon.send_signal(signal.SIGTERM)
        try:
            return self.daemon.wait(90)
        except subprocess.TimeoutExpired:
            self.daemon.kill()
            self.daemon.wait()
            return None

    def kernel_dead(self) -> bool:
        return self.daemon is not None and self.daemon.poll() is not None

    # -- workers ------------------------------------------------------------------------

    def roles(self) -> list[Role]:
        roles = [ROLES[i % len(ROLES)] for i in range(self.args.workers)]
        if os.geteuid() != 0:
            me = os.geteuid()
            self.report.note(f"not root: every worker runs as uid {me}; the "
                             f"cross-user calls of uids {USERS} are skipped")
            roles = [Role(me, r.kind, r.lifeline_pred, r.threads, r.builder) for r in roles]
        return roles

    def spawn(self, slot: Slot) -> None:
        slot.incarnation += 1
        slot.killed = slot.reaped = False
        cfg = {"index": slot.index, "incarnation": slot.incarnation, "seed": self.args.seed,
               "role": slot.role.__dict__, "socket": str(self.sock), "until": self.until,
               "ops": self.args.ops.split(",") if self.args.ops else None,
               "deep": slot.deep}
        slot.stderr = self.root / f"worker{slot.index}.{slot.incarnation}.err"
        with open(slot.stderr, "wb") as err:
            slot.proc = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(cfg)],
                stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, cwd="/")
        slot.reader = threading.Thread(target=self.read_worker,
                                       args=(slot, slot.proc, slot.incarnation), daemon=True)
        slot.reader.start()

    def read_worker(self, slot: Slot, proc: subprocess.Popen, incarnation: int) -> None:
        key = (slot.index, incarnation)
        for raw in proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                self.report.note(f"w{slot.index}: not JSON: {raw[:200]!r}")
                continue
            if msg["t"] == "counts":
                with self.report.lock:
                    self.report.counts[key] = msg["counts"]
                if msg.get("deep"):
                    slot.deep = msg["deep"]
            elif msg["t"] == "finding":
                f = {k: v for k, v in msg.items() if k != "t"}
                with self.report.lock:
                    self.report.findings.append(f)
            else:
                self.report.note(msg.get("text", str(msg)))

    def reap(self, slot: Slot) -> None:
        """A worker ended: a crash (not a kill, not the end, not a lost kernel) is a
        finding."""
        if slot.reaped:
            return
        slot.reaped = True
        rc = slot.proc.returncode
        if slot.reader is not None:
            slot.reader.join(5)
        if rc in (0, 3, -signal.SIGKILL):
            return
        tail = slot.stderr.read_text(errors="replace")[-3000:] if slot.stderr else ""
        self.found("worker-crash", "-", f"worker exited {rc}\n{tail}",
                   f"worker {slot.index}, incarnation {slot.incarnation}")

    def run_workers(self) -> None:
        self.until = time.time() + self.args.seconds
        self.role_list = self.roles()
        slots = [Slot(i, role) for i, role in enumerate(self.role_list)]
        for slot in slots:
            self.spawn(slot)
        every = self.args.kill_every
        next_kill = time.monotonic() + self.rng.expovariate(1 / every) if every else math.inf
        while time.time() < self.until:
            time.sleep(0.1)
            if self.kernel_dead():
                self.found("kernel-died", "-", f"the kernel exited "
                           f"{self.daemon.returncode} during the run",
                           "the kernel's log")
                break
            for slot in slots:
                if slot.proc.poll() is None:
                    continue
                self.reap(slot)
                if self.restarts < self.args.max_restarts and self.until - time.time() > 2:
                    self.restarts += 1
                    self.spawn(slot)
            if time.monotonic() >= next_kill:
                next_kill = time.monotonic() + self.rng.expovariate(1 / every)
                alive = [s for s in slots if s.proc.poll() is None and not s.role.builder]
                if alive:
                    victim = self.rng.choice(alive)
                    victim.killed = True
                    victim.proc.kill()
        # Workers stop at the deadline on their own; one that does not is stuck in a call.
        grace = time.monotonic() + HANG_S + 15
        for slot in slots:
            try:
                slot.proc.wait(max(0.1, grace - time.monotonic()))
            except subprocess.TimeoutExpired:
                slot.proc.kill()
                slot.proc.wait()
                self.found("hang", "-", f"worker {slot.index} still running "
                           f"{HANG_S + 15:.0f} s after the end (see its hang finding)",
                           f"worker {slot.index}.{slot.incarnation}")
            self.reap(slot)
        self.report.note(f"{self.restarts} worker restarts")
        depths = sorted((depth for slot in slots for _, _, depth in slot.deep), reverse=True)
        self.report.note(f"directory chains: {depths[:6]} levels deep")

    # -- after the run ------------------------------------------------------------------

    def walk(self, k: Kernel) -> tuple[dict[int, Any], dict[str, int]]:
        """Every named KV file (by inode, one stat each) and every path of one outside /tmp
        (its tokens), walking the namespace as root without recursion. A tree that renames
        moved deeper than a path reaches is moved up first (`hoist`), and the walk starts
        over: a file it did not reach would count as a leak."""
        for _ in range(HOISTS):
            by_ino, persisted, deep = self.walk_once(k)
            if not deep or not any([self.hoist(k, d) for d in deep]):
                break
        if deep:
            self.walk_incomplete = True
            self.report.note(f"the walk cannot reach below {short(deep[0], 60)}")
        return by_ino, persisted

    def walk_once(self, k: Kernel) -> tuple[dict[int, Any], dict[str, int], list[str]]:
        """One walk: its files, its paths, and the directories whose path is too long."""
        by_ino: dict[int, Any] = {}
        persisted: dict[str, int] = {}
        deep: list[str] = []
        stack = ["/"]
        while stack:
            d = stack.pop()
            try:
                entries = k.readdir(d)
            except OSError as e:
                if e.errno == errno.ENAMETOOLONG:  # a tree moved deeper than PATH_MAX
                    deep.append(d)
                    continue
                self.found("check", "readdir", f"{type(e).__name__}: {e}",
                           f"k.readdir({short(d)}) as root after the run")
                continue
            for name, st in entries:
                path = d.rstrip("/") + "/" + name
                if st.is_dir:
                    stack.append(path)
                    continue
                by_ino.setdefault(st.ino, st)
                if not path.startswith("/tmp/"):
                    persisted[path] = st.tokens
        return by_ino, persisted, deep

    def hoist(self, k: Kernel, deep: str) -> bool:
        """Move the ancestor of `deep` about half its path long (reachable: deep's parent
        was) to a new name in the top directory of its path (in /tmp it stays temporary),
        as root: the tree's paths get about half as long. Whether it moved (a tree another
        hoist of this walk moved has another path now: the next walk finds it)."""
        cut, top = deep.rfind("/", 0, len(deep) // 2), "/" + deep.split("/")[1]
        if cut <= len(top):
            return False
        self.hoists += 1
        new = f"{top}/walk-{self.hoists}"
        try:
            k.rename(deep[:cut], new)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENAMETOOLONG, errno.EEXIST):
                self.found("check", "rename", f"{type(e).__name__}: {e}",
                           f"k.rename({short(deep[:cut])}, {new!r}) as root after the run")
            return False
        self.report.note("the walk moved trees deeper than a path reaches up")
        return True

    @staticmethod
    def pages(k: Kernel, files: dict[int, Any]) -> dict[str, int]:
        """meminfo's used pages, against the pages the named files hold, shared ones once
        (a page in more than one place shows in /proc/kv with its references and files);
        and the pages charged to users (meminfo's quota lines), against what the named
        files hold counted once per user holding a page (a page shared by files of two
        users is charged to both: `owned` is `named` and one more for each such other
        user)."""
        mem = proc_fields(k.procfs("meminfo"))
        used = sum(int(mem.get(f"{tier}_used", 0)) for tier in ("device", "host", "disk"))
        charged = sum(int(v.split("/")[0]) for key, v in mem.items() if key.startswith("quota_"))
        held = sum(st.pages for st in files.values())
        extra_refs, extra_users, strangers = 0, 0, set()
        for row in k.procfs("kv").splitlines()[1:]:
            _, _, refs, inodes = row.split("\t")
            extra_refs += int(refs) - 1
            inos = {int(i) for i in inodes.split(",") if i}
            strangers |= inos - set(files)
            extra_users += max(0, len({files[i].uid for i in inos if i in files}) - 1)
        return {"used": used, "charged": charged, "named": held - extra_refs,
                "owned": held - extra_refs + extra_users,
                "files": len(files), "held_by_unnamed_inodes": len(strangers)}

    def check_after(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        try:
            k = Kernel.connect(self.sock, name="fuzz-check")
        except OSError as e:
            self.found("check", "connect", str(e), "after the run")
            return out
        with k:
            deadline = time.monotonic() + 30
            while True:
                others = [p for p in k.ps() if p.pid != k.pid]
                if not others or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            if others:
                self.found("not-reaped", "ps", f"{len(others)} processes left after every "
                           "worker exited: " + ", ".join(f"{p.pid} {p.name} {p.state}"
                                                         for p in others[:5]),
                           "k.ps() after the run")
            deadline = time.monotonic() + 15
            while True:  # a guess of the scheduler may hold a page a moment longer
                # Walked again each time: a file's stat counts such a page while it is held.
                files, self.persisted = self.walk(k)  # no worker changes them any more
                pages = self.pages(k, files)
                ok = (pages["used"] == pages["named"]
                      and pages["charged"] == pages["owned"])
                if ok or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            out["pages"] = pages
            if not ok or pages["held_by_unnamed_inodes"]:
                self.found("leak", "meminfo", f"pages used {pages['used']}, charged to "
                           f"users {pages['charged']}, held by named files "
                           f"{pages['named']} ({pages['files']} files), by each user's "
                           f"named files {pages['owned']}; inodes without a "
                           f"name hold shared pages: {pages['held_by_unnamed_inodes']}"
                           + ("; the walk did not reach every file"
                              if self.walk_incomplete else ""),
                           "k.procfs('meminfo') against readdir/stat and /proc/kv")
        return out

    def check_restart(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        rc = self.stop_kernel()
        out["stop_rc"] = rc
        if rc != 0:
            self.found("stop", "SIGTERM", f"the kernel exited {rc} on SIGTERM",
                       "kill -TERM <kernel> after the run")
            return out
        try:
            self.launch()
        except RuntimeError as e:
            self.found("restart", "-", str(e)[-3000:], "restart on the same --state-dir")
            return out
        with Kernel.connect(self.sock, name="fuzz-restart") as k:
            _, back = self.walk(k)
            lost = sorted(set(self.persisted) - set(back))
            changed = sorted(p for p in set(self.persisted) & set(back)
                             if self.persisted[p] != back[p])
            out.update(persisted=len(self.persisted), restored=len(back))
            if lost or changed:
                self.found("restart", "-", f"{len(lost)} files lost, {len(changed)} "
                           f"changed: {short(lost[:3] + changed[:3], 300)}",
                           "restart on the same --state-dir")
            for path in self.rng.sample(sorted(back), min(5, len(back))):
                try:
                    with k.open(path) as f:
                        tokens, _ = f.read()
                    if len(tokens) != back[path]:
                        self.found("restart", "read", f"{len(tokens)} tokens read, stat "
                                   f"says {back[path]}", f"k.open({path!r}).read()")
                except OSError as e:
                    if e.errno in (errno.ENOSPC, errno.EDQUOT):
                        continue
                    self.found("restart", "open", f"{type(e).__name__}: {e}",
                               f"k.open({short(path)}) after a restart")
        rc = self.stop_kernel()
        out["second_stop_rc"] = rc
        if rc != 0:
            self.found("stop", "SIGTERM", f"the restarted kernel exited {rc} on SIGTERM",
                       "kill -TERM <kernel> after a restart")
        return out

    def scan_log(self) -> None:
        """Tracebacks and failed syscalls in the kernel's log, one finding each."""
        if self.log is None or not self.log.exists():
            return
        lines = self.log.read_text(errors="replace").splitlines()
        for i, line in enumerate(lines):
            if "Traceback (most recent call last)" not in line:
                continue
            j = i + 1
            while j < len(lines) and (lines[j].startswith((" ", "\t")) or not lines[j]):
                j += 1
            last = lines[j] if j < len(lines) else "?"
            context = next((lines[h] for h in range(i - 1, max(i - 4, -1), -1)
                            if lines[h].strip()), "")
            where = [ln.strip() for ln in lines[i + 1:j] if ln.strip().startswith("File ")]
            self.found("kernel-traceback", "-", f"{last}\n{context}\n"
                       + "\n".join(where[-3:]),
                       f"{self.log}:{i + 1}" + ("" if self.args.keep else " (--keep keeps it)"))

    # -- the whole run -------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        args = self.args
        phases: dict[str, float] = {}
        result: dict[str, Any] = {"phases": phases}
        at = started = time.monotonic()

        def phase(name: str) -> None:
            nonlocal at
            phases[name] = round(time.monotonic() - at, 1)
            at = time.monotonic()

        if args.socket:
            self.sock = Path(args.socket)
            self.report.note("an external kernel: no stop/restart check")
        else:
            self.start_kernel(self.model())
        phase("start")
        self.run_workers()
        phase("calls")
        if not self.kernel_dead():
            result.update(self.check_after())
            phase("leak check")
            if not args.socket:
                result.update(self.check_restart())
                phase("stop and restart")
        self.stop_kernel()
        self.scan_log()
        result["seconds_total"] = round(time.monotonic() - started, 1)
        return result

    def cleanup(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.stop_kernel()
        if not self.args.keep:
            shutil.rmtree(self.root, ignore_errors=True)


def summarize(fuzz: Fuzz, result: dict[str, Any]) -> dict[str, Any]:
    rep, args = fuzz.report, fuzz.args
    totals = rep.totals()
    calls = sum(sum(c.values()) for c in totals.values())
    errnos: collections.Counter[str] = collections.Counter()
    for counter in totals.values():
        for err, n in counter.items():
            errnos[errname(err)] += n
    groups: dict[tuple, list[dict]] = collections.defaultdict(list)
    for f in sorted(rep.findings, key=lambda f: f["at"]):  # the first of each shown
        groups[group_key(f)].append(f)
    return {
        "seed": args.seed, "workers": args.workers, "seconds": args.seconds,
        "roles": [r.describe() for r in fuzz.role_list],
        "calls": calls,
        "per_call": {call: {errname(e): n for e, n in sorted(c.items())}
                     for call, c in sorted(totals.items())},
        "errnos": dict(errnos.most_common()),
        "findings": [{**items[0], "count": len(items),
                      "calls": sorted({f["call"] for f in items})} for items in groups.values()],
        "findings_total": len(rep.findings),
        "notes": [text if n == 1 else f"{text} (x{n})" for text, n in rep.notes.items()],
        **result,
    }


def print_summary(s: dict[str, Any]) -> None:
    print(f"\nfuzz: seed {s['seed']}, {s['workers']} workers, {s['seconds']} s of calls "
          f"({s.get('seconds_total', '?')} s in all): {s['calls']} calls")
    print("workers: " + "; ".join(s["roles"]))
    print("seconds: " + ", ".join(f"{k} {v}" for k, v in s.get("phases", {}).items()))
    width = max((len(c) for c in s["per_call"]), default=4)
    for call, errs in s["per_call"].items():
        cells = "  ".join(f"{e} {n}" for e, n in errs.items())
        print(f"  {call:<{width}}  {cells}")
    print("errnos: " + ", ".join(f"{e} {n}" for e, n in s["errnos"].items()))
    if "pages" in s:
        p = s["pages"]
        print(f"pages after the run: used {p['used']}, charged {p['charged']}, held by "
              f"{p['files']} named files {p['named']}, once per user {p['owned']}")
    if "stop_rc" in s:
        print(f"stop: exit {s['stop_rc']}; restart: {s.get('restored', '-')} of "
              f"{s.get('persisted', '-')} files back; second stop: exit "
              f"{s.get('second_stop_rc', '-')}")
    for note in s["notes"]:
        print(f"note: {note}")
    print(f"findings: {len(s['findings'])} distinct ({s['findings_total']} in all)")
    for f in s["findings"]:
        calls = ", ".join(f["calls"])
        print(f"\n[{f['kind']}] {calls} x{f['count']}: {f['error'].rstrip()}")
        who = f" (uid {f['uid']}, {f['who']}, seed {f['seed']})" if "who" in f else ""
        print(f"  repro: {f['repro']}{who}")
        if f.get("fds"):
            print(f"  fds: {f['fds']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--seconds", type=float, default=60.0, help="how long workers make calls")
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", help="checkpoint directory (default: a small random Llama)")
    ap.add_argument("--socket", help="fuzz the kernel already at this socket (no restart check)")
    ap.add_argument("--log", help="that kernel's log, to scan for tracebacks")
    ap.add_argument("--kv-pages", type=int, default=256, help="the started kernel's device pages")
    ap.add_argument("--quota", type=int, default=96, help="its per-user page quota")
    ap.add_argument("--kernel-arg", action="append", default=[],
                    help="one more flag for `symphony kernel` (repeatable)")
    ap.add_argument("--kill-every", type=float, default=3.0,
                    help="mean seconds between SIGKILLs of a random worker (0: none)")
    ap.add_argument("--max-restarts", type=int, default=200)
    ap.add_argument("--ops", help="only these calls, comma-separated (Gen.WEIGHTS' names: "
                    "pred,anon,close,...), to narrow a finding down")
    ap.add_argument("--ignore", action="append", default=[], metavar="KIND",
                    help="findings of this kind (EIO, exception, client-range, hang, wrong, "
                    "leak, ...) are listed but do not fail the run (repeatable)")
    ap.add_argument("--json", help="also write the summary here")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (log, state)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(json.loads(args.worker))
    fuzz = Fuzz(args, sys.argv[1:] if argv is None else argv)
    try:
        result = fuzz.run()
    finally:
        fuzz.cleanup()
    summary = summarize(fuzz, result)
    print_summary(summary)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1, default=str))
    return 1 if any(f["kind"] not in args.ignore for f in summary["findings"]) else 0


if __name__ == "__main__":
    sys.exit(main())
