"""A real kernel daemon for the tests: its own process, socket and state directory."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from checkpoints import add_tokenizer, make_checkpoint

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

    def connect(self, name: str = "test") -> Kernel:
        return Kernel.connect(self.socket, name=name)

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


def start_daemon(model: Path, root: Path | None = None, *flags: str) -> Daemon:
    root = root or world_dir()
    sock, state, log = root / "kernel.sock", root / "state", root / "kernel.log"
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "symphony.cli", "kernel", "--model", str(model),
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


def prompt(n: int, salt: int = 0) -> list[int]:
    """n token ids of the test model's vocabulary (320), varied by salt."""
    return [(7 * i + 13 * salt) % 290 + 6 for i in range(n)]


def wait_for(predicate, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
