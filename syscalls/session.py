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

from syscalls import errors

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
