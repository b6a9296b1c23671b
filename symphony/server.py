"""The kernel's front door: the gRPC socket that carries syscalls and the hello socket that
carries identity (see syscalls/session.py).

Requests are parsed here, not by gRPC, so a malformed one gets EINVAL like any other bad
argument. Each call is charged to the process its session token names.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import inspect
import logging
import os
import pwd
import re
import resource
import socket
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
from google.protobuf.message import DecodeError

from kvfs.errors import FSError
from kvfs.perm import Cred, check_ids
from symphony.kernel_bell import KernelBells
from symphony.known_preds import KnownPreds
from symphony.pred_job import Output
from symphony.process import Process
from symphony.read_pause import IN_FLIGHT, OWED, REPLIES, ReadPause
from symphony.reply_budget import ReplyBudget, debtor
from symphony.scheduler import taken_back
from symphony.syscall_table import (
    TABLE,
    einval,
    known_pred,
    reply_bound,
    reply_payload,
    submit_known,
    submit_pred,
    sys_pred,
)
from syscalls import ring, wire
from syscalls import symphony_pb2 as pb
from syscalls.session import AS_KEY, SESSION_KEY, refusal
from syscalls.users import user_name

if TYPE_CHECKING:
    from symphony.daemon import Kernel

log = logging.getLogger("symphony.server")


def quiet_ended_streams(record: logging.LogRecord) -> bool:
    """gRPC's log filter: drop its traceback for a stream's write on a call its client has
    ended (a race that context.cancelled() narrows but cannot close): any user could
    cancel exports in a loop and fill the kernel's log with them."""
    return not record.getMessage().startswith("ExecuteBatchError raised in core")


logging.getLogger("grpc._cython.cygrpc").addFilter(quiet_ended_streams)
SERVICE = "symphony.Kernel"


class Malformed:
    """Stands in for a request whose bytes did not parse."""

    def __init__(self, error: Exception):
        self.error = error


def parser(message_type):
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except (DecodeError, ValueError) as e:
            return Malformed(e)

    return parse


# The longest error message a reply carries: a message that quoted a caller's input whole
# could pass a reply's 64 MiB, and the caller would get no reply at all.
MESSAGE_MAX = 4096


def error_reply(reply_type, e: BaseException):
    if isinstance(e, OSError) and e.errno:
        code, message = e.errno, getattr(e, "message", None) or e.strerror or str(e)
    else:
        log.exception("syscall failed", exc_info=e)
        code, message = errno.EIO, f"kernel error: {e!r}"
    if len(message) > MESSAGE_MAX:
        cut = f"... (cut: {len(message)} characters)"
        message = message[:MESSAGE_MAX - len(cut)] + cut
    return reply_type(error=pb.Error(errno=code, message=message))


AS_FORM = re.compile(r"(-?[0-9]{1,20}):(-?[0-9]{1,20})")  # longer is no id either

# gRPC's server defaults do not fit a kernel. It takes requests of at most 4 MiB (we take
# wire.MAX_PAYLOAD, as the lifeline does: longer ones fail with RESOURCE_EXHAUSTED, EMSGSIZE
# to the client). And it sheds calls with CANCELLED once about 1000 (at random; all past
# 3000) wait to be picked up, which an asyncio LIP with thousands of preds in flight hit.
CALL_OPTIONS = [
    ("grpc.max_receive_message_length", wire.MAX_PAYLOAD),
    ("grpc.server.max_pending_requests", 1 << 16),
    ("grpc.server.max_pending_requests_hard_limit", 1 << 16),
]


def as_cred(value: str) -> Cred:
    """The credentials `symphony-as: uid:gid` names; EINVAL for anything but two ids."""
    form = AS_FORM.fullmatch(value)
    if form is None:
        raise FSError(errno.EINVAL, f"{AS_KEY}: {value!r} is not uid:gid")
    uid, gid = int(form[1]), int(form[2])
    check_ids(uid, gid, f"{AS_KEY}: {value!r}")
    try:
        groups = frozenset(os.getgrouplist(pwd.getpwuid(uid).pw_name, gid))
    except KeyError:
        groups = frozenset()
    return Cred(uid, gid, groups)


class Front:
    def __init__(self, kernel: Kernel):
        self.kernel = kernel
        # Processes whose completions were posted this loop turn: their bells ring in one
        # callback at the turn's end, not one callback a process (a step answers many).
        self.bells_due: list[Hello] = []
        self.kernel_bells = KernelBells()  # a process's rings share one bell

    @functools.cached_property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop serving the syscalls, asked once (get_running_loop makes a system call,
        as Scheduler.loop says)."""
        return asyncio.get_running_loop()

    def ring_later(self, hello: Hello) -> None:
        if not self.bells_due:
            self.loop.call_soon(self.ring_bells)
        self.bells_due.append(hello)

    def ring_bells(self) -> None:
        due, self.bells_due = self.bells_due, []
        for hello in due:
            hello.ring_bell()

    def caller(self, context) -> tuple[Process, Cred]:
        meta = dict(context.invocation_metadata() or ())
        token = meta.get(SESSION_KEY)
        proc = self.kernel.procs.by_token.get(token) if token else None
        if proc is None:
            raise FSError(errno.EPERM, "no session: open one through the hello socket "
                          "(or the process has exited or was killed)")
        if AS_KEY not in meta:
            return proc, proc.cred
        if not proc.cred.root:
            raise FSError(errno.EPERM, f"{AS_KEY}: only a root session may act for another user")
        return proc, as_cred(meta[AS_KEY])

    @staticmethod
    def admit(name: str, request, who: Callable[[], tuple[Process, Cred]]
              ) -> tuple[Process, Cred]:
        if isinstance(request, Malformed):
            raise FSError(errno.EINVAL, f"{name}: malformed request ({request.error})")
        return who()

    def account(self, proc: Process | None, name: str, start: float) -> None:
        """A syscall of proc's ended: its count and time in /proc/PID/syscalls."""
        if proc is not None:
            proc.calls[name] += 1
            proc.call_seconds[name] += time.perf_counter() - start
            proc.last_active = time.monotonic()

    async def call(self, name: str, fn, reply_type, request,
                   who: Callable[[], tuple[Process, Cred]]):
        """One unary syscall, whichever transport brought it; who() names the caller."""
        start, proc = time.perf_counter(), None
        try:
            proc, cred = self.admit(name, request, who)
            result = fn(self.kernel, proc, cred, request)
            return await result if inspect.isawaitable(result) else result
        except Exception as e:
            return error_reply(reply_type, e)
        finally:
            self.account(proc, name, start)

    def unary(self, name: str, fn, reply_type):
        async def handle(request, context):
            return await self.call(name, fn, reply_type, request, lambda: self.caller(context))

        return handle

    def pred_rpc(self):
        """The Pred rpc: as unary's, its reply's bound taken from its debtor's budget of
        replies the kernel holds (reply_budget.py) first, and given back when it ends."""
        async def handle(request, context):
            try:
                proc = self.caller(context)[0]
            except Exception:  # call() reports it
                proc = None
            if proc is not None and isinstance(request, pb.PredRequest):
                owes, key, budgets = reply_bound(request), debtor(proc), self.kernel.reply_budgets
                budget = budgets.setdefault(key, ReplyBudget())
                await budget.take(owes)

                def ended(_) -> None:
                    budget.give(owes)
                    if budget.idle() and budgets.get(key) is budget:
                        del budgets[key]

                context.add_done_callback(ended)
            return await self.call("Pred", sys_pred, pb.PredReply, request,
                                   lambda: self.caller(context))

        return handle

    def server_stream(self, name: str, fn, reply_type):
        async def handle(request, context):
            start, proc = time.perf_counter(), None
            try:
                proc, cred = self.admit(name, request, lambda: self.caller(context))
                async for chunk in fn(self.kernel, proc, cred, request):
                    if context.cancelled():  # the client went: a write would fail, and
                        return  # gRPC log a traceback for it (any user could fill the log)
                    yield chunk
            except Exception as e:
                if not context.cancelled():
                    yield error_reply(reply_type, e)
            finally:
                self.account(proc, name, start)

        return handle

    def client_stream(self, name: str, fn, reply_type):
        async def handle(request_iterator, context):
            start, proc = time.perf_counter(), None

            async def chunks():
                async for chunk in request_iterator:
                    if isinstance(chunk, Malformed):
                        raise FSError(errno.EINVAL, f"{name}: malformed chunk ({chunk.error})")
                    yield chunk

            try:
                proc, cred = self.caller(context)
                return await fn(self.kernel, proc, cred, chunks())
            except Exception as e:
                return error_reply(reply_type, e)
            finally:
                self.account(proc, name, start)

        return handle

    def handler(self) -> grpc.GenericRpcHandler:
        methods = {}
        for name, (fn, request_type, reply_type, streams) in TABLE.items():
            out = reply_type.SerializeToString
            if request_type is None:
                methods[name] = grpc.stream_unary_rpc_method_handler(
                    self.client_stream(name, fn, reply_type),
                    request_deserializer=parser(pb.ImportChunk), response_serializer=out)
            elif streams:
                methods[name] = grpc.unary_stream_rpc_method_handler(
                    self.server_stream(name, fn, reply_type),
                    request_deserializer=parser(request_type), response_serializer=out)
            else:
                methods[name] = grpc.unary_unary_rpc_method_handler(
                    self.pred_rpc() if name == "Pred" else self.unary(name, fn, reply_type),
                    request_deserializer=parser(request_type), response_serializer=out)
        return grpc.method_handlers_generic_handler(SERVICE, methods)


PEERCRED = struct.Struct("iII")  # struct ucred: pid_t pid, uid_t uid, gid_t gid
SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5, asm-generic (x86, arm)
pred_request = parser(pb.PredRequest)
# Descriptors kept for root's sessions and for what running sessions open (fsync writes a
# file, swap, the state directory): other users' hellos are refused before these.
FD_RESERVE = 256
# A lifeline's write buffer: past REPLIES_HIGH bytes of replies its process has not read,
# the kernel takes no more of its preds (Hello.pause_writing) until they are down to
# REPLIES_LOW. The mark only stops intake, so it need not hold a whole reply (one of up to
# 64 MiB is still written whole, and the preds taken before the pause are still answered):
# it bounds what a process that never reads makes the kernel keep to a few MiB more than
# the replies of what it had submitted, where asyncio's default (64 KiB) would stop intake
# at every reply with top logprobs, before a process reading as it should could take it.
REPLIES_HIGH = 4 << 20
REPLIES_LOW = 1 << 20
# Preds a process may have in flight on its lifeline and rings: at IN_FLIGHT_MAX the kernel
# takes no more of them until it has answered all but IN_FLIGHT_LOW (they wait in the ring
# or the socket; no error). Each costs the kernel a job, a future and its spec: without a
# bound, a process writing small preds faster than steps answer them (a ring takes
# thousands at a time) grew the run queue, and the kernel's memory, without end.
IN_FLIGHT_MAX = 4096
IN_FLIGHT_LOW = 3072
# And the most bytes their replies could take in all (syscall_table.reply_bound) is its
# user's (symphony/owed.py): a process that sends its preds in one burst had them all
# taken before the first reply backed up (100 preds of 4 MB replies each: 420 MB).


def fd_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# A connection that has not sent HTTP/2's preface and settings this long after it was made
# is closed (gRPC's default: 120 s). A client sends them at once (a Python or Node client
# connects and handshakes in milliseconds), so only a connection that never speaks goes.
HANDSHAKE_TIMEOUT_MS = 10_000


def grpc_cap() -> int:
    """The most connections the gRPC server holds at once: half the descriptors outside the
    reserve, so that they leave hellos and running sessions their share. Its connections
    need no hello, but they are counted per user all the same (symphony/connections.py),
    so that no one user fills the cap."""
    return max(1, (fd_limit() - FD_RESERVE) // 2)


def grpc_options() -> list[tuple[str, int]]:
    """The gRPC server's settings."""
    return [("grpc.max_allowed_incoming_connections", grpc_cap()),
            ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
            *CALL_OPTIONS]


def refused(kernel: Kernel, uid: int, fd: int) -> str | None:
    """Why a new session of uid, on descriptor fd, is refused; None when it is not. Root's
    never is."""
    if uid == 0:
        return None
    limit = kernel.opts.max_procs_per_user
    if kernel.procs.per_uid[uid] >= limit:
        return (f"{user_name(uid)} has {limit} processes, the limit per user "
                "(symphony kernel --max-procs-per-user)")
    # The OS hands out the lowest free descriptor, so a new one numbered fd means that at
    # least fd are open (gRPC's connections and the files being written included).
    if fd >= fd_limit() - FD_RESERVE:
        return (f"the kernel has {fd} of its {fd_limit()} file descriptors open; the last "
                f"{FD_RESERVE} are kept for root and running sessions")
    return None


def peer_pidfd(sock: socket.socket, pid: int) -> int | None:
    """A pidfd of the process that connected, which names it even once its pid is reused;
    None when it is gone. Before SO_PEERPIDFD (Linux 6.5), pidfd_open right away leaves
    its pid only the moment since connect() to be reused in."""
    try:
        return sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as e:
        if e.errno != errno.ENOPROTOOPT:
            return None
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None


class Hello(asyncio.Protocol):
    """One connection of the hello socket: a process's identity and its lifeline, which
    then carries its fast-path preds (syscalls/wire.py), and, once asked, its syscall
    rings (syscalls/ring.py). While its replies back up in the lifeline's write buffer
    (the process does not read them), no more of its preds are taken: the lifeline is not
    read and the ring not drained until the buffer is down again."""

    def __init__(self, kernel: Kernel, front: Front):
        self.kernel, self.front, self.proc = kernel, front, None
        self.frames = wire.Frames()
        # Preds in flight, by call id: their futures and what answers them.
        self.calls: dict[int, tuple[asyncio.Future, float]] = {}  # future, start
        self.taking_back: set[asyncio.Task] = set()
        self.ring: ring.KernelRing | None = None
        # Ring records not taken yet: after a FRAMED record whose frame has not come.
        self.backlog: list[tuple[int, int, bytes]] = []
        self.framed: dict[int, bytes] = {}  # a pred frame read, its FRAMED record not yet
        self.bell_due = False  # the process's bell rings once per loop turn of completions
        self.unread: list[tuple[int, int, bytes]] = []  # frames read, not taken yet
        self.backed_up = False  # the replies are past REPLIES_HIGH: take nothing more
        self.owes: dict[int, int] = {}  # the bound on each pred in flight's reply, by call
        self.full = False  # IN_FLIGHT_MAX preds in flight: take no more
        self.in_debt = False  # its debtor is over symphony/owed.py's bounds: take no more
        self.debtor: object = None  # its user, or the process if root's (reply_budget.debtor)
        self.known = KnownPreds()  # its decode loops' requests, known by their bytes
        self.vocab = kernel.engine.config.vocab_size

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.reads = ReadPause(transport)
        transport.set_write_buffer_limits(high=REPLIES_HIGH, low=REPLIES_LOW)
        sock = transport.get_extra_info("socket")
        pid, uid, gid = PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
        try:
            check_ids(uid, gid, "hello")
        except FSError as e:
            transport.write(refusal(errno.EINVAL, e.message))
            transport.close()
            return
        if self.kernel.connections is not None:  # before its gRPC connection comes
            self.kernel.connections.hello()
        why = refused(self.kernel, uid, sock.fileno())
        if why is not None:
            transport.write(refusal(errno.EAGAIN, why))
            transport.close()
            return
        self.proc = self.kernel.procs.spawn(pid, uid, gid, peer_pidfd(sock, pid))
        self.bell_key = (uid, pid)  # its rings' kernel bell is its process's (kernel_bell.py)
        self.debtor = debtor(self.proc)
        self.kernel.lifelines[self.proc.pid] = transport
        transport.write(f"{self.proc.token}\n".encode())

    def data_received(self, data: bytes) -> None:
        held = self.frames.held
        try:
            frames = self.frames.feed(data)
        except wire.FrameError as e:
            self.drop(f"lifeline dropped: {e}")
            return
        self.kernel.frame_hold.update(self.proc.uid, self.reads, held, self.frames.held)
        self.unread += frames
        self.take()

    def take(self) -> None:
        """Take the frames read, in order, until the replies back up: the rest wait for
        resume_writing."""
        if self.unread and self.ring is not None:
            # Any frame takes the ring's records first (docs/syscalls.md): a CANCEL frame
            # may name a pred still in the ring. A PRED frame's own FRAMED record stops this
            # drain until the frame is in `framed`, below.
            self.drain()
        taken = 0
        for kind, call, payload in self.unread:
            if self.held_back():
                break
            if kind == wire.CANCEL:
                self.cancel(call)
            elif kind == wire.RING_SETUP:
                self.setup_ring(call, payload)
            elif kind == wire.PRED and self.ring is not None:
                # Its FRAMED record was written before it was sent: take the ring up to it.
                self.framed[call] = payload
                if self.drain() and call in self.framed:
                    # Cut short before its FRAMED record, if it has one: taken again later.
                    del self.framed[call]
                    break
                if call in self.framed:  # no FRAMED record: it goes in arrival order
                    self.pred(kind, call, self.framed.pop(call))
            else:
                self.pred(kind, call, payload)
            taken += 1
        del self.unread[:taken]

    def held_back(self) -> bool:
        """Whether the kernel takes no more of the process's preds for now. Asked before
        each pred is taken, so that a user over symphony/owed.py's bounds gets no more
        taken on any of its lifelines, not one more on each."""
        if self.backed_up or self.full or self.in_debt:
            return True
        if self.debtor in self.kernel.owed.over:
            self.in_debt = True
            self.reads.pause(OWED)
            self.kernel.owed.hold(self.debtor, self.debt_paid)
            return True
        return False

    def debt_paid(self) -> None:
        """Its debtor is under the bounds again: take more."""
        self.in_debt = False
        self.reads.resume(OWED)
        asyncio.get_running_loop().call_soon(self.go_on)

    def pause_writing(self) -> None:
        """The replies the process has not read are past REPLIES_HIGH: take no more of its
        preds (those taken are still answered) until resume_writing."""
        self.backed_up = True
        self.reads.pause(REPLIES)
        self.kernel.owed.backs_up(self.debtor, True)

    def resume_writing(self) -> None:
        """The process read its replies down to REPLIES_LOW: read its lifeline again
        (unless FrameHold holds it) and take what it submitted meanwhile, in order."""
        self.backed_up = False
        self.reads.resume(REPLIES)
        asyncio.get_running_loop().call_soon(self.go_on)
        self.kernel.owed.backs_up(self.debtor, False)

    def go_on(self) -> None:
        if self.held_back() or self.transport.is_closing():
            return
        self.take()
        self.drain()

    def drop(self, why: str) -> None:
        """The process broke its lifeline or its ring: it is reaped, as if it had died."""
        log.warning("pid %d: %s", self.proc.pid, why)
        self.transport.close()

    def setup_ring(self, call: int, payload: bytes) -> None:
        """RING_SETUP: make the rings and send their memfd and bells (SCM_RIGHTS) in a RING
        frame; the error in a REPLY of call id 0 when they cannot be made."""
        why = ("the process has its rings already" if self.ring is not None else
               f"its call id is {call}, not 0" if call else
               f"it has {len(payload)} bytes of payload, not none" if payload else
               "the lifeline has replies waiting to be sent"
               if self.transport.get_write_buffer_size() else None)
        if why is not None:
            self.send_reply(0, error_reply(pb.PredReply, einval(f"ring setup: {why}"))
                            .SerializeToString())
            return
        bells, key = self.front.kernel_bells, self.bell_key
        try:
            made = ring.KernelRing(bells.bell(key).fd)
        except OSError as e:
            bells.unused(key)
            self.send_reply(0, error_reply(pb.PredReply, e).SerializeToString())
            return
        sock = self.transport.get_extra_info("socket")
        data = wire.frame(wire.RING, 0, ring.GEOMETRY.pack(made.mem.sq_bytes, made.mem.cq_bytes))
        try:
            with socket.socket(fileno=os.dup(sock.fileno())) as raw:
                sent = socket.send_fds(raw, [data], made.fds())
        except OSError as e:
            made.close()
            bells.unused(key)
            self.drop(f"ring setup failed: {e}")
            return
        made.sent()
        if sent != len(data):  # a fresh lifeline's buffer takes a frame whole
            made.close()
            bells.unused(key)
            self.drop(f"ring setup: {sent} of {len(data)} bytes sent")
            return
        self.ring = made
        bells.join(key, self)

    def drain(self) -> bool:
        """Take every record submitted to the ring, in order; stop at a FRAMED record whose
        frame has not come (it resumes when the frame comes), or when the replies back up
        (resume_writing drains again). True when the replies cut it short.

        The records copied out and not taken yet (`backlog`) are the ring's last take
        alone: no more are copied out while they wait, so a FRAMED record whose frame never
        comes leaves the rest in the ring, which the process finds full (copied out behind
        it, a process's records grew the kernel's memory without bound)."""
        if self.ring is None or self.transport.is_closing():
            return False
        resumed = bool(self.backlog)  # a FRAMED record's frame came, or room for replies
        while True:
            if self.held_back():  # the records stay in the ring: the process finds it full
                return True
            if not self.backlog:
                try:
                    self.backlog = self.ring.take()
                except ring.RingError as e:
                    self.drop(f"ring dropped: {e}")
                    return False
            taken = 0
            for kind, call, payload in self.backlog:
                if taken and self.held_back():  # before the first: asked above
                    break
                if kind == ring.FRAMED:
                    if call not in self.framed:
                        break
                    kind, payload = wire.PRED, self.framed.pop(call)
                taken += 1
                if kind == wire.CANCEL:
                    self.cancel(call)
                else:
                    self.pred(kind, call, payload)
            del self.backlog[:taken]
            if not resumed or self.backlog:
                return self.held_back()
            resumed = False  # the backlog is through: once more, for what waited in the ring

    def pred(self, kind: int, call: int, payload: bytes) -> None:
        """A pred from the lifeline or the ring, as Front.call would do it but with no task
        (a task, its steps and its coroutines cost the loop 3 to 4 us a pred): checked and
        queued at once, then answered when the scheduler settles it, at once when it failed
        or took a guess already computed (decoding ahead)."""
        if call in self.calls:  # a reply would be that pred's as much as this one's
            self.send_reply(call, error_reply(pb.PredReply, einval(
                f"pred: call id {call} has a pred in flight; a call id may be used again "
                "once its reply has come")).SerializeToString())
            return
        start, proc = time.perf_counter(), None
        answer = functools.partial(self.answer, call, start)
        known = self.known.match(payload, self.vocab) if kind == wire.PRED else None
        try:
            if known is not None:
                proc, _ = self.caller()
                future = submit_known(self.kernel, proc, *known, reply=answer)
                owes = known[0].bound
            else:
                request = (pred_request(payload) if kind == wire.PRED
                           else Malformed(ValueError(f"frame kind {kind} is not a pred")))
                proc, cred = self.front.admit("Pred", request, self.caller)
                future = submit_pred(self.kernel, proc, cred, request, reply=answer)
                owes = reply_bound(request)
                key = self.known.key(payload, request)
                if key is not None:
                    self.known.learn(key, known_pred(self.kernel, request))
        except Exception as e:
            self.send_reply(call, error_reply(pb.PredReply, e).SerializeToString())
            self.front.account(proc, "Pred", start)
            return
        if future.done():  # answered already (a computed guess, or failed at once)
            return
        self.calls[call] = future, start
        self.owes[call] = owes
        self.kernel.owed.add(self.debtor, owes)
        if len(self.calls) >= IN_FLIGHT_MAX and not self.full:
            self.full = True
            self.reads.pause(IN_FLIGHT)

    def answer(self, call: int, start: float, outputs: list[Output] | None,
               error: BaseException | None) -> None:
        """The pred of `call` is done: its reply goes. The scheduler calls it the moment it
        settles the pred (Scheduler.submit's `reply`), not through a callback of the loop's;
        never for a pred taken back (cancel() answers that)."""
        self.reply(call, reply_payload(outputs) if error is None
                   else error_reply(pb.PredReply, error).SerializeToString())
        self.front.account(self.proc, "Pred", start)

    def answered(self, call: int) -> None:
        """call is answered, or taken back: its debt is paid, and under IN_FLIGHT_LOW in
        flight, take more."""
        self.calls.pop(call, None)
        owes = self.owes.pop(call, None)
        if owes is not None:
            self.kernel.owed.pay(self.debtor, owes)
        if self.full and len(self.calls) <= IN_FLIGHT_LOW:
            self.full = False
            self.reads.resume(IN_FLIGHT)
            asyncio.get_running_loop().call_soon(self.go_on)

    def cancel(self, call: int) -> None:
        """A CANCEL frame: take back the pred of that call id, which stays in flight (its
        call id taken) until its one reply, ECANCELED, is sent. None in flight (answered
        already: the frames crossed; or no such call), or one taken back already, is
        nothing to do."""
        future, start = self.calls.get(call, (None, 0.0))
        if future is None or not future.cancel():
            return
        self.front.account(self.proc, "Pred", start)  # take_back replies
        task = asyncio.get_running_loop().create_task(self.take_back(call, future))
        self.taking_back.add(task)
        task.add_done_callback(self.taking_back.discard)

    async def take_back(self, call: int, future: asyncio.Future) -> None:
        """Its one reply, ECANCELED, once its file is as before."""
        await self.kernel.sched.cancel(future)
        self.reply(call, error_reply(pb.PredReply, taken_back()).SerializeToString())

    def reply(self, call: int, payload: bytes) -> None:
        """The pred of `call` is answered: its serialized reply goes (send_reply)."""
        self.answered(call)  # the client may use the call id again
        self.send_reply(call, payload)

    def send_reply(self, call: int, payload: bytes) -> None:
        """On the ring when it has room, else as a frame on the lifeline. None once the
        process is reaped: its lifeline closes, and that is the answer to what it had in
        flight (the cancelled preds' EINTR is gRPC's)."""
        if self.transport.is_closing() or (self.proc is not None and not self.proc.alive):
            return
        if self.ring is not None:
            try:
                posted = self.ring.post(wire.REPLY, call, payload)
            except ring.RingError as e:
                self.drop(f"ring dropped: {e}")
                return
            if posted:
                if not self.bell_due:
                    self.bell_due = True
                    self.front.ring_later(self)
                return
        self.transport.write(wire.frame(wire.REPLY, call, payload))

    def ring_bell(self) -> None:
        self.bell_due = False
        if not self.transport.is_closing():
            self.ring.ring_process()

    def caller(self) -> tuple[Process, Cred]:
        if not self.proc.alive:
            raise FSError(errno.EPERM, "no session: the process has exited or was killed")
        return self.proc, self.proc.cred

    def connection_lost(self, exc: Exception | None) -> None:
        if self.proc is not None:
            self.kernel.frame_hold.forget(self.proc.uid, self.reads, self.frames.held)
            # Its preds in flight are cancelled as it is reaped, its replies dropped.
            self.kernel.owed.forget(self.debtor, self.debt_paid)
            self.kernel.owed.pay(self.debtor, sum(self.owes.values()))
            self.owes.clear()
            if self.backed_up:
                self.kernel.owed.backs_up(self.debtor, False)
        if self.ring is not None:
            self.front.kernel_bells.leave(self.bell_key, self)
            self.ring.close()
        if self.proc is not None:
            self.kernel.lifelines.pop(self.proc.pid, None)
            self.kernel.spawn_reap(self.proc)
