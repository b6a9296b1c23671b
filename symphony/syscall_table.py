"""The syscall table: one function per call of syscalls/symphony.proto.

Each takes the kernel, the calling process, the credentials the call acts with and the
request, and returns the reply without its error; it raises an OSError (FSError) to fail.
Checks come first, so a failed call changes nothing.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import functools
import os
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from kvfs.errors import FSError, NoRoom
from kvfs.format import exported_size
from kvfs.fs import Handle
from kvfs.perm import Cred
from symphony.engine.sampler import RowControl, SamplingParams
from symphony.engine.tokenizer import Tokenizer
from symphony.engine.tree import ancestor_bits, depths
from symphony.known_preds import KnownPred
from symphony.pred_job import Output, PredSpec, Reply
from symphony.process import NICE_MAX, NICE_MIN, Process
from symphony.top_wire import encode_tops
from syscalls import symphony_pb2 as pb
from syscalls import wire
from syscalls.convert import plain_reply
from syscalls.users import user_name

if TYPE_CHECKING:
    from symphony.daemon import Kernel

EXPORT_CHUNK = 1 << 20
LITTLE_INT32 = np.dtype("<i4")  # a mask's words on the wire (docs/syscalls.md, pred)
OPEN_FLAGS = os.O_ACCMODE | os.O_CREAT | os.O_EXCL | os.O_TRUNC
T = TypeVar("T")


def einval(message: str) -> FSError:
    return FSError(errno.EINVAL, message)


async def _room_made(k: Kernel, what: str, op: Callable[[], T]) -> T:
    """op, tried again if it was short of pages: once guesses of the scheduler's have given
    theirs back (decoding ahead must never cost a call its memory), and once the pages it
    was short of have moved down as for a pred (symphony/relief.py: files nobody has open,
    then idle processes'). kvfs checks before it changes anything, so a failed try left
    everything as it was. A refusal for want of room names the call (`what`: "splice to
    fd 4"), where the pool's or the quota's message does not."""
    try:
        return await _with_room(k, op)
    except FSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT) and not e.message.startswith(
                what.split()[0]):
            raise FSError(e.errno, f"{what}: {e.message}") from e
        raise


async def _with_room(k: Kernel, op: Callable[[], T]) -> T:
    try:
        return op()
    except FSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        short = e
    if await k.sched.give_way():
        try:
            return op()
        except NoRoom as e:
            short = e
    if not isinstance(short, NoRoom):
        raise short
    k.sched.relief.relieve(short.short)
    return op()


# -- process --------------------------------------------------------------------------


def sys_attach(k: Kernel, proc: Process, cred: Cred, req: pb.AttachRequest) -> pb.AttachReply:
    """Names the session's process; the identity it reports, and whose home it makes, is
    the one the call acts as (a root session's `symphony-as`), as for every other call."""
    user = user_name(cred.uid)
    home = k.fs.home(cred, user)
    proc.name = req.name or proc.name
    proc.argv = list(req.argv)
    return pb.AttachReply(pid=proc.pid, uid=cred.uid, gid=cred.gid, user=user, home=home)


async def sys_exit(k: Kernel, proc: Process, cred: Cred, req: pb.ExitRequest) -> pb.Empty:
    proc.exit_code = req.code
    await k.reap(proc)
    return pb.Empty()


def sys_getpid(k: Kernel, proc: Process, cred: Cred, req: pb.Void) -> pb.GetPidReply:
    return pb.GetPidReply(pid=proc.pid)


def sys_ps(k: Kernel, proc: Process, cred: Cred, req: pb.Void) -> pb.PsReply:
    return pb.PsReply(procs=[k.proc_info(p, cred) for p in k.procs])


async def sys_kill(k: Kernel, proc: Process, cred: Cred, req: pb.KillRequest) -> pb.Empty:
    target = k.procs.get(req.pid)
    if not (cred.root or cred.uid == target.uid):
        raise FSError(errno.EPERM, f"kill {req.pid}: process of uid {target.uid}")
    await k.kill(target)
    return pb.Empty()


def sys_nice(k: Kernel, proc: Process, cred: Cred, req: pb.NiceRequest) -> pb.NiceReply:
    if req.increment < 0 and not cred.root:
        raise FSError(errno.EPERM, "nice: only root may raise a priority")
    proc.nice = max(NICE_MIN, min(NICE_MAX, proc.nice + req.increment))
    return pb.NiceReply(nice=proc.nice)


# -- model ----------------------------------------------------------------------------


def sys_model_info(k: Kernel, proc: Process, cred: Cred, req: pb.Void) -> pb.ModelInfoReply:
    cfg, tok = k.engine.config, k.engine.tokenizer
    bos = tok.bos_id if tok else cfg.bos_token_id
    return pb.ModelInfoReply(
        name=k.model_name, architecture=cfg.architecture, vocab_size=cfg.vocab_size,
        bos_id=-1 if bos is None else bos, eos_ids=list(k.engine.eos_ids()),
        special_tokens=tok.special_tokens if tok else {},
        chat_template=(tok.chat_template or "") if tok else "",
        page_size=k.engine.page_size, context_length=cfg.max_position_embeddings,
        fingerprint=k.fingerprint, dtype=str(k.engine.dtype).removeprefix("torch."),
        has_tokenizer=tok is not None,
    )


def _tokenizer(k: Kernel, what: str):
    if k.engine.tokenizer is None:
        raise FSError(errno.EOPNOTSUPP, f"{what}: the model has no tokenizer "
                      f"({Tokenizer.missing(k.engine.model_dir)})")
    return k.engine.tokenizer


def _check_ids(ids, vocab: int, what: str) -> list[int]:
    ids = ids[:]  # a list: list() of a protobuf repeated field takes twice as long
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        bad = next(t for t in ids if not 0 <= t < vocab)
        raise einval(f"{what}: token {bad} is outside the vocabulary [0, {vocab})")
    return ids


# Tokenizing runs in worker threads (the tokenizer releases the GIL), this many at a time:
# a text of megabytes takes seconds and a hundred times its size in memory, which on the
# loop's thread stalled every process's calls.
TOKENIZERS = 2
_tokenizing = threading.BoundedSemaphore(TOKENIZERS)


async def _off_the_loop(fn: Callable[..., Any], *args: Any) -> Any:
    def run() -> Any:
        with _tokenizing:
            return fn(*args)

    return await asyncio.to_thread(run)


async def sys_tokenize(k: Kernel, proc: Process, cred: Cred,
                       req: pb.TokenizeRequest) -> pb.TokenizeReply:
    tok = _tokenizer(k, "tokenize")
    if req.messages:
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        try:
            text = await _off_the_loop(tok.apply_chat_template, messages,
                                       req.add_generation_prompt)
        except Exception as e:  # a template is user code: any error is EINVAL
            raise einval(f"tokenize: the chat template failed: {e}") from e
        return pb.TokenizeReply(ids=await _off_the_loop(tok.encode, text, False))
    return pb.TokenizeReply(ids=await _off_the_loop(
        tok.encode, req.text, None if req.add_special else False))


async def sys_detokenize(k: Kernel, proc: Process, cred: Cred,
                         req: pb.DetokenizeRequest) -> pb.DetokenizeReply:
    tok = _tokenizer(k, "detokenize")
    ids = _check_ids(req.ids, k.engine.config.vocab_size, "detokenize")
    return pb.DetokenizeReply(text=await _off_the_loop(tok.decode, ids, not req.keep_special))


@functools.lru_cache(maxsize=1)
def _vocab(tok: Tokenizer, vocab: int) -> pb.VocabReply:
    """Built once: a 128k vocabulary takes a while. Per id of the model's: ids past the
    tokenizer's (a model's vocabulary is often padded) are empty, as no token's."""
    tokens = tok.token_bytes()[:vocab]
    return pb.VocabReply(tokens=tokens + [b""] * (vocab - len(tokens)),
                         special_ids=[i for i in tok.special_ids() if i < vocab])


def sys_vocab(k: Kernel, proc: Process, cred: Cred, req: pb.Void) -> pb.VocabReply:
    return _vocab(_tokenizer(k, "vocab"), k.engine.config.vocab_size)


def _sampler_params(sampler: bytes, vocab: int) -> SamplingParams:
    """The checked SamplingParams of a sampler's bytes on the wire; EINVAL for one out of
    range."""
    s = pb.Sampler.FromString(sampler)
    if not 0 <= s.top_p <= 1:  # 0 is the field unset: no limit, as 1
        raise einval(f"pred: sampler: top_p must be in [0, 1] (0 or 1: no limit), "
                     f"got {s.top_p}")
    params = SamplingParams(temperature=s.temperature, top_k=s.top_k,
                            top_p=1.0 if s.top_p == 0 else s.top_p, min_p=s.min_p,
                            seed=s.seed if s.HasField("seed") else None,
                            top_logprobs=s.top_logprobs)
    try:
        params.validate(vocab)
    except ValueError as e:
        raise einval(f"pred: sampler: {e}") from e
    return params


# One SamplingParams per distinct sampler, checked once: a LIP sends the same sampler with
# every pred, and reading its fields and building a frozen dataclass each time is slow. Keyed
# by the bytes, so only short ones are kept: fields protobuf skips can make a sampler as long
# as its sender likes, and 1024 such keys could hold gigabytes.
_checked_sampler = functools.lru_cache(maxsize=1024)(_sampler_params)
SAMPLER_KEPT_BYTES = 128  # a sampler's fields take at most some 40


def _sampling(req: pb.PredRequest, vocab: int) -> SamplingParams:
    sampler = req.sampler.SerializeToString()
    if len(sampler) > SAMPLER_KEPT_BYTES:
        return _sampler_params(sampler, vocab)
    return _checked_sampler(sampler, vocab)


def pred_reply_bytes(rows: int, top_logprobs: int,
                     controls: list[RowControl | None] | None = None,
                     score_next: bool = False) -> int:
    """The most bytes a PredReply of `rows` outputs with `top_logprobs` entries each can
    take: each integer as its longest varint, with its field's tag and length prefix. A
    PredOutput: 1 + 5 (tag, length) + 6 (row) + 6 (token) + 5 (logprob); a TopLogprob: 1 + 1
    + 6 (id) + 5 (logprob). A controlled row (`controls` per row) adds 5 (model_logprob) and
    1 + 5 + 4 a score (packed floats); score_next 5 a row (next_logprob)."""
    size = rows * (23 + 13 * top_logprobs + 5 * score_next)
    for control in controls or ():
        if control is not None:
            size += 11 + 4 * len(control.score_ids)
    return size


def reply_bound(req: pb.PredRequest) -> int:
    """pred_reply_bytes of a request as it asks (checked or not): the most bytes its reply
    can take, which submit_pred holds to the limit."""
    rows = 0 if req.no_outputs else len(req.outputs) or 1
    size = rows * (23 + 13 * req.sampler.top_logprobs + 5 * req.score_next)
    controls = req.controls
    return size + sum(11 + 4 * len(c.score_ids) for c in controls) if controls else size


def _tree(req: pb.PredRequest, tokens: list[int], positions: list[int] | None
          ) -> tuple[np.ndarray | None, list[int] | None]:
    """The pred's ancestor bits, and the depths its default positions add to the file's next
    position (None when positions are given); (None, None) for a chain: causal attention."""
    parents = req.parents[:]
    if len(parents) != len(tokens):
        raise einval(f"pred: {len(parents)} parents for {len(tokens)} tokens")
    bad = next((i for i, p in enumerate(parents) if not -1 <= p < i), None)
    if bad is not None:
        raise einval(f"pred: parents[{bad}] is {parents[bad]}, not -1 (a root) or an earlier "
                     f"row in [0, {bad})")
    if parents == list(range(-1, len(parents) - 1)):
        return None, None
    return ancestor_bits(parents), depths(parents) if positions is None else None


def _row_control(c: pb.LogitControl, i: int, vocab: int) -> RowControl | None:
    """controls[i] as the sampler takes it, checked; None when it asks for nothing."""
    mask = c.allowed  # bytes: each read of the field copies them
    if not (mask or c.bias_ids or c.bias_values or c.score_ids):
        return None
    if len(mask) % 4:
        raise einval(f"pred: controls[{i}].allowed is {len(mask)} bytes, not whole 32-bit "
                     "words")
    allowed = torch.from_numpy(np.frombuffer(mask, LITTLE_INT32).astype(np.int32)) if mask else None
    control = RowControl(allowed, tuple(c.bias_ids), tuple(c.bias_values), tuple(c.score_ids))
    try:
        control.validate(vocab)
    except ValueError as e:
        raise einval(f"pred: controls[{i}]: {e}") from e
    return control


def _controls(req: pb.PredRequest, rows: list[int], tokens: list[int],
              vocab: int) -> list[RowControl | None] | None:
    """Per output row (in the order of `rows`): its control, with score_next the row's next
    token added as its last score id. None when no row has one."""
    n = len(req.controls)
    if n not in (0, 1, len(rows)):
        raise einval(f"pred: {n} controls for {len(rows)} output rows (0, 1 for every row, "
                     "or one per row)")
    parsed = [_row_control(c, i, vocab) for i, c in enumerate(req.controls)]
    controls = parsed * len(rows) if n == 1 else parsed or [None] * len(rows)
    if req.score_next:
        controls = [c if r + 1 == len(tokens)
                    else RowControl(None, score_ids=(tokens[r + 1],)) if c is None
                    else RowControl(c.allowed, c.bias_ids, c.bias_values,
                                    (*c.score_ids, tokens[r + 1]))
                    for c, r in zip(controls, rows, strict=True)]
    return None if all(c is None for c in controls) else controls


def _open_for(proc: Process, fd: int, what: str, *, write: bool) -> Handle:
    """The handle of fd, open for writing (or for reading): EBADF naming the fd, before
    kvfs, which knows no fd, would refuse it."""
    handle = proc.handle(fd)
    if not (handle.writable if write else handle.readable):
        raise FSError(errno.EBADF, f"{what}: fd {fd} is not open for "
                      f"{'writing' if write else 'reading'}")
    return handle


def known_pred(k: Kernel, req: pb.PredRequest) -> KnownPred:
    """What the checks made of a decode loop's request that passed them (submit_pred), to
    know it by its bytes from now on (known_preds.py)."""
    return KnownPred(req.fd, _sampling(req, k.engine.config.vocab_size), reply_bound(req))


def submit_known(k: Kernel, proc: Process, known: KnownPred, token: int,
                 reply: Reply | None = None) -> asyncio.Future:
    """submit_pred of a known decode request with this token (in the vocabulary): only
    what may have changed since its bytes were checked, the fd, is checked again. When it
    is the file's guess, it takes the guess with no request built (a decode loop's steady
    state); otherwise it is queued as submit_pred queues it."""
    handle = _open_for(proc, known.fd, "pred", write=True)
    taken = k.sched.take_guess(handle, token, known.params, reply)
    if taken is not None:
        return taken
    return k.sched.submit(proc, handle, PredSpec([token], None, [0], known.params), reply)


def submit_pred(k: Kernel, proc: Process, cred: Cred, req: pb.PredRequest,
                reply: Reply | None = None) -> asyncio.Future:
    """A pred up to its wait: checked, then queued; the future gets its Outputs. The
    lifeline and the rings pass `reply`, called with the Outputs or the error once it is
    settled (no task or callback of the loop's a pred); gRPC awaits the future in
    sys_pred."""
    handle = _open_for(proc, req.fd, "pred", write=True)
    config = k.engine.config
    vocab = config.vocab_size
    tokens = _check_ids(req.tokens, vocab, "pred")
    if not tokens:
        raise einval("pred: no tokens")
    positions = req.positions[:] or None
    context = config.max_position_embeddings
    if positions is not None:
        if len(positions) != len(tokens):
            raise einval(f"pred: {len(positions)} positions for {len(tokens)} tokens")
        if min(positions) < 0:
            raise einval(f"pred: negative position {min(positions)}")
        if max(positions) >= context:
            raise FSError(errno.EOVERFLOW, f"pred: position {max(positions)} is past the "
                          f"model's context ({context})")
    tree, tree_depths = _tree(req, tokens, positions) if req.parents else (None, None)
    cut = req.truncate if req.HasField("truncate") else None
    if cut is not None and cut < 0:
        raise einval(f"pred: truncate {cut} is negative")
    if req.no_outputs:
        for given, what in ((req.outputs, "outputs"), (req.controls, "controls"),
                            (req.score_next, "score_next")):
            if given:
                raise einval(f"pred: {what} given with no_outputs")
        rows = []
    elif req.outputs:
        rows = req.outputs[:]
        if min(rows) < 0 or max(rows) >= len(tokens):
            bad = next(r for r in rows if not 0 <= r < len(tokens))
            raise einval(f"pred: output row {bad} is not a row of {len(tokens)} tokens")
        if len(set(rows)) != len(rows):
            twice = next(r for r, n in collections.Counter(rows).items() if n > 1)
            raise einval(f"pred: output row {twice} is given more than once")
    else:
        rows = [len(tokens) - 1]
    params = _sampling(req, vocab)
    controls = _controls(req, rows, tokens, vocab) if req.controls or req.score_next else None
    size = pred_reply_bytes(len(rows), params.top_logprobs, controls, req.score_next)
    if size > wire.MAX_PAYLOAD:
        raise FSError(errno.EMSGSIZE, f"pred: {len(rows)} output rows with {params.top_logprobs}"
                      f" top logprobs each{' and their scores' if controls else ''} may take "
                      f"{size} bytes, over the {wire.MAX_PAYLOAD >> 20} MiB limit of a reply "
                      f"({wire.MAX_PAYLOAD} bytes)")
    if controls is not None:  # kept with their rows, which the scheduler takes sorted
        order = sorted(range(len(rows)), key=rows.__getitem__)
        rows, controls = [rows[i] for i in order], [controls[i] for i in order]
    elif len(rows) > 1:
        rows = sorted(rows)
    spec = PredSpec(tokens, positions, rows, params, controls=controls,
                    score_next=req.score_next, tree=tree, depths=tree_depths, cut=cut)
    return k.sched.submit(proc, handle, spec, reply)


# Top logprobs in a reply past which numpy builds them (symphony/top_wire.py): below,
# add() a message each is faster than numpy's cost a call.
FEW_TOPS = 256


def pred_reply(outputs: list[Output]) -> pb.PredReply:
    reply = pb.PredReply()
    many = sum(len(o.top_ids) for o in outputs) > FEW_TOPS
    tops = _tops(outputs) if many else [b""] * len(outputs)
    for o, top in zip(outputs, tops, strict=True):
        # add() in place: about twice as fast as building the messages
        out = reply.outputs.add(row=o.row, token=o.token, logprob=o.logprob)
        if top:
            out.MergeFromString(top)
        elif not many:
            for i, lp in zip(o.top_ids, o.top_logprobs, strict=True):
                out.top.add(id=int(i), logprob=float(lp))
        if o.model_logprob is not None:  # only a controlled row has these
            out.model_logprob = o.model_logprob
        if o.scores:
            out.scores.extend(o.scores)
        if o.next_logprob is not None:
            out.next_logprob = o.next_logprob
    return reply


def reply_payload(outputs: list[Output]) -> bytes:
    """pred_reply(outputs) serialized, as the lifeline and the rings send it: plain outputs
    (no top logprobs, nothing a control adds) written directly, with no message built."""
    for o in outputs:
        if len(o.top_ids) or o.model_logprob is not None or o.scores or o.next_logprob is not None:
            return pred_reply(outputs).SerializeToString()
    return plain_reply([(o.row, o.token, o.logprob) for o in outputs])


def _tops(outputs: list[Output]) -> list[bytes]:
    """The outputs' top logprobs on the wire (symphony/top_wire.py): all rows at once where
    they have as many, as a pred's rows do."""
    counts = {len(o.top_ids) for o in outputs}
    if counts <= {0}:
        return [b""] * len(outputs)
    if len(counts) == 1:
        return encode_tops(np.array([o.top_ids for o in outputs]),
                           np.array([o.top_logprobs for o in outputs]))
    return [encode_tops(np.array([o.top_ids]), np.array([o.top_logprobs]))[0]
            for o in outputs]


async def sys_pred(k: Kernel, proc: Process, cred: Cred, req: pb.PredRequest) -> pb.PredReply:
    future = submit_pred(k, proc, cred, req)
    try:
        outputs = await future
    except asyncio.CancelledError:
        # The client cancelled the rpc (or closed its channel): cancelling this handler
        # cancelled the pred's future, unless the pred was answered first: then its answer
        # stands. Else the cancellation goes on once the file is as before (a pred in the
        # running step is rolled back when the step ends).
        if not future.cancelled():
            outputs = future.result()
        else:
            await k.sched.cancel(future)
            raise
    return pred_reply(outputs)


# -- KV files -------------------------------------------------------------------------


def _installing(proc: Process, what: str, op: Callable[[], Handle]) -> Callable[[], int]:
    """op, which opens a file, made the fd of a live process with room for one: checked
    right before op runs, with no wait between, so that a call that waited (for a step,
    for pages) and finds its process reaped or its last fd taken meanwhile opens nothing,
    and creates no name."""
    def install() -> int:
        if not proc.alive:
            raise FSError(errno.EINTR, f"process {proc.pid} is exiting")
        proc.fd_room(what)
        return proc.add_fd(op())

    return install


async def _settle_path(k: Kernel, cred: Cred, path: str) -> None:
    """Before a call rewrites the file at `path`: no work ahead is left on it."""
    with contextlib.suppress(FSError):  # else the call itself says what is wrong
        await k.sched.settle(k.fs.lookup(cred, path))


async def sys_open(k: Kernel, proc: Process, cred: Cred, req: pb.OpenRequest) -> pb.FdReply:
    if req.flags & ~OPEN_FLAGS:
        raise einval(f"open {req.path!r}: unsupported flags {req.flags & ~OPEN_FLAGS:#o}")
    mode = req.mode if req.HasField("mode") else 0o600
    proc.fd_room(f"open {req.path!r}")
    if req.flags & os.O_TRUNC and req.path:
        await _settle_path(k, cred, req.path)
    what = f"open {req.path!r}"
    return pb.FdReply(fd=await _room_made(k, what, _installing(
        proc, what, lambda: k.fs.open(cred, req.path, req.flags, mode))))


async def sys_close(k: Kernel, proc: Process, cred: Cred, req: pb.FdRequest) -> pb.Empty:
    await k.sched.settle(proc.handle(req.fd).inode)
    handle = proc.handle(req.fd)  # again: another thread may have closed it meanwhile
    if k.sched.uses(handle):
        raise FSError(errno.EBUSY, f"close: fd {req.fd} has a pred in progress")
    del proc.fds[req.fd]
    k.fs.close(handle)
    k.sched.poke()  # pages may have been freed
    return pb.Empty()


async def sys_fork(k: Kernel, proc: Process, cred: Cred, req: pb.FdRequest) -> pb.FdReply:
    handle = _open_for(proc, req.fd, "fork", write=False)
    proc.fd_room(f"fork of fd {req.fd}")
    what = f"fork of fd {req.fd}"
    return pb.FdReply(fd=await _room_made(k, what, _installing(
        proc, what, lambda: k.fs.fork(handle, cred))))


def sys_link(k: Kernel, proc: Process, cred: Cred, req: pb.LinkRequest) -> pb.Empty:
    k.fs.link(proc.handle(req.fd), req.path)
    return pb.Empty()


def sys_read(k: Kernel, proc: Process, cred: Cred, req: pb.ReadRequest) -> pb.ReadReply:
    tokens, positions = k.fs.read(_open_for(proc, req.fd, "read", write=False), req.start,
                                  req.count)
    return pb.ReadReply(tokens=tokens, positions=positions)


async def sys_splice(k: Kernel, proc: Process, cred: Cred, req: pb.SpliceRequest) -> pb.Empty:
    src = _open_for(proc, req.src_fd, "splice", write=False)
    dst = _open_for(proc, req.dst_fd, "splice", write=True)
    await k.sched.settle(dst.inode)
    await _room_made(k, f"splice to fd {req.dst_fd}",
                     lambda: k.fs.splice(src, req.start, req.end, dst))
    return pb.Empty()


async def sys_truncate(k: Kernel, proc: Process, cred: Cred,
                       req: pb.TruncateRequest) -> pb.Empty:
    handle = _open_for(proc, req.fd, "truncate", write=True)
    await k.sched.settle(handle.inode)
    await _room_made(k, f"truncate fd {req.fd}", lambda: k.fs.truncate(handle, req.length))
    k.sched.poke()
    return pb.Empty()


async def sys_keep(k: Kernel, proc: Process, cred: Cred, req: pb.KeepRequest) -> pb.Empty:
    handle = _open_for(proc, req.fd, "keep", write=True)
    await k.sched.settle(handle.inode)
    await _room_made(k, f"keep fd {req.fd}", lambda: k.fs.keep(handle, req.start, req.entries[:]))
    k.sched.poke()  # pages past the new end were freed
    return pb.Empty()


async def sys_shift(k: Kernel, proc: Process, cred: Cred, req: pb.ShiftRequest) -> pb.Empty:
    handle = _open_for(proc, req.fd, "shift", write=True)
    await k.sched.settle(handle.inode)
    # The keys are rotated here, on the loop's thread, as splice copies K/V rows: the pool
    # rows a shift writes are no running step's (a file with a pred in flight is busy, and
    # shared pages are made private first), and kvfs's state and every other change of the
    # pool are the loop's alone, in order. In the engine process the rotation would wait
    # for the step, with fs.shift half done.
    await _room_made(k, f"shift fd {req.fd}",
                     lambda: k.fs.shift(handle, req.start, req.end, req.delta,
                                        k.engine.config.max_position_embeddings,
                                        k.engine.rotate_keys))
    return pb.Empty()


async def sys_punch(k: Kernel, proc: Process, cred: Cred, req: pb.PunchRequest) -> pb.Empty:
    handle = _open_for(proc, req.fd, "punch", write=True)
    await k.sched.settle(handle.inode)
    k.fs.punch(handle, req.start, req.end)
    k.sched.poke()
    return pb.Empty()


def stat_reply(k: Kernel, inode) -> pb.StatReply:
    st = k.fs.stat_inode(inode)
    return pb.StatReply(
        ino=st.ino, mode=st.mode, uid=st.uid, gid=st.gid, nlink=st.nlink, tokens=st.tokens,
        pages=st.pages, size=0 if inode.is_dir else exported_size(inode, k.fs.layout),
        atime_ns=st.atime, mtime_ns=st.mtime, ctime_ns=st.ctime,
    )


def sys_stat(k: Kernel, proc: Process, cred: Cred, req: pb.StatRequest) -> pb.StatReply:
    if req.WhichOneof("target") == "fd":
        inode = proc.handle(req.fd).inode
    else:
        inode = k.fs.lookup(cred, req.path)
    return stat_reply(k, inode)


def sys_readdir(k: Kernel, proc: Process, cred: Cred, req: pb.PathRequest) -> pb.ReaddirReply:
    return pb.ReaddirReply(entries=[pb.DirEntry(name=name, stat=stat_reply(k, inode))
                                    for name, inode in k.fs.readdir(cred, req.path)])


def sys_mkdir(k: Kernel, proc: Process, cred: Cred, req: pb.ModeRequest) -> pb.Empty:
    k.fs.mkdir(cred, req.path, req.mode if req.HasField("mode") else 0o755)
    return pb.Empty()


def sys_rmdir(k: Kernel, proc: Process, cred: Cred, req: pb.PathRequest) -> pb.Empty:
    k.fs.rmdir(cred, req.path)
    return pb.Empty()


def sys_unlink(k: Kernel, proc: Process, cred: Cred, req: pb.PathRequest) -> pb.Empty:
    k.fs.unlink(cred, req.path)
    k.sched.poke()
    return pb.Empty()


def sys_rename(k: Kernel, proc: Process, cred: Cred, req: pb.RenameRequest) -> pb.Empty:
    k.fs.rename(cred, req.old, req.new)
    return pb.Empty()


def sys_chmod(k: Kernel, proc: Process, cred: Cred, req: pb.ModeRequest) -> pb.Empty:
    if not req.HasField("mode"):
        raise einval(f"chmod {req.path!r}: no mode")
    k.fs.chmod(cred, req.path, req.mode)
    return pb.Empty()


def sys_access(k: Kernel, proc: Process, cred: Cred, req: pb.ModeRequest) -> pb.Empty:
    """access(2): may the caller read, write or search `path` (mode 0: does it exist)?"""
    if req.mode & ~(os.R_OK | os.W_OK | os.X_OK):
        raise einval(f"access {req.path!r}: bad mode {req.mode:#o}")
    k.fs.access(cred, req.path, req.mode)
    return pb.Empty()


def sys_chown(k: Kernel, proc: Process, cred: Cred, req: pb.ChownRequest) -> pb.Empty:
    k.fs.chown(cred, req.path, req.uid, req.gid)
    return pb.Empty()


def sys_fsync(k: Kernel, proc: Process, cred: Cred, req: pb.FdRequest) -> pb.Empty:
    k.fs.fsync(proc.handle(req.fd))
    return pb.Empty()


async def sys_export(k: Kernel, proc: Process, cred: Cred,
                     req: pb.ExportRequest) -> AsyncIterator[pb.ExportChunk]:
    """The canonical form, streamed; [offset, offset + length) when a range is asked.

    It streams from a copy-on-write fork taken first, so a file that changes meanwhile
    still exports as one consistent snapshot, a chunk in memory at a time. The fork shares
    every full page and copies the last one if partial: that page is the caller's (ENOSPC,
    EDQUOT when none can be had).
    """
    if req.offset < 0 or req.length < 0:
        raise einval(f"export: bad range offset {req.offset}, length {req.length}")
    by_fd = req.WhichOneof("target") == "fd"
    src = _open_for(proc, req.fd, "export", write=False) if by_fd else await _room_made(
        k, f"export {req.path!r}", lambda: k.fs.open(cred, req.path, os.O_RDONLY))
    try:
        snap = await _with_room(k, lambda: k.fs.fork(src, cred, snapshot=True))
    except FSError as e:  # the fork's refusal, said as export's
        what = f"fd {req.fd}" if by_fd else repr(req.path)
        raise FSError(e.errno, f"export {what}: its snapshot: "
                      f"{e.message.removeprefix('fork: ')}") from e
    finally:
        if not by_fd:
            k.fs.close(src)
    try:
        size = exported_size(snap.inode, k.fs.layout)
        end = size if req.length == 0 else min(size, req.offset + req.length)
        start = min(req.offset, end)
        first = k.fs.read_bytes(snap, start, min(EXPORT_CHUNK, end - start))
        yield pb.ExportChunk(size=end - start, data=first)
        for off in range(start + len(first), end, EXPORT_CHUNK):
            yield pb.ExportChunk(data=k.fs.read_bytes(snap, off, min(EXPORT_CHUNK, end - off)))
    finally:
        k.fs.close(snap)


async def sys_import(k: Kernel, proc: Process, cred: Cred,
                     chunks: AsyncIterator[pb.ImportChunk]) -> pb.Empty:
    """Checked as it arrives, so that a refused file costs the kernel little: the caller's
    permission on the path before the body is taken, the header as soon as it is whole.
    The bytes it declares count against the caller's bound on streams in flight until it
    ends, whether it is imported, refused, cancelled or its client goes."""
    first = await anext(chunks, None)
    if first is None or not first.path:
        raise einval("import: no path in the first chunk")
    path, mode = first.path, first.mode if first.HasField("mode") else 0o600
    try:
        with k.fs.receive(cred, path) as incoming:
            incoming.feed(first.data)
            async for chunk in chunks:
                incoming.feed(chunk.data)
            await _settle_path(k, cred, path)
            await _room_made(k, f"import {path!r}",
                             lambda: k.fs.import_file(cred, path, incoming.data(), mode))
    except FSError as e:  # the format's checks name no file: say which
        if repr(path) in e.message:
            raise
        raise FSError(e.errno, f"import {path!r}: {e.message}") from e
    return pb.Empty()


# -- info -----------------------------------------------------------------------------


def sys_procfs(k: Kernel, proc: Process, cred: Cred, req: pb.PathRequest) -> pb.ProcfsReply:
    return pb.ProcfsReply(text=k.procfs.read(req.path, cred))


# name: (function, request type or None for a client stream, reply type, server streams)
TABLE = {
    "Attach": (sys_attach, pb.AttachRequest, pb.AttachReply, False),
    "Exit": (sys_exit, pb.ExitRequest, pb.Empty, False),
    "GetPid": (sys_getpid, pb.Void, pb.GetPidReply, False),
    "Ps": (sys_ps, pb.Void, pb.PsReply, False),
    "Kill": (sys_kill, pb.KillRequest, pb.Empty, False),
    "Nice": (sys_nice, pb.NiceRequest, pb.NiceReply, False),
    "ModelInfo": (sys_model_info, pb.Void, pb.ModelInfoReply, False),
    "Tokenize": (sys_tokenize, pb.TokenizeRequest, pb.TokenizeReply, False),
    "Detokenize": (sys_detokenize, pb.DetokenizeRequest, pb.DetokenizeReply, False),
    "Vocab": (sys_vocab, pb.Void, pb.VocabReply, False),
    "Pred": (sys_pred, pb.PredRequest, pb.PredReply, False),
    "Open": (sys_open, pb.OpenRequest, pb.FdReply, False),
    "Close": (sys_close, pb.FdRequest, pb.Empty, False),
    "Fork": (sys_fork, pb.FdRequest, pb.FdReply, False),
    "Link": (sys_link, pb.LinkRequest, pb.Empty, False),
    "Read": (sys_read, pb.ReadRequest, pb.ReadReply, False),
    "Splice": (sys_splice, pb.SpliceRequest, pb.Empty, False),
    "Truncate": (sys_truncate, pb.TruncateRequest, pb.Empty, False),
    "Punch": (sys_punch, pb.PunchRequest, pb.Empty, False),
    "Keep": (sys_keep, pb.KeepRequest, pb.Empty, False),
    "Shift": (sys_shift, pb.ShiftRequest, pb.Empty, False),
    "Stat": (sys_stat, pb.StatRequest, pb.StatReply, False),
    "Readdir": (sys_readdir, pb.PathRequest, pb.ReaddirReply, False),
    "Mkdir": (sys_mkdir, pb.ModeRequest, pb.Empty, False),
    "Rmdir": (sys_rmdir, pb.PathRequest, pb.Empty, False),
    "Unlink": (sys_unlink, pb.PathRequest, pb.Empty, False),
    "Rename": (sys_rename, pb.RenameRequest, pb.Empty, False),
    "Chmod": (sys_chmod, pb.ModeRequest, pb.Empty, False),
    "Access": (sys_access, pb.ModeRequest, pb.Empty, False),
    "Chown": (sys_chown, pb.ChownRequest, pb.Empty, False),
    "Fsync": (sys_fsync, pb.FdRequest, pb.Empty, False),
    "Export": (sys_export, pb.ExportRequest, pb.ExportChunk, True),
    "Import": (sys_import, None, pb.Empty, False),
    "Procfs": (sys_procfs, pb.PathRequest, pb.ProcfsReply, False),
}
