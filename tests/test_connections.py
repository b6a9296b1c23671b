"""Connections to the kernel's gRPC socket, counted per user (symphony/connections.py): a
user that holds many cannot fill gRPC's cap and stop other users' sessions."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys

import pytest
from daemon import ROOT, start_daemon, wait_for, world_dir

from symphony.connections import Connections, per_user_limit
from symphony.server import FD_RESERVE

NEEDS_ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become other users")
# What a gRPC client sends first: HTTP/2's preface and an empty SETTINGS frame. A connection
# that sent it is one gRPC keeps (no handshake timeout), as a client's.
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])

# Connections to sys.argv[3], as user sys.argv[1], sys.argv[2] of them (fewer if a connect
# fails), each sending PREFACE; the count made, then on a line from stdin how many the
# other end has not ended.
HOLDER = """
import json, os, socket, sys, time
uid, n, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
socket.setdefaulttimeout(10)
def connect():
    # A socket with a timeout gets EAGAIN at once while the listener's backlog is full (a
    # loaded machine's kernel accepting late): try again, as a blocking connect would wait.
    deadline = time.monotonic() + 10
    while True:
        s = socket.socket(socket.AF_UNIX)
        try:
            s.connect(path)
        except BlockingIOError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
        except OSError:
            s.close()
            raise
        try:
            s.sendall(PREFACE)
        except (BrokenPipeError, ConnectionResetError):
            pass  # taken and closed at once (past the cap): made, and not open
        return s
held, stopped = [], None
for _ in range(n):
    try:
        held.append(connect())
    except OSError as e:
        stopped = repr(e)
        break
print(json.dumps({"made": len(held), "stopped": stopped}), flush=True)
def still_open(s):
    s.setblocking(False)
    try:
        while True:
            if not s.recv(65536):
                return False
    except BlockingIOError:
        return True
    except OSError:
        return False
while sys.stdin.readline():
    print(json.dumps({"open": sum(map(still_open, held))}), flush=True)
"""


class Holder:
    """A process of another user's holding connections to a socket."""

    def __init__(self, uid: int, n: int, path: os.PathLike | str):
        self.p = subprocess.Popen(
            [sys.executable, "-c", f"PREFACE = {PREFACE!r}\n" + HOLDER, str(uid), str(n),
             str(path)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        made = self.line()
        self.made, self.stopped = made["made"], made["stopped"]

    def line(self) -> dict:
        line = self.p.stdout.readline()
        assert line, self.p.communicate(timeout=60)[1]
        return json.loads(line)

    def still_open(self) -> int:
        self.p.stdin.write("count\n")
        self.p.stdin.flush()
        return self.line()["open"]

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.communicate(timeout=60)


def test_a_user_may_hold_four_connections_per_process_and_at_most_a_quarter_of_the_cap():
    assert per_user_limit(256, 262016) == 1024
    assert per_user_limit(3, 128) == 12
    assert per_user_limit(100000, 128) == 32  # the descriptors bound it, not the processes
    assert per_user_limit(1, 2) == 1


# -- the look itself, on a socket of the test's own ---------------------------------------

def ended(s: socket.socket) -> bool:
    """Whether the other end of s ended it (what it sent read off)."""
    s.setblocking(False)
    try:
        while True:
            if not s.recv(65536):
                return True
    except BlockingIOError:
        return False


def reap(accepted: list[socket.socket]) -> list[socket.socket]:
    """Close those that ended, as gRPC does; the rest."""
    for s in accepted:
        if ended(s):
            s.close()
    return [s for s in accepted if s.fileno() != -1]


def listening(path: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    os.chmod(path, 0o666)
    listener.listen(64)
    listener.settimeout(30)
    return listener


@NEEDS_ROOT
def test_a_look_shuts_down_the_connections_a_user_made_last_past_its_limit():
    """Only connections to the socket looked after count, root's never; what a user holds
    past the limit is shut down, the connections seen at an earlier look kept; the kernel's
    descriptors stay its own to close."""
    where = world_dir()  # pytest's tmp_path is not searchable by other users
    path, other_path = str(where / "grpc.sock"), str(where / "other.sock")
    listener, other = listening(path), listening(other_path)
    holders, accepted, mine = [], [], []
    try:
        for _ in range(6):  # root's
            mine.append(socket.socket(socket.AF_UNIX))
            mine[-1].connect(path)
        first, second = Holder(60031, 3, path), Holder(60032, 2, path)
        elsewhere = Holder(60031, 5, other_path)  # another socket's: not counted
        holders += [first, second, elsewhere]
        accepted = [listener.accept()[0] for _ in range(6 + 3 + 2)]
        accepted += [other.accept()[0] for _ in range(5)]
        looks = Connections(path, limit=3, threshold=0)
        assert looks.look() == 0  # each at its limit or under
        later = Holder(60031, 4, path)
        holders.append(later)
        accepted += [listener.accept()[0] for _ in range(4)]
        idle = Connections(path, limit=3, threshold=10**6)
        assert idle.look() == 0 and idle.known == {}  # few descriptors: no look
        assert looks.look() == 4
        accepted = reap(accepted)
        assert len(accepted) == 6 + 3 + 2 + 5
        assert [h.still_open() for h in holders] == [3, 2, 5, 0]
        assert not any(ended(s) for s in mine)
        assert looks.look() == 0 and looks.cut == 4
        probe = socket.socket(socket.AF_UNIX)  # the listener still listens
        probe.connect(path)
        listener.accept()[0].close()
        probe.close()
    finally:
        for h in holders:
            h.close()
        for s in [*accepted, *mine, listener, other]:
            s.close()


# -- a flood on a real kernel ------------------------------------------------------------

FDS = 512  # the kernel's descriptors: gRPC's cap is (512 - FD_RESERVE) / 2 = 128
MAX_PROCS = 3  # a user may hold 4 x 3 = 12 connections
FLOODER, OTHER = 60033, 60034

# A session of user sys.argv[1]'s, with calls over gRPC and preds on its rings.
SESSION = """
import json, os, sys
from syscalls.client import Kernel
uid = int(sys.argv[1])
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
try:
    with Kernel.connect(name="other") as k:
        f = k.open(k.home + "/kept.kv", os.O_CREAT | os.O_RDWR | os.O_TRUNC)
        f.pred([5, 6, 7], no_outputs=True)
        out = {"uid": k.uid, "ps": k.pid in [p.pid for p in k.ps()], "tokens": f.read()[0]}
except OSError as e:
    out = {"errno": e.errno, "message": str(e)}
print(json.dumps(out))
"""


def session_of(daemon, uid: int) -> dict:
    out = subprocess.run([sys.executable, "-c", SESSION, str(uid)], env=daemon.env(),
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@NEEDS_ROOT
def test_a_user_holding_connections_cannot_stop_another_users_session(model):
    """A user that fills gRPC's cap with connections that send nothing but HTTP/2's preface
    (no hello, no call): the kernel shuts down all but 12 of them (4 per process it may
    have), so another user's session connects and calls; root's are never counted."""
    assert FDS - FD_RESERVE == 256 and per_user_limit(MAX_PROCS, 128) == 12
    d = start_daemon(model, None, "--kv-pages", "64", "--max-procs-per-user", str(MAX_PROCS),
                     nofile=FDS)
    holders = []
    try:
        assert resource.prlimit(d.process.pid, resource.RLIMIT_NOFILE) == (FDS, FDS)
        holders.append(Holder(0, 20, d.socket))  # root's: never counted
        holders.append(Holder(FLOODER, 300, d.socket))
        # the ones past the cap are taken, and closed at once
        assert holders[1].made == 300, holders[1].stopped
        assert session_of(d, OTHER) == {"uid": OTHER, "ps": True, "tokens": [5, 6, 7]}
        wait_for(lambda: holders[1].still_open() == 12, 10, "the flooder's excess shut down")
        assert holders[0].still_open() == 20
        assert "uid60033 held" in d.log_text() and "past its limit of 12" in d.log_text()
        with d.connect("root") as k:
            assert k.ps()
        # The flooder connects again and again: each look takes what it holds past 12.
        holders.append(Holder(FLOODER, 300, d.socket))
        assert session_of(d, OTHER)["tokens"] == [5, 6, 7]
        wait_for(lambda: holders[2].still_open() == 0, 10, "the flooder's excess shut down")
        assert holders[1].still_open() == 12  # the ones seen at an earlier look are kept
    finally:
        for h in holders:
            h.close()
        assert d.stop() == 0, d.log_text()
