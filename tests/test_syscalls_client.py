"""The LIP-side library without a kernel: requests, replies, errors, flags, and what a client
sees when no kernel answers. (Calls against a running kernel are tested end to end.)"""

from __future__ import annotations

import argparse
import asyncio
import errno
import inspect
import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import grpc.aio
import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings

from syscalls import convert, errors, session
from syscalls import symphony_pb2 as pb
from syscalls.aio import AsyncFile, AsyncKernel
from syscalls.client import File, Kernel
from syscalls.context import AsyncContext, Context, _kept, _step_sampling
from syscalls.flags import add_sampling_flags, kv_path, parse_ids, report, sampling_kwargs

# -- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code, exc",
    [
        (errno.ENOENT, FileNotFoundError),
        (errno.EACCES, PermissionError),
        (errno.EPERM, PermissionError),
        (errno.EEXIST, FileExistsError),
        (errno.EISDIR, IsADirectoryError),
        (errno.ENOTDIR, NotADirectoryError),
        (errno.ESRCH, ProcessLookupError),
        (errno.EPIPE, BrokenPipeError),
        (errno.EINVAL, OSError),
        (errno.ENOSPC, OSError),
    ],
)
def test_a_reply_error_raises_the_oserror_its_errno_names(code, exc):
    reply = pb.Empty(error=pb.Error(errno=code, message="what happened"))
    with pytest.raises(exc) as info:
        errors.check(reply)
    assert info.value.errno == code and info.value.strerror == "what happened"


def test_a_reply_without_error_is_returned():
    reply = pb.FdReply(fd=3)
    assert errors.check(reply) is reply


@pytest.mark.parametrize(
    "status, exc, code",
    [
        (grpc.StatusCode.UNAVAILABLE, BrokenPipeError, errno.EPIPE),
        (grpc.StatusCode.DEADLINE_EXCEEDED, TimeoutError, errno.ETIMEDOUT),
        (grpc.StatusCode.UNIMPLEMENTED, OSError, errno.ENOSYS),
        (grpc.StatusCode.INTERNAL, OSError, errno.EIO),
    ],
)
def test_transport_failures_become_oserrors_naming_the_socket(status, exc, code):
    rpc_error = grpc.aio.AioRpcError(status, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")
    e = convert.transport_error(rpc_error, "/run/k.sock")
    assert isinstance(e, exc) and e.errno == code
    assert "/run/k.sock" in e.strerror and "gone" in e.strerror


def test_connect_without_a_kernel_says_which_socket(tmp_path):
    sock = tmp_path / "k.sock"
    with pytest.raises(FileNotFoundError, match=f"no Symphony kernel at {sock}"):
        Kernel.connect(sock)


def test_connect_to_a_dead_kernels_socket_is_refused(tmp_path):
    sock = tmp_path / "k.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(session.hello_path(sock)))  # bound, never listening: a kernel that died
    try:
        with pytest.raises(ConnectionRefusedError, match=str(sock)):
            Kernel.connect(sock)
    finally:
        stale.close()


def _hung(signum, frame):
    raise AssertionError("Kernel.connect still waits after 10 s")


@pytest.mark.parametrize("backlog", ["room", "full"])
def test_connect_to_a_hello_socket_that_never_answers_times_out_naming_the_socket(tmp_path,
                                                                                  backlog):
    """A stopped kernel (SIGSTOP), or anything that listens on SOCK.hello and answers
    nothing, hung every client for ever: with room in its backlog in the wait for the
    token, with none in connect."""
    sock = tmp_path / "k.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(session.hello_path(sock)))
    listener.listen(0)
    queued = []
    while backlog == "full":
        queued.append(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        queued[-1].setblocking(False)
        try:
            queued[-1].connect(str(session.hello_path(sock)))
        except BlockingIOError:
            break
    before = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(10)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError) as e:
            Kernel.connect(sock, hello_timeout=0.5)
        assert 0.5 <= time.monotonic() - start < 5
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
        for s in (listener, *queued):
            s.close()
    assert e.value.errno == errno.ETIMEDOUT
    assert e.value.strerror.startswith(f"no hello from the kernel at {sock} in 0.5 s: "
                                       f"{sock}.hello takes connections but answers none")



def test_the_asyncio_clients_connect_takes_the_same_bound_on_the_hello(tmp_path):
    sock = tmp_path / "k.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(session.hello_path(sock)))
    listener.listen(1)
    try:
        with pytest.raises(TimeoutError) as e:
            asyncio.run(asyncio.wait_for(AsyncKernel.connect(sock, hello_timeout=0.5), 10))
    finally:
        listener.close()
    assert e.value.errno == errno.ETIMEDOUT
    assert e.value.strerror.startswith(f"no hello from the kernel at {sock} in 0.5 s: ")

def test_a_call_to_a_kernel_that_is_gone_raises_broken_pipe(tmp_path):
    sock = tmp_path / "k.sock"
    lifeline, _ = socket.socketpair()
    channel = grpc.insecure_channel(session.grpc_target(sock))
    k = Kernel(sock, lifeline, "token", channel)
    with k, pytest.raises(BrokenPipeError, match="kernel unreachable"):
        k.getpid()
    assert lifeline.fileno() == -1  # closing the session closed the lifeline


def test_an_async_call_to_a_kernel_that_is_gone_raises_broken_pipe(tmp_path):
    sock = tmp_path / "k.sock"

    async def calls():
        with pytest.raises(FileNotFoundError, match=str(sock)):
            await AsyncKernel.connect(sock)
        lifeline, _ = socket.socketpair()
        channel = grpc.aio.insecure_channel(session.grpc_target(sock))
        async with AsyncKernel(sock, lifeline, "token", channel) as k:
            with pytest.raises(BrokenPipeError, match="kernel unreachable"):
                await k.model_info()

    asyncio.run(calls())


def test_calls_on_a_closed_session_raise_ebadf_without_a_kernel(tmp_path):
    """Not a gRPC ValueError ("closed channel") nor "kernel unreachable": a pred still
    waiting when the session closes, and every later call, raise EBADF naming the socket."""
    sock = tmp_path / "k.sock"
    closed = f"{sock}: the session is closed"

    def check(call) -> None:
        with pytest.raises(OSError, match=closed) as e:
            call()
        assert e.value.errno == errno.EBADF

    lifeline, _ = socket.socketpair()
    k = Kernel(sock, lifeline, "token", grpc.insecure_channel(session.grpc_target(sock)))
    k.close()
    for call in (lambda: k.stat("/tmp"), lambda: k.pred(3, [1]), lambda: k.close(3),
                 lambda: k.export("/tmp/a"), lambda: k.acting_as(0, 0).getpid()):
        check(call)
    k.close()  # again: nothing left to do

    async def calls() -> None:
        lifeline, _ = socket.socketpair()
        channel = grpc.aio.insecure_channel(session.grpc_target(sock))
        k = AsyncKernel(sock, lifeline, "token", channel)
        waiting = asyncio.create_task(k.pred(3, [1]))  # sent; no kernel answers it
        await asyncio.sleep(0.05)
        await k.close()
        for call in (waiting, k.stat("/tmp"), k.pred(3, [1]), k.export("/tmp/a")):
            with pytest.raises(OSError, match=closed) as e:
                await call
            assert e.value.errno == errno.EBADF
        await k.close()

    asyncio.run(calls())


def test_a_with_blocks_own_error_is_not_replaced_by_its_close(tmp_path):
    """A with block that raises (a pred's EIO when the kernel died) keeps its error when
    the close on the way out fails too; a block that ends well still reports its close's
    failure."""
    sock = tmp_path / "k.sock"
    lifeline, _ = socket.socketpair()
    k = Kernel(sock, lifeline, "token", grpc.insecure_channel(session.grpc_target(sock)))
    k.close()  # every call now fails, the files' closes too
    with pytest.raises(LookupError, match="the block's"):
        with File(k, 3):
            raise LookupError("the block's")
    with pytest.raises(LookupError, match="the block's"):
        with Context(k, File(k, 3)):
            raise LookupError("the block's")
    with pytest.raises(OSError) as e:
        with File(k, 3):
            pass
    assert e.value.errno == errno.EBADF

    async def blocks() -> None:
        lifeline, _ = socket.socketpair()
        ak = AsyncKernel(sock, lifeline, "token", grpc.aio.insecure_channel(
            session.grpc_target(sock)))
        await ak.close()
        with pytest.raises(LookupError, match="the block's"):
            async with AsyncFile(ak, 3):
                raise LookupError("the block's")
        with pytest.raises(OSError):
            async with AsyncFile(ak, 3):
                pass

    asyncio.run(blocks())


# -- requests -----------------------------------------------------------------------------


def test_pred_request_from_keywords():
    f = File(None, 7)
    sampling = convert.sampler(None, {"temperature": 0.7, "top_k": 5, "seed": 0})
    call = convert.pred(f, [1, 2, 3], None, [0, 2], sampling, False)
    req = call.request
    assert call.rpc == "Pred" and req.fd == 7 and list(req.tokens) == [1, 2, 3]
    assert list(req.positions) == [] and list(req.outputs) == [0, 2]
    assert req.sampler.top_k == 5 and req.sampler.top_p == 1.0
    assert req.sampler.HasField("seed") and req.sampler.seed == 0  # seed 0 is a seed


def test_pred_defaults_to_greedy_without_a_seed():
    req = convert.pred(3, [1], None, None, convert.sampler(None, {}), True).request
    assert req.sampler.temperature == 0 and not req.sampler.HasField("seed") and req.no_outputs


@pytest.mark.parametrize("field, value", [
    ("seed", 1 << 64), ("seed", -(1 << 63) - 1), ("top_k", 1 << 40), ("top_logprobs", 1 << 31),
])
def test_a_sampler_integer_the_proto_cannot_hold_is_einval_naming_it(field, value):
    with pytest.raises(OSError, match=f"sampler: {field} must be a signed") as e:
        convert.pred(3, [1], None, None, convert.sampler(None, {field: value}), False)
    assert e.value.errno == errno.EINVAL
    convert.Sampling(seed=(1 << 63) - 1, top_k=(1 << 31) - 1)  # the largest it can


INT32 = st.integers(-(1 << 31), (1 << 31) - 1)
FLOAT32 = st.floats(width=32)
FEW = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FEW
@given(fd=st.integers(0, (1 << 31) - 1), tokens=st.lists(INT32, max_size=40),
       positions=st.none() | st.lists(st.integers(-(1 << 63), (1 << 63) - 1), max_size=40),
       outputs=st.none() | st.lists(INT32, max_size=5), no_outputs=st.booleans(),
       sampling=st.builds(convert.Sampling, temperature=FLOAT32, top_k=INT32, top_p=FLOAT32,
                          min_p=FLOAT32, seed=st.none() | st.integers(-(1 << 63), (1 << 63) - 1),
                          top_logprobs=INT32),
       extras=st.just(convert.NO_EXTRAS) | st.builds(
           convert.PredExtras,
           control=st.none() | st.lists(st.builds(
               convert.LogitControl, allowed=st.none() | st.binary(max_size=16),
               bias=st.none() | st.dictionaries(INT32, FLOAT32, max_size=3),
               score=st.lists(INT32, max_size=3)), max_size=3),
           score_next=st.booleans(), parents=st.none() | st.lists(INT32, max_size=5),
           truncate=st.none() | st.integers(-(1 << 63), (1 << 63) - 1)))
def test_the_lifeline_request_is_protobufs_serialization(fd, tokens, positions, outputs,
                                                         no_outputs, sampling, extras):
    want = convert.pred(fd, tokens, positions, outputs, sampling, no_outputs, extras).request
    got = convert.pred_request(fd, tokens, positions, outputs, sampling, no_outputs, extras)
    assert got == want.SerializeToString()


EDGE_INTS = st.sampled_from([0, 1, 127, 128, 16383, 16384, (1 << 31) - 1, 1 << 31, -1])


@FEW
@given(fd=st.integers(0, (1 << 31) - 1) | EDGE_INTS,
       tokens=st.lists(st.integers(0, (1 << 31) - 1) | EDGE_INTS, min_size=0, max_size=10),
       seed=st.none() | st.integers(0, 1 << 40))
def test_a_decode_loops_request_is_written_as_protobuf_writes_it(fd, tokens, seed):
    """A request of a few tokens is written without protobuf's message (_plain_head):
    byte for byte its serialization, and whatever that path does not take (a negative or
    too large value, no tokens, more than PLAIN_TOKENS) fails or is written as protobuf
    does it."""
    sampling = convert.Sampling(seed=seed)
    assert _outcome(convert.pred_request, fd, tokens, None, None, sampling, False) == _outcome(
        lambda: convert.pred(fd, tokens, None, None, sampling, False).request
        .SerializeToString())
    for other in ([True], [3.0], (5,)):  # not a list of ints: protobuf's path, same bytes
        assert _outcome(convert.pred_request, fd, other, None, None, sampling, False) == (
            _outcome(lambda o=other: convert.pred(fd, o, None, None, sampling, False).request
                     .SerializeToString()))


def _outcome(fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # the same failure is the point
        return type(e), getattr(e, "errno", None)


@FEW
@given(outputs=st.lists(st.builds(
           pb.PredOutput, row=INT32, token=INT32, logprob=FLOAT32,
           top=st.lists(st.builds(pb.TopLogprob, id=INT32, logprob=FLOAT32), max_size=3),
           model_logprob=st.none() | FLOAT32, scores=st.lists(FLOAT32, max_size=2),
           next_logprob=st.none() | FLOAT32),
           max_size=4),
       code=st.sampled_from([0, errno.EINVAL, errno.ENOSPC]), cut=st.integers(0, 200))
def test_the_lifeline_reply_reads_as_protobufs(outputs, code, cut):
    error = pb.Error(errno=code, message="no") if code else None
    payload = pb.PredReply(error=error, outputs=outputs).SerializeToString()
    for data in (payload, payload[:cut]):  # whole, and cut short (mostly no longer a reply)
        want = _outcome(lambda d: convert.pred(3, [1], None, None, convert.GREEDY, False).result(
            errors.check(pb.PredReply.FromString(d))), data)
        assert repr(_outcome(convert.pred_outputs, data)) == repr(want)  # NaN too


def test_a_mask_is_xgrammars_packed_layout_from_bytes_arrays_or_tensors():
    import numpy as np
    import torch

    ids = {0, 5, 31, 32, 63, 99}
    mask = convert.LogitControl.allowing(ids, 100).proto().allowed
    assert len(mask) == 4 * 4  # ceil(100 / 32) little-endian int32 words
    words = np.frombuffer(mask, dtype="<i4")
    assert {t for t in range(100) if words[t // 32] >> (t % 32) & 1} == ids
    assert convert.LogitControl(allowed=words).proto().allowed == mask
    assert convert.LogitControl(allowed=torch.from_numpy(words.copy())).proto().allowed == mask
    with pytest.raises(TypeError, match="not list"):  # a list of ids is not a mask
        convert.LogitControl(allowed=[0, 5]).proto()
    control = convert.LogitControl(bias={7: -1.5, 2: 3.0}, score=[4, 1]).proto()
    assert dict(zip(control.bias_ids, control.bias_values, strict=True)) == {7: -1.5, 2: 3.0}
    assert list(control.score_ids) == [4, 1] and control.allowed == b""
    assert convert.pred_extras(None, False, None, None) is convert.NO_EXTRAS


def test_pred_takes_a_sampler_or_keywords_not_both():
    with pytest.raises(TypeError):
        convert.sampler(convert.Sampling(temperature=1.0), {"seed": 1})
    with pytest.raises(TypeError):
        convert.sampler(None, {"temprature": 1.0})


def test_fds_are_ints_or_files_and_targets_paths_or_fds():
    assert convert.close(File(None, 4)).request.fd == 4
    assert convert.fork(AsyncFile(None, 5)).request.fd == 5
    by_fd = convert.stat(0).request
    assert by_fd.WhichOneof("target") == "fd" and by_fd.fd == 0
    by_path = convert.export(os.path.join("/home", "u", "x"), 10, 0).request
    assert by_path.path == "/home/u/x" and by_path.offset == 10
    assert convert.read(1, 0, None).request.count == convert.READ_ALL


def test_tokenize_messages():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    req = convert.tokenize("", messages, True, False).request
    assert [(m.role, m.content) for m in req.messages] == [("system", "be brief"), ("user", "hi")]
    assert req.add_generation_prompt and not req.add_special


def test_attach_names_the_program_by_default():
    req = convert.attach(None, ["/usr/lib/lips/chat.py", "--x"]).request
    assert req.name == "chat.py" and list(req.argv) == ["/usr/lib/lips/chat.py", "--x"]
    assert convert.attach("mine", []).request.name == "mine"


def test_import_chunks_name_the_file_first_and_stay_small():
    data = bytes(range(256)) * (3 * convert.CHUNK_BYTES // 256 + 1)
    chunks = list(convert.import_chunks("/home/u/f", 0o640, data))
    assert (chunks[0].path, chunks[0].mode) == ("/home/u/f", 0o640)
    assert all(c.path == "" for c in chunks[1:])
    assert all(len(c.data) <= convert.CHUNK_BYTES for c in chunks)
    assert b"".join(c.data for c in chunks) == data
    pieces = list(convert.import_chunks("/f", 0o600, iter([b"ab", b"", b"c"])))
    assert [c.data for c in pieces] == [b"ab", b"c"] and pieces[0].path == "/f"


def test_an_empty_import_is_one_naming_chunk():
    (chunk,) = convert.import_chunks("/f", 0o600, b"")
    assert chunk.path == "/f" and chunk.data == b""


# -- replies ------------------------------------------------------------------------------


def test_replies_become_plain_values():
    info = convert.model_info().result(
        pb.ModelInfoReply(name="m", eos_ids=[2, 7], special_tokens={"<|eos|>": 2}, bos_id=-1)
    )
    assert info.eos_ids == (2, 7) and info.special_tokens == {"<|eos|>": 2}
    assert info.bos_id == -1 and not info.has_tokenizer
    outs = convert.pred(0, [1], None, None, convert.Sampling(), False).result(
        pb.PredReply(
            outputs=[pb.PredOutput(row=0, token=9, logprob=-0.5, top=[pb.TopLogprob(id=9)])]
        )
    )
    assert outs == [convert.PredOutput(0, 9, -0.5, [(9, 0.0)], -0.5, [], None)]
    scored = convert.pred(0, [1, 2], None, None, convert.Sampling(), False).result(
        pb.PredReply(outputs=[pb.PredOutput(row=0, token=3, logprob=-0.25, model_logprob=-2.0,
                                            scores=[-1.0, -3.0], next_logprob=-4.0)]))
    assert scored == [convert.PredOutput(0, 3, -0.25, [], -2.0, [-1.0, -3.0], -4.0)]
    vocab = convert.vocab().result(pb.VocabReply(tokens=[b"", b"a", b"\xe2"], special_ids=[0]))
    assert vocab.tokens == [b"", b"a", b"\xe2"] and vocab.special_ids == {0}
    entries = convert.readdir("/d").result(
        pb.ReaddirReply(entries=[pb.DirEntry(name="x", stat=pb.StatReply(mode=0o40755, ino=3))])
    )
    assert entries[0][0] == "x" and entries[0][1].ino == 3 and entries[0][1].is_dir
    procs = convert.ps().result(pb.PsReply(procs=[pb.ProcInfo(pid=1, argv=["a", "b"])]))
    assert procs[0].pid == 1 and procs[0].argv == ("a", "b")
    assert convert.read(0, 0, 2).result(pb.ReadReply(tokens=[5, 6], positions=[0, 1])) == (
        [5, 6],
        [0, 1],
    )


# -- the two clients ----------------------------------------------------------------------


def _api(cls) -> dict[str, list]:
    """Public methods and their parameters: names, kinds and defaults."""
    return {
        name: [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]
        for name, fn in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


@pytest.mark.parametrize(
    "sync, async_", [(Kernel, AsyncKernel), (File, AsyncFile), (Context, AsyncContext)]
)
def test_the_asyncio_twin_has_the_same_api(sync, async_):
    ours, theirs = _api(sync), _api(async_)
    theirs.pop("create", None)  # AsyncContext's constructor, which can await
    if sync is Context:
        assert {"tokens", "stop"} <= set(theirs) - set(ours)  # properties on the sync side
        theirs.pop("tokens"), theirs.pop("stop")
    assert ours == theirs


def test_every_rpc_has_a_method():
    rpcs = pb.DESCRIPTOR.services_by_name["Kernel"].methods_by_name
    snake = {"GetPid": "getpid", "ModelInfo": "model_info", "Import": "import_file"}
    for rpc in rpcs:
        name = snake.get(rpc, rpc.lower())
        assert callable(getattr(Kernel, name)) and callable(getattr(AsyncKernel, name)), rpc


# -- context helpers ----------------------------------------------------------------------


def test_seeded_steps_draw_different_reproducible_seeds():
    assert _step_sampling({"temperature": 1.0, "seed": 10}, 3) == {"temperature": 1.0, "seed": 13}
    assert _step_sampling({"temperature": 1.0, "seed": None}, 3)["seed"] is None
    assert _step_sampling({}, 3) == {}


def test_truncating_keeps_the_pending_tokens_below_the_cut():
    assert _kept([7, 8, 9], written=10, length=12) == [7, 8]
    assert _kept([7, 8, 9], written=10, length=10) == []
    assert _kept([7, 8, 9], written=10, length=4) == []


# -- flags --------------------------------------------------------------------------------


def _flags(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_sampling_flags(p)
    return p.parse_args(argv)


def test_sampling_flags_are_greedy_unless_a_temperature_is_given():
    assert sampling_kwargs(_flags())["temperature"] == 0.0
    assert sampling_kwargs(_flags("--temperature", "0.8", "--seed", "3")) == {
        "temperature": 0.8,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "seed": 3,
    }
    assert sampling_kwargs(_flags("--temperature", "0.8", "--greedy"))["temperature"] == 0.0
    convert.Sampling(**sampling_kwargs(_flags("--top-k", "4")))  # the names Sampling takes


def test_parse_ids_and_kv_paths():
    assert parse_ids("1,2 3") == [1, 2, 3]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_ids("1,x")
    assert kv_path("/home/u", "a/b.kv") == "/home/u/a/b.kv"
    assert kv_path("/home/u", "/tmp/b.kv") == "/tmp/b.kv"


def test_report_says_what_went_wrong(capsys):
    assert report("chat", FileNotFoundError(errno.ENOENT, "'/home/u/x'")) == 1
    assert capsys.readouterr().err == "chat: '/home/u/x': No such file or directory\n"
    report("kv", PermissionError(errno.EACCES, "open '/home/root/x': permission denied"))
    assert capsys.readouterr().err == "kv: open '/home/root/x': permission denied\n"  # once
    report("chat", ValueError("empty prompt"))
    assert capsys.readouterr().err == "chat: empty prompt\n"
    report("symphony", FileNotFoundError(errno.ENOENT, "No such file or directory", "-"))
    assert capsys.readouterr().err == "symphony: -: No such file or directory\n"


# -- LIPs without a kernel ----------------------------------------------------------------


@pytest.mark.parametrize(
    "lip, argv",
    [
        ("complete", ["--prompt", "x"]),
        ("chat", ["--message", "hi"]),
        ("best_of_n", ["--prompt-ids", "1,2"]),
        ("prompt_cache", ["--document", __file__, "--cache", "c", "--question", "q"]),
    ],
)
def test_lips_report_a_missing_kernel(lip, argv, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SYMPHONY_SOCKET", str(tmp_path / "k.sock"))
    module = __import__(f"lips.{lip}", fromlist=["main"])
    assert module.main(argv) == 1
    assert capsys.readouterr().err.startswith(f"{lip}: no Symphony kernel at {tmp_path}")


LIP_ARGV = {"complete": ["--prompt", "x"], "chat": ["--message", "hi"],
            "best_of_n": ["--prompt-ids", "1,2"], "constrained": ["--prompt", "x", "--regex", "a"],
            "cacheback": ["--prompt", "x"], "sink": ["--prompt", "x"],
            "async_lm": ["--prompt", "x"], "agent": ["--question", "t"],
            "prompt_cache": ["--document", __file__, "--cache", "c", "--question", "q"]}


@pytest.mark.parametrize("lip", sorted(LIP_ARGV))
@pytest.mark.parametrize("flag, value", [
    ("--temperature", "-1"), ("--temperature", "nan"), ("--top-p", "2"), ("--top-k", "-5"),
    ("--min-p", "-0.5"), ("--max-new-tokens", "0"), ("--seed", str(1 << 63))])
def test_a_bad_sampling_flag_is_a_usage_error_before_any_kernel(lip, flag, value, tmp_path,
                                                                monkeypatch, capsys):
    """Every program that takes the sampling flags refuses a value the kernel would refuse
    with exit status 2 and the flag's name (docs/programs.md), not once the kernel was
    asked (a prompt cache had built its modules by then)."""
    monkeypatch.setenv("SYMPHONY_SOCKET", str(tmp_path / "k.sock"))
    module = __import__(f"lips.{lip}", fromlist=["main"])
    with pytest.raises(SystemExit) as e:
        module.main([*LIP_ARGV[lip], flag, value])
    assert e.value.code == 2
    assert f"argument {flag}: " in capsys.readouterr().err
    good = "1" if flag in ("--max-new-tokens", "--seed") else "0"
    assert module.main([*LIP_ARGV[lip], flag, good]) == 1  # the flags parse: no kernel


@pytest.mark.parametrize("ids", ["", " ", ","])
@pytest.mark.parametrize("lip", ["complete", "best_of_n", "sink"])
def test_no_prompt_ids_is_a_usage_error(lip, ids, tmp_path, monkeypatch, capsys):
    """`--prompt-ids ""` was `complete: empty prompt`, exit 1, once the kernel was asked."""
    module = __import__(f"lips.{lip}", fromlist=["main"])
    monkeypatch.setenv("SYMPHONY_SOCKET", str(tmp_path / "k.sock"))
    with pytest.raises(SystemExit) as e:
        module.main(["--prompt-ids", ids])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument --prompt-ids: no token ids" in err


def test_complete_ends_the_echoed_prompt_before_an_error(monkeypatch, capsys):
    """The echoed prompt had no newline, so the error followed it on its line
    ("xcomplete: pred: ...")."""
    from types import SimpleNamespace

    from lips import complete

    class FakeKernel:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def model_info(self):
            return SimpleNamespace(has_tokenizer=True, eos_ids=[0], context_length=1024)

        def tokenize(self, text, add_special=False):
            return [1, 2]

    class FailingContext:
        def __init__(self, k, **kw):
            pass

        def __enter__(self):
            raise OSError(errno.EINVAL, "pred: top_k 999999 is past the vocabulary")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(Kernel, "connect", classmethod(lambda cls, *a, **kw: FakeKernel()))
    monkeypatch.setattr(complete, "Context", FailingContext)
    assert complete.main(["--prompt", "x", "--top-k", "999999"]) == 1
    out, err = capsys.readouterr()
    assert out == "x\n" and err.startswith("complete: pred: top_k 999999")


def test_best_of_n_needs_one_continuation(capsys):
    from lips import best_of_n

    with pytest.raises(SystemExit) as e:
        best_of_n.main(["--prompt", "x", "--n", "0"])
    assert e.value.code == 2
    assert f"argument --n: must be in [1, {session.FD_MAX - 1}], got 0" in capsys.readouterr().err


@pytest.mark.parametrize("build", [
    lambda: convert.splice(3, 2**63 - 1, 2**63, 3),
    lambda: convert.punch(3, -2**63, -2**63 - 1),
    lambda: convert.truncate(2**31, 0),
    lambda: convert.chown("/tmp/x", 2**40, 0),
    lambda: convert.import_chunks("/tmp/x", 2**40, b""),
])
def test_an_argument_the_wire_cannot_carry_is_einval_naming_the_call(build):
    with pytest.raises(OSError) as e:
        build()
    assert e.value.errno == errno.EINVAL and "does not fit" in str(e.value)


OWN_PID_CHILD = """
import os
from syscalls.own_pid import own_pid
assert own_pid() == os.getpid()
r, w = os.pipe()
child = os.fork()
if child == 0:
    os.write(w, b"%d %d" % (own_pid(), os.getpid()))
    os._exit(0)
os.waitpid(child, 0)
kept, real = map(int, os.read(r, 64).split())
print(kept == real == child and own_pid() == os.getpid() != child)
"""


def test_own_pid_is_the_childs_after_a_fork():
    """The clients' fork check reads the pid kept by syscalls/own_pid.py: a forked child
    must read its own, or it would use its parent's ring. (The fork happens in a process of
    its own, as test_rings.py's does.)"""
    out = subprocess.run([sys.executable, "-c", OWN_PID_CHILD], capture_output=True, text=True,
                         timeout=60, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
