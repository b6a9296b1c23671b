"""Connections to the kernel's gRPC socket, counted per user.

gRPC (C-core) accepts them itself, with no hook for the kernel, and they need no hello: a
user that opened thousands and sent nothing held gRPC's cap on connections
(server.grpc_cap), and every other user's session failed to connect. They can be counted
all the same: each is a descriptor of the kernel, a socket whose own address is the gRPC
socket's path, and the OS knows its peer (SO_PEERCRED). So when the kernel holds many
descriptors, it looks them over (on a timer, and at a hello) and shuts down what a user
holds past its limit, the ones it saw last first. It works on a duplicate of gRPC's
descriptor, never closing gRPC's own: shutdown() ends the connection itself, gRPC sees it
end and closes its descriptor. Root's connections (the mount's) are never counted.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
import struct
import time
from collections import defaultdict

from syscalls.users import user_name

log = logging.getLogger("symphony.connections")

PEERCRED = struct.Struct("iII")  # struct ucred: pid_t pid, uid_t uid, gid_t gid
FD_DIR = "/proc/self/fd"
# The connections a user may hold, per process it may have: a LIP holds one (its session's
# channel; a process that opens several sessions counts as several processes), so this
# leaves room for reconnections and for a process's own channels.
PER_PROCESS = 4
INTERVAL = 1.0  # seconds between looks on the timer
# The looks' share of the kernel's time: the next one waits at least this many times as
# long as the last took, so that a kernel with many descriptors (each one an fstat) spends
# at most about a tenth of its time on them, however many hellos come.
DUTY = 10


def per_user_limit(max_procs_per_user: int, cap: int) -> int:
    """The connections a user other than root may hold: PER_PROCESS for each process it may
    have, and never more than a quarter of gRPC's cap, so that no one user fills it."""
    return max(1, min(PER_PROCESS * max_procs_per_user, cap // 4))


class Connections:
    """The gRPC socket's connections, by user. look() shuts down those past a user's
    `limit`, once the kernel holds `threshold` descriptors (below it, a flood could not
    reach the cap, and the look costs one listing of /proc/self/fd)."""

    def __init__(self, path: str, limit: int, threshold: int):
        self.path, self.limit, self.threshold = path, limit, threshold
        # Each connection's socket (its inode) seen at the last look: its peer's uid (None:
        # not a connection to the gRPC socket), and the look that first saw it.
        self.known: dict[int, tuple[int | None, int]] = {}
        self.looks = 0
        self.last = 0.0  # when the last look ended (time.monotonic)
        self.took = 0.0  # how long it took
        self.cut = 0  # connections shut down since the kernel started

    def due(self) -> bool:
        return time.monotonic() - self.last >= DUTY * self.took

    def hello(self) -> None:
        """A hello came: its process connects to the gRPC socket next, so look now (unless
        the last look was too recent for the duty cycle) before it finds the cap full."""
        if self.due():
            self.safe_look()

    async def watch(self) -> None:
        """Look every INTERVAL (or less often, if looks take long; a hello's look counts)."""
        while True:
            await asyncio.sleep(max(INTERVAL, DUTY * self.took))
            if self.due():
                self.safe_look()

    def safe_look(self) -> None:
        try:
            self.look()
        except Exception:  # a hello, and the next look, go on
            log.exception("looking over the gRPC socket's connections failed")

    def look(self) -> int:
        """Shut down what each user holds past the limit; the number shut down."""
        start = time.monotonic()
        try:
            return self._look()
        finally:
            self.last = time.monotonic()
            self.took = self.last - start

    def _look(self) -> int:
        try:
            fds = os.listdir(FD_DIR)
        except OSError:  # out of descriptors (EMFILE) for the listing itself: next time
            return 0
        if len(fds) < self.threshold:
            self.known.clear()
            return 0
        self.looks += 1
        known: dict[int, tuple[int | None, int]] = {}
        by_uid: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
        for name in fds:
            fd = int(name)
            try:
                st = os.fstat(fd)
            except OSError:  # closed since the listing (the listing's own one, too)
                continue
            if not stat.S_ISSOCK(st.st_mode):
                continue
            ino = st.st_ino
            seen = self.known.get(ino)
            if seen is None:
                uid = self.peer(fd, ino)
                if uid is False:  # its descriptor holds another socket now: next look
                    continue
                seen = (uid, self.looks)
            known[ino] = seen
            uid, first = seen
            if uid:  # root's (0) and what is no connection to the gRPC socket (None) go
                by_uid[uid].append((first, ino, fd))
        self.known = known
        cut = 0
        for uid, conns in by_uid.items():
            if len(conns) <= self.limit:
                continue
            conns.sort()  # the ones seen first first: the last seen are shut down
            gone = sum(shutdown(fd, ino) for _, ino, fd in conns[self.limit:])
            if gone:
                log.warning("%s held %d connections to %s, past its limit of %d: %d shut "
                            "down", user_name(uid), len(conns), self.path, self.limit, gone)
            cut += gone
        self.cut += cut
        return cut

    def peer(self, fd: int, ino: int) -> int | None | bool:
        """The uid of the peer of the socket at fd if it is a connection to the gRPC socket
        (its listening socket has the same address, and is none); None if it is not;
        False if fd holds another socket than ino now."""
        sock = dup(fd, ino)
        if sock is None:
            return False
        with sock:
            try:
                if (sock.family != socket.AF_UNIX or sock.getsockname() != self.path
                        or sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                    return None
                return PEERCRED.unpack(sock.getsockopt(
                    socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))[1]
            except OSError:
                return None


def dup(fd: int, ino: int) -> socket.socket | None:
    """A socket object on a duplicate of fd, if fd still holds socket ino; closing it
    closes the duplicate only."""
    try:
        copy = os.dup(fd)
    except OSError:
        return None
    try:
        if os.fstat(copy).st_ino == ino:
            return socket.socket(fileno=copy)
    except OSError:
        pass
    os.close(copy)
    return None


def shutdown(fd: int, ino: int) -> bool:
    """End the connection of socket ino at fd, for both ends: its peer reads the end, and
    gRPC, reading it too, closes fd itself."""
    sock = dup(fd, ino)
    if sock is None:
        return False
    with sock:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
    return True
