"""The shell's side of the kernel: start, stop, status, run, serve, ps, kill."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import importlib.util
import json
import os
import pwd
import select
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import BinaryIO

from symphony.options import RENDEZVOUS_SECONDS
from syscalls.client import Kernel
from syscalls.flags import each
from syscalls.pred_rpc import MAIN_THREAD_SIGNALS
from syscalls.session import DEFAULT_SOCKET, pid_path, socket_path

START_TIMEOUT = 300.0  # loading and fingerprinting a large checkpoint takes a while
STOP_TIMEOUT = 120.0  # stopping saves every changed KV file
# A serving kernel answers a hello within milliseconds, under load too: status says one
# that has not in this long is not answering, rather than wait as long as a program would.
STATUS_HELLO_TIMEOUT = 5.0
PROBE_WAIT = 2.0  # kernel_pid's wait for room in a listener's full backlog


PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def kernel_pid(sock: Path) -> int | None:
    """The pid of the kernel that listens on sock, as the OS tells it (SO_PEERCRED of a
    connection); None when nothing answers there. Not the kernel's pid file: after a crash
    that names a dead kernel, a zombie, or whatever process has its pid since; but a
    listener whose backlog stays full for PROBE_WAIT (a kernel stopped with SIGSTOP, or
    hung) is the kernel the pid file names, if it names a live process: a blocking probe
    waited for room for ever."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)  # a connection is made at once or refused at once (EAGAIN)
    deadline = time.monotonic() + PROBE_WAIT
    try:
        while time.monotonic() < deadline:
            try:
                probe.connect(str(sock))
            except BlockingIOError:  # its backlog is full
                time.sleep(0.05)
                continue
            except OSError:
                return None
            cred = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size)
            return PEERCRED.unpack(cred)[0]
    finally:
        probe.close()
    return _listed_pid(sock)


def _listed_pid(sock: Path) -> int:
    """The pid in the kernel's pid file, for a listener that takes no connection; OSError
    (EAGAIN) when the file names no live process."""
    try:
        # Not through a link, nor from a FIFO planted there (its open would wait).
        fd = os.open(pid_path(sock), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise ValueError
            pid = int(os.read(fd, 64))
        finally:
            os.close(fd)
        os.kill(pid, 0)
        return pid
    except PermissionError:  # alive, another user's
        return pid
    except (OSError, ValueError):
        raise OSError(errno.EAGAIN, f"{sock}: a process listens there but takes no "
                      f"connection in {PROBE_WAIT:g} s, and {pid_path(sock)} names no live "
                      "kernel") from None


def kernel_socket(path: str | os.PathLike | None) -> Path:
    """Where a kernel started on `path` binds: a symlink's target, the socket it names
    (docs/syscalls.md), so that it and every other link to that socket lead to the kernel
    (bound at the link, it replaced the link and left the others at a dead socket). The
    directories of both are checked first (socket_dir): a link in the default socket's
    directory is followed only once that directory is found to be the user's own."""
    sock = socket_path(path)
    socket_dir(sock)
    if not sock.is_symlink():
        return sock
    target = sock.resolve()
    socket_dir(target)
    return target


def socket_dir(sock: Path) -> None:
    """Make the default socket's directory (in /tmp, which a reboot empties) or check it is
    the user's own (own_dir); another socket's must be a directory already, as for bind(2):
    ENOENT or ENOTDIR naming it (a mistyped --socket made directories)."""
    if sock.parent == Path(DEFAULT_SOCKET).parent:
        own_dir(sock.parent)
    elif not sock.parent.is_dir():
        code = errno.ENOTDIR if sock.parent.exists() else errno.ENOENT
        raise OSError(code, f"the socket's directory {sock.parent}: {os.strerror(code)}")


def own_dir(path: Path) -> None:
    """Make `path` with mode 0755, or take the one there only if it is a directory (not a
    symlink) of this user's that no one else may write: EPERM naming its owner and mode.
    Whoever may write in the directory of root's socket could put a socket of theirs in its
    place (and take other users' session tokens), or links where the kernel writes its pid
    file and log. mkdir first, then the check: one made by another between the two is
    checked too."""
    try:
        path.mkdir(mode=0o755)
        made = True
    except FileExistsError:
        made = False
    st = os.lstat(path)
    kind = ("a symlink" if stat.S_ISLNK(st.st_mode) else
            "" if stat.S_ISDIR(st.st_mode) else "not a directory")
    if kind or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise OSError(errno.EPERM, (
            f"the socket's directory {path}: {os.strerror(errno.EPERM)}: "
            f"{kind + ', ' if kind else ''}owner {user_name(st.st_uid)}, mode "
            f"{stat.S_IMODE(st.st_mode):04o}; the kernel takes only a directory of its "
            f"user's ({user_name(os.geteuid())}) that no one else may write: remove it, "
            "or use --socket"))
    if made:  # 0755 whatever the umask: every user connects, so searches it
        path.chmod(0o755)


def user_name(uid: int) -> str:
    """A uid as `name (uid N)`, or `uid N` where it has no name."""
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


class Claim:
    """The kernel's socket path, held by a kernel that starts (its engine loads, its ranks
    meet) before it serves there: a socket that listens and answers nothing, so that
    kernel_pid finds the kernel (`symphony status` says it starts, `symphony stop` stops
    it, a second `symphony start` is refused), and that hello's path, absent, keeps clients
    out (they find no kernel). OSError if a kernel listens there already."""

    def __init__(self, sock: Path):
        self.path = sock
        pid = kernel_pid(sock)
        if pid is not None:
            raise OSError(errno.EADDRINUSE, f"{sock}: a kernel already listens there (pid {pid})")
        sock.unlink(missing_ok=True)  # a dead kernel's
        self.listener: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(sock))
        self.listener.listen()
        # Every probe's connection taken and closed: left in the backlog, 129 of them (a
        # script polling `symphony status` while a model loads) filled it, and every probe
        # after waited for room until the kernel served. The thread starts with the
        # signals the kernel handles blocked (a thread starts with its creator's mask): one
        # delivered to it would leave the main thread's wait uninterrupted, so a Ctrl-C
        # while the model loads went unanswered until the load ended.
        self._taker = threading.Thread(target=self._take, args=(self.listener,), daemon=True)
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, MAIN_THREAD_SIGNALS)
        try:
            self._taker.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)

    @staticmethod
    def _take(listener: socket.socket) -> None:
        while True:
            try:
                listener.accept()[0].close()
            except OSError:  # shut down by release
                return

    def release(self) -> None:
        """For the kernel to listen there itself (once: later calls do nothing, so that a
        kernel's socket is never taken for the placeholder's)."""
        if self.listener is not None:
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the taker's accept
            self._taker.join()
            self.listener.close()
            self.listener = None
            self.path.unlink(missing_ok=True)


def start_wait(args: argparse.Namespace) -> float:
    """How long `symphony start` waits for its kernel to answer: the ranks of other nodes
    may come up to RENDEZVOUS_SECONDS after it."""
    nodes = args.nnodes or int(os.environ.get("NNODES") or 1)
    return START_TIMEOUT + (RENDEZVOUS_SECONDS if nodes > 1 else 0.0)


def cmd_start(args: argparse.Namespace, kernel_argv: list[str]) -> int:
    sock = kernel_socket(args.socket)
    pid = kernel_pid(sock)
    if pid is not None:
        print(f"symphony: a kernel already runs on {sock} (pid {pid})", file=sys.stderr)
        return 1
    log = sock.with_name(sock.name + ".log")
    with open_log(log) as out:
        # The log keeps every start's lines: a failure shows only what this kernel wrote.
        since = out.seek(0, os.SEEK_END)
        child = subprocess.Popen(
            [sys.executable, "-m", "symphony.cli", "kernel", "--socket", str(sock),
             *kernel_argv],
            stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True)
        wait = start_wait(args)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if child.poll() is not None:
                out.seek(since)
                tail = out.read().decode(errors="replace").splitlines()[-20:]
                print("\n".join(tail), file=sys.stderr)
                print(f"symphony: the kernel exited with status {child.returncode} "
                      f"(log: {log})", file=sys.stderr)
                return 1
            try:
                with Kernel.connect(sock, name="symphony-start") as k:
                    info = k.model_info()
            except OSError:
                time.sleep(0.2)
                continue
            if (answering := kernel_pid(sock)) not in (child.pid, None):
                child.terminate()
                print(f"symphony: another kernel (pid {answering}) took {sock} while kernel "
                      f"{child.pid} started (log: {log})", file=sys.stderr)
                return 1
            print(f"kernel {child.pid} serves {info.name} on {sock} (log: {log})")
            return 0
    child.terminate()
    print(f"symphony: the kernel did not answer within {wait:.0f} s (log: {log})",
          file=sys.stderr)
    return 1


def open_log(log: Path) -> BinaryIO:
    """The kernel's log, to append to and read back: never through a symlink (ELOOP naming
    it), which whoever may write in the socket's directory could plant to have the kernel's
    lines appended to a file of root's."""
    try:
        fd = os.open(log, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o644)
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise OSError(errno.ELOOP, f"{log}: the kernel's log is a symlink, which start never "
                      "writes through: remove it") from None
    return open(fd, "a+b")


def cmd_stop(args: argparse.Namespace) -> int:
    sock = socket_path(args.socket)
    pid = kernel_pid(sock)
    if pid is None:
        print(f"symphony: no kernel runs on {sock}", file=sys.stderr)
        return 1
    # A pidfd reads ready once the kernel has exited, reaped or not: its parent need not be
    # us, nor reap it.
    pidfd = os.pidfd_open(pid)
    try:
        try:
            signal.pidfd_send_signal(pidfd, signal.SIGTERM)  # it saves every changed KV file
        except PermissionError as e:
            print(f"symphony: kernel {pid} on {sock} runs as {_owner(pid)}: only that user or "
                  f"root can stop it: {e.strerror}", file=sys.stderr)
            return 1
        if _stopped(pid):  # SIGTERM waits until it runs again: waiting here would be for that
            print(f"symphony: kernel {pid} is stopped (SIGSTOP or a debugger): it stops, saving "
                  f"its files, once it continues (kill -CONT {pid})", file=sys.stderr)
            return 1
        if select.select([pidfd], [], [], STOP_TIMEOUT)[0]:
            print(f"kernel {pid} stopped")
            return 0
    finally:
        os.close(pidfd)
    print(f"symphony: kernel {pid} is still running after {STOP_TIMEOUT:.0f} s", file=sys.stderr)
    return 1


def _stopped(pid: int) -> bool:
    """Whether a process is stopped by a signal or traced (/proc's state T or t)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _owner(pid: int) -> str:
    """The user a process runs as, by name where it has one."""
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return "another user"
    return user_name(uid)


def cmd_status(args: argparse.Namespace) -> int:
    sock = socket_path(args.socket)
    try:
        with Kernel.connect(sock, name="symphony-status",
                            hello_timeout=STATUS_HELLO_TIMEOUT) as k:
            info, procs = k.model_info(), k.ps()
            meminfo = k.procfs("meminfo")
    except TimeoutError as e:
        print(f"not answering: {e.strerror}")
        return 3
    except OSError as e:
        pid = kernel_pid(sock)  # a kernel that starts holds the socket's path (Claim)
        if pid is None:
            print(f"not running: {e.strerror or e}")
        else:
            print(f"starting: kernel {pid} holds {sock} but does not serve yet (its model "
                  "loads, or it waits for its ranks)")
        return 3  # as in LSB status: not running (yet)
    print(f"kernel {kernel_pid(sock) or '?'} on {sock}")
    print(f"model {info.name} ({info.architecture}, {info.dtype}), fingerprint "
          f"{info.fingerprint[:16]}, context {info.context_length}, page {info.page_size}")
    print(f"processes {len(procs) - 1}")  # not counting this one
    print(meminfo, end="")
    return 0


# si_code of a signal the OS sent: a terminal's Ctrl-C or hangup, which reaches its whole
# foreground process group (<asm-generic/siginfo.h>).
SI_KERNEL = 0x80
PASSED_ON = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def reached_the_program(info: signal.struct_siginfo, program: int) -> bool:
    """Whether a signal that `run` got reached the program too, which shares run's process
    group: one the terminal sent (to its foreground group), or one the program sent (to its
    group: `kill 0`). Passed on again, a Ctrl-C would interrupt the program twice. Any other
    sender's is passed on: a process of run's group (a test harness, a supervisor) that
    signals run's pid reaches run alone, and the program must stop too; one sent to the group
    from another process comes twice."""
    return info.si_code == SI_KERNEL or info.si_pid == program


def cmd_run(args: argparse.Namespace) -> int:
    sock = socket_path(args.socket)
    prog = args.program
    argv = [sys.executable, prog, *args.args] if prog.endswith(".py") else [prog, *args.args]
    env = {**os.environ, "SYMPHONY_SOCKET": str(sock.resolve())}
    # Blocked, the signals wait for sigwaitinfo, which says who sent them; SIGCHLD says the
    # program has exited. The program starts with the mask run had.
    waited = {*PASSED_ON, signal.SIGCHLD}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    try:
        try:
            # A shell hands its fds on (`--prompt-file <(...)` is /dev/fd/N): so does run.
            child = subprocess.Popen(argv, env=env, close_fds=False, preexec_fn=lambda:
                                     signal.pthread_sigmask(signal.SIG_SETMASK, mask))
        except OSError as e:
            print(f"symphony: {prog}: {e.strerror}", file=sys.stderr)
            return 127
        while (code := child.poll()) is None:
            info = signal.sigwaitinfo(waited)
            if info.si_signo != signal.SIGCHLD and not reached_the_program(info, child.pid):
                child.send_signal(info.si_signo)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return 128 - code if code < 0 else code


def cmd_serve(args: argparse.Namespace) -> int:
    """`symphony run lips/openai_server.py FLAGS`: the server is a LIP like any other."""
    program = importlib.util.find_spec("lips.openai_server").origin
    return cmd_run(argparse.Namespace(socket=args.socket, program=program, args=args.rest))


def cmd_ps(args: argparse.Namespace) -> int:
    with Kernel.connect(args.socket, name="symphony-ps") as k:
        procs = k.ps()
    if args.json:
        print(json.dumps([dataclasses.asdict(p) for p in procs]))
        return 0
    print(f"{'PID':>5} {'OSPID':>7} {'USER':<10} {'STATE':<9} {'NI':>3} {'CALLS':>7} "
          f"{'TOKENS':>8} {'PAGES':>6} {'CPU':>7} {'ACCEL':>7}  NAME")
    for p in procs:
        print(f"{p.pid:>5} {p.os_pid:>7} {p.user[:10]:<10} {p.state:<9} {p.nice:>3} "
              f"{p.syscalls:>7} {p.tokens:>8} {p.pages:>6} {p.cpu_seconds:>7.2f} "
              f"{p.accel_seconds:>7.2f}  {p.name}")
    return 0


def cmd_kill(args: argparse.Namespace) -> int:
    """As kill(1): a pid that cannot be killed does not stop the others."""
    with Kernel.connect(args.socket, name="symphony-kill") as k:
        return each("kill", args.pids, k.kill)
