"""`symphony top`: the kernel's KV memory, scheduler and processes, refreshed like top(1).

q quits; any other key refreshes now. --once prints one frame instead, for scripts.
"""

from __future__ import annotations

import argparse
import curses
import math
import os
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass

from syscalls.client import Kernel
from syscalls.convert import ProcInfo, proc_fields

# Every line fits an 80-column terminal (curses leaves the last column alone): the summary
# wraps, and the process table's NAME starts at column 69. A process's syscall count is in
# `symphony ps` and /proc/PID/status.
WIDTH = 79
ROW = "{:>5} {:<8} {:<8} {:>3} {:>7} {:>8} {:>6} {:>6} {:>6} {}"
COLUMNS = ROW.format("PID", "USER", "STATE", "NI", "TOK/S", "TOKENS", "PAGES", "CPU", "ACCEL",
                     "NAME")
QUIT = (ord("q"), ord("Q"))


@dataclass(frozen=True)
class Sample:
    taken: float  # time.time()
    procs: list[ProcInfo]
    meminfo: dict[str, str]
    sched: dict[str, str]


def sample(k: Kernel) -> Sample:
    meminfo, sched = proc_fields(k.procfs("meminfo")), proc_fields(k.procfs("sched"))
    return Sample(time.time(), k.ps(), meminfo, sched)


def rates(before: Sample, after: Sample) -> dict[int, float]:
    """Tokens per second of each process of `after` since `before`. One missing from
    `before` attached since, so it counts from 0."""
    dt = after.taken - before.taken
    old = {p.pid: p.tokens for p in before.procs}
    return {
        p.pid: max(p.tokens - old.get(p.pid, 0), 0) / dt if dt > 0 else 0.0 for p in after.procs
    }


def wrap(head: str, items: list[str], sep: str = ", ") -> list[str]:
    """`head` and the items joined by `sep`, in lines of WIDTH at most (an item is not
    split), the lines after the first indented as far as the first's items."""
    lines, line, indent = [], head, " " * len(head)
    for i, item in enumerate(items):
        piece = item if line in (head, indent) else sep + item
        if line not in (head, indent) and len(line) + len(piece.rstrip()) > WIDTH:
            lines.append(line.rstrip())
            line, piece = indent, item
        line += piece
        if i == len(items) - 1:
            lines.append(line)
    return lines or [head.rstrip()]


def frame(s: Sample, rate: Mapping[int, float]) -> list[str]:
    """The screen: summary lines, COLUMNS, then the processes, busiest first. A process
    without a rate (the first frame) shows "-". Every line but a long process name fits
    WIDTH columns."""
    # A field this kernel does not report shows as "-": an older or newer kernel still draws.
    m, q = defaultdict(lambda: "-", s.meminfo), defaultdict(lambda: "-", s.sched)
    tiers = [key.removesuffix("_total") for key in s.meminfo if key.endswith("_total")]
    states = Counter(p.state for p in s.procs)
    quotas = [
        f"{key.removeprefix('quota_')} {value}"
        for key, value in s.meminfo.items()
        if key.startswith("quota_")
    ]
    # The engine's ranks (tensor parallelism): /proc/sched's "rankR: pid=... busy=..." rows.
    ranks = []
    for key, value in s.sched.items():
        if key.startswith("rank") and key[4:].isdigit():
            f = defaultdict(lambda: "-", (kv.split("=", 1) for kv in value.split() if "=" in kv))
            ranks.append(f"{key[4:]} pid {f['pid']} {f['device']} on {f['host']} "
                         f"busy {f['busy']}")
    lines = [
        *wrap(f"symphony top - {time.strftime('%H:%M:%S', time.localtime(s.taken))}  "
              f"processes {len(s.procs)}: ",
              [f"{n} {state}" for state, n in sorted(states.items())]),
        *wrap("KV pages: ",
              [f"{t} {m[t + '_used']}/{m[t + '_total']} used, {m[t + '_free']} free"
               for t in tiers], " | "),
        *wrap("          ", [f"shared {m['shared']}", f"swapped {m['swapped_out']}",
                             f"on disk {m['on_disk']}"]),
        *wrap("Sched: ", [
            f"run queue {q['run_queue']}", f"waiting for memory {q['waiting_for_memory']}",
            f"{q['steps_per_s']} steps/s", f"{q['tokens_per_s']} tokens/s",
            f"batch {q['batch_seqs_avg']} avg {q['batch_seqs_max']} max",
            f"budget use {q['budget_use']} of {q['token_budget']} tokens",
            f"prefill share {q['prefill_share']}",
            f"queue delay p50 {q['queue_delay_p50_ms']} p90 {q['queue_delay_p90_ms']} "
            f"p99 {q['queue_delay_p99_ms']} ms",
            f"preemptions {q['preemptions']}", f"pages swapped out {q['pages_swapped_out']}",
            f"admission waits {q['admission_waits']}",
            f"engine busy {q['engine_busy']}",
            f"loop CPU {q['loop_cpu_us_per_pred']} us a pred",
            f"decoding ahead {q['decode_ahead']}: {q['ahead_used']} of "
            f"{q['ahead_guesses']} guesses taken",
        ]),
        *(wrap("Ranks: ", ranks) if ranks else []),
        *(wrap("Quota (pages used / limit): ", quotas) if quotas else []),
        "",
        COLUMNS,
    ]
    for p in sorted(s.procs, key=lambda p: (-rate.get(p.pid, 0.0), -p.tokens, p.pid)):
        r = f"{rate[p.pid]:.1f}" if p.pid in rate else "-"
        lines.append(ROW.format(p.pid, p.user[:8], p.state, p.nice, r, p.tokens, p.pages,
                                f"{p.cpu_seconds:.1f}", f"{p.accel_seconds:.1f}", p.name))
    return lines


def draw(screen: curses.window, lines: list[str]) -> None:
    height, width = screen.getmaxyx()
    screen.erase()
    for y, line in enumerate(lines[:height]):
        attr = curses.A_REVERSE if line == COLUMNS else curses.A_NORMAL
        # Not the last column: writing the bottom-right cell is an error in curses.
        screen.addnstr(y, 0, line, width - 1, attr)
    screen.refresh()


def live(screen: curses.window, k: Kernel, interval: float) -> None:
    with suppress(curses.error):  # not every terminal can hide its cursor
        curses.curs_set(0)
    screen.timeout(int(interval * 1000))
    last, rate = sample(k), {}
    while True:
        draw(screen, frame(last, rate))
        if screen.getch() in QUIT:  # -1 when the interval passed without a key
            return
        now = sample(k)
        rate, last = rates(last, now), now


def run(args: argparse.Namespace) -> int:
    if not (args.once or sys.stdout.isatty()):
        raise ValueError("top: stdout is not a terminal (use --once)")
    try:
        with Kernel.connect(args.socket, name="symphony-top") as k:
            if args.once:
                first = sample(k)
                time.sleep(args.interval)
                last = sample(k)
                print("\n".join(frame(last, rates(first, last))))
            else:
                # ncurses prefers LINES and COLUMNS to the terminal's own size, even after a
                # resize; a shell may have exported them for a size the terminal has left.
                for name in ("LINES", "COLUMNS"):
                    os.environ.pop(name, None)
                curses.wrapper(live, k, args.interval)
    except KeyboardInterrupt:  # Ctrl-C is how many quit top; curses.wrapper restored the tty
        pass
    return 0


def seconds(text: str) -> float:
    """An argparse type: --interval's seconds, finite and above 0."""
    value = float(text)  # a ValueError is argparse's "invalid seconds value: ..."
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    top = sub.add_parser(
        "top",
        help="a live view of the kernel's memory, scheduler and processes",
        description=__doc__,
    )
    top.add_argument("--socket", help="the kernel's socket (default: $SYMPHONY_SOCKET or "
                     "/tmp/symphony/kernel.sock)")
    top.add_argument("--interval", type=seconds, default=1.0,
                     help="seconds between refreshes (default %(default)s)")
    top.add_argument(
        "--once",
        action="store_true",
        help="print one frame, rates measured over one interval, and exit",
    )
    top.set_defaults(func=run)
