"""A real kernel daemon for the tests: its own process, socket and state directory."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from checkpoints import add_tokenizer, make_checkpoint

from syscalls import session
from syscalls import symphony_pb2 as pb
from syscalls.client import Kernel
from syscalls.convert import proc_fields

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT = 90.0


def make_model(directory: Path) -> Path:
    """A random-weight Llama with a tokenizer, its logits peaked so greedy never ties."""
    make_checkpoint(directory, "llama", weight_scale=4.0, seed=7)
    add_tokenizer(directory)
    return directory


_WORLD: list[Path] = []


def world_dir() -> Path:
    """A directory every user can reach (pytest's tmp_path is not searchable by others),
    removed when the test run ends."""
    if not _WORLD:
        _WORLD.append(Path(tempfile.mkdtemp(prefix="symphony-test-")))
        _WORLD[0].chmod(0o755)
        atexit.register(shutil.rmtree, _WORLD[0], ignore_errors=True)
    path = Path(tempfile.mkdtemp(dir=_WORLD[0]))
    path.chmod(0o755)
    return path


@dataclass
class Daemon:
    socket: Path
    state: Path
    log: Path
    process: subprocess.Popen

    def env(self) -> dict[str, str]:
        return {**os.environ, "SYMPHONY_SOCKET": str(self.socket)}

    def connect(self, name: str = "test", **how) -> Kernel:
        """A session (Kernel.connect's `rings` and `lifeline_pred` in `how`)."""
        return Kernel.connect(self.socket, name=name, **how)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


def start_daemon(model: Path, root: Path | None = None, *flags: str,
                 nofile: int | None = None) -> Daemon:
    """nofile: the kernel's RLIMIT_NOFILE, soft and hard. prlimit sets it and execs the
    kernel (the pid stays the kernel's), not a preexec_fn, which makes subprocess run Python
    in the forked child of this process, gRPC's at-fork handler too (once hung the suite)."""
    root = root or world_dir()
    sock, state, log = root / "kernel.sock", root / "state", root / "kernel.log"
    limit = [] if nofile is None else ["prlimit", f"--nofile={nofile}:{nofile}", "--"]
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [*limit, sys.executable, "-m", "symphony.cli", "kernel", "--model", str(model),
             "--socket", str(sock), "--state-dir", str(state), *flags],
            stdout=out, stderr=out, stdin=subprocess.DEVNULL, cwd=ROOT)
    daemon = Daemon(sock, state, log, process)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the kernel exited ({process.returncode}):\n{daemon.log_text()}")
        try:
            with daemon.connect("probe") as k:
                k.model_info()
            return daemon
        except OSError:
            time.sleep(0.1)
    daemon.stop()
    raise RuntimeError(f"the kernel did not answer:\n{daemon.log_text()}")


def meminfo(k: Kernel) -> dict[str, str]:
    return proc_fields(k.procfs("meminfo"))


def sched(k: Kernel) -> dict[str, str]:
    return proc_fields(k.procfs("sched"))


def preds_answered(k: Kernel, pid: int) -> int:
    """The preds of process pid the kernel has answered, from /proc/PID/syscalls."""
    rows = [r.split("\t") for r in k.procfs(f"{pid}/syscalls").splitlines()[1:]]
    return next((int(r[1]) for r in rows if r[0] == "Pred"), 0)


def send_while_taken(k: Kernel, pid: int, calls: range, send: Callable[[int], None]) -> None:
    """send(call) for each call as a client that reads no replies but keeps the kernel busy
    would: the next once the kernel has answered all but 2 of those sent (process pid's
    /proc count), and, once it has answered none for a second, the rest at once."""
    stalled = False
    for sent, call in enumerate(calls):
        deadline = time.monotonic() + 1.0
        while not stalled and sent - preds_answered(k, pid) > 2:
            stalled = time.monotonic() > deadline
            time.sleep(0.01)
        send(call)


def raw_open(sock: Path, token: str) -> int:
    """An anonymous file opened O_RDWR over gRPC by the session of `token` (a raw lifeline
    of session.hello): its fd."""
    with grpc.insecure_channel(session.grpc_target(sock)) as channel:
        open_ = channel.unary_unary("/symphony.Kernel/Open",
                                    request_serializer=pb.OpenRequest.SerializeToString,
                                    response_deserializer=pb.FdReply.FromString)
        return open_(pb.OpenRequest(path="", flags=os.O_RDWR),
                     metadata=[(session.SESSION_KEY, token)]).fd


def vm_rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


# A pred whose reply is large (every row of 256 tokens with 300 top logprobs: about 700 KB)
# for a process that does not read its replies; it truncates its file first, so the file
# never grows.
HOG_TOKENS = 256
HOG = {"tokens": [(7 * i) % 290 + 6 for i in range(HOG_TOKENS)],
       "outputs": list(range(HOG_TOKENS)), "top_logprobs": 300, "truncate": 0}


def hog_payload(fd: int) -> bytes:
    """HOG on fd as a serialized PredRequest, for a raw lifeline or ring."""
    return pb.PredRequest(fd=fd, tokens=HOG["tokens"], outputs=HOG["outputs"], truncate=0,
                          sampler=pb.Sampler(top_logprobs=300)).SerializeToString()


def prompt(n: int, salt: int = 0) -> list[int]:
    """n token ids of the test model's vocabulary (320), varied by salt."""
    return [(7 * i + 13 * salt) % 290 + 6 for i in range(n)]


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie has exited: its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def settled(read, quiet: float = 0.5):
    """read()'s value once it has stood still for `quiet` seconds."""
    value, since = read(), time.monotonic()
    while time.monotonic() - since < quiet:
        time.sleep(0.05)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
    return value


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


SYMPHONY = [sys.executable, "-m", "symphony.cli"]
NEEDS_MOUNT = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/dev/fuse") or not shutil.which("fusermount3"),
    reason="needs root, /dev/fuse and fusermount3",
)


def mounted_at(target: Path) -> bool:
    """From the mount table: stat on a mount whose kernel died would fail."""
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == str(target) for line in f)


@contextlib.contextmanager
def mounted(daemon: Daemon, foreground: bool = True):
    """The kernel mounted at DIR (the process too when in the foreground); always unmounted
    at the end, lazily if it must be."""
    target = daemon.socket.parent / "mnt"
    target.mkdir(exist_ok=True)
    cmd = [*SYMPHONY, "mount", str(target), "--socket", str(daemon.socket)]
    process = None
    if foreground:
        process = subprocess.Popen([*cmd, "--foreground"], cwd=ROOT)
        wait_for(lambda: mounted_at(target) or process.poll() is not None, what="the mount")
        assert process.poll() is None, "the mount process exited"
    else:
        subprocess.run(cmd, cwd=ROOT, check=True, timeout=60)
        assert mounted_at(target)
    try:
        yield target, process
    finally:
        if mounted_at(target):
            umount = subprocess.run([*SYMPHONY, "umount", str(target)], cwd=ROOT)
            if umount.returncode:
                subprocess.run(["fusermount3", "-u", "-z", str(target)])
        if process is not None:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def run_script(daemon: Daemon, script: str, *args: str, timeout: float = 120) -> str:
    """The output of `python -c script args...` run against the daemon; it must succeed.
    A script that becomes another user does so itself, after its imports."""
    out = subprocess.run([sys.executable, "-c", script, *args], env=daemon.env(), cwd=ROOT,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out.stdout


def errno_of(fn, *args) -> int:
    """The errno fn(*args) fails with; 0 if it does not."""
    try:
        fn(*args)
    except OSError as e:
        return e.errno
    return 0


def as_user(uid: int, *cmd: str) -> subprocess.CompletedProcess:
    """A plain system tool (ls, cat, cp on the mount) run as another user: what the mount
    tests ask of the file system needs no Python. Through setpriv, not subprocess's user=:
    with user= Python forks (no vfork), and fork runs gRPC's at-fork handler, which in this
    process of many gRPC channels once waited forever on gRPC's own shutdown thread."""
    return subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *cmd],
        capture_output=True, cwd="/", timeout=60)


def make(k: Kernel, path: str, n: int, mode: int = 0o644, salt: int = 0) -> None:
    """A KV file of n tokens at path."""
    with k.open(path, os.O_CREAT | os.O_RDWR, mode) as f:
        f.pred(prompt(n, salt), no_outputs=True)


@dataclass
class Server:
    """`symphony serve` on a daemon, as a subprocess, and OpenAI clients of it."""

    url: str  # http://127.0.0.1:PORT
    api_key: str
    proc: subprocess.Popen
    log: Path

    @property
    def client(self):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key, max_retries=0)

    @property
    def aclient(self):
        import openai

        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key,
                                  max_retries=0)

    def stop(self) -> int:
        """SIGTERM, and the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(START_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


LISTENING = "symphony serve: listening on "


def start_server(daemon: Daemon, *flags: str, api_key: str = "test-key") -> Server:
    """`symphony serve --port 0` on `daemon`; returns once it prints that it listens."""
    log = daemon.log.with_name(f"serve-{os.getpid()}-{time.monotonic_ns()}.log")
    with open(log, "ab") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "symphony.cli", "serve", "--socket", str(daemon.socket),
             "--port", "0", "--api-key", api_key, *flags],
            stdout=subprocess.PIPE, stderr=err, stdin=subprocess.DEVNULL, cwd=ROOT, text=True)
    line = process.stdout.readline()  # the one line, or "" when it exited first
    if not line.startswith(LISTENING):
        process.kill()
        process.wait()
        raise RuntimeError(f"symphony serve did not start ({process.returncode}): {line!r}\n"
                           f"{log.read_text(errors='replace')}")
    return Server(line[len(LISTENING):].strip(), api_key, process, log)


def run_reader_gone(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """Run argv (from the repository root) with a stdout whose reader has gone before
    anything is written, as `... | head -1` leaves it; its stderr captured."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(argv, env=env, cwd=ROOT, stdout=write, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write)


# The start of a script (python -c) run as root that becomes the user whose uid is its
# argv[1], after its imports, and says a call's refusal as data: refusal(fn) is
# [errno, message], or None when fn() succeeds.
AS_UID = """
import json, os, sys
from syscalls.client import Kernel
from syscalls.convert import proc_fields
uid = int(sys.argv[1])
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
def refusal(fn):
    try:
        fn()
    except OSError as e:
        return [e.errno, str(e)]
    return None
"""
