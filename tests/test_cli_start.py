"""`symphony start` and `symphony kernel` failing or interrupted before they serve."""

import errno
import os
import pwd
import signal
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from daemon import ROOT, alive, wait_for

from symphony import control
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
        # Its thread leaves Ctrl-C to the main thread (taken there, a Ctrl-C while a model
        # loaded went unanswered till the load ended), and the main thread keeps its mask.
        with open(f"/proc/self/task/{claim._taker.native_id}/status") as f:
            blocked = int(next(line for line in f if line.startswith("SigBlk:")).split()[1], 16)
        assert blocked >> (signal.SIGINT - 1) & 1
        assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
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
        pid_path(sock).unlink()
        os.mkfifo(pid_path(sock))  # planted: its open would wait for a writer

        def errno_of_probe() -> int:
            try:
                kernel_pid(sock)
            except OSError as e:
                return e.errno
            return 0

        assert within(PROBE_WAIT + 10, errno_of_probe) == errno.EAGAIN
    finally:
        for c in queued:
            c.close()
        listener.close()


DIR_REFUSED = ("the socket's directory {d}: Operation not permitted: {kind}owner {owner}, mode "
               "{mode}; the kernel takes only a directory of its user's (root (uid 0)) that no "
               "one else may write: remove it, or use --socket")


def plant_theirs(d: Path) -> None:
    d.mkdir(mode=0o755)
    os.chown(d, 1000, 1000)


def plant_theirs_with_a_link(d: Path) -> None:
    """Their link at the socket's path, to a socket in a directory of root's."""
    plant_theirs(d)
    (d.parent / "roots").mkdir(mode=0o755)
    (d / "kernel.sock").symlink_to(d.parent / "roots" / "k.sock")


def plant_writable(d: Path) -> None:
    d.mkdir()
    d.chmod(0o777)


def plant_group_writable(d: Path) -> None:
    d.mkdir()
    d.chmod(0o775)


def plant_link(d: Path) -> None:
    (d.parent / "mine").mkdir(mode=0o755)
    d.symlink_to("mine")


def plant_file(d: Path) -> None:
    d.write_text("")
    d.chmod(0o644)


@pytest.mark.parametrize("plant, kind, owner, mode", [
    (plant_theirs, "", f"{pwd.getpwuid(1000).pw_name} (uid 1000)", "0755"),
    (plant_theirs_with_a_link, "", f"{pwd.getpwuid(1000).pw_name} (uid 1000)", "0755"),
    (plant_writable, "", "root (uid 0)", "0777"),
    (plant_group_writable, "", "root (uid 0)", "0775"),
    (plant_link, "a symlink, ", "root (uid 0)", "0777"),
    (plant_file, "not a directory, ", "root (uid 0)", "0644"),
], ids=["another-users", "another-users-link", "world-writable", "group-writable", "symlink",
        "file"])
def test_the_default_socket_s_directory_is_taken_only_if_it_is_the_user_s_own(
        tmp_path, monkeypatch, plant, kind, owner, mode):
    """Another user who made /tmp/symphony first had root's kernel write its pid file and
    log through links planted there, and could put a socket of theirs in place of root's.
    Now such a directory is refused, as a link to one or a file; tmp_path stands in for
    /tmp, where the default's directory is."""
    d = tmp_path / "symphony"
    monkeypatch.setattr(control, "DEFAULT_SOCKET", str(d / "kernel.sock"))
    plant(d)
    with pytest.raises(OSError) as e:
        control.kernel_socket(d / "kernel.sock")
    assert e.value.errno == errno.EPERM
    assert e.value.strerror == DIR_REFUSED.format(d=d, kind=kind, owner=owner, mode=mode)


def test_the_default_socket_s_directory_is_made_0755_whatever_the_umask(tmp_path, monkeypatch):
    """Every user connects, so searches it; no one else writes there. One there already,
    the user's own and written by no one else, is taken as it is."""
    d = tmp_path / "symphony"
    monkeypatch.setattr(control, "DEFAULT_SOCKET", str(d / "kernel.sock"))
    umask = os.umask(0o077)
    try:
        assert control.kernel_socket(d / "kernel.sock") == d / "kernel.sock"
    finally:
        os.umask(umask)
    assert d.is_dir() and stat.S_IMODE(d.stat().st_mode) == 0o755
    d.chmod(0o700)
    assert control.kernel_socket(d / "kernel.sock") == d / "kernel.sock"
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


def victim(tmp_path: Path) -> Path:
    """A file of root's that no one else may read or write."""
    path = tmp_path / "victim"
    path.write_text("root's\n")
    path.chmod(0o600)
    return path


def start_tiny(sock: Path) -> subprocess.CompletedProcess:
    return symphony("start", "--socket", str(sock), "--state-dir", str(sock.parent / "st"),
                    "--model", str(ROOT / "models/tiny"), "--kv-pages", "16")


def test_start_never_writes_its_log_through_a_symlink(tmp_path):
    """A link planted at SOCK.log had the kernel's lines appended to the file it names. Now
    start refuses, naming the log, and starts nothing."""
    sock, root_s = tmp_path / "k.sock", victim(tmp_path)
    log = tmp_path / "k.sock.log"
    log.symlink_to(root_s)
    started = start_tiny(sock)
    try:
        assert started.returncode == 1, started.stderr
        assert started.stderr == (f"symphony: {log}: the kernel's log is a symlink, which start "
                                  "never writes through: remove it: Too many levels of "
                                  "symbolic links\n")
        assert not sock.exists()
    finally:
        symphony("stop", "--socket", str(sock))
    assert root_s.read_text() == "root's\n" and log.is_symlink()


def test_a_kernel_replaces_a_symlink_at_its_pid_file(tmp_path):
    """A link planted at SOCK.pid had the kernel write its pid through it, over the file it
    names. Now the kernel's pid file replaces the link."""
    sock, root_s = tmp_path / "k.sock", victim(tmp_path)
    pid_path(sock).symlink_to(root_s)
    started = start_tiny(sock)
    try:
        assert started.returncode == 0, started.stderr
        assert not pid_path(sock).is_symlink()
        assert pid_path(sock).read_text() == f"{kernel_pid(sock)}\n"
        assert stat.S_IMODE(pid_path(sock).stat().st_mode) == 0o644
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "k.sock", "k.sock.hello", "k.sock.log", "k.sock.pid", "st", "victim"]
    finally:
        stopped = symphony("stop", "--socket", str(sock))
    assert stopped.returncode == 0, stopped.stderr
    assert root_s.read_text() == "root's\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with CUDA")
@pytest.mark.parametrize("command", [["kernel", "--socket", "{sock}", "--state-dir", "{state}"],
                                     ["generate", "--prompt-ids", "1,2"]])
def test_device_cuda_without_cuda_is_one_line(tmp_path, command):
    """It was an assertion's 30-line traceback from the KV pool (an outside tester's
    finding); `symphony rank` already said it in a line."""
    argv = [a.format(sock=tmp_path / "k.sock", state=tmp_path / "st") for a in command]
    run = symphony(*argv, "--device", "cuda", "--model", str(ROOT / "models" / "tiny"))
    assert run.returncode == 1
    assert run.stderr == (f"symphony: --device cuda: no CUDA on this node (host "
                          f"{socket.gethostname()}): use --device cpu, or a node with a GPU\n")
    assert not (tmp_path / "k.sock").exists()


def test_an_engine_whose_kernel_goes_before_its_setup_exits_quietly():
    """The kernel interrupted after it started its engine process but before it sent the
    setup: the engine printed an EOFError's traceback on the terminal they share (the
    test above failed so once in the suite)."""
    ours, theirs = socket.socketpair()
    engine = subprocess.Popen([sys.executable, "-m", "symphony.engine_process",
                               str(theirs.fileno())], pass_fds=[theirs.fileno()], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    theirs.close()
    ours.close()
    out, err = engine.communicate(timeout=120)
    assert (engine.returncode, out, err) == (0, "", "")
