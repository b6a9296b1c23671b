"""Persistence on a real kernel: SIGKILL at many instants through calls that save, after
which every file is its old version or its new one, bit for bit; a stop that a deep tree
cannot break; and reaping that a failed save cannot stop."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest
from daemon import ROOT, alive, meminfo, prompt, sched, start_daemon, wait_for

from symphony.daemon import scheduler_defect
from symphony.engine_process import EngineDied
from syscalls.session import pid_path

pytestmark = pytest.mark.slow

# Every version is a token range of one file made once by pred; splice copies K/V and never
# recomputes, so each is the same bytes whenever it is built.
OLD = {"a": [(0, 1000)], "b": [(0, 300)], "b.new": [(300, 700)], "c": None,
       "d": [(0, 200)], "e": [(0, 500)], "f": [(0, 400)]}
NEW = {"a": [(100, 1100)], "b": [(300, 700)], "b.new": None, "c": [(0, 600)], "d": None,
       "e": [(0, 500), (500, 700)], "f": [(0, 400), (400, 432)]}
# The mark after which each file must be its new version: the call that changed its name,
# or for f, changed but never closed or fsynced, the stop that saved it.
ACKED_BY = {"a": "a", "b": "b", "b.new": "b", "c": "c", "d": "d", "e": "e", "f": "stop"}
GAP = 0.2  # a named file left open: the old order had no data for it on disk here


def spliced(k, src, ranges) -> bytes | None:
    if ranges is None:
        return None
    with k.open("", os.O_RDWR) as f:
        for start, end in ranges:
            f.splice_from(src, start, end)
        return k.export(f)


def contents(k, path: str) -> bytes | None:
    try:
        return k.export(path)
    except FileNotFoundError:
        return None


def calls(d, home: str, new: dict[str, bytes | None], mark: Callable[[str], None]) -> None:
    """Import over a file, rename over one, link an anonymous file, unlink, fsync, and
    stop with a changed file open; each call that returns is marked (it may not, when the
    kernel is killed under it)."""
    k = d.connect("crash")
    try:
        mark("start")
        k.import_file(home + "/a", new["a"])
        mark("a")
        k.rename(home + "/b.new", home + "/b")
        mark("b")
        src = k.open(home + "/src")
        with k.open("", os.O_RDWR) as c:
            c.splice_from(src, 0, 600)
            c.link(home + "/c")
            mark("c")
            time.sleep(GAP)
        mark("gap")
        k.unlink(home + "/d")
        mark("d")
        with k.open(home + "/e", os.O_RDWR) as e:
            e.splice_from(src, 500, 700)
            e.fsync()
        mark("e")
        f = k.open(home + "/f", os.O_RDWR)
        f.splice_from(src, 400, 432)  # left open and changed: the stop saves it
        mark("f")
        d.process.send_signal(signal.SIGTERM)
        if d.process.wait(60) == 0:
            mark("stop")
    finally:
        with contextlib.suppress(OSError):  # the kernel is gone
            k.close()


def crash_round(d, home: str, new: dict, kill: tuple[str, float] | None) -> dict[str, float]:
    """The calls, and when each returned; kill = (mark, seconds): the kernel is SIGKILLed
    that long after that mark."""
    marks: dict[str, float] = {}
    killers: list[threading.Timer] = []

    def mark(what: str) -> None:
        marks[what] = time.monotonic()
        if kill is not None and what == kill[0]:
            killers.append(threading.Timer(kill[1], d.process.kill))
            killers[0].start()

    try:
        calls(d, home, new, mark)
    except ConnectionError:  # the kernel died under a call
        assert killers
    finally:
        for killer in killers:
            killer.join()
        d.process.wait(60)
    return marks


def check(k, home: str, old: dict, new: dict, done: set[str]) -> None:
    got = {name: contents(k, f"{home}/{name}") for name in OLD}
    for name in OLD:
        acked = ACKED_BY[name] in done or "stop" in done
        allowed = (new[name],) if acked else (old[name], new[name])
        assert got[name] in allowed, (name, done)
    assert (got["b"], got["b.new"]) in ((old["b"], old["b.new"]), (new["b"], None))


def reset(k, home: str, old: dict) -> None:
    """Every file back to its old version (an import over a file rewrites it in place)."""
    for name, data in old.items():
        if data is not None:
            k.import_file(f"{home}/{name}", data)
        elif contents(k, f"{home}/{name}") is not None:
            k.unlink(f"{home}/{name}")


def test_a_kill_at_any_instant_leaves_every_file_old_or_new(model):
    d = start_daemon(model)
    try:
        with d.connect() as k:
            home = k.home
            with k.open(home + "/src", os.O_CREAT | os.O_RDWR) as src:
                src.pred(prompt(1100), no_outputs=True)
                old = {name: spliced(k, src, ranges) for name, ranges in OLD.items()}
                new = {name: spliced(k, src, ranges) for name, ranges in NEW.items()}
            reset(k, home, old)
        # A round with no kill times the calls; then each round kills the kernel halfway
        # through one of them (halfway by that timing).
        marks = crash_round(d, home, new, None)
        steps = list(marks)
        assert steps == ["start", "a", "b", "c", "gap", "d", "e", "f", "stop"]
        kills = [(before, (marks[step] - marks[before]) / 2)
                 for before, step in zip(steps, steps[1:], strict=False)]
        done = set(marks)
        for kill in kills:
            d = start_daemon(model, d.socket.parent)
            with d.connect() as k:
                check(k, home, old, new, done)
                reset(k, home, old)
            done = set(crash_round(d, home, new, kill))
            assert d.process.returncode in (0, -signal.SIGKILL)
        d = start_daemon(model, d.socket.parent)
        with d.connect() as k:
            check(k, home, old, new, done)
        assert d.stop() == 0, d.log_text()
    finally:
        d.stop()


def test_stop_after_a_tree_deeper_than_the_stack(model):
    d = start_daemon(model)
    deep = "/d" * 1200
    try:
        with d.connect() as k:
            path = "/tmp/deep"
            k.mkdir(path)
            for _ in range(1200):  # under /tmp, which is never saved: quick
                path += "/d"
                k.mkdir(path)
            k.rename("/tmp/deep", k.home + "/deep")  # the next save walks all of it
            k.mkdir(k.home + "/after")
            home = k.home
        assert d.stop() == 0, d.log_text()
        assert not d.socket.exists() and not pid_path(d.socket).exists()
        d = start_daemon(model, d.socket.parent)
        with d.connect() as k:
            assert k.stat(home + "/deep" + deep).nlink == 2
            k.stat(home + "/after")
        assert d.stop() == 0, d.log_text()
    finally:
        d.stop()


HOLDER = """
import os, sys
from syscalls.client import Kernel
k = Kernel.connect(name="holder")
x = k.open(sys.argv[1], os.O_RDWR)
x.truncate(39)  # changed: its save when the process is reaped fails
files = [k.open("", os.O_RDWR) for _ in range(3)]
for f in files:
    f.pred(list(range(6, 70)), no_outputs=True)
print("ready", flush=True)
sys.stdin.read()
"""


def test_reaping_and_stop_free_everything_when_a_save_fails(model):
    d = start_daemon(model)
    try:
        with d.connect() as k:
            x = k.home + "/x"
            with k.open(x, os.O_CREAT | os.O_RDWR) as f:
                f.pred(prompt(40), no_outputs=True)
            ino = k.stat(x).ino
            blocker = d.state / "files" / f"{ino}.kv.tmp"
            blocker.mkdir()  # x's next save cannot write its temporary file
            used = int(meminfo(k)["device_used"])
            lip = subprocess.Popen([sys.executable, "-c", HOLDER, x], env=d.env(), cwd=ROOT,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert lip.stdout.readline() == "ready\n"
            assert int(meminfo(k)["device_used"]) > used
            lip.kill()
            assert lip.wait(30) == -signal.SIGKILL
            wait_for(lambda: int(meminfo(k)["device_used"]) == used, timeout=15,
                     what="every page of the dead process to be freed")
            assert f"saving inode {ino} failed" in d.log_text()
            assert k.stat(x).tokens == 39  # the change stands
    finally:
        code = d.stop()
    # The stop saves all it can, says what it could not, and leaves nothing behind.
    assert code == 1 and f"not saved: inode {ino}" in d.log_text(), d.log_text()
    assert not d.socket.exists() and not pid_path(d.socket).exists()


def test_a_dead_engine_process_stops_the_kernel_and_loses_no_saved_file(model):
    d = start_daemon(model)
    try:
        with d.connect() as k:
            x = k.home + "/x"
            with k.open(x, os.O_CREAT | os.O_RDWR) as f:
                f.pred(prompt(40), no_outputs=True)
                f.fsync()
            engine = int(sched(k)["engine_pid"])
            assert engine != d.process.pid and alive(engine)
            os.kill(engine, signal.SIGKILL)
            # The pred in flight, or the next, fails: the kernel stops, it does not hang.
            with pytest.raises(OSError), k.open(x, os.O_RDWR) as f:
                for _ in range(100):
                    f.pred([7], no_outputs=True)
        assert d.process.wait(30) == 1, d.log_text()
        assert f"the engine process (pid {engine}) exited" in d.log_text()
        assert not d.socket.exists() and not pid_path(d.socket).exists()
        d = start_daemon(model, d.socket.parent)
        with d.connect() as k:
            assert k.stat(x).tokens == 40
    finally:
        d.stop()


def test_a_killed_kernel_takes_its_engine_process_with_it(model):
    d = start_daemon(model)
    try:
        with d.connect() as k:
            engine = int(sched(k)["engine_pid"])
        d.process.kill()
        d.process.wait(30)
        wait_for(lambda: not alive(engine), timeout=10, what="the engine process to exit")
    finally:
        d.stop()


def test_the_engine_process_leaves_stopping_to_its_kernel(model):
    """A SIGTERM to the kernel's process group (a service manager's stop) reaches the engine
    process too: it ignores it, and the kernel stops cleanly and then stops it."""
    d = start_daemon(model)
    try:
        with d.connect() as k:
            engine = int(sched(k)["engine_pid"])
            os.kill(engine, signal.SIGTERM)
            time.sleep(0.5)
            with k.open("", os.O_RDWR) as f:
                f.pred(prompt(8), no_outputs=True)
            assert alive(engine)
        assert d.stop() == 0, d.log_text()
        assert "the engine process" not in d.log_text()
        wait_for(lambda: not alive(engine), timeout=10, what="the engine process to exit")
    finally:
        d.stop()


def test_a_second_kernel_on_a_state_directory_in_use_is_refused(model, tmp_path):
    """Two kernels on one state directory both started, and the last to save lost the
    other's names; the second now exits 1 naming the directory and the kernel that has it,
    touching nothing, and one may start there once the first has stopped."""
    first = start_daemon(model)
    try:
        with first.connect() as k:
            with k.open(k.home + "/kept.kv", os.O_CREAT | os.O_RDWR) as f:
                f.pred(prompt(8), no_outputs=True)
        second = subprocess.run(
            [sys.executable, "-m", "symphony.cli", "kernel", "--model", str(model), "--socket",
             str(tmp_path / "second.sock"), "--state-dir", str(first.state)],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert second.returncode == 1, second.stderr
        assert (f"state directory {first.state}: another kernel uses it "
                f"(pid {first.process.pid})") in second.stderr, second.stderr
        assert not (tmp_path / "second.sock").exists()
        with first.connect() as k:
            assert k.stat(k.home + "/kept.kv").tokens == 8
    finally:
        assert first.stop() == 0, first.log_text()
    again = start_daemon(model, first.state.parent)
    try:
        with again.connect() as k:
            assert k.stat(k.home + "/kept.kv").tokens == 8
    finally:
        again.stop()


def test_the_log_tells_a_scheduler_defect_from_the_engine_s_death():
    """A scheduler that ended on its own exception (a defect of the kernel's, as a
    TypeError in a kvfs call) is logged as itself: it read "the engine process exited
    with status None". The engine's death (EngineDied) and a stop (cancelled) are not."""
    async def ended(e: BaseException | None) -> asyncio.Task:
        async def run() -> None:
            if e is not None:
                raise e
            await asyncio.sleep(60)

        task = asyncio.get_running_loop().create_task(run())
        await asyncio.sleep(0)
        if e is None:
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return task

    async def bugs() -> list:
        bug = TypeError("unref() missing 1 required positional argument: 'uid'")
        died = EngineDied(errno.EIO, "rank 0")
        return [scheduler_defect(await ended(e)) for e in (bug, died, None)]

    found = asyncio.run(bugs())
    assert isinstance(found[0], TypeError) and found[1:] == [None, None]
