"""Where the kernel listens, and the hello handshake that gives a process its identity.

The gRPC socket carries the calls; the hello socket beside it carries identity. A process
connects to the hello socket, the kernel reads the peer's uid, gid and pid from the OS
(SO_PEERCRED) and answers one line: a session token, or `refused ERRNO MESSAGE` (then it
hangs up) when one of its limits stands in the way. The connection then stays open for the
life of the process, so the kernel learns of its death, crash or SIGKILL included, from
the OS too. After the line it carries frames (syscalls/wire.py): pred's fast path.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from pathlib import Path

from syscalls import errors, ring, wire

DEFAULT_SOCKET = "/tmp/symphony/kernel.sock"
SESSION_KEY = "symphony-session"  # gRPC metadata: the token
AS_KEY = "symphony-as"  # gRPC metadata: "uid:gid", honoured for root sessions only
TOKEN_BYTES = 32
REFUSED = "refused "  # hello's answer instead of a token: "refused ERRNO MESSAGE"
# How long a process waits for the kernel's answer to its hello and ring setup. The
# kernel's loop answers within milliseconds, under load too; the bound is long so that a
# program connecting while the loop is held up (a long step, a large checkpoint's save) does
# not fail for it, and finite so that a stopped or hung kernel, or a listener that is no
# kernel, cannot hang every client.
HELLO_TIMEOUT = 60.0
# Fds a process may have open, as RLIMIT_NOFILE: past it open and fork fail with EMFILE.
# Each is a handle in the kernel's memory; without a bound a process could open one file
# without end.
FD_MAX = 16384
# A hello socket whose backlog is full (its kernel accepts nothing now) is tried this often.
CONNECT_RETRY = 0.01


def socket_path(path: str | os.PathLike | None = None) -> Path:
    """The kernel's socket: the argument, else SYMPHONY_SOCKET, else the default."""
    return Path(path or os.environ.get("SYMPHONY_SOCKET") or DEFAULT_SOCKET)


def hello_path(sock: Path) -> Path:
    return sock.with_name(sock.name + ".hello")


def pid_path(sock: Path) -> Path:
    """The serving kernel's pid, written as it listens, removed as it stops."""
    return sock.with_name(sock.name + ".pid")


def grpc_target(sock: Path) -> str:
    return f"unix://{sock.resolve()}"


def refusal(code: int, message: str) -> bytes:
    """The kernel's answer to a hello it refuses."""
    return f"{REFUSED}{code} {message}\n".encode()


def hello(sock: Path, timeout: float = HELLO_TIMEOUT) -> tuple[socket.socket, str]:
    """Open a session: the lifeline connection (keep it open) and the token it gave.

    Raises ConnectionRefusedError or FileNotFoundError when no kernel listens there,
    TimeoutError (ETIMEDOUT) when no answer comes within `timeout` seconds, and the
    kernel's errno (EAGAIN: a limit) with its message when it refuses the session.
    """
    # Beside the socket a symlink names: the kernel made its hello socket next to its own.
    where = hello_path(sock.resolve())
    deadline = time.monotonic() + timeout
    lifeline = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            _connect(lifeline, where, deadline)
            line = b""
            while not line.endswith(b"\n"):  # a byte at a time: frames may follow the line
                lifeline.settimeout(_left(deadline))
                chunk = lifeline.recv(1)
                if not chunk:
                    raise ConnectionResetError(f"{where}: the kernel hung up in hello")
                line += chunk
        except TimeoutError:
            raise errors.error(errno.ETIMEDOUT, (
                f"no hello from the kernel at {sock} in {timeout:g} s: {where} takes "
                "connections but answers none (the kernel is stopped or hung, or what "
                "listens there is no kernel)")) from None
        token = line.decode().strip()
        if token.startswith(REFUSED):
            code, _, message = token.removeprefix(REFUSED).partition(" ")
            raise errors.error(int(code), f"{where}: {message}")
    except BaseException:
        lifeline.close()
        raise
    lifeline.settimeout(None)
    lifeline.set_inheritable(False)
    return lifeline, token


def _left(deadline: float) -> float:
    """Seconds until a time.monotonic() deadline; TimeoutError once it has passed (a socket
    timeout of 0 would mean "do not block", not "no time left")."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _connect(sock: socket.socket, path: Path, deadline: float) -> None:
    """connect, waiting until the deadline while the listener's backlog is full (EAGAIN:
    a socket with a timeout does not wait for room, as a blocking one does)."""
    while True:
        sock.settimeout(_left(deadline))
        try:
            sock.connect(str(path))
            return
        except BlockingIOError:
            time.sleep(min(CONNECT_RETRY, _left(deadline)))


def ring_setup(lifeline: socket.socket) -> ring.ProcessRing | None:
    """Ask for syscall rings on a lifeline that carries nothing else yet (syscalls/ring.py);
    None when the kernel says no (its error is in a REPLY frame of call id 0). Raises
    ConnectionResetError when the kernel hangs up meanwhile."""
    lifeline.sendall(wire.frame(wire.RING_SETUP, 0))
    size = wire.HEADER.size + ring.GEOMETRY.size
    data, fds = b"", []
    try:  # the descriptors come with the frame's first bytes: none kept if it breaks off
        while len(data) < wire.HEADER.size or (len(data) < size and data[8] == wire.RING):
            chunk, got, _, _ = socket.recv_fds(lifeline, size - len(data), 3)
            fds += got
            if not chunk:
                raise ConnectionResetError("the kernel hung up in the ring setup")
            data += chunk
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    payload, _, kind = wire.HEADER.unpack_from(data)
    if kind != wire.RING or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        if kind == wire.REPLY:  # its error, which there is nothing to do about: read it off
            while payload > len(data) - wire.HEADER.size:
                data += lifeline.recv(payload + wire.HEADER.size - len(data))
            return None
        raise ConnectionResetError(f"the kernel answered the ring setup with a frame of kind "
                                   f"{kind} and {len(fds)} descriptors")
    memfd, kernel_bell, process_bell = fds
    sq_bytes, cq_bytes = ring.GEOMETRY.unpack_from(data, wire.HEADER.size)
    try:
        mem = ring.RingMemory(memfd, sq_bytes, cq_bytes)
    except BaseException:
        for fd in (kernel_bell, process_bell):
            os.close(fd)
        raise
    finally:
        os.close(memfd)
    if mem.get(ring.MAGIC_AT) != ring.MAGIC:
        mem.close()
        for fd in (kernel_bell, process_bell):
            os.close(fd)
        raise ConnectionResetError("the kernel's ring memory is not a ring")
    for fd in (kernel_bell, process_bell):
        os.set_inheritable(fd, False)
    return ring.ProcessRing(mem, kernel_bell, process_bell)


def open_session(sock: Path, rings: bool, timeout: float = HELLO_TIMEOUT,
                 ) -> tuple[socket.socket, str, ring.ProcessRing | None]:
    """hello, then the rings when asked for (None when the kernel has none to give), within
    `timeout` seconds in all (TimeoutError, ETIMEDOUT, past it)."""
    deadline = time.monotonic() + timeout
    lifeline, token = hello(sock, timeout)
    try:
        if not rings:
            return lifeline, token, None
        try:
            lifeline.settimeout(_left(deadline))
            shared = ring_setup(lifeline)
        except TimeoutError:
            raise errors.error(errno.ETIMEDOUT, f"the kernel at {sock} answered no ring "
                               f"setup in {timeout:g} s (it is stopped or hung)") from None
        lifeline.settimeout(None)
        return lifeline, token, shared
    except BaseException:
        lifeline.close()
        raise
