"""The synchronous LIP-side library: one method per syscall of syscalls/symphony.proto (the
plain ones from syscalls/usys.py, which `make stubs` makes).

    with Kernel.connect() as k:
        with k.open() as f:  # an anonymous KV file
            out = f.pred(k.tokenize("def f", add_special=True))
            print(k.detokenize([out[0].token]))

Kernel statuses raise OSError subclasses (FileNotFoundError for ENOENT, and so on); a kernel
that is gone raises BrokenPipeError (EPIPE) naming the socket. Once the session is closed,
every call raises EBADF; once the process has exited, EPERM.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import functools
import os
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Self, TypeVar

import grpc

from syscalls import convert, errors, pred_rpc, rollbacks, session
from syscalls import symphony_pb2_grpc as pb_grpc
from syscalls.convert import Fd, Identity, KvPath, LogitControl, PredOutput, Sampling, Target
from syscalls.lifeline import Lifeline
from syscalls.own_pid import own_pid
from syscalls.ring import ProcessRing
from syscalls.ring_line import RingLine
from syscalls.usys import FileCalls, KernelCalls
from syscalls.wire import MAX_PAYLOAD

T = TypeVar("T")

# How long a pred the kernel failed waits for the lifeline to say whether it is stopping.
STOPPING_WAIT = 2.0


def reaped(code: int, message: str) -> bool:
    """Whether an error says the kernel no longer has this process (exited, killed, or
    reaped by a stopping kernel)."""
    return code == errno.EPERM and message.startswith("no session")


# One limit for every message, either way, whichever transport (gRPC's own default is 4 MiB
# received): a longer request fails here with EMSGSIZE before it is sent.
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_PAYLOAD),
                   ("grpc.max_send_message_length", MAX_PAYLOAD)]


class Session:
    """What a client holds: the lifeline connection (the kernel frees everything this
    process held when it closes), the stub, the token sent with every call, and the
    identity the kernel gave at attach."""

    LINE: type = Lifeline  # pred's fast path on the lifeline (syscalls/wire.py)
    RING_LINE: type = RingLine  # and through syscall rings, when the session has them

    def __init__(self, sock: os.PathLike, lifeline: socket.socket, token: str, channel,
                 rings: ProcessRing | None = None):
        self.socket = sock
        self._lifeline = lifeline
        self._rings = rings
        self._line = (self.LINE(lifeline, str(sock)) if rings is None
                      else self.RING_LINE(lifeline, str(sock), rings))
        self._opener = own_pid()  # a forked child holds the same connection
        self._channel = channel
        self._stub = pb_grpc.KernelStub(channel)
        self._metadata = [(session.SESSION_KEY, token)]
        self._ended: list[tuple[int, str]] = []  # why calls fail now; views share it
        self._rollbacks = rollbacks.Rollbacks()  # files of preds lately taken back unawaited
        self.pid = self.uid = self.gid = -1
        self.user = self.home = ""

    def _send(self, call: convert.Call, *, ending: bool = False) -> Any:
        """The stub's answer: the reply itself, or on grpc.aio something to await. Once the
        session has ended only the call that ends it (`ending`: exit's) goes."""
        if self._ended and not ending:
            raise errors.error(*self._ended[0])
        return getattr(self._stub, call.rpc)(call.request, metadata=self._metadata)

    def _checked(self, reply: Any) -> Any:
        """errors.check(reply); but once the session has ended, or the kernel said it is
        stopping, an error is its reason: the call was still waiting when it ended (a pred
        the exit cancelled, EINTR). A "no session" EPERM waits for that notice a while: a
        stopping kernel sends it before it reaps the process, but it may be read after."""
        error = reply.error
        if error.errno and (self._ended or self._stopping(
                STOPPING_WAIT if reaped(error.errno, error.message) else 0.0)):
            raise errors.error(*self._ended[0])
        return errors.check(reply)

    def _leaving(self) -> None:
        """exit is called: from now on every call raises EPERM, those still waiting
        included; the exit call itself goes (_send's `ending`)."""
        if self._ended:
            raise errors.error(*self._ended[0])
        self._ended.append((errno.EPERM, f"{self.socket}: no session: process {self.pid} has "
                            "exited"))

    def _failed(self, e: grpc.RpcError) -> OSError:
        """What a call whose transport failed raises: why the session ended, if it ended
        meanwhile (closing the channel cancels the calls in flight), else what the status
        means."""
        if self._ended or self._stopping():
            return errors.error(*self._ended[0])
        return convert.transport_error(e, self.socket)

    def _stopping(self, wait: float = 0.0) -> bool:
        """Whether the kernel said it is stopping (the lifeline read `wait` seconds at
        most); if so the session ends, its calls failing with that, not with how the
        kernel ended them (EINTR, "no session", a closed lifeline)."""
        if self._ended or self._line is None or not self._line.stopped(wait):
            return False
        self._end(errno.EPIPE, "kernel unreachable: the kernel is stopping")
        return True

    def _end(self, code: int, why: str) -> None:
        """From now on calls raise OSError(code, why); the first reason given stays."""
        if not self._ended:
            self._ended.append((code, f"{self.socket}: {why}"))
        if self._line is not None:
            self._line.end(*self._ended[0])

    def _exited(self) -> None:
        """The exit went (or failed): the lifeline's waiting calls end with the reason."""
        self._end(errno.EPERM, f"no session: process {self.pid} has exited")

    def _identify(self, ident: Identity) -> None:
        self.pid, self.uid, self.gid = ident.pid, ident.uid, ident.gid
        self.user, self.home = ident.user, ident.home

    def acting_as(self, uid: int, gid: int) -> Self:
        """The same session, its calls checked as uid:gid would be. Only a root session may
        (the mount does, for the process behind each request); others get EPERM. The view
        shares the connection: close the session, not the view."""
        view = copy.copy(self)
        view._metadata = [(session.SESSION_KEY, self._metadata[0][1]),
                          (session.AS_KEY, f"{uid}:{gid}")]
        view._line = None  # the lifeline speaks for the session's own uid only
        return view

    def _close_rings(self) -> None:
        """Unmap the rings and close their bells (the session has ended)."""
        if self._rings is not None and own_pid() == self._opener:
            self._rings.close()
            self._rings = None

    def transport(self) -> str:
        """How this session's preds travel: "ring", "lifeline" (frames) or "grpc"."""
        if self._line is None:
            return "grpc"
        return "ring" if self._rings is not None else "lifeline"

    def lifeline(self) -> socket.socket:
        """The hello connection: the kernel sends a SHUTDOWN frame (syscalls/wire.py) on it
        when it stops cleanly, and it reads end-of-file when the kernel dies."""
        return self._lifeline


class Kernel(KernelCalls, Session):
    """A session with the kernel; one method per syscall, the plain ones KernelCalls's."""

    _rpcs: pred_rpc.Rpcs | None = None  # the thread making the main thread's Pred rpcs

    @classmethod
    def connect(
        cls,
        socket: KvPath | None = None,
        name: str | None = None,
        argv: Sequence[str] | None = None,
        lifeline_pred: bool = True,
        rings: bool = True,
        hello_timeout: float = session.HELLO_TIMEOUT,
    ) -> Kernel:
        """Open a session (socket: the argument, else $SYMPHONY_SOCKET, else the default)
        and attach as `name` (default: this program's file name) with `argv`. Preds go
        through syscall rings in shared memory; rings=False sends them as frames on the
        lifeline, lifeline_pred=False over gRPC like every other call. TimeoutError
        (ETIMEDOUT) when the kernel answers no hello within `hello_timeout` seconds."""
        sock = session.socket_path(socket)
        try:
            lifeline, token, shared = session.open_session(sock, lifeline_pred and rings,
                                                           hello_timeout)
        except OSError as e:
            raise convert.connect_error(e, sock) from e
        # gRPC's threads start with the channel: made apart, they leave the signals a LIP
        # handles to its main thread (syscalls/pred_rpc.py).
        channel = pred_rpc.apart(grpc.insecure_channel, session.grpc_target(sock),
                                 options=CHANNEL_OPTIONS)
        k = cls(sock, lifeline, token, channel, shared)
        if not lifeline_pred:
            k._line = None
        try:
            k.attach(name, argv)
        except BaseException:
            k.close()
            raise
        return k

    def close(self, fd: Fd | None = None) -> None:
        """close(fd) is the close syscall; close() ends the session, and the kernel frees
        everything this process held."""
        if fd is not None:
            self._do(convert.close(fd))
            return
        self._end(errno.EBADF, "the session is closed")
        self._channel.close()
        if self._rpcs is not None and self._rpcs.pid == own_pid():
            self._rpcs.close()
            self._rpcs = None
        if own_pid() == self._opener:  # a child's close must not end its parent's session
            with contextlib.suppress(OSError):  # wakes a thread reading it; the kernel reaps
                self._lifeline.shutdown(socket.SHUT_RDWR)
        self._lifeline.close()
        self._close_rings()

    def __enter__(self) -> Kernel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _do(self, call: convert.Call[T]) -> T:
        while True:
            try:
                reply = self._send(call)
            except grpc.RpcError as e:
                raise self._failed(e) from e
            if not self._rollbacks.again(call, reply):
                return call.result(self._checked(reply))
            time.sleep(rollbacks.RETRY_PAUSE)

    def _file(self, fd: int) -> File:
        return File(self, fd)

    def attach(self, name: str | None = None, argv: Sequence[str] | None = None) -> None:
        """Join the process table (connect does it); the kernel says who we are."""
        self._identify(self._do(convert.attach(name, argv)))

    def exit(self, code: int = 0) -> None:
        """Leave with a status, freeing everything, and end the session: calls still
        waiting, and every later one, raise EPERM."""
        call = convert.exit(code)
        self._leaving()
        try:
            try:
                reply = self._send(call, ending=True)
            except grpc.RpcError as e:
                raise convert.transport_error(e, self.socket) from e
            call.result(errors.check(reply))
        finally:
            self._exited()
            self.close()

    def pred(
        self,
        fd: Fd,
        tokens: Iterable[int],
        positions: Iterable[int] | None = None,
        outputs: Iterable[int] | None = None,
        sampler: Sampling | None = None,
        *,
        no_outputs: bool = False,
        control: LogitControl | Sequence[LogitControl] | None = None,
        score_next: bool = False,
        parents: Sequence[int] | None = None,
        truncate: int | None = None,
        **sampling: Any,
    ) -> list[PredOutput]:
        """Append `tokens` to the KV file and sample at the `outputs` rows (default: the
        last). Sampling comes from `sampler` or from keywords naming Sampling's fields
        (temperature, top_k, top_p, min_p, seed, top_logprobs); the default is greedy.
        `control`: a LogitControl for every output row, or one per row (masks, biases,
        scores); `score_next`: each row also scores the next token; `parents`: tree
        attention, a parent row per token (-1: a root); `truncate`: cut the file to this
        length first, atomically with the append (docs/syscalls.md, pred)."""
        s = convert.sampler(sampler, sampling)
        extras = convert.pred_extras(control, score_next, parents, truncate)
        if self._line is not None:
            request = convert.pred_request(fd, tokens, positions, outputs, s, no_outputs,
                                           extras)
            try:
                return convert.pred_outputs(self._line.call(request))
            except BaseException as e:
                raise self._line_failure(e, [fd]) from None
        call = convert.pred(fd, tokens, positions, outputs, s, no_outputs, extras)
        (outcome,) = self._pred_rpcs([call])
        return call.result(self._checked(self._reply(outcome)))

    def _line_failure(self, e: BaseException, fds: Iterable[Fd]) -> BaseException:
        """What a pred on the lifeline or the rings that failed with `e` raises. An error
        once the session has ended is its reason (the lifeline may close, or the pred be
        cancelled with EINTR, before exit's reply comes). An interruption has taken back
        the preds, unless interrupted again meanwhile: their rollback may then still be
        under way, so a call on their files that finds them busy is made again
        (rollbacks.py)."""
        if isinstance(e, OSError):
            # A stopping kernel cancels the preds (EINTR), reaps the process (EPERM "no
            # session") and closes the lifeline (EPIPE).
            if e.errno in (errno.EINTR, errno.EPIPE) or reaped(e.errno, e.strerror or ""):
                self._stopping(STOPPING_WAIT)
            return errors.error(*self._ended[0]) if self._ended else e
        self._rollbacks.cancelled(map(convert.fd_number, fds))
        return e

    def _pred_rpcs(self, made: list[convert.Call]) -> list[Any]:
        """The Pred rpcs of `made`, all in flight at once: each one's reply, or the RpcError
        it failed with. An interrupted wait cancels them before the interruption goes on
        (syscalls/pred_rpc.py)."""
        if self._ended:
            raise errors.error(*self._ended[0])
        start = functools.partial(self._stub.Pred.future, metadata=self._metadata)
        requests = [m.request for m in made]
        try:
            if threading.current_thread() is not threading.main_thread():
                return pred_rpc.here(start, requests)
            if self._rpcs is None or self._rpcs.pid != own_pid():  # a child has its own
                self._rpcs = pred_rpc.Rpcs()
            return self._rpcs.call(start, requests)
        except BaseException:
            self._rollbacks.cancelled(r.fd for r in requests)
            raise

    def _reply(self, outcome: Any) -> Any:
        if isinstance(outcome, grpc.RpcError):
            raise self._failed(outcome) from outcome
        if isinstance(outcome, grpc.FutureCancelledError):  # the session closed meanwhile
            raise errors.error(*(self._ended or [(errno.ECANCELED, "pred: cancelled")])[0])
        return outcome

    def pred_many(self, calls: Iterable[Mapping[str, Any]], *,
                  return_exceptions: bool = False) -> list[list[PredOutput] | OSError]:
        """Several preds sent together, each a mapping of pred's arguments by name (`fd` and
        `tokens`, and any of pred's others), answered in their order: through the rings in
        one submission and one bell; preds on one file are appended in the order given. An
        error of one is raised once every pred has its answer (the others' entries stand),
        or with return_exceptions=True takes its place in the list."""
        arguments = [_pred_arguments(c) for c in calls]
        if self._ended:
            raise errors.error(*self._ended[0])
        if self._line is None:  # gRPC: every call in flight at once
            made = [convert.pred(*a) for a in arguments]
            outcomes = self._pred_rpcs(made)
            results = [_settled(lambda m=m, o=o: m.result(self._checked(self._reply(o))))
                       for m, o in zip(made, outcomes, strict=True)]
        else:
            try:
                replies = self._line.call_many([convert.pred_request(*a) for a in arguments])
            except BaseException as e:
                raise self._line_failure(e, [a[0] for a in arguments]) from None
            results = [_settled(lambda r=r: convert.pred_outputs(r)) for r in replies]
            results = [self._line_failure(r, ()) if isinstance(r, OSError) else r
                       for r in results]
        if not return_exceptions:
            for r in results:
                if isinstance(r, OSError):
                    raise r
        return results

    def export_iter(self, target: Target, offset: int = 0, length: int = 0) -> Iterator[bytes]:
        """The canonical serialized form (docs/kv-format.md) of bytes [offset, offset +
        length) (length 0: to the end), as the kernel streams it."""
        call = convert.export(target, offset, length)
        try:
            for chunk in self._send(call):
                yield call.result(errors.check(chunk))
        except grpc.RpcError as e:
            raise self._failed(e) from e

    def export(self, target: Target, offset: int = 0, length: int = 0) -> bytes:
        return b"".join(self.export_iter(target, offset, length))

    def import_file(self, path: KvPath, data: bytes | Iterable[bytes], mode: int = 0o600) -> None:
        """Make the file at `path` from its serialized form: bytes, or an iterable of
        chunks of it. The kernel checks it whole; nothing appears when it is refused."""
        self._do(convert.import_file(convert.import_chunks(path, mode, data)))


def _pred_arguments(call: dict[str, Any]) -> tuple:
    """convert.pred's arguments from pred's, by name (pred_many's calls)."""
    call = dict(call)
    try:
        fd, tokens = call.pop("fd"), call.pop("tokens")
    except KeyError as e:
        raise TypeError(f"pred_many: a call without {e.args[0]!r}") from None
    positions, outputs = call.pop("positions", None), call.pop("outputs", None)
    s = convert.sampler(call.pop("sampler", None), {
        k: call.pop(k) for k in list(call) if k in convert.Sampling.__dataclass_fields__})
    no_outputs = call.pop("no_outputs", False)
    extras = convert.pred_extras(call.pop("control", None), call.pop("score_next", False),
                                 call.pop("parents", None), call.pop("truncate", None))
    if call:
        raise TypeError(f"pred_many: unknown arguments {sorted(call)}")
    return fd, tokens, positions, outputs, s, no_outputs, extras


def _settled(result: Any) -> Any:
    """result() as pred_many lists it: its value, or the OSError it raised."""
    try:
        return result()
    except OSError as e:
        return e


class OpenFile:
    """What File and AsyncFile share: the kernel and the fd."""

    def __init__(self, kernel: Any, fd: int):
        self.kernel, self.fd = kernel, fd
        self.closed = False

    def __int__(self) -> int:
        return self.fd

    def __index__(self) -> int:  # what an fd argument takes (convert.fd_number)
        return self.fd

    def fileno(self) -> int:
        return self.fd

    def __repr__(self) -> str:
        return f"<{type(self).__name__} fd={self.fd}{' closed' if self.closed else ''}>"


class File(FileCalls, OpenFile):
    """An open KV file; closing it is the close syscall."""

    kernel: Kernel

    def close(self) -> None:
        if not self.closed:
            self.kernel.close(self.fd)  # EBUSY while a pred runs: still open then
            self.closed = True

    def __enter__(self) -> File:
        return self

    def __exit__(self, failed: type | None, *exc: object) -> None:
        if failed is None:
            self.close()
            return
        # The block's own error stands: a close that fails too (the kernel died with the
        # pred that raised) must not take its place.
        with contextlib.suppress(OSError):
            self.close()

    def pred(
        self,
        tokens: Iterable[int],
        positions: Iterable[int] | None = None,
        outputs: Iterable[int] | None = None,
        sampler: Sampling | None = None,
        **options: Any,
    ) -> list[PredOutput]:
        """Kernel.pred on this file; `options` are its keyword arguments."""
        return self.kernel.pred(self, tokens, positions, outputs, sampler, **options)
