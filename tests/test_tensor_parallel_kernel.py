"""Tensor parallelism through the kernel: `symphony kernel --tensor-parallel 2` against one
rank (greedy tokens of 8 concurrent LIPs), two ranks meeting over TCP as two machines' would
(`symphony rank` for node 1, its KV shard mirrored in the kernel), and the death of a rank."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from daemon import ROOT, alive, prompt, sched, start_daemon, wait_for
from test_tensor_parallel import free_port

from syscalls.convert import LogitControl
from syscalls.session import pid_path

pytestmark = pytest.mark.slow

SYMPHONY = [sys.executable, "-m", "symphony.cli"]
FLAGS = ("--kv-pages", "256", "--token-budget", "48")  # prompts chunked, decodes interleaved


def ranks_of(stats: dict[str, str]) -> dict[int, dict[str, str]]:
    """/proc/sched's rank rows: rank -> its fields."""
    out = {}
    for key, value in stats.items():
        if key.startswith("rank") and key[4:].isdigit():
            out[int(key[4:])] = dict(f.split("=", 1) for f in value.split())
    return out


@pytest.fixture(scope="module")
def alone(model):
    """Greedy tokens of one prompt alone, from one rank's engine in this process."""
    from symphony.engine.engine import Engine
    from symphony.engine.generate import generate
    from symphony.engine.sampler import GREEDY

    engine = Engine(model, kv_pages=256)
    return lambda ids, n: generate(engine, [ids], GREEDY, n)[0]


def complete(d, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens of `prompts`, each a LIP of its own, all at once."""
    lips = [
        subprocess.Popen(
            [
                *SYMPHONY,
                "run",
                "lips/complete.py",
                "--prompt-ids",
                ",".join(map(str, ids)),
                "--max-new-tokens",
                str(n),
                "--json",
            ],
            env=d.env(),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for ids in prompts
    ]
    outs = [lip.communicate(timeout=300) for lip in lips]
    for lip, (_, err) in zip(lips, outs, strict=True):
        assert lip.returncode == 0, err
    return [json.loads(out)["output_ids"] for out, _ in outs]


@pytest.fixture(scope="module")
def two_ranks(model):
    """A kernel of two ranks on this machine; the module's last test kills it."""
    d = start_daemon(model, None, *FLAGS, "--tensor-parallel", "2")
    yield d
    d.stop()


def test_eight_concurrent_lips_on_two_ranks_get_what_one_rank_gives(two_ranks, alone):
    prompts = [prompt(5 + 17 * i, salt=i) for i in range(8)]
    got = complete(two_ranks, prompts, 12)
    with two_ranks.connect() as k:
        stats = sched(k)
    ranks = ranks_of(stats)
    assert int(stats["batch_seqs_max"]) > 1, "the LIPs never shared a forward pass"
    assert stats["tensor_parallel"] == "2"
    assert sorted(ranks) == [0, 1]
    assert int(ranks[0]["pid"]) == int(stats["engine_pid"])
    for r in ranks.values():
        assert alive(int(r["pid"])) and r["device"] == "cpu" and r["node"] == "0"
        assert 0 < float(r["busy"])  # each rank computed
    for ids, out in zip(prompts, got, strict=True):
        assert out == alone(ids, 12)


def export_after_forks(d) -> tuple[list[list[int]], list[bytes]]:
    """Greedy tokens and the exports of files that share pages: a prompt, and two forks that
    each decode on (the shared last page copied on write), one of them under a mask, and are
    shifted, then decode once more."""
    allowed = [40, 41, 42]
    with d.connect() as k, k.open(k.home + "/base", os.O_CREAT | os.O_RDWR) as f:
        (first,) = f.pred(prompt(37))
        tokens, exports = [], [k.export(f)]
        for masked in (False, True):
            control = LogitControl.allowing(allowed, 320) if masked else None
            with f.fork() as branch:
                t, out = first.token, []
                for _ in range(6):
                    (o,) = branch.pred([t], control=control)
                    t = o.token
                    out.append(t)
                branch.shift(0, 40, 5)
                (o,) = branch.pred([t])
                tokens.append([*out, o.token])
                exports.append(k.export(branch))
        assert set(tokens[1][:6]) <= set(allowed)
        return tokens, exports


def two_nodes() -> tuple[str, ...]:
    """The flags of two ranks on two nodes meeting over loopback TCP, as across machines."""
    return (
        "--tensor-parallel",
        "2",
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
    )


def test_two_nodes_meet_over_tcp_and_the_kernel_keeps_node_1s_kv(model, two_ranks, tmp_path):
    """Node 1's rank holds its shard itself: what kvfs does to its pages (copy on write,
    shift) reaches it, and what it computes reaches the kernel's mirror (the export): all
    as on one node, bit for bit."""
    want = export_after_forks(two_ranks)
    rendezvous = two_nodes()
    log = open(tmp_path / "node1.log", "wb")
    node1 = subprocess.Popen(
        [
            *SYMPHONY,
            "rank",
            "--node-rank",
            "1",
            "--model",
            str(model),
            "--device",
            "cpu",
            *rendezvous,
        ],
        cwd=ROOT,
        stdout=log,
        stderr=log,
        stdin=subprocess.DEVNULL,
    )
    d = start_daemon(model, None, *FLAGS, "--node-rank", "0", *rendezvous)
    try:
        with d.connect() as k:
            ranks = ranks_of(sched(k))
        assert ranks[1]["node"] == "1" and ranks[1]["busy"] == "-"  # not on node 0's /proc
        assert export_after_forks(d) == want
    finally:
        assert d.stop() == 0, d.log_text()
    # The kernel's stop ends the group, and with it node 1's ranks.
    assert node1.wait(30) == 0, (tmp_path / "node1.log").read_text()


def test_a_node_without_the_checkpoint_says_so_before_it_waits(tmp_path):
    """`symphony rank --model` of a path that holds no checkpoint waited for the kernel (up
    to 10 minutes) and only then said config.json was missing: now at once."""
    said = subprocess.run(
        [*SYMPHONY, "rank", "--node-rank", "1", "--device", "cpu", "--model",
         str(tmp_path / "nowhere"), *two_nodes()],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert said.returncode == 1
    assert said.stderr == f"symphony: {tmp_path}/nowhere/config.json: no such file\n", said


def test_a_kernel_that_cannot_listen_at_master_addr_says_so_before_it_waits(model, tmp_path):
    """A --master-addr not this machine's (TEST-NET-3, RFC 5737) was logged as the address
    the kernel waited for its ranks at, and only then refused: now refused first, and no
    wait is logged."""
    port = free_port()
    said = subprocess.run(
        [*SYMPHONY, "kernel", "--model", str(model), "--socket", str(tmp_path / "k.sock"),
         "--state-dir", str(tmp_path / "state"), *FLAGS, "--tensor-parallel", "2",
         "--nnodes", "2", "--node-rank", "0", "--master-addr", "203.0.113.1",
         "--master-port", str(port)],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert said.returncode == 1, said
    assert said.stderr.endswith(f"symphony: rank 0: cannot listen at 203.0.113.1:{port} "
                                f"([Errno {errno.EADDRNOTAVAIL}] Cannot assign requested "
                                "address)\n"), said
    assert "waiting up to" not in said.stderr, said


def test_a_killed_kernel_takes_every_rank_with_it(two_ranks):
    with two_ranks.connect() as k:
        pids = [int(f["pid"]) for f in ranks_of(sched(k)).values()]
    two_ranks.process.kill()
    two_ranks.process.wait(30)
    for pid in pids:
        wait_for(lambda p=pid: not alive(p), timeout=10, what=f"rank pid {pid} to exit")


@pytest.mark.parametrize("victim", [1, 0])
def test_a_dead_rank_stops_the_kernel_and_loses_no_saved_file(model, victim):
    """The pred in flight when a rank dies gets EIO naming it, whichever rank it was (a
    follower's death left it waiting on rank 0, and its process saw its lifeline close:
    EPIPE), and the kernel stops, it does not hang."""
    d = start_daemon(model, None, *FLAGS, "--tensor-parallel", "2")
    try:
        with d.connect() as k:
            x = k.home + "/x"
            with k.open(x, os.O_CREAT | os.O_RDWR) as f:
                f.pred(prompt(40), no_outputs=True)
                f.fsync()
            ranks = {r: int(f["pid"]) for r, f in ranks_of(sched(k)).items()}
            f = k.open(x, os.O_RDWR)
            os.kill(ranks[victim], signal.SIGSTOP)  # the next step waits for it
            failed: list[OSError] = []

            def pred() -> None:
                try:
                    f.pred([7], no_outputs=True)
                except OSError as e:
                    failed.append(e)

            waiting = threading.Thread(target=pred)
            waiting.start()
            time.sleep(0.5)  # the pred's step is in flight, stuck on the stopped rank
            os.kill(ranks[victim], signal.SIGKILL)
            waiting.join(30)
        assert [e.errno for e in failed] == [errno.EIO], failed
        assert f"rank {victim} (pid {ranks[victim]}) exited with status -9" in str(failed[0])
        assert d.process.wait(30) == 1, d.log_text()
        assert "exception was never retrieved" not in d.log_text()
        assert f"rank {victim} (pid {ranks[victim]}) exited with status -9" in d.log_text()
        assert not d.socket.exists() and not pid_path(d.socket).exists()
        for pid in ranks.values():  # the other rank went too
            wait_for(lambda p=pid: not alive(p), timeout=10, what=f"rank pid {pid} to exit")
        if victim == 1:  # saved at N=2, opened at N=1
            d = start_daemon(model, d.socket.parent)
            with d.connect() as k:
                assert k.stat(x).tokens == 40
    finally:
        d.stop()


def test_a_node_with_another_checkpoint_is_refused_on_both_sides(model, tmp_path):
    """Node 1 with another checkpoint (its config.json one byte longer) was taken, and the
    tokens were wrong: rank 0 refuses it at the rendezvous, naming both, and both exit 1."""
    other = tmp_path / "other"
    shutil.copytree(model, other)
    with open(other / "config.json", "a") as f:
        f.write("\n")
    rendezvous = two_nodes()
    node1 = subprocess.Popen(
        [*SYMPHONY, "rank", "--node-rank", "1", "--device", "cpu", "--model", str(other),
         *rendezvous],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    why = (rf"rank 1 \(node 1, host [^)]+\) has another checkpoint than the kernel: "
           rf"{other} \(fingerprint [0-9a-f]{{16}}\) there, {model} \(fingerprint "
           r"[0-9a-f]{16}\) on node 0")
    with pytest.raises(RuntimeError,
                       match=rf"the kernel exited \(1\)(.|\n)*symphony: rank 0: {why}"):
        start_daemon(model, None, *FLAGS, "--node-rank", "0", *rendezvous)
    said, _ = node1.communicate(timeout=60)
    assert node1.returncode == 1, said
    assert re.search(rf"symphony: rank 1: refused by the kernel at 127.0.0.1:\d+: {why}",
                     said), said


def test_a_kernel_waiting_for_its_ranks_holds_its_socket_and_state(model, tmp_path):
    """While the kernel waits for another node's ranks it held neither its socket nor its
    state directory: status said "not running", stop found nothing, and a second kernel
    started there. Now both are its own from the start: status says it starts, a second
    kernel on either is refused, and stop ends it."""
    from symphony.control import kernel_pid

    sock, state = tmp_path / "k.sock", tmp_path / "state"
    waiting = subprocess.Popen(
        [*SYMPHONY, "kernel", "--model", str(model), "--socket", str(sock), "--state-dir",
         str(state), *FLAGS, "--node-rank", "0", *two_nodes()],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: kernel_pid(sock) == waiting.pid, timeout=60,
                 what="the waiting kernel to hold its socket")

        def symphony(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([*SYMPHONY, *args], cwd=ROOT, capture_output=True,
                                  text=True, timeout=60)

        said = symphony("status", "--socket", str(sock))
        assert said.returncode == 3
        assert said.stdout.startswith(f"starting: kernel {waiting.pid} holds {sock}"), said
        said = symphony("kernel", "--model", str(model), "--socket", str(sock),
                        "--state-dir", str(tmp_path / "other"))
        assert said.returncode == 1
        assert f"a kernel already listens there (pid {waiting.pid})" in said.stderr, said
        said = symphony("kernel", "--model", str(model), "--socket", str(tmp_path / "o.sock"),
                        "--state-dir", str(state))
        assert said.returncode == 1
        assert f"another kernel uses it (pid {waiting.pid})" in said.stderr, said
        said = symphony("stop", "--socket", str(sock))
        assert (said.returncode, said.stdout) == (0, f"kernel {waiting.pid} stopped\n"), said
        out, _ = waiting.communicate(timeout=30)
        assert waiting.returncode == 1 and "stopped by SIGTERM before serving" in out, out
        assert not sock.exists()
    finally:
        waiting.kill()
        waiting.wait()


def four_ranks_on(nnodes: int, node_rank: int, port: int) -> list[str]:
    return ["--tensor-parallel", "4", "--nnodes", str(nnodes), "--node-rank", str(node_rank),
            "--master-addr", "127.0.0.1", "--master-port", str(port)]


def symphony_rank(model, *flags: str) -> subprocess.Popen:
    return subprocess.Popen([*SYMPHONY, "rank", "--device", "cpu", "--model", str(model),
                             *flags], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True)


def test_a_second_node_with_the_same_node_rank_is_refused_whole(model):
    """Two `symphony rank` of node 1 started at once each took one of its two ranks: the
    group formed from halves of two nodes and served, and both kept running. Now the first
    claim makes node 1 its `symphony rank`'s: the other's ranks are each refused in a line
    naming it, that one exits 1, and the group is node 0's and the first's."""
    port = free_port()
    nodes = [symphony_rank(model, *four_ranks_on(2, 1, port)) for _ in range(2)]
    d = start_daemon(model, None, *FLAGS, *four_ranks_on(2, 0, port))
    try:
        wait_for(lambda: any(n.poll() is not None for n in nodes), timeout=30,
                 what="the second node to be refused")
        (loser,) = [n for n in nodes if n.poll() is not None]
        (winner,) = [n for n in nodes if n is not loser]
        said, _ = loser.communicate(timeout=30)
        assert loser.returncode == 1, said
        assert sorted(said.splitlines()) == [  # a line a rank, no more
            f"symphony: rank {rank}: refused by the kernel at 127.0.0.1:{port}: node 1 was "
            f"claimed already, by pid {winner.pid} on host {os.uname().nodename} (another node "
            "with --node-rank 1, this node before a restart, or a group formed already); the "
            "first claimant keeps its place" for rank in (2, 3)], said
        with d.connect() as k:
            ranks = ranks_of(sched(k))
        assert [ranks[r]["node"] for r in range(4)] == ["0", "0", "1", "1"]
        assert complete(d, [prompt(9)], 3)[0] == complete(d, [prompt(9)], 3)[0]
    finally:
        assert d.stop() == 0, d.log_text()
        for n in nodes:
            if n.poll() is None:
                n.wait(30)  # the winner: the kernel's stop ends the group
    assert winner.returncode == 0, winner.communicate()[0]


def claimed(port: int, rank: int) -> bool:
    """Whether `rank` has put its claim in the rendezvous's store at `port`."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    except OSError:
        return False
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5),
                          wait_for_workers=False)
    return store.check([f"claim/{rank}"])


def test_a_refused_node_is_said_once_in_the_kernels_log(model):
    """Rank 0 refused another node's rank: node 0's rank 1, which did nothing wrong, said it
    too, a line before rank 0's in the kernel's log. Now the log has rank 0's alone. (Node
    0's rank 1 claims first, as where the other node comes last: the refusal reaches it.)"""
    port, failed = free_port(), []

    def kernel() -> None:
        try:
            start_daemon(model, None, *FLAGS, *four_ranks_on(2, 0, port)).stop()
        except RuntimeError as e:
            failed.append(str(e))

    started = threading.Thread(target=kernel)
    started.start()
    wait_for(lambda: claimed(port, 1), timeout=60, what="node 0's rank 1 to claim")
    node = symphony_rank(model, *four_ranks_on(4, 2, port))
    started.join(120)
    (log,) = failed
    assert log.startswith("the kernel exited (1)"), log
    why = f"rank 2 (node 2, host {os.uname().nodename}) has --nnodes 4, the kernel --nnodes 2"
    assert [line for line in log.splitlines() if "rank 2 (node 2" in line] == [
        f"symphony: rank 0: {why}"], log
    said, _ = node.communicate(timeout=60)
    assert node.returncode == 1
    assert f"symphony: rank 2: refused by the kernel at 127.0.0.1:{port}: {why}\n" in said, said
