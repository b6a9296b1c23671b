"""End to end against a real kernel daemon on a Unix socket: LIPs as OS processes, the
process table freeing what dies, identity from SO_PEERCRED, and errnos that change nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch
from daemon import ROOT, meminfo, prompt, run_script, sched, start_daemon, wait_for

from symphony.engine_process import DRIVER_NICE
from syscalls import symphony_pb2 as pb
from syscalls.aio import AsyncKernel
from syscalls.convert import proc_fields
from syscalls.session import SESSION_KEY, grpc_target, hello

BUDGET = 48  # small, so that prompts are chunked and decodes interleave with prefills
SYMPHONY = [sys.executable, "-m", "symphony.cli"]


CUDA = torch.cuda.is_available()  # the daemon's default device, as the engine's
DAEMON_FLAGS = ("--kv-pages", "512", "--token-budget", str(BUDGET))


def run_lip(daemon, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*SYMPHONY, "run", *args], env=daemon.env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=120, **kw)


def generate_cli(model, ids: list[int], n: int) -> list[int]:
    """What `symphony generate` prints for a prompt."""
    out = subprocess.run(
        [*SYMPHONY, "generate", "--model", str(model), "--prompt-ids",
         ",".join(map(str, ids)), "--max-new-tokens", str(n), "--json"],
        capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout)["output_ids"]


@pytest.fixture(scope="module")
def alone(model):
    """Greedy tokens of one prompt alone, from the engine in this process, on the daemon's
    device and dtype (CUDA and bf16 where there is a GPU: bench/gpu.sh)."""
    from symphony.engine.engine import Engine
    from symphony.engine.generate import generate
    from symphony.engine.sampler import GREEDY

    engine = Engine(model, kv_pages=512)
    return lambda ids, n: generate(engine, [ids], GREEDY, n)[0]


def device_used(k) -> int:
    return int(meminfo(k)["device_used"])


def test_complete_equals_generate(daemon, model):
    ids = prompt(2 * BUDGET + 7)  # three prefill chunks
    lip = run_lip(daemon, "lips/complete.py", "--prompt-ids", ",".join(map(str, ids)),
                  "--max-new-tokens", "24", "--json")
    assert lip.returncode == 0, lip.stderr
    assert json.loads(lip.stdout)["output_ids"] == generate_cli(model, ids, 24)


def test_sixteen_concurrent_lips_get_what_they_get_alone(daemon, alone):
    prompts = [prompt(3 + 9 * i, salt=i) for i in range(16)]
    lips = [subprocess.Popen(
        [*SYMPHONY, "run", "lips/complete.py", "--prompt-ids", ",".join(map(str, ids)),
         "--max-new-tokens", "16", "--json"],
        env=daemon.env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for ids in prompts]
    outs = [lip.communicate(timeout=300) for lip in lips]
    for lip, (_, err) in zip(lips, outs, strict=True):
        assert lip.returncode == 0, err
    with daemon.connect() as k:
        stats = sched(k)
    assert int(stats["batch_seqs_max"]) > 1, "the LIPs never shared a forward pass"
    assert float(stats["loop_cpu_us_per_pred"]) > 0  # the loop thread's CPU, per pred
    assert 0 < float(stats["engine_busy"]) <= 1  # a share of the window
    # fp32 on the CPU runs the C kernels (this machine has a C compiler).
    want = "cuda bfloat16, attention triton" if CUDA else "cpu float32, attention c"
    assert stats["engine"] == want
    for ids, (out, _) in zip(prompts, outs, strict=True):
        assert json.loads(out)["output_ids"] == alone(ids, 16)


HOG = """
import os, sys
from syscalls.client import Kernel
k = Kernel.connect(name="hog")
f = k.open("", os.O_RDWR)
ids = [(5 * i) % 290 + 6 for i in range(200)]
f.pred(ids[:20])
print(k.pid, flush=True)
for _ in range(1000):
    f.pred(ids)
    f.truncate(0)
"""


# Kills itself while three threads keep preds in flight: the kill's own call loses its
# connection as the process dies, which must not cut its reaping short.
SUICIDE = """
import os, threading, time
from syscalls.client import Kernel
k = Kernel.connect(name="hog")
ids = [(5 * i) % 290 + 6 for i in range(200)]
def loop(f):
    while True:
        f.pred(ids, no_outputs=True)
        f.truncate(20)
for _ in range(3):
    f = k.open("", os.O_RDWR)
    f.pred(ids[:20], no_outputs=True)
    threading.Thread(target=loop, args=(f,), daemon=True).start()
print(k.pid, flush=True)
time.sleep(0.5)
k.kill(k.pid)
"""


@pytest.mark.parametrize("how", ["sigkill", "symphony kill", "itself"])
def test_killed_lip_leaks_nothing(daemon, how):
    with daemon.connect() as k:
        baseline = device_used(k)
        lip = subprocess.Popen([sys.executable, "-c", SUICIDE if how == "itself" else HOG],
                               env=daemon.env(), cwd=ROOT, stdout=subprocess.PIPE, text=True)
        pid = int(lip.stdout.readline())

        def running():
            return any(p.pid == pid and p.state == "running" for p in k.ps())

        if how != "itself":
            wait_for(running, what="the LIP to be inside pred")
            # Its loop truncates the file to nothing between preds: it holds pages at times.
            wait_for(lambda: device_used(k) > baseline, what="the LIP to hold pages")
        if how == "sigkill":
            lip.send_signal(signal.SIGKILL)
        elif how == "symphony kill":
            subprocess.run([*SYMPHONY, "kill", str(pid)], env=daemon.env(), check=True)
        assert lip.wait(30) == -signal.SIGKILL
        wait_for(lambda: all(p.pid != pid for p in k.ps()), what="the process to be reaped")
        wait_for(lambda: device_used(k) == baseline, what="its pages to be freed")


@pytest.mark.slow  # a daemon on the default model
def test_loop_answers_while_a_forward_pass_runs(tmp_path):
    d = start_daemon(ROOT / "models" / "tiny", None, "--kv-pages", "128",
                     "--token-budget", "1024")
    try:
        with d.connect() as k, k.open("", os.O_RDWR) as f:
            ids = prompt(1000)
            done = threading.Event()
            answered = []
            t = threading.Thread(target=lambda: (f.pred(ids), done.set()))
            t.start()
            wait_for(lambda: any(p.state == "running" for p in k.ps()), what="the pred")
            while not done.is_set():
                k.stat("/tmp")
                answered.append(time.monotonic())
            t.join()
        # Were the engine on the loop's thread, nothing could be answered while it ran.
        assert len(answered) >= 5, answered
    finally:
        assert d.stop() == 0, d.log_text()


# -- identity ---------------------------------------------------------------------------

AS_USER = """
import json, os, sys, grpc
from syscalls.client import Kernel
from syscalls import symphony_pb2 as pb, symphony_pb2_grpc
from syscalls.convert import proc_fields
from syscalls.session import SESSION_KEY, AS_KEY, grpc_target, hello, socket_path
# Become the user only now: Python itself may live where other users cannot read.
role, uid = sys.argv[1], int(sys.argv[2])
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
k = Kernel.connect(name="user")
secret = "/home/uid60001/secret"
def errno_of(fn):
    try:
        fn()
    except OSError as e:
        return e.errno
    return 0
if role == "owner":
    with k.open(secret, os.O_CREAT | os.O_RDWR, 0o600) as f:
        f.pred([7, 8, 9, 10], no_outputs=True)
    print(k.user, k.home)
else:
    results = {
        "open": errno_of(lambda: k.open(secret, os.O_RDONLY)),
        "open_rw": errno_of(lambda: k.open(secret, os.O_RDWR)),
        "unlink": errno_of(lambda: k.unlink(secret)),
        "rename": errno_of(lambda: k.rename(secret, "/tmp/stolen")),
        "chmod": errno_of(lambda: k.chmod(secret, 0o666)),
        "export": errno_of(lambda: k.export(secret)),
    }
    # A request that lies: a session of uid 60002 claiming to act as 60001 (or root).
    sock = socket_path()
    life, token = hello(sock)
    stub = symphony_pb2_grpc.KernelStub(grpc.insecure_channel(grpc_target(sock)))
    for claim in ("60001:60001", "0:0"):
        reply = stub.Open(pb.OpenRequest(path=secret, flags=os.O_RDONLY),
                          metadata=[(SESSION_KEY, token), (AS_KEY, claim)])
        results["as " + claim] = reply.error.errno
    print(json.dumps(results))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become two users")
def test_two_users_cannot_touch_each_others_files(daemon):
    assert run_script(daemon, AS_USER, "owner", "60001").split() == ["uid60001", "/home/uid60001"]
    results = json.loads(run_script(daemon, AS_USER, "other", "60002"))
    assert results == {
        "open": errno.EACCES, "open_rw": errno.EACCES, "unlink": errno.EACCES,
        "rename": errno.EACCES, "chmod": errno.EPERM, "export": errno.EACCES,
        "as 60001:60001": errno.EPERM, "as 0:0": errno.EPERM,
    }
    with daemon.connect() as k:  # root sees the file as it was
        st = k.stat("/home/uid60001/secret")
        assert (st.uid, st.mode & 0o777, st.tokens) == (60001, 0o600, 4)


# -- bad input --------------------------------------------------------------------------


def test_bad_calls_get_their_errno_and_change_nothing(daemon):
    with daemon.connect() as k, k.open("/tmp/kept", os.O_CREAT | os.O_RDWR) as f:
        f.pred(prompt(20), no_outputs=True)
        def state():  # reading sets atime: everything but that
            return (k.read(f), dataclasses.replace(k.stat(f), atime_ns=0), device_used(k),
                    sorted(n for n, _ in k.readdir("/tmp")))

        before = state()
        context = k.model_info().context_length
        bad = {
            errno.EBADF: lambda: k.pred(9999, [1]),
            errno.EINVAL: lambda: f.pred([1, 400, 2]),  # vocab is 320
            errno.EOVERFLOW: lambda: f.pred([1], positions=[context]),
            errno.ENOENT: lambda: k.open("/nowhere/x", os.O_RDONLY),
            errno.ENOTDIR: lambda: k.open("/tmp/kept/x", os.O_RDONLY),
            errno.EEXIST: lambda: k.open("/tmp/kept", os.O_CREAT | os.O_EXCL | os.O_RDWR),
            errno.EISDIR: lambda: k.open("/tmp", os.O_RDONLY),
        }
        for code, call in bad.items():
            with pytest.raises(OSError) as e:
                call()
            assert e.value.errno == code, (code, e.value)
        for outside in ("relative/path", "", "/tmp/" + "x" * 300):
            with pytest.raises(OSError) as e:
                k.stat(outside)
            assert e.value.errno in (errno.EINVAL, errno.ENAMETOOLONG, errno.ENOENT)
        # Bytes that are no request at all.
        life, token = hello(daemon.socket)
        channel = grpc.insecure_channel(grpc_target(daemon.socket))
        raw = channel.unary_unary("/symphony.Kernel/Pred", request_serializer=None,
                                  response_deserializer=pb.PredReply.FromString)
        reply = raw(b"\x0a\xff\xff\xff", metadata=[(SESSION_KEY, token)])
        assert reply.error.errno == errno.EINVAL and "malformed" in reply.error.message
        no_session = raw(pb.PredRequest(fd=3, tokens=[1]).SerializeToString())
        assert no_session.error.errno == errno.EPERM
        channel.close()
        life.close()
        assert state() == before



def lip_json(daemon, *args: str) -> dict:
    lip = run_lip(daemon, *args, "--json")
    assert lip.returncode == 0, lip.stderr
    return json.loads(lip.stdout)


def test_prompt_cache_answers_as_a_full_prefill_would(daemon, alone, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("The quick brown fox jumps over the lazy dog. " * 6)
    args = ("lips/prompt_cache.py", "--document", str(doc), "--cache", "doc.kv",
            "--question", "fox?", "--question", "dog?", "--max-new-tokens", "8")
    first, second = lip_json(daemon, *args), lip_json(daemon, *args)
    assert first["built"] and not second["built"]  # the second run only forks the file
    with daemon.connect() as k:
        document = k.tokenize(doc.read_text(), add_special=True)
        for a in first["answers"]:
            question = k.tokenize(f"\n\nQ: {a['question']}\nA:")
            assert a["output_ids"] == alone(document + question, 8)
    assert [a["output_ids"] for a in second["answers"]] == [
        a["output_ids"] for a in first["answers"]]


def test_best_of_n_picks_the_most_likely_of_n_reproducible_branches(daemon):
    args = ("lips/best_of_n.py", "--prompt", "def fibonacci(n):", "--n", "4", "--seed", "1",
            "--max-new-tokens", "6")
    one, two = lip_json(daemon, *args), lip_json(daemon, *args)
    assert len(one["candidates"]) == 4
    # Same seeds, same tokens; the logprobs only to rounding, as batches differ run to run.
    for a, b in zip(one["candidates"], two["candidates"], strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert a["mean_logprob"] == pytest.approx(b["mean_logprob"], abs=1e-4)
    means = [c["mean_logprob"] for c in one["candidates"]]
    assert one["pick"] == means.index(max(means))


def test_chat_keeps_the_conversation_in_one_kv_file(daemon):
    lip = run_lip(daemon, "lips/chat.py", "--message", "hi", "--message", "the fox?",
                  "--save", "chat.kv", "--max-new-tokens", "5")
    assert lip.returncode == 0, lip.stderr
    with daemon.connect() as k, k.open(k.home + "/chat.kv") as f:
        tokens = k.read(f)[0]
        first = k.tokenize(messages=[{"role": "user", "content": "hi"}],
                           add_generation_prompt=True)
        assert tokens[: len(first)] == first
        assert k.stat(f).tokens == len(tokens) > len(first) + 5

# -- level 1: KV memory pressure --------------------------------------------------------


def test_idle_process_is_swapped_out_and_back_and_enospc_only_when_nothing_helps(model, alone):
    d = start_daemon(model, None, "--kv-pages", "24", "--host-pages", "64")
    try:
        with d.connect("a") as a, d.connect("b") as b, d.connect("c") as c:
            ids_a, ids_b = prompt(257, salt=1), prompt(256, salt=2)
            fa, fb = a.open("", os.O_RDWR), b.open("", os.O_RDWR)
            fa.pred(ids_a[:-1], no_outputs=True)  # 16 of the 24 device pages
            fb.pred(ids_b, no_outputs=True)  # room only by moving a's pages to the host
            states = {p.pid: p.state for p in c.ps()}
            assert states[a.pid] == "swapped" and states[b.pid] == "sleeping"
            assert int(meminfo(c)["host_used"]) > 0
            # a calls again: its pages come back (b's go down), and its K/V are intact.
            (out,) = fa.pred(ids_a[-1:])
            assert out.token == alone(ids_a, 1)[0]
            assert {p.pid: p.state for p in c.ps()}[b.pid] == "swapped"
            # More than the whole device: nothing can make room, and nothing changes.
            before = meminfo(c)
            with c.open("", os.O_RDWR) as fc:
                with pytest.raises(OSError) as e:
                    fc.pred(prompt(25 * 16), no_outputs=True)
                assert e.value.errno == errno.ENOSPC
                assert f"pred on fd {fc.fd}: kv pool: " in str(e.value)  # names the file
                assert c.stat(fc).tokens == 0
            assert meminfo(c) == before
            with c.open("", os.O_RDWR) as src, c.open("", os.O_RDWR) as fc:
                src.pred(prompt(8 * 16), no_outputs=True)
                with pytest.raises(OSError) as e:  # copies (unaligned): past both tiers
                    for _ in range(12):
                        c.splice(src, 1, 8 * 16, fc)
                assert e.value.errno == errno.ENOSPC
                assert f"splice to fd {fc.fd}: kv pool: " in str(e.value)
    finally:
        assert d.stop() == 0, d.log_text()


def test_two_decoders_filling_the_device_take_turns_through_the_host(model, alone):
    """Two processes decode at once on files that together fill the device, their preds
    arriving together: each new page one needs comes from preempting the other (its pred
    only queued), and both get their greedy tokens; before, one got ENOSPC although the
    host tier had room."""
    prompts = [prompt(11 * 16 - 1, salt=1), prompt(11 * 16 - 1, salt=2)]
    expected = [alone(ids, 24) for ids in prompts]
    d = start_daemon(model, None, "--kv-pages", "24", "--host-pages", "64",
                     "--decode-ahead", "off")

    async def decode(ids: list[int]) -> list[int]:
        async with await AsyncKernel.connect(d.socket, rings=True) as k:
            f = await k.open()
            await f.pred(ids[:-1], no_outputs=True)
            tokens, last = [], ids[-1]
            for _ in range(24):
                (out,) = await f.pred([last])
                tokens.append(last := out.token)
            return tokens

    async def both() -> list[list[int]]:
        return list(await asyncio.gather(*(decode(ids) for ids in prompts)))

    try:
        assert asyncio.run(both()) == expected
        with d.connect() as k:
            assert int(sched(k)["preemptions"]) > 0
    finally:
        assert d.stop() == 0, d.log_text()


def test_import_and_export_move_idle_files_down_for_room_as_a_pred_does(model):
    """Pages of files nobody has open go to the host for an import, or for the page an
    export's snapshot copies, as they do for a pred (both failed with ENOSPC)."""
    d = start_daemon(model, None, "--kv-pages", "24", "--host-pages", "64")
    try:
        with d.connect() as k:
            for path, n in (("/tmp/a", 256), ("/tmp/p", 17)):  # 16 pages, then 2
                with k.open(path, os.O_CREAT | os.O_RDWR) as f:
                    f.pred(prompt(n, salt=n), no_outputs=True)
            a, p = k.export("/tmp/a"), k.export("/tmp/p")
            k.import_file("/tmp/c", a)  # 16 pages, 6 free: a's and p's move down
            assert int(meminfo(k)["device_free"]) == 0 and int(meminfo(k)["host_used"]) > 0
            assert k.export("/tmp/p") == p  # its last page copied: one more moves down
            assert k.export("/tmp/a") == a == k.export("/tmp/c")
    finally:
        assert d.stop() == 0, d.log_text()


# -- the shell's side -------------------------------------------------------------------

EXITS = """
import sys
from syscalls.client import Kernel
with Kernel.connect() as k:
    print("pid", k.getpid(), flush=True)
    print("oops", file=sys.stderr)
sys.exit(3)
"""


def test_symphony_run_streams_output_and_passes_the_exit_status(daemon, tmp_path):
    prog = tmp_path / "exits.py"
    prog.write_text(EXITS)
    lip = run_lip(daemon, str(prog))
    assert lip.returncode == 3
    assert lip.stdout.startswith("pid ") and lip.stderr == "oops\n"
    missing = run_lip(daemon, str(tmp_path / "nope"))
    assert missing.returncode == 127 and "nope" in missing.stderr


def test_stop_persists_named_files_and_start_brings_them_back(model):
    d = start_daemon(model, None)
    ids = prompt(40, salt=3)
    with d.connect() as k:
        with k.open(k.home + "/doc", os.O_CREAT | os.O_RDWR) as f:
            f.pred(ids, no_outputs=True)
            (expected,) = f.pred([ids[-1]])
            f.truncate(len(ids))
        exported = k.export(k.home + "/doc")
    assert d.stop() == 0, d.log_text()
    again = start_daemon(model, d.socket.parent)
    try:
        with again.connect() as k, k.open(k.home + "/doc", os.O_RDWR) as f:
            assert k.read(f)[0] == ids
            assert k.export(f) == exported
            (out,) = f.pred([ids[-1]])  # the K/V came back too: same logits, same token
            assert out.token == expected.token
    finally:
        assert again.stop() == 0, again.log_text()


def test_restored_files_export_by_path_moving_others_down_for_room(model):
    """After a restart each file's pages load on its first open: an export by path that
    loads one moves files nobody has open down for room, as an open does (it was ENOSPC)."""
    flags = ("--kv-pages", "8", "--host-pages", "8")
    d = start_daemon(model, None, *flags)
    with d.connect() as k:
        exported = {}
        for i in range(3):  # three pages each: more than the device holds together
            path = f"{k.home}/s{i}"
            with k.open(path, os.O_CREAT | os.O_RDWR) as f:
                f.pred(prompt(40, salt=i), no_outputs=True)
            exported[path] = k.export(path)
    assert d.stop() == 0, d.log_text()
    again = start_daemon(model, d.socket.parent, *flags)
    try:
        with again.connect() as k:
            assert {path: k.export(path) for path in exported} == exported
    finally:
        assert again.stop() == 0, again.log_text()


# -- /proc ------------------------------------------------------------------------------


def test_proc_agrees_with_the_kernel(daemon):
    with daemon.connect("prober") as k:
        listing = k.procfs("/proc").split()
        assert {"meminfo", "sched", "kv", f"{k.pid}/"} <= set(listing)
        assert k.procfs(f"/proc/{k.pid}").split() == ["fds", "status", "syscalls"]
        before = meminfo(k)
        with k.open("", os.O_RDWR) as f:
            f.pred(prompt(40), no_outputs=True)  # 3 pages, the last one partly filled
            with f.fork() as g:
                after = meminfo(k)
                # The fork shares the two full pages and copies the partial one.
                assert int(after["device_used"]) - int(before["device_used"]) == 4
                assert int(after["shared"]) - int(before["shared"]) == 2
                shared = [line.split("\t") for line in k.procfs("kv").splitlines()[1:]]
                assert [row[3] for row in shared].count(f"{f.stat().ino},{g.stat().ino}") == 2
                fds = k.procfs(f"{k.pid}/fds").splitlines()[1:]
                assert [line.split("\t")[3:] for line in fds] == [["40", "3"], ["40", "3"]]
        status = proc_fields(k.procfs(f"{k.pid}/status"))
        assert status["name"] == "prober" and status["tokens"] == "40"
        calls = {line.split("\t")[0]: int(line.split("\t")[1])
                 for line in k.procfs(f"{k.pid}/syscalls").splitlines()[1:]}
        assert calls["Pred"] == 1 and calls["Fork"] == 1 and calls["Open"] == 1
        assert calls["Close"] == 2 and calls["Procfs"] >= 6
        with pytest.raises(FileNotFoundError):
            k.procfs("/proc/nope")


def test_preds_on_one_file_are_served_in_the_order_they_came(daemon):
    """While a long prefill writes the file (chunked over several steps), a prefill and then
    a one-token pred queue on it. Decodes go first among equals in a step, but the one-token
    pred must still append after the prefill that came before it."""
    from syscalls.aio import AsyncKernel

    long, first, second = prompt(6 * BUDGET, salt=3), prompt(40, salt=4), [5]

    async def run() -> tuple[list[int], list[int]]:
        k = await AsyncKernel.connect(daemon.socket, name="order")
        f = await k.open("", os.O_RDWR)
        await asyncio.gather(*(f.pred(ids, no_outputs=True) for ids in (long, first, second)))
        tokens, positions = await f.read()
        await k.close()
        return tokens, positions

    tokens, positions = asyncio.run(run())
    assert tokens == long + first + second
    assert positions == list(range(len(tokens)))


# -- level 1: fair share ----------------------------------------------------------------


async def contend(socket, nice_b: int, preds: int, warmup: int = 30) -> tuple[int, int]:
    """Two processes keep two budget-sized preds queued each, so every step has room for
    one of them; returns how many preds each got through after the first `warmup` (both
    start at the same virtual runtime: the weighted lead takes a few steps to build)."""
    from syscalls.aio import AsyncKernel

    a = await AsyncKernel.connect(socket, name="a")
    b = await AsyncKernel.connect(socket, name="b")
    await b.nice(nice_b)
    done = {a.pid: 0, b.pid: 0}
    started = [0]

    async def loop(k):
        f = await k.open("", os.O_RDWR)
        while sum(done.values()) < preds:
            await f.pred(prompt(BUDGET), no_outputs=True)
            await f.truncate(0)
            if started[0] < warmup:
                started[0] += 1
            else:
                done[k.pid] += 1

    await asyncio.gather(*(loop(k) for k in (a, a, b, b)))
    await a.close()
    await b.close()
    return done[a.pid], done[b.pid]


@pytest.mark.parametrize("nice_b, low, high", [(0, 0.7, 1.4), (10, 6.0, 14.0)])
def test_contending_processes_share_by_nice_weight(daemon, nice_b, low, high):
    got_a, got_b = asyncio.run(contend(daemon.socket, nice_b, preds=120))
    # CFS weights: 1024 / 1.25**nice, so nice 10 gets 1/9.3 of nice 0's share.
    assert low < got_a / got_b < high, (got_a, got_b)


def test_only_a_real_sleep_costs_a_process_its_lead(model, tmp_path):
    """The wake-up clamp, on a real kernel's scheduler: a process back within SLEEP_GRACE of
    its last answer keeps its virtual runtime; after a longer sleep, or on its first pred,
    it keeps at most one token budget of lead over min_vruntime."""
    from symphony.daemon import Kernel
    from symphony.engine.sampler import GREEDY
    from symphony.engine_process import EngineProcess
    from symphony.options import Options
    from symphony.pred_job import PredSpec
    from symphony.scheduler import SLEEP_GRACE
    from symphony.syscall_table import TABLE

    engine = EngineProcess(model, kv_pages=16)
    k = Kernel(engine, Options(socket=tmp_path / "k.sock", state_dir=tmp_path / "state"))

    async def lead_after(away: float | None) -> float:
        s = k.sched
        s.min_vruntime = 100_000.0
        p = k.procs.spawn(os.getpid(), 0, 0)
        fd = (await TABLE["Open"][0](k, p, p.cred,
                                     pb.OpenRequest(path="", flags=os.O_RDWR))).fd
        p.answered = 0.0 if away is None else time.monotonic() - away
        future = s.submit(p, p.handle(fd), PredSpec([5], None, [0], GREEDY))
        await s.cancel(future)
        return s.min_vruntime - p.vruntime

    try:
        assert asyncio.run(lead_after(SLEEP_GRACE / 10)) == 100_000.0
        assert asyncio.run(lead_after(SLEEP_GRACE * 10)) == k.sched.token_budget
        assert asyncio.run(lead_after(None)) == k.sched.token_budget
    finally:
        engine.close()


def test_an_open_that_waited_opens_nothing_once_the_fds_ran_out(model, tmp_path):
    """An O_TRUNC open waits for the work ahead on its file; meanwhile the file is unlinked
    and other calls take the process's last fds. The open fails with EMFILE and creates
    no name (it made the file again, then found no fd for it, and left it)."""
    from kvfs.errors import FSError
    from symphony.daemon import Kernel
    from symphony.engine_process import EngineProcess
    from symphony.options import Options
    from symphony.syscall_table import TABLE
    from syscalls.session import FD_MAX

    engine = EngineProcess(model, kv_pages=16)
    k = Kernel(engine, Options(socket=tmp_path / "k.sock", state_dir=tmp_path / "state"))
    open_, made = TABLE["Open"][0], os.O_CREAT | os.O_RDWR

    async def race() -> None:
        p = k.procs.spawn(os.getpid(), 0, 0)
        fd = (await open_(k, p, p.cred, pb.OpenRequest(path="/tmp/x.kv", flags=made))).fd

        async def settle(inode) -> None:  # the wait, and what other calls did meanwhile
            k.fs.unlink(p.cred, "/tmp/x.kv")
            while len(p.fds) < FD_MAX:
                p.add_fd(p.handle(fd))

        k.sched.settle = settle
        with pytest.raises(FSError) as e:
            await open_(k, p, p.cred, pb.OpenRequest(path="/tmp/x.kv", flags=made | os.O_TRUNC))
        assert e.value.errno == errno.EMFILE, e.value
        with pytest.raises(FSError) as e:
            k.fs.lookup(p.cred, "/tmp/x.kv")
        assert e.value.errno == errno.ENOENT

    try:
        asyncio.run(race())
    finally:
        engine.close()


def test_a_prefill_is_not_starved_by_decodes_that_fill_every_step(model):
    """With one sequence a step, a process decoding on four files keeps every step busy; a
    prompt of another process still gets its turn by virtual runtime."""
    d = start_daemon(model, None, "--kv-pages", "256", "--max-seqs", "1")
    stop = threading.Event()
    decoded = [0] * 4

    def decode(k, i: int) -> None:
        with k.open("", os.O_RDWR) as f:
            (out,) = f.pred(prompt(8, salt=i))
            while not stop.is_set():
                (out,) = f.pred([out.token])
                decoded[i] += 1

    try:
        with d.connect("decoder") as a, d.connect("prompt") as b:
            threads = [threading.Thread(target=decode, args=(a, i)) for i in range(4)]
            for t in threads:
                t.start()
            wait_for(lambda: min(decoded) > 5, what="both decode streams running")
            with b.open("", os.O_RDWR) as f:
                result: list = []
                prefill = threading.Thread(target=lambda: result.append(f.pred(prompt(40))))
                prefill.start()
                prefill.join(1.0)  # a step or two; ordering decodes first took 1.7 s to never
                assert result, "the prompt did not get a step while the decodes ran"
                prefill.join()
            before = sum(decoded)
            wait_for(lambda: sum(decoded) > before, what="the decodes going on")
            stop.set()
            for t in threads:
                t.join(30)
    finally:
        stop.set()
        assert d.stop() == 0, d.log_text()


def test_a_cpu_engine_keeps_the_kernels_nice(daemon, k):
    # Its steps are the CPU's own work: above the LIPs it would starve them (a GPU's driver
    # or the simulated accelerator runs at DRIVER_NICE: test_engine_sleep).
    kernel = os.getpriority(os.PRIO_PROCESS, daemon.process.pid)
    if kernel == DRIVER_NICE:
        pytest.skip(f"the kernel itself runs at {DRIVER_NICE}: the two cannot be told apart")
    assert int(sched(k)["engine_nice"]) == kernel


def test_other_calls_are_answered_while_a_long_text_is_tokenized(daemon):
    """Megabytes of text take the tokenizer seconds: that runs off the loop's thread (and
    without the GIL), so another session's calls go on being answered meanwhile. They
    waited for the whole tokenize: one gap as long as it. (A ratio of the tokenize's own
    time, not a speed.)"""
    text = "ab " * 1_500_000
    result: list[list[int]] = []
    with daemon.connect() as k, daemon.connect() as other:
        tokenizing = threading.Thread(target=lambda: result.append(k.tokenize(text)))
        start = time.monotonic()
        tokenizing.start()
        answers = [start]
        while tokenizing.is_alive():
            other.getpid()
            answers.append(time.monotonic())
        took = time.monotonic() - start
    assert len(result[0]) >= 1_500_000
    longest_wait = max(b - a for a, b in zip(answers, answers[1:], strict=False))
    assert longest_wait < took / 2, (longest_wait, took)


@pytest.mark.parametrize("prog", ["complete", "best_of_n"])  # sync and asyncio
def test_ctrl_c_ends_a_lip_quietly_and_frees_what_it_held(daemon, k, prog):
    """SIGINT mid-generation: status 130 and nothing on stderr, as a shell's commands end
    (each LIP printed KeyboardInterrupt's traceback: an outside tester's finding); the
    kernel frees its files as it exits."""
    used = meminfo(k)["device_used"]
    n = k.model_info().context_length - 4
    lip = subprocess.Popen([sys.executable, "-m", f"lips.{prog}", "--prompt-ids", "1,2,3",
                            "--max-new-tokens", str(n)], env=daemon.env(), cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: any(p.os_pid == lip.pid and p.tokens > 3 for p in k.ps()),
                 what="the LIP decoding")
        lip.send_signal(signal.SIGINT)
        out, err = lip.communicate(timeout=60)
    finally:
        if lip.poll() is None:
            lip.kill()
            lip.wait()
    assert (lip.returncode, err) == (130, "")
    wait_for(lambda: meminfo(k)["device_used"] == used, what="its pages freed")
