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
