"""The scheduler's figures, as /proc/sched shows them."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

STATS_WINDOW = 10.0  # seconds of steps /proc/sched summarises


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
    preemptions: int = 0  # idle processes whose pages were moved down
    pages_swapped_out: int = 0
    waits: int = 0  # admissions deferred for want of KV memory
    ahead: int = 0  # preds guessed (decoding ahead), one token each
    ahead_used: int = 0  # guesses a pred took
    max_seqs: int = 0  # the most sequences one step has packed
    preds: int = 0  # preds answered
    recent: deque = field(default_factory=deque)  # StepRecords of the last STATS_WINDOW s
    delays: deque = field(default_factory=lambda: deque(maxlen=1024))  # queue delays, s

    def record(self, step: StepRecord) -> None:
        self.steps += 1
        self.max_seqs = max(self.max_seqs, step.seqs)
        self.tokens += step.prefill + step.decode
        self.recent.append(step)
        while self.recent and self.recent[0].end < step.end - STATS_WINDOW:
            self.recent.popleft()
