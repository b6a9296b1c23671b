"""What the sync and asyncio clients share: each syscall as a request built from Python
arguments plus the conversion of its reply, the values replies turn into, and the mapping
of transport failures to OSError.

A client runs a `Call` by sending `call.request` to the stub method named `call.rpc`,
checking the reply's error (syscalls.errors.check) and returning `call.result(reply)`.
A plain syscall's builder is also its client methods' signature, defaults and docstring
(syscalls/stubs.py makes the methods from it): its docstring speaks to the caller.
"""

from __future__ import annotations

import errno
import functools
import operator
import os
import socket
import stat as _stat
import struct
import sys
from collections.abc import AsyncIterable, Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Generic, SupportsIndex, TypeVar

import grpc

from syscalls import errors
from syscalls import symphony_pb2 as pb

T = TypeVar("T")

# An fd: a plain int or anything that is one (File, AsyncFile: __index__).
Fd = SupportsIndex
# A path in the kernel's namespace (absolute: there is no working directory).
KvPath = str | os.PathLike
# What stat and export take: a path, or an open file.
Target = KvPath | SupportsIndex

def fd_number(fd: Fd) -> int:
    """An fd argument's number. An int, or an object that is one (a File); a float or a
    string is refused, as a length is (int() would make fd 3 of 3.7)."""
    try:
        return operator.index(fd)
    except TypeError:
        raise TypeError(f"an fd is an int or a File, not {type(fd).__name__} {fd!r}") from None


CHUNK_BYTES = 1 << 20  # per ImportChunk: well under gRPC's 4 MiB message limit
READ_ALL = (1 << 63) - 1  # read's count when none is given: the kernel clips it to the end


@dataclass(frozen=True)
class Call(Generic[T]):
    rpc: str  # the KernelStub method
    request: Any
    result: Callable[[Any], T]  # applied to the checked reply


# -- values -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """How pred picks a token; the defaults are greedy. The names are the sampling flags'."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    top_logprobs: int = 0  # also return the n most likely (id, logprob) per output

    def __post_init__(self) -> None:
        """EINVAL for an integer the proto's field cannot hold (protobuf would raise a bare
        ValueError); the kernel checks the rest (docs/syscalls.md)."""
        for name, bits in (("top_k", 32), ("top_logprobs", 32), ("seed", 64)):
            value, bound = getattr(self, name), 1 << (bits - 1)
            if value is not None and not -bound <= value < bound:
                raise errors.error(errno.EINVAL, f"pred: sampler: {name} must be a signed "
                                   f"{bits}-bit integer, got {value}")

    def proto(self) -> pb.Sampler:
        # Field by field: dataclasses.asdict would be a third of a pred's client time.
        return pb.Sampler(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                          min_p=self.min_p, seed=self.seed,  # None leaves seed unset
                          top_logprobs=self.top_logprobs)

    @functools.cached_property
    def encoded(self) -> bytes:
        """PredRequest's sampler field (6, length-delimited) as it is serialized; kept, as
        a LIP's preds mostly share one sampler. A Sampler is under 128 bytes, so its length
        is one byte."""
        body = self.proto().SerializeToString()
        return b"\x32" + bytes((len(body),)) + body


GREEDY = Sampling()  # pred's sampler when none is given


@dataclass(frozen=True)
class LogitControl:
    """What pred does with an output row's logits beyond sampling (docs/syscalls.md, pred):
    `allowed`, a packed bitmask (bit t % 32 of little-endian 32-bit word t // 32 allows
    token t, at least ceil(vocab_size / 32) words: the layout of xgrammar's and llguidance's token
    bitmasks, as bytes, a numpy int32 array or a CPU tensor); `bias`, added to the logits
    (OpenAI's logit_bias); `score`, ids whose logprobs (the model's own) the row returns."""

    allowed: Any = None
    bias: Mapping[int, float] | None = None
    score: Sequence[int] = ()

    @classmethod
    def allowing(cls, ids: Iterable[int], vocab_size: int, **rest: Any) -> LogitControl:
        """A control whose mask allows exactly `ids`."""
        words = [0] * (-(-vocab_size // 32))
        for t in ids:
            words[t // 32] |= 1 << (t % 32)
        return cls(allowed=struct.pack(f"<{len(words)}I", *words), **rest)

    def proto(self) -> pb.LogitControl:
        # Only the fields given: empty ones cost a masked pred's client a third of its time.
        fields: dict[str, Any] = {}
        if self.allowed is not None:
            fields["allowed"] = _mask_bytes(self.allowed)
        if self.bias:
            fields["bias_ids"], fields["bias_values"] = list(self.bias), list(self.bias.values())
        if self.score:
            fields["score_ids"] = self.score
        return pb.LogitControl(**fields)


def _mask_bytes(allowed: Any) -> bytes:
    """A mask as the wire carries it: bytes as given; an array's (or tensor's) int32 words
    in little-endian order."""
    if allowed is None:
        return b""
    if isinstance(allowed, bytes | bytearray | memoryview):
        return bytes(allowed)
    if hasattr(allowed, "numpy"):  # a torch tensor (on the CPU)
        allowed = allowed.numpy()
    if not hasattr(allowed, "astype"):
        raise TypeError(f"LogitControl.allowed: bytes, a numpy array or a tensor of 32-bit "
                        f"words, not {type(allowed).__name__}")
    return allowed.astype("<i4", copy=False).tobytes()


@dataclass(frozen=True)
class Identity:
    pid: int
    uid: int
    gid: int
    user: str
    home: str


@dataclass(frozen=True)
class PredOutput:
    row: int  # index into the tokens of the pred call
    token: int
    logprob: float  # of `token` under the model's distribution with the row's mask and bias
    top: list[tuple[int, float]]  # (id, logprob) of the same, most likely first
    model_logprob: float  # of `token` under the model's own distribution
    scores: list[float]  # the LogitControl's `score` ids, in order, the model's own
    next_logprob: float | None  # score_next: of tokens[row + 1], the model's own


@dataclass(frozen=True)
class Vocabulary:
    tokens: list[bytes]  # per id: the bytes the token stands for (empty: no token)
    special_ids: frozenset[int]  # control tokens (BOS, EOS, chat markers)


@dataclass(frozen=True)
class Stat:
    ino: int
    mode: int
    uid: int
    gid: int
    nlink: int
    tokens: int
    pages: int
    size: int  # bytes of the canonical form; 0 for a directory
    atime_ns: int
    mtime_ns: int
    ctime_ns: int

    @property
    def is_dir(self) -> bool:
        return _stat.S_ISDIR(self.mode)


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    os_pid: int
    uid: int
    user: str
    name: str
    argv: tuple[str, ...]
    state: str
    nice: int
    syscalls: int
    tokens: int
    pages: int
    cpu_seconds: float
    accel_seconds: float
    fds: int
    started: float


@dataclass(frozen=True)
class ModelInfo:
    name: str
    architecture: str
    vocab_size: int
    bos_id: int  # -1 when the model has none
    eos_ids: tuple[int, ...]
    special_tokens: dict[str, int]
    chat_template: str
    page_size: int
    context_length: int
    fingerprint: str
    dtype: str
    has_tokenizer: bool


def proc_fields(text: str) -> dict[str, str]:
    """A /proc text of `key: value` lines (meminfo, sched, PID/status) as a dict."""
    pairs = (line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {key.strip(): value.strip() for key, value in pairs}


def _record(cls: type[T], msg: Any) -> T:
    """The dataclass `cls` from the message fields of the same names."""
    values = {}
    for f in fields(cls):
        v = getattr(msg, f.name)
        if isinstance(v, Mapping):
            v = dict(v)
        elif isinstance(v, Sequence) and not isinstance(v, str | bytes):
            v = tuple(v)
        values[f.name] = v
    return cls(**values)


def _pred_output(o: pb.PredOutput) -> PredOutput:
    return PredOutput(o.row, o.token, o.logprob, [(t.id, t.logprob) for t in o.top],
                      o.model_logprob if o.HasField("model_logprob") else o.logprob,
                      list(o.scores),
                      o.next_logprob if o.HasField("next_logprob") else None)


_FLOAT = struct.Struct("<f").unpack_from


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """The varint at `at` and where it ends; ValueError past an int32's range, which only
    protobuf reads right (a negative int32 is ten bytes)."""
    value = shift = 0
    while shift < 35:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            if value >= 1 << 31:
                break
            return value, at
        shift += 7
    raise ValueError("not a plain varint")


def _plain_outputs(data: bytes) -> list[PredOutput]:
    """The outputs of a serialized PredReply made only of rows with row, token, logprob
    and model_logprob (a masked row's); ValueError for anything else (an error, top
    logprobs, scores, other fields)."""
    outputs, at = [], 0
    try:
        while at < len(data):
            if data[at] != 0x12:  # outputs (2, length-delimited)
                raise ValueError("not a plain output")
            size, at = _varint(data, at + 1)
            end, row, token, logprob, model = at + size, 0, 0, 0.0, None
            while at < end:
                tag = data[at]
                if tag == 0x08:  # row (1, varint)
                    row, at = _varint(data, at + 1)
                elif tag == 0x10:  # token (2, varint)
                    token, at = _varint(data, at + 1)
                elif tag == 0x1D:  # logprob (3, fixed32)
                    (logprob,), at = _FLOAT(data, at + 1), at + 5
                elif tag == 0x2D:  # model_logprob (5, fixed32)
                    (model,), at = _FLOAT(data, at + 1), at + 5
                else:
                    raise ValueError("not a plain output")
            if at != end:
                raise ValueError("an output overruns its length")
            outputs.append(PredOutput(row, token, logprob, [],
                                      logprob if model is None else model, [], None))
    except (IndexError, struct.error) as e:
        raise ValueError("a truncated reply") from e
    return outputs


_F32 = struct.Struct("<f").pack
_ZERO_F32 = bytes(4)


def _varint_bytes(value: int) -> bytes:
    """A non-negative int32 as protobuf writes it."""
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def plain_reply(outputs: Iterable[tuple[int, int, float]]) -> bytes:
    """The serialized PredReply of outputs made only of (row, token, logprob), byte for
    byte as protobuf writes it (fields at zero left out; row and token in [0, 2^31)): what
    _plain_outputs reads. The kernel writes most preds' replies so, building no message."""
    parts = []
    for row, token, logprob in outputs:
        bits = _F32(logprob)
        body = ((b"\x08" + _varint_bytes(row) if row else b"")
                + (b"\x10" + _varint_bytes(token) if token else b"")
                + (b"" if bits == _ZERO_F32 else b"\x1d" + bits))
        parts.append(b"\x12" + bytes((len(body),)) + body)  # at most 17 bytes
    return b"".join(parts)


def _none(reply: Any) -> None:
    return None


def _fd(reply: Any) -> int:
    return reply.fd


def _text(reply: Any) -> str:
    return reply.text


def _stat_of(reply: Any) -> Stat:
    return _record(Stat, reply)


# -- the syscalls, in the proto's order ---------------------------------------------------


def _wire_checked(build: Callable[..., T]) -> Callable[..., T]:
    """A request builder, with an argument its proto field cannot hold (an int past int64,
    say) answered EINVAL naming the call, as the kernel answers a bad argument (protobuf
    itself raises a bare ValueError)."""

    @functools.wraps(build)
    def checked(*args: Any, **kwargs: Any) -> T:
        try:
            return build(*args, **kwargs)
        except UnicodeError as e:  # a path or text with bytes that are not UTF-8
            given = e.object if isinstance(e.object, str) else os.fsdecode(e.object)
            raise OSError(errno.EINVAL, f"{build.__name__}: '{shown(given)}' is not UTF-8 "
                          "text (\\xNN: a byte that is not)") from None
        except ValueError as e:
            raise OSError(errno.EINVAL, f"{build.__name__}: an argument does not fit its "
                          f"field ({e})") from None

    return checked


def shown(text: str) -> str:
    """`text` as a string field can hold it: its bytes (os.fsencode: sys.argv and file names
    hold a byte that is not UTF-8 as a surrogate escape) as UTF-8, each byte that is not
    written \\xNN, as Python's backslashreplace writes it (a lone surrogate that stands for
    no byte: \\udNNN)."""
    try:
        return os.fsencode(text).decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode()


@_wire_checked
def attach(name: str | None, argv: Sequence[str] | None) -> Call[Identity]:
    """By default a process shows in ps as its program's file name, with its sys.argv. A
    byte of an argument or the name that is not UTF-8 shows as \\xNN (`shown`)."""
    argv = [shown(a) for a in (sys.argv if argv is None else argv)]
    name = shown(name or (os.path.basename(argv[0]) if argv and argv[0] else "python"))
    return Call("Attach", pb.AttachRequest(name=name, argv=argv), lambda r: _record(Identity, r))


@_wire_checked
def exit(code: int) -> Call[None]:
    return Call("Exit", pb.ExitRequest(code=code), _none)


def getpid() -> Call[int]:
    return Call("GetPid", pb.Void(), lambda r: r.pid)


def ps() -> Call[list[ProcInfo]]:
    return Call("Ps", pb.Void(), lambda r: [_record(ProcInfo, p) for p in r.procs])


@_wire_checked
def kill(pid: int) -> Call[None]:
    return Call("Kill", pb.KillRequest(pid=pid), _none)


@_wire_checked
def nice(increment: int) -> Call[int]:
    """Add to this process's nice value (lowering it needs root); the new value."""
    return Call("Nice", pb.NiceRequest(increment=increment), lambda r: r.nice)


def model_info() -> Call[ModelInfo]:
    return Call("ModelInfo", pb.Void(), lambda r: _record(ModelInfo, r))


@_wire_checked
def tokenize(
    text: str = "",
    messages: Iterable[Mapping[str, str]] | None = None,
    add_generation_prompt: bool = False,
    add_special: bool = False,
) -> Call[list[int]]:
    """Token ids of `text`, or of `messages` (each a mapping with str "role" and "content";
    its other keys are not sent) rendered by the chat template. add_special: BOS as the
    tokenizer itself would add it."""
    request = pb.TokenizeRequest(
        text=text,
        messages=[_chat_message(i, m) for i, m in enumerate(messages or ())],
        add_generation_prompt=add_generation_prompt,
        add_special=add_special,
    )
    return Call("Tokenize", request, lambda r: list(r.ids))


def _chat_message(i: int, message: Any) -> pb.ChatMessage:
    """messages[i] as the request holds it; EINVAL naming it unless it is a mapping with
    str "role" and "content"."""
    if not (isinstance(message, Mapping)
            and all(isinstance(message.get(key), str) for key in ("role", "content"))):
        raise OSError(errno.EINVAL, f"tokenize: messages[{i}] is not a mapping with str "
                      f"'role' and 'content': {message!r}")
    return pb.ChatMessage(role=message["role"], content=message["content"])


@_wire_checked
def detokenize(ids: Iterable[int], keep_special: bool = False) -> Call[str]:
    return Call("Detokenize", pb.DetokenizeRequest(ids=ids, keep_special=keep_special), _text)


def sampler(given: Sampling | None, sampling: Mapping[str, Any]) -> Sampling:
    """pred's sampler: a Sampling, or keyword arguments naming its fields, not both."""
    if given is not None and sampling:
        raise TypeError("pred: give a Sampling or sampling keywords, not both")
    return given or (Sampling(**sampling) if sampling else GREEDY)


@dataclass(frozen=True)
class PredExtras:
    """pred's arguments past the sampler (PredRequest fields 7 on): logit control, teacher
    forcing, tree attention, truncating first."""

    control: LogitControl | Sequence[LogitControl] | None = None
    score_next: bool = False
    parents: Sequence[int] | None = None
    truncate: int | None = None

    def proto(self) -> pb.PredRequest:
        """A PredRequest holding only these fields."""
        request = pb.PredRequest(score_next=self.score_next, parents=self.parents,
                                 truncate=self.truncate)
        control = self.control
        if isinstance(control, LogitControl):
            request.controls.append(control.proto())
        elif control is not None:
            request.controls.extend(c.proto() for c in control)
        return request


NO_EXTRAS = PredExtras()


def pred_extras(control: LogitControl | Sequence[LogitControl] | None, score_next: bool,
                parents: Sequence[int] | None, truncate: int | None) -> PredExtras:
    """pred's extras; the shared NO_EXTRAS when there are none (the plain pred's path)."""
    if control is None and not score_next and parents is None and truncate is None:
        return NO_EXTRAS
    return PredExtras(control, score_next, parents, truncate)


@_wire_checked
def pred(
    fd: Fd,
    tokens: Iterable[int],
    positions: Iterable[int] | None,
    outputs: Iterable[int] | None,
    sampling: Sampling,
    no_outputs: bool,
    extras: PredExtras = NO_EXTRAS,
) -> Call[list[PredOutput]]:
    request = _pred_head(fd, tokens, positions, outputs, no_outputs)
    request.sampler.CopyFrom(sampling.proto())
    if extras is not NO_EXTRAS:
        request.MergeFrom(extras.proto())
    return Call("Pred", request, lambda r: [_pred_output(o) for o in r.outputs])


def _pred_head(fd: Fd, tokens: Iterable[int], positions: Iterable[int] | None,
               outputs: Iterable[int] | None, no_outputs: bool) -> pb.PredRequest:
    """A PredRequest without its sampler."""
    return pb.PredRequest(fd=fd_number(fd), tokens=tokens, positions=positions,
                          outputs=outputs, no_outputs=no_outputs)


@_wire_checked
def pred_request(
    fd: Fd,
    tokens: Iterable[int],
    positions: Iterable[int] | None,
    outputs: Iterable[int] | None,
    sampling: Sampling,
    no_outputs: bool,
    extras: PredExtras = NO_EXTRAS,
) -> bytes:
    """pred(...).request serialized, at a fraction of its cost (the lifeline's pred, one a
    token): protobuf writes fields in number order, so the request's fields before its
    sampler (field 6), the sampler's kept bytes, then the fields after it are the same
    message."""
    if positions is None and outputs is None and not no_outputs and extras is NO_EXTRAS:
        plain = _plain_head(fd_number(fd), tokens)
        if plain is not None:
            return plain + sampling.encoded
    head = _pred_head(fd, tokens, positions, outputs, no_outputs)
    tail = b"" if extras is NO_EXTRAS else extras.proto().SerializeToString()
    return head.SerializeToString() + sampling.encoded + tail


# Requests of up to this many tokens (a decode loop's: one) are written by _plain_head, at a
# fraction of protobuf's cost through its message; longer ones by protobuf.
PLAIN_TOKENS = 8


def _plain_head(fd: int, tokens: Iterable[int]) -> bytes | None:
    """A PredRequest's fd and tokens (fields 1 and 2), written as protobuf writes them, for
    a decode loop's request: a list of up to PLAIN_TOKENS ints in [0, 2**31), and an fd
    in it too. None for anything else, which protobuf writes (and checks)."""
    if type(tokens) is not list or not 0 < len(tokens) <= PLAIN_TOKENS or not 0 <= fd < 1 << 31:
        return None
    for token in tokens:
        if type(token) is not int or not 0 <= token < 1 << 31:
            return None
    packed = b"".join([_varint_bytes(token) for token in tokens])  # 40 bytes at most
    return ((b"\x08" + _varint_bytes(fd) if fd else b"")
            + b"\x12" + bytes((len(packed),)) + packed)


def pred_outputs(payload: bytes) -> list[PredOutput]:
    """What pred returns for a serialized PredReply, raising its error. Plain rows are
    read here, at a third of the cost of protobuf's message and its wrappers; anything
    else goes to protobuf."""
    try:
        return _plain_outputs(payload)
    except ValueError:
        reply = errors.check(pb.PredReply.FromString(payload))
        return [_pred_output(o) for o in reply.outputs]


def vocab() -> Call[Vocabulary]:
    """Every token's bytes and which ids are special: what a grammar engine or a prefix
    trie is built from. It never changes while the kernel runs: call it once."""
    return Call("Vocab", pb.Void(),
                lambda r: Vocabulary(list(r.tokens), frozenset(r.special_ids)))


@_wire_checked
def open(path: KvPath = "", flags: int = os.O_RDONLY, mode: int = 0o600) -> Call[int]:
    """Open a KV file; path "" makes an anonymous one (always read-write)."""
    return Call("Open", pb.OpenRequest(path=os.fspath(path), flags=flags, mode=mode), _fd)


@_wire_checked
def close(fd: Fd) -> Call[None]:
    return Call("Close", pb.FdRequest(fd=fd_number(fd)), _none)


@_wire_checked
def fork(fd: Fd) -> Call[int]:
    """A copy-on-write clone of the file, anonymous."""
    return Call("Fork", pb.FdRequest(fd=fd_number(fd)), _fd)


@_wire_checked
def link(fd: Fd, path: KvPath) -> Call[None]:
    return Call("Link", pb.LinkRequest(fd=fd_number(fd), path=os.fspath(path)), _none)


@_wire_checked
def read(
    fd: Fd, start: int = 0, count: int | None = None
) -> Call[tuple[list[int], list[int]]]:
    """(token ids, positions) of entries [start, start + count), clipped to the end."""
    request = pb.ReadRequest(fd=fd_number(fd), start=start,
                             count=READ_ALL if count is None else count)
    return Call("Read", request, lambda r: (list(r.tokens), list(r.positions)))


@_wire_checked
def splice(src: Fd, start: int, end: int, dst: Fd) -> Call[None]:
    """Append entries [start, end) of src to dst, sharing pages, computing nothing."""
    request = pb.SpliceRequest(src_fd=fd_number(src), start=start, end=end,
                               dst_fd=fd_number(dst))
    return Call("Splice", request, _none)


@_wire_checked
def truncate(fd: Fd, length: int) -> Call[None]:
    return Call("Truncate", pb.TruncateRequest(fd=fd_number(fd), length=length), _none)


@_wire_checked
def punch(fd: Fd, start: int, end: int) -> Call[None]:
    """Drop entries [start, end) from attention, freeing their whole pages."""
    return Call("Punch", pb.PunchRequest(fd=fd_number(fd), start=start, end=end), _none)


@_wire_checked
def keep(fd: Fd, start: int, entries: Iterable[int]) -> Call[None]:
    """The file keeps entries [0, start) and then `entries` (increasing indices past
    start), their K/V moved, not recomputed: a tree pred's accepted branch."""
    return Call("Keep", pb.KeepRequest(fd=fd_number(fd), start=start, entries=entries), _none)


@_wire_checked
def shift(fd: Fd, start: int, end: int, delta: int) -> Call[None]:
    """Move entries [start, end) by `delta` positions, their keys rotated to match."""
    request = pb.ShiftRequest(fd=fd_number(fd), start=start, end=end, delta=delta)
    return Call("Shift", request, _none)


def _target(target: Target) -> dict[str, Any]:
    if isinstance(target, str | os.PathLike):
        return {"path": os.fspath(target)}
    return {"fd": fd_number(target)}


@_wire_checked
def stat(target: Target) -> Call[Stat]:
    """Stat a path, or an open file (int or File)."""
    return Call("Stat", pb.StatRequest(**_target(target)), _stat_of)


@_wire_checked
def readdir(path: KvPath) -> Call[list[tuple[str, Stat]]]:
    return Call(
        "Readdir",
        pb.PathRequest(path=os.fspath(path)),
        lambda r: [(e.name, _stat_of(e.stat)) for e in r.entries],
    )


@_wire_checked
def mkdir(path: KvPath, mode: int = 0o755) -> Call[None]:
    return Call("Mkdir", pb.ModeRequest(path=os.fspath(path), mode=mode), _none)


@_wire_checked
def rmdir(path: KvPath) -> Call[None]:
    return Call("Rmdir", pb.PathRequest(path=os.fspath(path)), _none)


@_wire_checked
def unlink(path: KvPath) -> Call[None]:
    return Call("Unlink", pb.PathRequest(path=os.fspath(path)), _none)


@_wire_checked
def rename(old: KvPath, new: KvPath) -> Call[None]:
    request = pb.RenameRequest(old=os.fspath(old), new=os.fspath(new))
    return Call("Rename", request, _none)


@_wire_checked
def access(path: KvPath, mode: int = os.F_OK) -> Call[None]:
    """Raise unless path exists and may be read/written/searched (os.R_OK|W_OK|X_OK)."""
    return Call("Access", pb.ModeRequest(path=os.fspath(path), mode=mode), _none)


@_wire_checked
def chmod(path: KvPath, mode: int) -> Call[None]:
    return Call("Chmod", pb.ModeRequest(path=os.fspath(path), mode=mode), _none)


@_wire_checked
def chown(path: KvPath, uid: int = -1, gid: int = -1) -> Call[None]:
    return Call("Chown", pb.ChownRequest(path=os.fspath(path), uid=uid, gid=gid), _none)


@_wire_checked
def fsync(fd: Fd) -> Call[None]:
    return Call("Fsync", pb.FdRequest(fd=fd_number(fd)), _none)


@_wire_checked
def export(target: Target, offset: int, length: int) -> Call[bytes]:
    """A server stream: `result` applies to each chunk, giving its bytes."""
    request = pb.ExportRequest(**_target(target), offset=offset, length=length)
    return Call("Export", request, lambda chunk: chunk.data)


class ImportChunks:
    """The Import stream of one file: the first chunk names it, none is over CHUNK_BYTES,
    and an empty file is still one (naming) chunk."""

    def __init__(self, path: KvPath, mode: int):
        self._first: pb.ImportChunk | None = pb.ImportChunk(path=os.fspath(path), mode=mode)

    def of(self, data: bytes) -> Iterator[pb.ImportChunk]:
        for i in range(0, len(data), CHUNK_BYTES):
            chunk = self._first or pb.ImportChunk()
            self._first = None
            chunk.data = bytes(data[i : i + CHUNK_BYTES])
            yield chunk

    def end(self) -> Iterator[pb.ImportChunk]:
        if self._first is not None:
            yield self._first
            self._first = None

    def stream(self, pieces: Iterable[bytes]) -> Iterator[pb.ImportChunk]:
        for piece in pieces:
            yield from self.of(piece)
        yield from self.end()


@_wire_checked
def import_chunks(
    path: KvPath, mode: int, data: bytes | Iterable[bytes]
) -> Iterator[pb.ImportChunk]:
    chunks = ImportChunks(path, mode)  # checked now, not once the stream has started
    return chunks.stream([data] if isinstance(data, bytes | bytearray | memoryview) else data)


def import_file(chunks: Iterable[pb.ImportChunk] | AsyncIterable[pb.ImportChunk]) -> Call[None]:
    """A client stream: its request is the stream of chunks (import_chunks)."""
    return Call("Import", chunks, _none)


@_wire_checked
def procfs(path: KvPath) -> Call[str]:
    """The text of a /proc entry: "meminfo", "sched", "PID/status"."""
    return Call("Procfs", pb.PathRequest(path=os.fspath(path)), _text)


# -- transport ----------------------------------------------------------------------------

# A gRPC status means the call never got a kernel's answer; UNAVAILABLE is the usual one:
# the kernel died or was stopped.
_TRANSPORT_ERRNO = {
    grpc.StatusCode.UNAVAILABLE: errno.EPIPE,
    grpc.StatusCode.DEADLINE_EXCEEDED: errno.ETIMEDOUT,
    grpc.StatusCode.CANCELLED: errno.ECANCELED,
    grpc.StatusCode.UNAUTHENTICATED: errno.EACCES,
    grpc.StatusCode.PERMISSION_DENIED: errno.EACCES,
    grpc.StatusCode.UNIMPLEMENTED: errno.ENOSYS,
    grpc.StatusCode.RESOURCE_EXHAUSTED: errno.EMSGSIZE,
    grpc.StatusCode.INVALID_ARGUMENT: errno.EINVAL,
}


def transport_error(e: grpc.RpcError, sock: os.PathLike | str) -> OSError:
    """The OSError for a failed gRPC call: BrokenPipeError (EPIPE) when the kernel is gone."""
    code = e.code() if callable(getattr(e, "code", None)) else grpc.StatusCode.UNKNOWN
    details = e.details() if callable(getattr(e, "details", None)) else str(e)
    what = "kernel unreachable" if code == grpc.StatusCode.UNAVAILABLE else code.name.lower()
    return errors.error(_TRANSPORT_ERRNO.get(code, errno.EIO), f"{sock}: {what}: {details}")


def connect_error(e: OSError, sock: os.PathLike | str) -> OSError:
    """The hello handshake's failure, saying which socket had no kernel behind it and why:
    FileNotFoundError when there is no socket; ConnectionRefusedError saying what is there
    when the path exists (a dead kernel's socket, whose hello socket is gone or dead too; a
    kernel's that does not serve yet), not the hello socket's ENOENT. EAGAIN comes only from
    a kernel that answered and refused the session, ETIMEDOUT from one that answered nothing
    in time (syscalls/session.py): their own messages say why, naming the socket."""
    if e.errno in (errno.EAGAIN, errno.ETIMEDOUT):
        return e
    there = _unanswered(sock) if e.errno in (errno.ENOENT, errno.ECONNREFUSED) else None
    if there is not None:
        return errors.error(errno.ECONNREFUSED, f"no Symphony kernel at {sock}: {there}: "
                            f"{os.strerror(errno.ECONNREFUSED)}")
    reason = e.strerror or str(e)
    return errors.error(e.errno or errno.ECONNREFUSED, f"no Symphony kernel at {sock}: {reason}")


def _unanswered(sock: os.PathLike | str) -> str | None:
    """What is at a kernel's socket path that answered no hello; None: nothing."""
    try:
        if not _stat.S_ISSOCK(os.stat(sock).st_mode):
            return "it is not a socket"
    except OSError:
        return None
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(os.fspath(sock))
    except OSError:
        return "the socket exists but no kernel answers on it"
    finally:
        probe.close()
    return ("something listens on the socket but answers no hello (as a kernel does while "
            "its model loads)")
