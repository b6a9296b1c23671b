"""/proc texts without a daemon: /proc/sched's rates cover the last STATS_WINDOW seconds (an
idle kernel's fall to 0); /proc/meminfo's and /proc/kv's formats are docs/syscalls.md's."""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
from kvfs_helpers import append, make_fs

from kvfs.perm import Cred
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
        sched=SimpleNamespace(stats=stats, run_queue=lambda: 0, token_budget=128,
                              decode_ahead=False, pipeline=False),
        engine=SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32,
                               attention="c", mode="model", pid=1, ranks=[],
                               nice=lambda: 0),
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


def kernel_of(fs) -> SimpleNamespace:
    return SimpleNamespace(fs=fs, engine=SimpleNamespace(pool=fs.store.pool), procs=[])


def test_meminfo_is_key_value_lines_with_a_quota_line_per_user():
    fs = make_fs(pages=64, host=16, quota={1000: 0}, default_quota=40)
    root, alice = Cred(0, 0), Cred(os.getuid() + 54321, 100)
    with_pages = fs.open(root, "", os.O_RDWR)
    append(fs, with_pages, list(range(10)))  # 3 pages of 4 tokens
    fs.open(alice, "", os.O_RDWR)  # anonymous, empty: charges nothing
    text = ProcFS(kernel_of(fs)).read("/proc/meminfo", root)
    lines = text.splitlines()
    keys = [line.split(":")[0] for line in lines]
    assert keys[:9] == [f"{t}_{w}" for t in ("device", "host", "disk")
                        for w in ("total", "free", "used")]
    assert keys[9:14] == ["page_size_tokens", "page_bytes", "shared", "swapped_out", "on_disk"]
    width = len(lines[0]) - len(lines[0].split(":", 1)[1].lstrip())  # values line up
    assert all(len(line) - len(line.split(":", 1)[1].lstrip()) == width for line in lines)
    fields = proc_fields(text)
    assert (fields["device_total"], fields["device_used"], fields["host_total"]) == (
        "64", "3", "16")
    assert fields["quota_root"] == "3 / -"  # root has no quota
    assert fields[f"quota_uid{alice.uid}"] == "0 / 40"  # no page, an inode: its line


def test_a_quota_of_zero_shows_as_zero_not_as_none():
    fs = make_fs(quota={1000: 0})
    fs.store.used[1000] = 0  # a user that held pages once
    assert proc_fields(ProcFS(kernel_of(fs)).read("meminfo", Cred(0, 0)))[
        "quota_" + procfs.user_name(1000)] == "0 / 0"


def test_proc_kv_lists_only_pages_more_than_one_file_holds():
    fs = make_fs()
    root = Cred(0, 0)
    a = fs.open(root, "", os.O_RDWR)
    append(fs, a, list(range(10)))  # 2 full pages and a partial one
    kv = ProcFS(kernel_of(fs))
    assert kv.read("kv", root) == "page\ttier\trefs\tinodes\n"  # 3 pages, none shared
    b = fs.fork(a, root)  # shares the 2 full pages, copies the partial one
    kv.k.procs = [SimpleNamespace(fds={3: a, 4: b})]
    rows = [line.split("\t") for line in kv.read("kv", root).splitlines()[1:]]
    assert [(tier, refs, inodes) for _, tier, refs, inodes in rows] == [
        ("device", "2", f"{a.inode.ino},{b.inode.ino}")] * 2
    assert [page for page, *_ in rows] == [f"device:{p.slot}" for p in a.inode.pages[:2]]
