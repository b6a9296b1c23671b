"""`symphony start` and `symphony kernel` failing or interrupted before they serve."""

import errno
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from daemon import ROOT, alive, wait_for

from symphony.control import PROBE_WAIT, Claim, kernel_pid
from syscalls.session import pid_path


def symphony(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "symphony.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_a_failed_start_shows_only_its_own_kernels_log(tmp_path):
    """The log is appended to: a failed start echoed the errors of earlier failed starts
    before its own."""
    sock, state = tmp_path / "k.sock", tmp_path / "statefile"
    state.write_text("")
    first = symphony("start", "--socket", str(sock), "--state-dir", str(state))
    assert first.returncode == 1 and "statefile" in first.stderr, first.stderr
    second = symphony("start", "--socket", str(sock), "--state-dir", str(tmp_path / "st"),
                      "--model", str(tmp_path / "missing.gguf"))
    assert second.returncode == 1 and "missing.gguf" in second.stderr, second.stderr
    assert "statefile" not in second.stderr


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def torch_loaded(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.parametrize("starting", [torch_loaded, children], ids=["importing", "engine"])
def test_a_kernel_interrupted_while_it_starts_exits_quietly(tmp_path, starting):
    """Ctrl-C while the kernel loads: a KeyboardInterrupt's traceback, death by the signal.
    Now 130, as a shell's, and nothing left: no socket, no pid file, no engine process."""
    kernel = subprocess.Popen(
        [sys.executable, "-m", "symphony.cli", "kernel", "--socket", str(tmp_path / "k.sock"),
         "--state-dir", str(tmp_path / "st"), "--kv-pages", "16"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        wait_for(lambda: starting(kernel.pid), what=starting.__name__)
        engines = children(kernel.pid)
        kernel.send_signal(signal.SIGINT)
        _, err = kernel.communicate(timeout=60)
    finally:
        kernel.kill()
    assert kernel.returncode == 130 and "Traceback" not in err, err
    assert not list(tmp_path.glob("k.sock*"))
    for pid in engines:
        wait_for(lambda pid=pid: not alive(pid), what=f"engine process {pid} to end")


def test_a_kernels_socket_that_no_kernel_serves_on_is_said_so(tmp_path):
    """A kernel that starts holds its socket with no hello socket beside it, and one killed
    then leaves that socket: every command said "no Symphony kernel at SOCK: No such file or
    directory" of a socket that is there. Now what is there: a listener that answers no
    hello, then a socket no kernel answers on."""
    sock = tmp_path / "k.sock"
    kernel = subprocess.Popen(
        [sys.executable, "-m", "symphony.cli", "kernel", "--socket", str(sock),
         "--state-dir", str(tmp_path / "st"), "--kv-pages", "16"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    try:
        wait_for(lambda: children(kernel.pid), what="the engine process")
        engines = children(kernel.pid)
        kernel.send_signal(signal.SIGSTOP)  # still starting, whatever the engine does now
        starting = symphony("ps", "--socket", str(sock))
        kernel.kill()
        kernel.wait(60)
        dead = [symphony(*command, "--socket", str(sock)) for command in (["ps"], ["kv", "ls"])]
    finally:
        kernel.kill()
    for pid in engines:
        wait_for(lambda pid=pid: not alive(pid), what=f"engine process {pid} to end")
    said = f"no Symphony kernel at {sock}: "
    assert (starting.returncode, starting.stderr) == (1, (
        f"symphony: {said}something listens on the socket but answers no hello (as a kernel "
        "does while its model loads): Connection refused\n"))
    assert [(out.returncode, out.stderr) for out in dead] == [
        (1, f"symphony: {prefix}{said}the socket exists but no kernel answers on it: "
            "Connection refused\n") for prefix in ("", "kv ls: ")]


def test_a_kernel_started_through_a_symlink_binds_where_the_link_leads(tmp_path):
    """`start --socket LINK` bound at the link itself, replacing it: the link's target and
    every other link to it led to a dead socket."""
    sock, link = tmp_path / "k.sock", tmp_path / "l.sock"
    link.symlink_to("k.sock")  # relative, to a socket not made yet
    started = symphony("start", "--socket", str(link), "--state-dir", str(tmp_path / "st"),
                       "--model", str(ROOT / "models/tiny"), "--kv-pages", "16")
    try:
        assert started.returncode == 0, started.stderr
        assert link.is_symlink() and sock.is_socket()
        assert [symphony("status", "--socket", str(p)).returncode for p in (sock, link)] == [0, 0]
    finally:
        stopped = symphony("stop", "--socket", str(link))
    assert stopped.returncode == 0, stopped.stderr
    assert link.is_symlink() and not sock.exists()


def within(seconds: float, fn):
    """fn's result, or the test fails if it has none in `seconds` (fn may hang for ever)."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert out, f"no answer in {seconds} s"
    return out[0]


def test_a_starting_kernel_s_placeholder_answers_every_probe(tmp_path):
    """The socket a kernel holds while its model loads (control.Claim) takes the probes of
    `symphony status` and `stop`: the 129th probe had found its backlog full and waited
    for room until the kernel served."""
    sock = tmp_path / "k.sock"
    claim = Claim(sock)
    try:
        assert within(30, lambda: [kernel_pid(sock) for _ in range(300)]) == [os.getpid()] * 300
    finally:
        claim.release()
    assert kernel_pid(sock) is None and not sock.exists()


def test_a_listener_that_takes_no_connection_is_the_kernel_its_pid_file_names(tmp_path):
    """A kernel stopped (SIGSTOP) or hung, its backlog full: the probe waits PROBE_WAIT for
    room, then takes the pid file's word if it names a live process, else says so."""
    sock = tmp_path / "k.sock"
    listener, queued = socket.socket(socket.AF_UNIX), []
    listener.bind(str(sock))
    listener.listen(0)
    try:
        while True:
            c = socket.socket(socket.AF_UNIX)
            c.setblocking(False)
            queued.append(c)
            try:
                c.connect(str(sock))
            except BlockingIOError:
                break
        pid_path(sock).write_text(f"{os.getpid()}\n")
        assert within(PROBE_WAIT + 10, lambda: kernel_pid(sock)) == os.getpid()
        pid_path(sock).write_text("999999999\n")
        with pytest.raises(OSError) as e:
            kernel_pid(sock)
        assert e.value.errno == errno.EAGAIN
        assert str(e.value) == (f"[Errno 11] {sock}: a process listens there but takes no "
                                f"connection in {PROBE_WAIT:g} s, and {pid_path(sock)} names "
                                "no live kernel")
    finally:
        for c in queued:
            c.close()
        listener.close()
