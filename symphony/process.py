"""The process table: who is attached, what each holds, and what each has used."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import signal
import time
from collections import Counter
from dataclasses import dataclass, field

from kvfs.errors import FSError
from kvfs.fs import Handle
from kvfs.perm import Cred
from syscalls.session import FD_MAX, TOKEN_BYTES
from syscalls.users import user_name

FIRST_FD = 3  # an fd left at the proto default (0) is never valid
NICE_MIN, NICE_MAX = -20, 19


# CFS's weights, by nice from NICE_MIN: each nice step is worth about 10% of CPU, nice 0
# weighs 1024.
NICE_WEIGHTS = tuple(1024 / 1.25**nice for nice in range(NICE_MIN, NICE_MAX + 1))


def os_groups(os_pid: int) -> frozenset[int]:
    """Supplementary groups of a live OS process, as the OS reports them."""
    try:
        with open(f"/proc/{os_pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return frozenset(int(g) for g in line.split()[1:])
    except OSError:
        pass
    return frozenset()


def os_alive(pidfd: int | None) -> bool:
    """Whether the process a pidfd names still runs. A pid may name another process once
    the first is gone; a pidfd never does."""
    if pidfd is None:
        return False
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a kernel not run as root may not signal it, but it runs
        pass
    return True


def os_cpu_seconds(os_pid: int) -> float:
    """User plus system CPU time of an OS process, 0 once it is gone."""
    try:
        with open(f"/proc/{os_pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


@dataclass(eq=False)
class Process:
    pid: int
    os_pid: int
    cred: Cred
    token: str
    name: str = "?"
    argv: list[str] = field(default_factory=list)
    nice: int = 0
    fds: dict[int, Handle] = field(default_factory=dict)
    next_fd: int = FIRST_FD
    alive: bool = True
    exit_code: int | None = None
    started: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.monotonic)
    calls: Counter = field(default_factory=Counter)  # syscall name -> count
    call_seconds: Counter = field(default_factory=Counter)  # syscall name -> total latency
    tokens: int = 0  # entries its pred calls computed
    accel_seconds: float = 0.0  # its share of forward passes
    vruntime: float = 0.0  # weighted tokens, for fair share (level 1)
    pending: int = 0  # pred calls queued or running
    waiting: bool = False  # a pred of it waits for KV memory
    swapped: bool = False  # its pages were moved off the device while it was idle
    answered: float = 0.0  # when its last pred was answered (monotonic)
    think: float = 0.0  # how long it usually takes from an answer to its next pred, s
    pidfd: int | None = None  # the OS process that said hello, even once its pid is reused

    @property
    def uid(self) -> int:
        return self.cred.uid

    @property
    def user(self) -> str:
        return user_name(self.cred.uid)

    @property
    def weight(self) -> float:
        return NICE_WEIGHTS[self.nice - NICE_MIN]

    @property
    def state(self) -> str:
        if not self.alive:
            return "exiting"
        if self.waiting:
            return "waiting"
        if self.pending:
            return "running"
        return "swapped" if self.swapped else "sleeping"

    def inspectable_by(self, cred: Cred) -> bool:
        """Whether cred may see what the process says and holds (argv, fds, calls): its
        user and root only, since an argv can hold a prompt."""
        return cred.root or cred.uid == self.uid

    @property
    def cpu_seconds(self) -> float:
        """Its OS process's CPU time; 0 once that is gone, as its pid may be another's."""
        seconds = os_cpu_seconds(self.os_pid)
        return seconds if os_alive(self.pidfd) else 0.0

    def send_signal(self, sig: int) -> None:
        """Signal the OS process that said hello; nothing if it is gone, never another
        process that got its pid since."""
        if self.pidfd is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                signal.pidfd_send_signal(self.pidfd, sig)

    def fd_room(self, what: str) -> None:
        """EMFILE when the process has FD_MAX fds open."""
        if len(self.fds) >= FD_MAX:
            raise FSError(errno.EMFILE, f"{what}: process {self.pid} has {FD_MAX} fds open, "
                          "its limit")

    def add_fd(self, handle: Handle) -> int:
        fd = self.next_fd
        self.next_fd += 1
        self.fds[fd] = handle
        return fd

    def fd_of(self, handle: Handle) -> int | None:
        """The fd of an open file of the process's (None once it is closed)."""
        return next((fd for fd, h in self.fds.items() if h is handle), None)

    def handle(self, fd: int) -> Handle:
        try:
            return self.fds[fd]
        except KeyError:
            raise FSError(errno.EBADF, f"fd {fd} is not open in process {self.pid}") from None


class ProcessTable:
    def __init__(self) -> None:
        self.by_pid: dict[int, Process] = {}
        self.by_token: dict[str, Process] = {}
        self.per_uid: Counter = Counter()  # uid -> processes in the table
        self.next_pid = 1

    def spawn(self, os_pid: int, uid: int, gid: int, pidfd: int | None = None) -> Process:
        """A new process for a peer the OS vouched for, with a fresh session token. The
        table owns `pidfd` (a pidfd of the peer) from here on and closes it at remove."""
        groups = os_groups(os_pid)
        # Read before the check: if the peer still runs, the groups read were its own.
        cred = Cred(uid, gid, groups if os_alive(pidfd) else frozenset())
        proc = Process(self.next_pid, os_pid, cred, secrets.token_hex(TOKEN_BYTES),
                       pidfd=pidfd)
        self.next_pid += 1
        self.by_pid[proc.pid] = proc
        self.by_token[proc.token] = proc
        self.per_uid[uid] += 1
        return proc

    def end_session(self, proc: Process) -> None:
        """Its token takes no more calls, and it no longer counts against its user's
        processes; it stays in the table (`exiting`) until remove."""
        if self.by_token.pop(proc.token, None) is not None:
            self.per_uid[proc.uid] -= 1

    def remove(self, proc: Process) -> None:
        self.end_session(proc)
        if self.by_pid.pop(proc.pid, None) is None:
            return
        if proc.pidfd is not None:
            os.close(proc.pidfd)
            proc.pidfd = None

    def get(self, pid: int) -> Process:
        proc = self.by_pid.get(pid)
        if proc is None:
            raise FSError(errno.ESRCH, f"no process {pid}")
        return proc

    def __iter__(self):
        return iter(list(self.by_pid.values()))

    def __len__(self) -> int:
        return len(self.by_pid)
