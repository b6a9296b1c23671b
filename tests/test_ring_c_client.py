"""A client of another language, from docs/syscalls.md alone: tests/ring_client.c says hello,
sets up the syscall rings and makes its preds through them, while this test makes the other
calls of its session over gRPC with the generated stubs and the `symphony-session` metadata
key, and checks what it gets against the project's own Python client on a real kernel."""

from __future__ import annotations

import errno
import os
import queue
import re
import shutil
import subprocess
import threading
from pathlib import Path

import grpc
import pytest
from daemon import prompt, settled, wait_for

from syscalls import symphony_pb2 as pb
from syscalls import symphony_pb2_grpc as pb_grpc

GCC = shutil.which("gcc")
pytestmark = pytest.mark.skipif(GCC is None,
                                reason="gcc is not installed: cannot build the C client")

SOURCE = Path(__file__).with_name("ring_client.c")
REPLY_WAIT = 60.0


@pytest.fixture(scope="module")
def binary(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ring_client") / "ring_client"
    built = subprocess.run([GCC, "-std=c11", "-O1", "-Wall", "-Werror", "-o", str(out),
                            str(SOURCE)], capture_output=True, text=True)
    assert built.returncode == 0, built.stderr
    return out


class CClient:
    """tests/ring_client.c as a subprocess on the daemon's socket, and a gRPC stub that
    makes calls of its session."""

    def __init__(self, binary: Path, daemon):
        self.proc = subprocess.Popen([str(binary), str(daemon.socket)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.token = self._line()
        # From another language: the gRPC target is unix:// and the socket's absolute path.
        self.channel = grpc.insecure_channel(f"unix://{daemon.socket.absolute()}")
        self.stub = pb_grpc.KernelStub(self.channel)
        self.md = [("symphony-session", self.token)]

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _line(self) -> str:
        try:
            line = self.lines.get(timeout=REPLY_WAIT)
        except queue.Empty:
            line = None
        if line is None:
            self.proc.kill()
            raise AssertionError(f"ring_client said nothing: {self.proc.stderr.read()}")
        return line

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line()

    def decode(self, fd: int, n: int, tokens: list[int]) -> list[int]:
        line = self.ask(f"decode {fd} {n} {' '.join(map(str, tokens))}")
        assert line.startswith("tokens "), line
        return [int(t) for t in line.split()[1:]]

    def call(self, rpc: str, request):
        reply = getattr(self.stub, rpc)(request, metadata=self.md, timeout=REPLY_WAIT)
        if hasattr(reply, "error"):
            assert reply.error.errno == 0, (rpc, reply.error)
        return reply

    def open(self) -> int:
        return self.call("Open", pb.OpenRequest(path="", flags=os.O_RDWR)).fd

    def length(self, fd: int) -> int:
        return self.call("Stat", pb.StatRequest(fd=fd)).tokens

    def close(self) -> int:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
        try:
            return self.proc.wait(30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.proc.stdin.close()


@pytest.fixture()
def c(binary, daemon):
    client = CClient(binary, daemon)
    yield client
    assert client.close() == 0, client.proc.stderr.read()


def python_decode(k, tokens: list[int], n: int) -> list[int]:
    """The project's client's greedy decode loop: the prompt, then each sample fed back."""
    with k.open() as f:
        (out,) = f.pred(tokens)
        got = [out.token]
        while len(got) < n:
            (out,) = f.pred([got[-1]])
            got.append(out.token)
        assert f.stat().tokens == len(tokens) + n - 1
    return got


def test_the_c_client_decodes_what_the_python_client_does(c, k):
    assert re.fullmatch(r"[0-9a-f]+", c.token), c.token  # hexadecimal today
    for salt, (length, n) in enumerate([(12, 8), (1, 5), (40, 3)]):
        p = prompt(length, salt)
        expected = python_decode(k, p, n)
        fd = c.open()
        assert c.decode(fd, n, p) == expected
        # The file holds the prompt and every sample but the last (it was never fed back).
        assert c.length(fd) == length + n - 1
        read = c.call("Read", pb.ReadRequest(fd=fd, start=0, count=length + n))
        assert list(read.tokens) == p + expected[:-1]
        assert list(read.positions) == list(range(length + n - 1))
        c.call("Close", pb.FdRequest(fd=fd))


def test_a_cancelled_ring_pred_leaves_its_file_as_before(c, k):
    for salt in range(3):
        p = prompt(24, salt)
        (expected,) = python_decode(k, p, 1)
        fd = c.open()
        line = c.ask(f"cancel {fd} {' '.join(map(str, p))}")
        if line.startswith("errno "):
            assert int(line.split()[1]) == errno.ECANCELED, line
            assert c.length(fd) == 0  # as before the pred
        else:
            assert line == f"token {expected}"  # answered before the CANCEL: it stands
            assert c.length(fd) == len(p)
        # Once the reply has come, a truncate right after succeeds.
        c.call("Truncate", pb.TruncateRequest(fd=fd, length=0))
        assert c.length(fd) == 0
        # The CANCEL got no second reply: the next pred's reply is its own.
        assert c.decode(fd, 2, p) == python_decode(k, p, 2)
        c.call("Close", pb.FdRequest(fd=fd))


def test_a_record_of_an_unknown_kind_gets_einval_and_the_session_goes_on(c, k):
    for salt in range(2):
        line = c.ask("bad")
        assert line.startswith(f"errno {errno.EINVAL} "), line
        p = prompt(10, salt)
        fd = c.open()
        assert c.decode(fd, 4, p) == python_decode(k, p, 4)
        assert c.length(fd) == 10 + 3


def test_proc_syscalls_counts_the_ring_preds(c):
    pid = c.call("GetPid", pb.Void()).pid
    fd = c.open()
    n = 6
    c.decode(fd, n, prompt(5))

    def preds() -> int:
        text = c.call("Procfs", pb.PathRequest(path=f"/proc/{pid}/syscalls")).text
        lines = text.splitlines()
        assert lines[0].split() == ["call", "count", "total_ms", "mean_us"], text
        rows = {r.split("\t")[0]: r.split("\t") for r in lines[1:]}
        return int(rows["Pred"][1]) if "Pred" in rows else 0

    wait_for(lambda: preds() >= n, timeout=10, what="the ring preds in /proc/PID/syscalls")
    assert settled(preds, quiet=0.3) == n
