"""/proc/sched's rates cover the last STATS_WINDOW seconds: an idle kernel's fall to 0."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from symphony import procfs
from symphony.procfs import ProcFS
from symphony.sched_stats import STATS_WINDOW, SchedStats, StepRecord
from syscalls.convert import proc_fields

RATES = ("steps_per_s", "tokens_per_s", "engine_busy", "loop_cpu_us_per_pred",
         "batch_seqs_avg", "budget_use", "prefill_share")


def busy_second(stats: SchedStats, start: float) -> None:
    """Ten steps of 0.05 s, one every 0.1 s from `start`, 64 tokens and 8 preds each."""
    for i in range(10):
        end = start + 0.1 * i + 0.05
        stats.preds += 8
        stats.record(StepRecord(end, 0.05, 8, 56, 8, loop_cpu=0.001 * i, preds=stats.preds))


def sched_at(stats: SchedStats, now: float, monkeypatch) -> dict[str, float]:
    kernel = SimpleNamespace(
        sched=SimpleNamespace(stats=stats, queue=[], token_budget=128, decode_ahead=False),
        engine=SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32,
                               attention="c", mode="model", pid=1),
        procs=[])
    monkeypatch.setattr(procfs.time, "monotonic", lambda: now)
    fields = proc_fields(ProcFS(kernel).read("sched", None))
    return {name: float(fields[name]) for name in RATES}


def test_the_rates_fall_to_zero_once_the_kernel_is_idle(monkeypatch):
    stats = SchedStats()
    busy_second(stats, 100.0)
    at_once = sched_at(stats, 101.0, monkeypatch)  # right after the last step
    assert at_once["steps_per_s"] == 10.0
    assert at_once["tokens_per_s"] == 640.0
    assert at_once["engine_busy"] == 0.5
    assert at_once["loop_cpu_us_per_pred"] > 0
    # Idle for 4 seconds: the same steps over 5 seconds of window.
    later = sched_at(stats, 105.0, monkeypatch)
    assert later["steps_per_s"] == 2.0
    assert later["tokens_per_s"] == 128.0
    assert later["engine_busy"] == 0.1
    # Idle for longer than the window: no step is left in it.
    idle = sched_at(stats, 101.0 + STATS_WINDOW + 0.01, monkeypatch)
    assert idle == dict.fromkeys(RATES, 0.0)
    assert stats.steps == 10  # the counts since start stay
    # Busy again: the rates are the new steps', not the old ones'.
    busy_second(stats, 200.0)
    assert sched_at(stats, 201.0, monkeypatch) == at_once


def test_the_window_keeps_only_the_last_seconds_of_steps():
    stats = SchedStats()
    busy_second(stats, 0.0)
    busy_second(stats, 20.0)
    steps, seconds = stats.window(21.0)
    assert [s.end for s in steps] == [20.0 + 0.1 * i + 0.05 for i in range(10)]
    assert seconds == 1.0  # from the first step's start
    assert stats.window(21.0 + STATS_WINDOW) == ([], 0.0)
