"""The command line against a real kernel: what a LIP says of its flags and of a kernel
that stops, and what `symphony kv cp` refuses."""

import os
import signal
import subprocess

import pytest
from daemon import ROOT, SYMPHONY, as_user, start_daemon, wait_for


@pytest.mark.parametrize("lip", ["complete.py", "best_of_n.py"])
def test_a_lip_refuses_prompt_ids_outside_the_vocabulary(daemon, lip):
    """syscalls.flags.prompt_of's (and aprompt_of's) check: it was the kernel's "batch:
    token id outside the vocabulary", exit 1, naming no flag."""
    out = subprocess.run([*SYMPHONY, "run", f"lips/{lip}", "--prompt-ids", "1,-3,999"],
                         env=daemon.env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr.endswith("error: --prompt-ids: token -3 is outside [0, 320), the "
                               "vocabulary\n"), out.stderr


@pytest.mark.parametrize(("lip", "tokens"), [("complete.py", 10), ("complete.py", -1),
                                             ("best_of_n.py", 10)],
                         ids=["generating", "attached", "asyncio"])
def test_a_lip_says_the_kernel_is_stopping_when_it_stops(model, lip, tokens):
    """`symphony stop` while a LIP generates (or has just attached): it said "pred:
    cancelled, the process is exiting: Interrupted system call", "kernel unreachable: the
    lifeline closed" or "no session: the process has exited or was killed", not that the
    kernel stopped, though the kernel says so first (SHUTDOWN)."""
    daemon = start_daemon(model, None, "--kv-pages", "64", "--engine", "sleep:20")
    try:
        run = subprocess.Popen([*SYMPHONY, "run", f"lips/{lip}", "--prompt-ids", "1,2,3",
                                "--max-new-tokens", "200", "--json"],
                               env=daemon.env(), cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        with daemon.connect() as k:
            wait_for(lambda: any(p.name == lip and p.tokens > tokens for p in k.ps()),
                     what="the LIP to generate")
        assert daemon.stop() == 0, daemon.log_text()
        out, err = run.communicate(timeout=60)
    finally:
        daemon.stop()
    assert (run.returncode, out) == (1, ""), err
    assert err.startswith(f"{lip.removesuffix('.py')}: ") and "the kernel is stopping" in err, err


def kv_cp(daemon, src: str, dst: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SYMPHONY, "kv", "cp", "--socket", str(daemon.socket), src, dst],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_kv_cp_refuses_a_file_onto_itself_leaving_it_as_it_was(daemon, k):
    """As cp(1) does: `kv cp kv:a.kv kv:a.kv` rewrote the file and exited 0, however the
    destination named it (its directory; its kernel by its socket)."""
    path = f"{k.home}/same.kv"
    with k.open(path, os.O_CREAT | os.O_RDWR) as f:
        f.pred([5, 6, 7, 8, 9] * 4, no_outputs=True)
    kept = ("ino", "mtime_ns", "ctime_ns", "tokens")
    before, exported = [getattr(k.stat(path), a) for a in kept], k.export(path)
    for dst in ("kv:same.kv", "kv:", f"kv:{path}", f"kv:{daemon.socket}:{k.home}/"):
        out = kv_cp(daemon, "kv:same.kv", dst)
        assert (out.returncode, out.stdout, out.stderr) == (1, "", (
            f"symphony: kv cp: 'kv:{path}' and 'kv:{path}' are the same file\n")), dst
    assert ([getattr(k.stat(path), a) for a in kept], k.export(path)) == (before, exported)
    k.unlink(path)


def test_kv_cp_of_a_local_directory_names_the_operation_and_the_directory(daemon, k,
                                                                          tmp_path):
    """It said "symphony: DIR: Is a directory", as no other kv cp error did."""
    out = kv_cp(daemon, str(tmp_path), "kv:x.kv")
    assert (out.returncode, out.stderr) == (1, f"symphony: kv cp: {tmp_path}: Is a directory\n")
    assert "x.kv" not in [name for name, _ in k.readdir(k.home)]


def test_stop_by_another_user_names_the_kernel_and_its_user(daemon):
    """It said only 'symphony: Operation not permitted'; the kernel runs on."""
    out = as_user(65534, *SYMPHONY, "stop", "--socket", str(daemon.socket))
    pid = daemon.process.pid
    assert out.returncode == 1
    assert out.stderr.decode() == (
        f"symphony: kernel {pid} on {daemon.socket} runs as root (uid 0): only that user or "
        "root can stop it: Operation not permitted\n")
    with daemon.connect() as k:
        assert k.ps()


def test_stop_of_a_stopped_kernel_says_so_and_it_stops_once_continued(model):
    """It waited 120 s for a kernel SIGSTOP held, then said only 'still running'."""
    d = start_daemon(model, None, "--kv-pages", "16")
    try:
        os.kill(d.process.pid, signal.SIGSTOP)
        out = subprocess.run([*SYMPHONY, "stop", "--socket", str(d.socket)], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
        pid = d.process.pid
        assert (out.returncode, out.stderr) == (1, (
            f"symphony: kernel {pid} is stopped (SIGSTOP or a debugger): it stops, saving its "
            f"files, once it continues (kill -CONT {pid})\n"))
        os.kill(pid, signal.SIGCONT)
        assert d.process.wait(60) == 0  # the SIGTERM stop sent, taken as it runs again
    finally:
        if d.process.poll() is None:
            os.kill(d.process.pid, signal.SIGCONT)
        d.stop()
