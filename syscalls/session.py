"""Where the kernel listens, and the hello handshake that gives a process its identity.

The gRPC socket carries the calls; the hello socket beside it carries identity. A process
connects to the hello socket, the kernel reads the peer's uid, gid and pid from the OS
(SO_PEERCRED) and answers one line: a session token, or `refused ERRNO MESSAGE` (then it
hangs up) when one of its limits stands in the way. The connection then stays open for the
life of the process, so the kernel learns of its death, crash or SIGKILL included, from
the OS too. After the line it carries frames (syscalls/wire.py): pred's fast path.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from syscalls import errors, ring, wire

DEFAULT_SOCKET = "/tmp/symphony/kernel.sock"
SESSION_KEY = "symphony-session"  # gRPC metadata: the token
AS_KEY = "symphony-as"  # gRPC metadata: "uid:gid", honoured for root sessions only
TOKEN_BYTES = 32
REFUSED = "refused "  # hello's answer instead of a token: "refused ERRNO MESSAGE"


def socket_path(path: str | os.PathLike | None = None) -> Path:
    """The kernel's socket: the argument, else SYMPHONY_SOCKET, else the default."""
    return Path(path or os.environ.get("SYMPHONY_SOCKET") or DEFAULT_SOCKET)


def hello_path(sock: Path) -> Path:
    return sock.with_name(sock.name + ".hello")


def grpc_target(sock: Path) -> str:
    return f"unix://{sock.resolve()}"


def refusal(code: int, message: str) -> bytes:
    """The kernel's answer to a hello it refuses."""
    return f"{REFUSED}{code} {message}\n".encode()


def hello(sock: Path) -> tuple[socket.socket, str]:
    """Open a session: the lifeline connection (keep it open) and the token it gave.

    Raises ConnectionRefusedError or FileNotFoundError when no kernel listens there, and
    the kernel's errno (EAGAIN: a limit) with its message when it refuses the session.
    """
    lifeline = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        lifeline.connect(str(hello_path(sock)))
        line = b""
        while not line.endswith(b"\n"):  # a byte at a time: frames may follow the line
            chunk = lifeline.recv(1)
            if not chunk:
                raise ConnectionResetError(f"{hello_path(sock)}: the kernel hung up in hello")
            line += chunk
        token = line.decode().strip()
        if token.startswith(REFUSED):
            code, _, message = token.removeprefix(REFUSED).partition(" ")
            raise errors.error(int(code), f"{hello_path(sock)}: {message}")
    except BaseException:
        lifeline.close()
        raise
    lifeline.set_inheritable(False)
    return lifeline, token


def ring_setup(lifeline: socket.socket) -> ring.ProcessRing | None:
    """Ask for syscall rings on a lifeline that carries nothing else yet (syscalls/ring.py);
    None when the kernel says no (its error is in a REPLY frame of call id 0). Raises
    ConnectionResetError when the kernel hangs up meanwhile."""
    lifeline.sendall(wire.frame(wire.RING_SETUP, 0))
    size = wire.HEADER.size + ring.GEOMETRY.size
    data, fds = b"", []
    while len(data) < wire.HEADER.size or (len(data) < size and data[8] == wire.RING):
        chunk, got, _, _ = socket.recv_fds(lifeline, size - len(data), 3)
        if not chunk:
            for fd in fds + got:
                os.close(fd)
            raise ConnectionResetError("the kernel hung up in the ring setup")
        data, fds = data + chunk, fds + got
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


def open_session(sock: Path, rings: bool) -> tuple[socket.socket, str, ring.ProcessRing | None]:
    """hello, then the rings when asked for (None when the kernel has none to give)."""
    lifeline, token = hello(sock)
    try:
        return lifeline, token, ring_setup(lifeline) if rings else None
    except BaseException:
        lifeline.close()
        raise
