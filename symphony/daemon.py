"""The kernel daemon: the engine, kvfs, the process table and the scheduler behind one
socket, on uvloop."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import resource
import signal
import socket
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path

import grpc

from kvfs.fs import FileSystem
from kvfs.pages import PageStore
from kvfs.perm import Cred
from kvfs.state import StateDir, hold
from symphony.connections import Connections, per_user_limit
from symphony.engine_process import EngineDied, EngineProcess
from symphony.frame_hold import FrameHold
from symphony.options import Options
from symphony.owed import Owed
from symphony.process import Process, ProcessTable
from symphony.procfs import ProcFS
from symphony.reply_budget import ReplyBudget
from symphony.scheduler import Scheduler
from symphony.server import Front, Hello, grpc_cap, grpc_options
from syscalls import symphony_pb2 as pb
from syscalls import wire
from syscalls.session import hello_path, pid_path

log = logging.getLogger("symphony.kernel")
YOUNG_OBJECTS = 10_000  # the collector's first threshold while the kernel serves (run_kernel)


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "symphony"


class Kernel:
    def __init__(self, engine: EngineProcess, opts: Options):
        self.engine, self.opts = engine, opts
        self.model_name = engine.model_dir.name
        self.fingerprint = engine.fingerprint
        opts.state_dir.mkdir(parents=True, exist_ok=True)
        self.state_lock = hold(opts.state_dir)  # before the swap file is opened
        store = PageStore(engine.pool, opts.state_dir / "swap", opts.disk_pages,
                          default_quota=opts.quota)
        self.fs = FileSystem(store, self.fingerprint, engine.config.vocab_size,
                             inode_quota=opts.inode_quota or None)
        self.state = StateDir(opts.state_dir, self.fs)
        self.state.restore()
        self.procs = ProcessTable()
        self.lifelines: dict[int, asyncio.Transport] = {}
        self.frame_hold = FrameHold()
        self.owed = Owed()  # lifeline and ring preds' replies in flight, by debtor
        self.reply_budgets: dict[object, ReplyBudget] = {}  # gRPC Pred replies, by debtor
        self.sched = Scheduler(engine, self.fs, lambda: self.procs,
                               opts.token_budget, opts.max_seqs, opts.decode_ahead,
                               pipeline=opts.pipeline)
        self.procfs = ProcFS(self)
        self.connections: Connections | None = None  # the gRPC socket's, once it listens
        self._reaping: dict[Process, asyncio.Task] = {}
        self.engine_lost = False  # the kernel stopped because its engine process exited

    # -- processes --------------------------------------------------------------------

    def spawn_reap(self, proc: Process) -> asyncio.Task:
        """Reap proc in a task of its own (once, however many ask)."""
        task = self._reaping.get(proc)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._reap(proc))
            self._reaping[proc] = task
            task.add_done_callback(lambda _: self._reaping.pop(proc, None))
        return task

    async def reap(self, proc: Process) -> None:
        """Reap proc and wait for it. The reaping is shielded: the call waiting here may be
        cancelled (a process that kills itself loses the connection its kill came on), and
        a reaping cut short would leave its files and pages held for ever."""
        await asyncio.shield(self.spawn_reap(proc))

    async def _reap(self, proc: Process) -> None:
        """A process is gone: cancel its calls, close its fds (anonymous files and private
        pages go with them), forget it. Until its files are closed it is `exiting` in ps."""
        if not proc.alive:
            return  # reaped already
        proc.alive = False
        self.procs.end_session(proc)
        self.sched.cancel_process(proc)
        await self.sched.quiesce()  # a running step may still write into its files
        for handle in proc.fds.values():
            self.fs.close(handle)
        proc.fds.clear()
        self.procs.remove(proc)
        lifeline = self.lifelines.pop(proc.pid, None)
        if lifeline is not None:
            lifeline.close()
        self.sched.poke()

    async def kill(self, proc: Process) -> None:
        """SIGKILL the OS process that said hello (if it is gone, its lifeline may live on
        in a child: reaping closes it) and reap."""
        proc.send_signal(signal.SIGKILL)
        await self.reap(proc)

    def proc_info(self, p: Process, cred: Cred) -> pb.ProcInfo:
        """What ps shows `cred` of p: another user's process without its argv."""
        return pb.ProcInfo(
            pid=p.pid, os_pid=p.os_pid, uid=p.uid, user=p.user, name=p.name,
            argv=p.argv if p.inspectable_by(cred) else [],
            state=p.state, nice=p.nice, syscalls=sum(p.calls.values()), tokens=p.tokens,
            pages=self.pages_of(p), cpu_seconds=p.cpu_seconds,
            accel_seconds=p.accel_seconds, fds=len(p.fds), started=p.started,
        )

    @staticmethod
    def pages_of(p: Process) -> int:
        """Distinct pages of the files a process has open."""
        return len({id(page) for h in p.fds.values() for page in h.inode.pages
                    if page is not None})

    # -- life cycle -------------------------------------------------------------------

    async def serve(self, release: Callable[[], None] | None = None) -> None:
        """Serve until stopped. release: gives up the placeholder that held the socket's
        path while the kernel started (control.Claim), called just before it listens."""
        loop = asyncio.get_running_loop()
        # First: a signal while the sockets are made stops the kernel once they are, and
        # the shutdown below removes them.
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        sock = self.opts.socket
        if release is not None:
            release()
        for path in (sock, hello_path(sock)):
            if path.exists():
                if _answers(path):
                    raise OSError(f"{path}: a kernel already listens there")
                path.unlink()
        server, front = grpc.aio.server(options=grpc_options()), Front(self)
        server.add_generic_rpc_handlers([front.handler()])
        if not server.add_insecure_port(f"unix:{sock}"):
            raise OSError(f"{sock}: cannot listen")
        # Both bound and opened to all before either listens: a swapped path (share_socket)
        # stops the kernel before it serves anything.
        share_socket(sock)
        hello_sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        hello_sock.bind(str(hello_path(sock)))
        share_socket(hello_path(sock))
        await server.start()
        # Counted per user: past its limit a user's connections are shut down, so that
        # none fills the cap (connections.py). Looked over once the kernel holds an eighth
        # of the cap in descriptors: below that no flood is near it.
        cap = grpc_cap()
        self.connections = Connections(
            str(sock), per_user_limit(self.opts.max_procs_per_user, cap), cap // 8)
        watch = loop.create_task(self.connections.watch())
        hello = await loop.create_unix_server(lambda: Hello(self, front), sock=hello_sock)
        write_pid(pid_path(sock))
        # Either ends early only when the engine process died: the kernel stops then.
        scheduler = loop.create_task(self.sched.run())
        engine_exit = loop.create_task(self.engine.exited())
        for task in (scheduler, engine_exit):
            task.add_done_callback(lambda _: stop.set())
        log.info("serving %s on %s (state in %s)", self.model_name, sock, self.opts.state_dir)
        try:
            await stop.wait()
        finally:
            self.engine_lost = engine_exit.done() or scheduler.done()
            if self.engine_lost:
                bug = scheduler_defect(scheduler)
                if bug is None:
                    log.critical("shutting down: %s", self.engine.deaths())
                else:  # a defect of the kernel's, not the engine's: its traceback
                    log.critical("shutting down: the scheduler failed: %r", bug, exc_info=bug)
                await self._fail_in_flight(scheduler)
            else:
                log.info("shutting down")
            engine_exit.cancel()
            watch.cancel()
            try:
                hello.close()
                for lifeline in self.lifelines.values():  # a clean stop, not a crash: the
                    lifeline.write(wire.frame(wire.SHUTDOWN, 0))  # mount unmounts
                await server.stop(grace=1.0)
                for proc in list(self.procs):
                    await self.reap(proc)
                scheduler.cancel()
                self.state.shutdown()  # all it can save; EIO after, if anything was not
            finally:  # whatever failed, no socket or pid file outlives the kernel
                for path in (sock, hello_path(sock), pid_path(sock)):
                    path.unlink(missing_ok=True)

    async def _fail_in_flight(self, scheduler: asyncio.Task) -> None:
        """A rank died: the preds of the steps in flight get EIO before the processes are
        reaped. Rank 0's death fails them at once; another rank's would leave them waiting
        for rank 0, which a dead peer's collective ends only later, and their processes
        would see their lifelines close instead of the error."""
        if self.sched.running:
            self.engine.fail_steps()
            await asyncio.wait([scheduler], timeout=1.0)  # it fails their preds, then ends
        if scheduler.done() and not scheduler.cancelled():
            scheduler.exception()  # the EngineDied logged above: seen, so asyncio logs none
        await asyncio.sleep(0)  # the replies' bells, rung on the next turn


def scheduler_defect(scheduler: asyncio.Task) -> BaseException | None:
    """What ended the scheduler, where it is not the engine's death (EngineDied)."""
    if not scheduler.done() or scheduler.cancelled():
        return None
    e = scheduler.exception()
    return None if isinstance(e, EngineDied) else e


def share_socket(path: Path) -> None:
    """Mode 0666 for the socket the kernel bound at `path`: every local user may connect;
    identity comes from SO_PEERCRED, not from access. Changed through a descriptor of the
    node, never by path: the kernel runs as root, and in a socket's directory others may
    write in (--socket /tmp/k.sock) another user could put a symlink in the socket's place
    after bind, whose target (/etc/shadow) os.chmod would make 0666. The node, opened
    without following a link, must be a socket of the kernel's user, which no other user
    can make: anything else there means the path was swapped, and the kernel stops rather
    than serve on it (ELOOP, ENOTSOCK or EPERM naming the path). An O_PATH descriptor's
    mode changes only through /proc/self/fd, as glibc's fchmodat(AT_SYMLINK_NOFOLLOW)."""
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if stat.S_ISLNK(st.st_mode):
            code, what = errno.ELOOP, "a symlink"
        elif not stat.S_ISSOCK(st.st_mode):
            code, what = errno.ENOTSOCK, "not a socket"
        elif st.st_uid != os.geteuid():
            code, what = errno.EPERM, f"a socket of uid {st.st_uid}'s"
        else:
            os.chmod(f"/proc/self/fd/{fd}", 0o666)
            return
        raise OSError(code, f"{path}: {what}, not the socket the kernel bound there (whoever "
                            f"may write in {path.parent} replaced it): the kernel stops")
    finally:
        os.close(fd)


def write_pid(path: Path) -> None:
    """The kernel's pid, written to a new file renamed over `path`: a symlink there (whoever
    may write in the socket's directory could plant one to a file of root's) is replaced,
    never written through."""
    fd, new = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as out:
            os.fchmod(fd, 0o644)
            out.write(f"{os.getpid()}\n")
        os.replace(new, path)
    except BaseException:
        os.unlink(new)
        raise


def _answers(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def run_kernel(engine: EngineProcess, opts: Options,
               release: Callable[[], None] | None = None) -> int:
    """Serve until SIGTERM or SIGINT, on uvloop: 0. Or until the engine process dies: 1.
    release: as Kernel.serve's."""
    import uvloop

    # Each session holds descriptors (its lifeline, a pidfd, its gRPC connection): take as
    # many as the OS allows.
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    thresholds = gc.get_threshold()
    try:
        kernel = Kernel(engine, opts)
        gc.freeze()  # see engine_process.py's main
        # A step's objects (a guess's job, reservation and future a pred, the answers) are
        # mostly freed by their counts within a step or two; at the default threshold (700
        # objects allocated net) that churn alone set off a collection every 50 preds at
        # 256 a step. Above a full step's churn, collections follow real growth.
        gc.set_threshold(YOUNG_OBJECTS, *thresholds[1:])
        uvloop.run(kernel.serve(release))
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
        engine.close()
    return 1 if kernel.engine_lost else 0
