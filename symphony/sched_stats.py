"""The scheduler's figures, as /proc/sched shows them."""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass, field

STATS_WINDOW = 10.0  # seconds of steps /proc/sched summarises
MIN_SPAN = 1.0  # seconds of readings a rank's busy share is taken over, at the least


@dataclass
class StepRecord:
    end: float
    seconds: float
    seqs: int
    prefill: int
    decode: int
    loop_cpu: float  # the event loop thread's CPU seconds so far (time.thread_time)
    preds: int  # preds answered so far


@dataclass
class SchedStats:
    steps: int = 0
    tokens: int = 0
    preemptions: int = 0  # idle or waiting processes whose pages were moved down
    pages_swapped_out: int = 0
    waits: int = 0  # admissions deferred for want of KV memory
    ahead: int = 0  # preds guessed (decoding ahead), one token each
    ahead_used: int = 0  # guesses a pred took
    pipelined: int = 0  # steps sent while the one before was computing
    max_seqs: int = 0  # the most sequences one step has packed
    preds: int = 0  # preds answered
    recent: deque = field(default_factory=deque)  # StepRecords of the last STATS_WINDOW s
    delays: deque = field(default_factory=lambda: deque(maxlen=1024))  # queue delays, s

    def record(self, step: StepRecord) -> None:
        self.steps += 1
        self.max_seqs = max(self.max_seqs, step.seqs)
        self.tokens += step.prefill + step.decode
        self.recent.append(step)
        self._forget(step.end)

    def window(self, now: float) -> tuple[list[StepRecord], float]:
        """The steps that ended in the last STATS_WINDOW seconds before `now`
        (time.monotonic), and the seconds /proc/sched's rates are taken over: from the start
        of the first of them to now (0 when there is none). So an idle kernel's rates fall
        as its steps recede and are 0 once the last has left the window, instead of keeping
        the figures of its last steps."""
        self._forget(now)
        if not self.recent:
            return [], 0.0
        first = self.recent[0]
        return list(self.recent), max(now - (first.end - first.seconds), first.seconds)

    def _forget(self, now: float) -> None:
        while self.recent and self.recent[0].end < now - STATS_WINDOW:
            self.recent.popleft()


def cpu_seconds(pid: int) -> tuple[float, float]:
    """A process's CPU seconds so far (user and system) and its age in seconds, from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    tick = os.sysconf("SC_CLK_TCK")
    # Fields 14, 15 and 22 of proc(5): utime, stime, starttime; fields[0] is field 3.
    return (int(fields[11]) + int(fields[12])) / tick, uptime - int(fields[19]) / tick


@dataclass
class RankClock:
    """The busy share of the engine's ranks on this machine: CPU seconds per second since the
    oldest reading of the last STATS_WINDOW seconds (readings are taken when /proc/sched is
    read), or over the process's life where that is under MIN_SPAN ago. A rank's threads
    together may pass 1."""

    readings: deque = field(default_factory=deque)  # (time.monotonic(), {pid: cpu seconds})

    def busy(self, pids: list[int], now: float) -> dict[int, float]:
        got = {}
        for pid in pids:
            try:
                got[pid] = cpu_seconds(pid)
            except (OSError, IndexError, ValueError):  # exited meanwhile
                continue
        self.readings.append((now, {pid: cpu for pid, (cpu, _) in got.items()}))
        while self.readings[0][0] < now - STATS_WINDOW:
            self.readings.popleft()
        then, before = self.readings[0]
        out = {}
        for pid, (cpu, age) in got.items():
            if then <= now - MIN_SPAN and pid in before:
                out[pid] = (cpu - before[pid]) / (now - then)
            else:
                out[pid] = cpu / age if age > 0 else 0.0
        return out
