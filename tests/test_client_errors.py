"""A client's mistakes against a real kernel: each gets a documented errno naming what was
wrong, never EIO, a bare gRPC error or a dead session. And `symphony start` after a crash."""

from __future__ import annotations

import errno
import math
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from daemon import ROOT, prompt

from kvfs.errors import FSError
from symphony.server import MESSAGE_MAX, as_cred, error_reply
from symphony.syscall_table import pred_reply_bytes
from syscalls import symphony_pb2 as pb
from syscalls import wire
from syscalls.client import Kernel

pytestmark = pytest.mark.slow

# Room for the many files of the concurrency test.
DAEMON_FLAGS = ("--kv-pages", "4096")


def raises(errno_: int, match: str, call, *args, **kwargs) -> OSError:
    with pytest.raises(OSError, match=match) as e:
        call(*args, **kwargs)
    assert e.value.errno == errno_, e.value
    return e.value


# -- symphony-as --------------------------------------------------------------------------


@pytest.mark.parametrize("value, says", [
    ("0:99999999999", "gid 99999999999 is not in"),
    ("-1:-1", "uid -1 is not in"),
    ("4294967295:0", "uid 4294967295 is not in"),  # (uid_t) -1
    ("2147483648:0", "uid 2147483648 is not in"),  # past the protocol's int32
    ("1:2:3", "'1:2:3' is not uid:gid"),
    ("9" * 5000 + ":0", "is not uid:gid"),  # past int()'s digit limit
])
def test_symphony_as_takes_two_ids_of_uid_t(value, says):
    raises(errno.EINVAL, says, as_cred, value)


def test_a_root_session_acting_as_no_id_gets_einval(daemon):
    if os.geteuid() != 0:
        pytest.skip("only a root session may act as another user")
    with daemon.connect() as k:
        for uid, gid in ((0, 99999999999), (-1, -1)):
            raises(errno.EINVAL, f"symphony-as: '{uid}:{gid}'", k.acting_as(uid, gid).stat,
                   "/tmp")
        raises(errno.EINVAL, "gid 4294967294 is not in", k.acting_as(0, 4294967294).stat,
               "/tmp")
        assert k.acting_as(2147483647, 2147483647).stat("/tmp").is_dir


HELLO = """
import errno, sys
from syscalls.client import Kernel
try:
    Kernel.connect(sys.argv[1])
except OSError as e:
    print(e.errno, e)
"""


def test_a_process_whose_uid_the_protocol_cannot_carry_is_refused_at_hello(daemon):
    """A uid past 2**31 - 1 (uid_t allows it) would be a negative int32 in every reply: the
    hello is refused, EINVAL naming it, and the kernel goes on."""
    if os.geteuid() != 0:
        pytest.skip("only root can run a process as uid 3000000000")
    run = subprocess.run(["setpriv", "--reuid=3000000000", "--regid=3000000000", "--clear-groups",
                          sys.executable, "-c", HELLO, str(daemon.socket)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)  # daemon.as_user: why
    assert run.stdout.startswith(f"{errno.EINVAL} ") and "uid 3000000000 is not in" in run.stdout, \
        (run.stdout, run.stderr)
    with daemon.connect() as k:
        assert k.stat("/tmp").is_dir


# -- pred ---------------------------------------------------------------------------------


def test_an_error_message_is_cut_to_message_max():
    """Whatever an error quotes, its reply stays small enough to be sent."""
    long = error_reply(pb.PredReply, FSError(errno.EINVAL, "x" * 10_000_000))
    assert long.error.errno == errno.EINVAL and len(long.error.message) == MESSAGE_MAX
    assert long.error.message.endswith("... (cut: 10000000 characters)")
    short = error_reply(pb.PredReply, FSError(errno.ENOENT, "'/home/a'"))
    assert short.error.message == "'/home/a'"


def test_the_reply_bound_holds_for_the_longest_values():
    most = (1 << 31) - 1
    for rows, top in ((1, 0), (3, 7), (40, 320)):
        reply = pb.PredReply(outputs=[
            pb.PredOutput(row=most, token=most, logprob=-1.0,
                          top=[pb.TopLogprob(id=most, logprob=-1.0)] * top)] * rows)
        assert reply.ByteSize() <= pred_reply_bytes(rows, top)


@pytest.mark.parametrize("lifeline", [True, False])
def test_a_pred_whose_reply_cannot_be_sent_is_refused_up_front(daemon, lifeline):
    """24000 rows of all 320 logprobs would be a 74 MB reply, over wire.MAX_PAYLOAD: the
    kernel computed it all, then a lifeline client died of the frame (UnboundLocalError)."""
    with Kernel.connect(daemon.socket, lifeline_pred=lifeline) as k, k.open() as f:
        n = 24000
        raises(errno.EMSGSIZE, "over the 64 MiB limit of a reply", f.pred, prompt(n),
               positions=[i % 4000 for i in range(n)], outputs=range(n), top_logprobs=320)
        assert f.stat().tokens == 0
        assert len(f.pred(prompt(8), outputs=range(8), top_logprobs=320)[7].top) == 320


@pytest.mark.parametrize("sampling, says", [
    ({"temperature": math.inf}, "temperature must be finite"),
    ({"temperature": 1e300}, "temperature must be finite"),  # inf as the proto's float
    ({"temperature": math.nan}, "temperature must be finite"),
    ({"temperature": 1.0, "top_p": math.nan}, r"top_p must be in \[0, 1\]"),
    ({"temperature": 1.0, "top_p": -0.1}, r"top_p must be in \[0, 1\] \(0 or 1: no limit\)"),
    ({"top_k": 1 << 40}, "top_k must be a signed 32-bit integer"),
    ({"top_logprobs": 321}, r"top_logprobs must be in \[0, 320\]"),
    ({"temperature": 1.0, "seed": 1 << 64}, "seed must be a signed 64-bit integer"),
])
def test_a_bad_sampler_is_einval_naming_the_field(daemon, sampling, says):
    with daemon.connect() as k, k.open() as f:
        raises(errno.EINVAL, says, f.pred, [5], **sampling)
        assert len(f.pred([5], temperature=1.0, seed=-(1 << 63))) == 1  # any int64 seeds


def test_requests_up_to_the_message_limit_pass_and_longer_get_emsgsize(daemon):
    with daemon.connect() as k:
        assert len(k.tokenize("ab " * (2 << 20))) > 0  # 6 MiB: over gRPC's own 4 MiB
        raises(errno.EMSGSIZE, str(wire.MAX_PAYLOAD), k.tokenize, "a" * (65 << 20))
        assert k.getpid() == k.pid  # the session goes on


def test_an_fd_is_an_int_or_a_file_not_a_float(k):
    """int() would truncate 3.7 to fd 3, and close a file nobody named."""
    f = k.open()
    for call, *args in ((k.close, float(f.fd)), (k.read, f.fd + 0.5, 0, 1),
                        (k.stat, float(f.fd)), (k.pred, float(f.fd), [5]),
                        (k.splice, f, 0, 0, str(f.fd))):
        with pytest.raises(TypeError, match="an fd is an int or a File"):
            call(*args)
    assert k.stat(f).tokens == 0 and k.stat(f.fd) == k.stat(f)  # still open
    f.close()


def test_a_call_on_an_fd_not_open_for_it_names_the_fd(k):
    """EBADF names the fd whichever call it refuses, as pred's does, and changes nothing."""
    with k.open("/tmp/ebadf-modes", os.O_CREAT | os.O_RDWR) as rw:
        rw.pred([1, 2, 3])
    with k.open("/tmp/ebadf-modes", os.O_WRONLY) as w, \
            k.open("/tmp/ebadf-modes", os.O_RDONLY) as r, k.open() as other:
        for what, mode, call, *args in (
                ("export", "reading", k.export, w), ("read", "reading", k.read, w, 0, 1),
                ("fork", "reading", k.fork, w), ("splice", "reading", k.splice, w, 0, 1, other),
                ("splice", "writing", k.splice, other, 0, 0, r),
                ("truncate", "writing", k.truncate, r, 1), ("punch", "writing", k.punch, r, 0, 1),
                ("keep", "writing", k.keep, r, 0, [0]), ("shift", "writing", k.shift, r, 0, 1, 1),
                ("pred", "writing", k.pred, r, [4])):
            fd = next(a for a in args if a in (w, r)).fd
            raises(errno.EBADF, rf"] {what}: fd {fd} is not open for {mode}$", call, *args)
        assert k.stat(r).tokens == 3 and k.read(r) == ([1, 2, 3], [0, 1, 2])
    k.unlink("/tmp/ebadf-modes")


# -- the session's end --------------------------------------------------------------------


def test_calls_after_exit_get_eperm_and_after_close_ebadf(daemon):
    for lifeline in (True, False):
        k = Kernel.connect(daemon.socket, lifeline_pred=lifeline)
        f = k.open()
        k.exit(3)
        for call, *args in ((k.getpid,), (f.pred, [5]), (k.stat, "/tmp"), (k.exit,)):
            raises(errno.EPERM, f"{daemon.socket}: no session: process {k.pid} has exited",
                   call, *args)
        k.close()
        k = Kernel.connect(daemon.socket, lifeline_pred=lifeline)
        f = k.open()
        k.close()
        for call, *args in ((k.getpid,), (f.pred, [5]), (f.close,), (k.exit,)):
            raises(errno.EBADF, f"{daemon.socket}: the session is closed", call, *args)


def run_python(code: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_thousands_of_calls_in_flight_on_one_asyncio_session_all_complete(daemon):
    """3000 tasks, each open, pred and close: gRPC's server once shed about a sixth of
    such calls with CANCELLED. Leaving asyncio.run afterwards prints nothing."""
    done = run_python("""
        import asyncio, sys
        from syscalls.aio import AsyncKernel

        async def main(n):
            async with await AsyncKernel.connect(sys.argv[1]) as k:
                async def one(i):
                    async with await k.open() as f:
                        return await f.pred([6 + i % 290])
                got = await asyncio.gather(*(one(i) for i in range(n)))
            print(sum(len(outs) for outs in got))

        asyncio.run(main(3000))
        """, str(daemon.socket))
    assert (done.returncode, done.stdout, done.stderr) == (0, "3000\n", "")


def test_async_calls_after_exit_get_eperm(daemon):
    done = run_python("""
        import asyncio, errno, sys
        from syscalls.aio import AsyncKernel

        async def main():
            k = await AsyncKernel.connect(sys.argv[1])
            f = await k.open()
            await k.exit(0)
            for call in (k.getpid(), f.pred([5]), k.stat("/tmp")):
                try:
                    await call
                except PermissionError as e:
                    print(e.errno == errno.EPERM, "has exited" in str(e))

        asyncio.run(main())
        """, str(daemon.socket))
    assert (done.returncode, done.stdout, done.stderr) == (0, "True True\n" * 3, "")


# -- symphony start after a crash ---------------------------------------------------------


def symphony(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "symphony.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def zombie() -> subprocess.Popen:
    """A child of ours that has exited and that nobody has waited for: a program run, not
    os.fork, whose child would run gRPC's at-fork handler in the suite's process (that can
    hang). Keep the Popen referenced until the end: one collected unwaited is reaped by
    subprocess's next start."""
    child = subprocess.Popen(["true"])
    while open(f"/proc/{child.pid}/stat").read().split(") ")[1][0] != "Z":
        time.sleep(0.01)
    return child


@pytest.mark.parametrize("stale", ["a live process", "a zombie"])
def test_start_after_a_crash_whose_pid_file_names_another_process(model, tmp_path, stale):
    sock = tmp_path / "kernel.sock"
    live = stale == "a live process"
    other = subprocess.Popen(["sleep", "300"]) if live else zombie()
    try:
        # as a crash leaves it
        sock.with_name("kernel.sock.pid").write_text(f"{other.pid}\n")
        started = symphony("start", "--socket", str(sock), "--model", str(model),
                           "--state-dir", str(tmp_path / "state"), "--kv-pages", "64")
        assert started.returncode == 0, started.stderr
        status = symphony("status", "--socket", str(sock))
        assert status.returncode == 0 and f"on {sock}" in status.stdout
        stopped = symphony("stop", "--socket", str(sock))
        assert stopped.returncode == 0, stopped.stderr
        assert symphony("stop", "--socket", str(sock)).returncode == 1  # none runs now
        assert not live or other.poll() is None  # not signalled
    finally:
        symphony("stop", "--socket", str(sock))  # when the test failed with it running
        other.kill()
        other.wait()


def test_a_process_has_at_most_fd_max_fds_open(daemon):
    """Past FD_MAX open fds, open and fork fail with EMFILE naming the process and the
    limit, and change nothing; a close makes room again."""
    from syscalls.session import FD_MAX

    with daemon.connect("fds") as k:
        with k.open("/tmp/fd-max.kv", os.O_CREAT | os.O_RDWR) as f:
            f.pred(prompt(3), no_outputs=True)
        fds = [k.open("/tmp/fd-max.kv") for _ in range(FD_MAX)]
        for call in (lambda: k.open("/tmp/fd-max.kv"), lambda: k.open("/tmp/new.kv",
                                                                     os.O_CREAT | os.O_RDWR),
                     lambda: fds[0].fork()):
            with pytest.raises(OSError) as e:
                call()
            assert e.value.errno == errno.EMFILE
            assert f"process {k.getpid()} has {FD_MAX} fds open, its limit" in str(e.value)
        assert [n for n, _ in k.readdir("/tmp")].count("new.kv") == 0
        fds.pop().close()
        k.open("/tmp/fd-max.kv").close()


# -- the socket's path --------------------------------------------------------------------


def test_a_socket_named_through_a_symlink_reaches_its_kernel(daemon):
    """The hello socket is beside the kernel's socket, not beside the symlink: status said
    "starting: ... does not serve yet" of a serving kernel, and every client "something
    listens on the socket but answers no hello"."""
    link = daemon.socket.with_name("kl.sock")
    link.symlink_to(daemon.socket.name)  # as `ln -s kernel.sock kl.sock` makes it
    try:
        with Kernel.connect(link, name="linked") as k:
            assert k.ps()[-1].name == "linked"
        status = symphony("status", "--socket", str(link))
        assert (status.returncode, status.stderr) == (0, ""), status
        assert f"kernel {daemon.process.pid} on {link}\n" in status.stdout
    finally:
        link.unlink()


def test_status_of_a_stopped_kernel_says_it_is_not_answering(daemon):
    """`kill -STOP` on the kernel hung `symphony status` for ever; it says so in a few
    seconds, status 3, and once the kernel goes on it serves as before."""
    from symphony.control import STATUS_HELLO_TIMEOUT

    os.kill(daemon.process.pid, signal.SIGSTOP)
    try:
        status = symphony("status", "--socket", str(daemon.socket))
    finally:
        os.kill(daemon.process.pid, signal.SIGCONT)
    assert (status.returncode, status.stderr) == (3, ""), status
    assert status.stdout.startswith(
        f"not answering: no hello from the kernel at {daemon.socket} in "
        f"{STATUS_HELLO_TIMEOUT:g} s: "), status
    assert symphony("status", "--socket", str(daemon.socket)).returncode == 0
