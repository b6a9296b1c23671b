"""Tensor parallelism at the engine: two gloo ranks against one, on random-weight Llama,
Qwen2 and Qwen3 checkpoints (fewer KV heads than ranks and tied embeddings among them),
through prefill chunks, decodes, a tree and an excluded range."""

from __future__ import annotations

import os
import pickle
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from checkpoints import FAMILIES, make_checkpoint

from symphony.engine.config import ModelConfig
from symphony.engine.engine import Batch, Engine, TreeRows
from symphony.engine.errors import ModelError
from symphony.engine.loader import load_model
from symphony.engine.tensor_parallel import Group, shard_of
from symphony.engine.tree import ancestor_bits
from symphony.engine_process import EngineProcess
from symphony.ranks import Bystander, Claim, Rendezvous, from_environment, meet
from symphony.top import Sample, frame

ATOL = 1e-4
PAGES = [5, 2, 7, 0]  # a shuffled page table, 64 slots
PROMPT = 45
TREE_PARENTS = [-1, 0, 0, 1, 2]


def scenario(engine: Engine) -> list[torch.Tensor | None]:
    """The logits (rank 0's; None on the others) of: a prompt in two chunks, three decodes,
    a tree of five rows after the prompt, and a decode with an excluded range."""
    ids = torch.randint(
        0, engine.config.vocab_size, (PROMPT + 3,), generator=torch.Generator().manual_seed(3)
    ).tolist()
    out = [engine.forward(Batch(ids[:30], list(range(30)), [30], [30], [PAGES], list(range(30))))]
    out.append(
        engine.forward(
            Batch(
                ids[30:PROMPT],
                list(range(30, PROMPT)),
                [PROMPT - 30],
                [PROMPT],
                [PAGES],
                list(range(PROMPT - 30)),
            )
        )
    )
    for i in range(PROMPT, PROMPT + 3):
        out.append(engine.forward(Batch([ids[i]], [i], [1], [i + 1], [PAGES], [0])))
    n, tree = PROMPT + 3, [11, 12, 13, 14, 15]
    out.append(
        engine.forward(
            Batch(
                tree,
                [n, n + 1, n + 1, n + 2, n + 2],
                [5],
                [n + 5],
                [PAGES],
                list(range(5)),
                trees=[TreeRows(n, ancestor_bits(TREE_PARENTS))],
            )
        )
    )
    out.append(engine.forward(Batch([16], [n], [1], [n + 1], [PAGES], [0], excluded=[[(3, 9)]])))
    return out


def free_port() -> int:
    return Rendezvous(2).with_port().master_port


def _rank(rank: int, world: int, port: int, directories: list[str], out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    torch.set_num_threads(1)
    try:
        results = {}
        for d in directories:
            cfg = ModelConfig.from_file(f"{d}/config.json")
            engine = Engine(d, kv_pages=8, group=Group(shard_of(cfg, rank, world)))
            results[d] = scenario(engine)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()
    # Out without the interpreter's finalization, as symphony/ranks.py's followers: gloo's
    # threads torn down there now and then end in std::terminate (SIGABRT, a rank that
    # ended cleanly reported dead; CI saw it once).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# The checkpoints the ranks are tested on: the parity tests' families, and a GGUF file
# (read whole, then cut; Q8_0, Llama's permuted q/k rows).
CHECKPOINTS = [*sorted(FAMILIES), "gguf-llama-q8_0"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    from gguf import GGMLQuantizationType
    from test_gguf import write_gguf

    out = {}
    for family in sorted(FAMILIES):
        directory = tmp_path_factory.mktemp(family)
        make_checkpoint(directory, family)
        out[family] = str(directory)
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    write_gguf(path, "llama", GGMLQuantizationType.Q8_0)
    out["gguf-llama-q8_0"] = str(path)
    return out


@pytest.fixture(scope="module")
def two_ranks(checkpoints, tmp_path_factory) -> dict[str, list[torch.Tensor]]:
    out = tmp_path_factory.mktemp("tp") / "logits.pt"
    mp.spawn(_rank, (2, free_port(), list(checkpoints.values()), str(out)), nprocs=2)
    return torch.load(out)


@pytest.mark.slow  # two rank processes
@pytest.mark.parametrize("family", CHECKPOINTS)
def test_two_ranks_give_the_logits_of_one(family, checkpoints, two_ranks):
    directory = checkpoints[family]
    cfg = ModelConfig.from_file(f"{directory}/config.json")
    if family == "qwen3":
        assert cfg.num_kv_heads < 2  # one KV head, replicated on both ranks
    if family in ("qwen2", "llama-tied-mha"):
        assert cfg.tie_word_embeddings
    # A shard multiplies by the fp32 copy of a GGUF file's blocks: so does the one rank here.
    want = scenario(Engine(directory, kv_pages=8, weights="float"))
    got = two_ranks[directory]
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape == (w.shape[0], cfg.vocab_size), step
        assert (g - w).abs().max() < ATOL, (family, step)


def test_a_shard_holds_whole_heads_and_its_vocab_rows(checkpoints):
    cfg = ModelConfig.from_file(f"{checkpoints['llama']}/config.json")  # 8 heads, 2 KV
    shards = [shard_of(cfg, r, 2) for r in range(2)]
    assert [s.q_heads for s in shards] == [(0, 4), (4, 8)]
    assert [s.kv_heads for s in shards] == [(0, 1), (1, 2)]
    assert [s.features for s in shards] == [(0, 80), (80, 160)]
    assert [s.vocab for s in shards] == [(0, 160), (160, 320)]
    qwen3 = ModelConfig.from_file(f"{checkpoints['qwen3']}/config.json")  # one KV head
    assert [shard_of(qwen3, r, 2).kv_heads for r in range(2)] == [(0, 1), (0, 1)]
    four = replace(cfg, num_heads=8, num_kv_heads=2)
    assert [shard_of(four, r, 4).kv_heads for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]


def test_a_rank_loads_its_slices_of_each_matrix(checkpoints):
    directory = checkpoints["qwen2"]  # q/k/v biases, tied embeddings
    cfg = ModelConfig.from_file(f"{directory}/config.json")
    whole, d = load_model(directory), cfg.head_dim
    part = load_model(directory, group=Group(shard_of(cfg, 1, 2)))  # no collective at load
    w, p = whole.model.layers[1], part.model.layers[1]
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    for kind in ("weight", "bias"):
        mine, full = getattr(p.self_attn.qkv_proj, kind), getattr(w.self_attn.qkv_proj, kind)
        assert torch.equal(mine[: q // 2], full[q // 2 : q])  # query heads 4..7
        assert torch.equal(mine[q // 2 : q // 2 + kv // 2], full[q + kv // 2 : q + kv])
        assert torch.equal(mine[q // 2 + kv // 2 :], full[q + kv + kv // 2 :])
    assert torch.equal(p.self_attn.o_proj.weight, w.self_attn.o_proj.weight[:, q // 2 :])
    inter = cfg.intermediate_size
    gate_up = w.mlp.gate_up_proj.weight
    assert torch.equal(
        p.mlp.gate_up_proj.weight,
        torch.cat([gate_up[inter // 2 : inter], gate_up[inter + inter // 2 :]]),
    )
    assert torch.equal(p.mlp.down_proj.weight, w.mlp.down_proj.weight[:, inter // 2 :])
    assert torch.equal(part.model.embed_tokens.weight, whole.model.embed_tokens.weight)
    assert torch.equal(part.logits_weight(), whole.logits_weight()[cfg.vocab_size // 2 :])


def test_a_model_that_does_not_divide_is_refused_naming_the_dimension(checkpoints):
    cfg = ModelConfig.from_file(f"{checkpoints['llama']}/config.json")  # 8 heads, 2 KV
    with pytest.raises(ModelError, match=r"attention heads \(8\) do not divide by 3"):
        shard_of(cfg, 0, 3)
    with pytest.raises(ModelError, match=r"intermediate size \(162\) do not divide by 4"):
        shard_of(replace(cfg, intermediate_size=162), 0, 4)
    with pytest.raises(ModelError, match="3 KV heads neither divide by 2 nor divide it"):
        shard_of(replace(cfg, num_heads=6, num_kv_heads=3), 0, 2)


def test_top_shows_a_row_per_rank():
    sched = {
        "tensor_parallel": "2",
        "rank0": "pid=41 node=0 host=a device=cpu busy=0.93",
        "rank1": "pid=7 node=1 host=b device=cuda:0 busy=-",
    }
    screen = "\n".join(frame(Sample(0.0, [], {}, sched), {}))
    assert "Ranks: 0 pid 41 cpu on a busy 0.93, 1 pid 7 cuda:0 on b busy -" in screen


def test_a_rendezvous_comes_from_flags_or_torchruns_variables(monkeypatch):
    for name in ("NNODES", "NODE_RANK", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert from_environment(2, None, None, None, None) == Rendezvous(2, 1, 0, "127.0.0.1", 0)
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    r = from_environment(4, None, None, None, None)
    assert r == Rendezvous(4, 2, 1, "10.0.0.1", 29500)
    assert list(r.local_ranks()) == [2, 3] and r.node_of(1) == 0
    assert from_environment(4, None, 0, "a", 7).master_port == 7  # flags first
    with pytest.raises(ValueError, match="--tensor-parallel 3 ranks over --nnodes 2"):
        Rendezvous(3, 2, 0, "a", 1)
    with pytest.raises(ValueError, match="--node-rank 2 outside"):
        Rendezvous(4, 2, 2, "a", 1)
    with pytest.raises(ValueError, match="needs --master-port"):
        Rendezvous(4, 2, 0)


def test_the_kernel_refuses_what_ranks_cannot_run(model, capsys):
    from symphony.cli import main

    # The kernel lives on node 0; a simulated accelerator has nothing to split.
    assert (
        main(
            [
                "start",
                "--tensor-parallel",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                "1",
                "--master-port",
                "1",
            ]
        )
        == 2
    )
    assert (
        main(
            [
                "rank",
                "--tensor-parallel",
                "2",
                "--nnodes",
                "2",
                "--node-rank",
                "0",
                "--master-port",
                "1",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "the kernel lives on node 0" in err and "--node-rank 0 is the kernel's node" in err
    # Flags that make no rendezvous are usage errors (2), named, before anything starts.
    assert main(["kernel", "--tensor-parallel", "2", "--nnodes", "3"]) == 2
    assert "--tensor-parallel 2 ranks over --nnodes 3" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["rank", "--tensor-parallel", "2", "--nnodes", "2", "--master-port", "70000"])
    assert e.value.code == 2
    assert "--master-port: 70000 is not a TCP port" in capsys.readouterr().err
    with pytest.raises(ValueError, match="sleep:MS loads no model"):
        EngineProcess(model, kv_pages=4, sleep_ms=1, rendezvous=Rendezvous(2))
    with pytest.raises(ModelError, match="attention heads \\(8\\) do not divide by 3"):
        EngineProcess(model, kv_pages=4, rendezvous=Rendezvous(3))


def test_ranks_that_do_not_all_meet_fail_in_one_line_naming_where(monkeypatch):
    """A node that never comes (or a wrong --master-port): rank 0's wait ends in a
    ModelError naming the rendezvous and the wait, which `symphony kernel` prints as one
    line, not torch's DistStoreError traceback."""
    from symphony import ranks

    monkeypatch.setattr(ranks, "TIMEOUT", timedelta(seconds=2))
    rdv = Rendezvous(world=2, nnodes=2, master_port=free_port())
    with pytest.raises(ModelError) as e:
        ranks.join(rdv, Claim(0, 2, 2, "a", "cpu", "/m", "ab"), torch.device("cpu"))
    said = str(e.value)
    assert said.startswith(f"rank 0: the 2 ranks did not all meet at {rdv.init_method} "
                           "(waiting 2 s at most): "), said
    assert "\n" not in said and not dist.is_initialized()


def meet_as(rdv: Rendezvous, claims: list[Claim]) -> list[str]:
    """What each of `claims` meets at `rdv` with (ranks.meet), each in a thread: the
    ModelError's message, or "met" (meet_in_threads's, its stores kept till all are done:
    rank 0's store closed as its thread ended, before rank 1 had read its verdict)."""
    return meet_in_threads(rdv, claims)[0]


def test_rank_0_refuses_a_rank_whose_checkpoint_or_rank_count_differs(monkeypatch):
    """A node with another checkpoint was taken, and computed wrong tokens; one with another
    --tensor-parallel left every rank waiting. Rank 0 now refuses it at the rendezvous,
    before any weight loads, and both sides say why in a line."""
    from symphony import ranks

    monkeypatch.setattr(ranks, "TIMEOUT", timedelta(seconds=20))
    kernel = Claim(0, 2, 2, "a", "cpu", "/m/tiny", "ab" * 32)
    node1 = replace(kernel, rank=1, host="b", model="/n/tiny2", fingerprint="cd" * 32)
    rdv = Rendezvous(2, 2, 0, "127.0.0.1", free_port())
    refused = ("rank 1 (node 1, host b) has another checkpoint than the kernel: /n/tiny2 "
               f"(fingerprint {'cd' * 8}) there, /m/tiny (fingerprint {'ab' * 8}) on node 0")
    assert meet_as(rdv, [kernel, node1]) == [
        f"rank 0: {refused}", f"rank 1: refused by the kernel at 127.0.0.1:{rdv.master_port}: "
        f"{refused}"]
    four = replace(node1, rank=2, world=4, fingerprint=kernel.fingerprint)
    rdv = replace(rdv, master_port=free_port())
    said = meet_as(rdv, [kernel, four])
    assert said[0] == ("rank 0: rank 2 (node 1, host b) has --tensor-parallel 4, the kernel "
                       "--tensor-parallel 2"), said
    assert said[1].startswith("rank 2: refused by the kernel"), said
    same = replace(node1, fingerprint=kernel.fingerprint)
    assert meet_as(replace(rdv, master_port=free_port()), [kernel, same]) == ["met", "met"]


def test_a_rank_with_no_kernel_at_its_port_says_so_in_a_line(monkeypatch):
    from symphony import ranks

    monkeypatch.setattr(ranks, "TIMEOUT", timedelta(seconds=1))
    rdv = Rendezvous(2, 2, 1, "127.0.0.1", free_port())
    with pytest.raises(ModelError) as e:
        meet(rdv, Claim(1, 2, 2, "b", "cpu", "/m", "ab"))
    assert str(e.value) == (f"rank 1: no kernel at 127.0.0.1:{rdv.master_port} after 1 s "
                            "(Connection refused)")


def test_symphony_start_waits_for_the_other_nodes_ranks(monkeypatch):
    """`symphony start` of a kernel whose ranks span nodes waits as long as they may take
    to come, on top of its start: 300 s alone was shorter than the ranks' own wait."""
    import argparse

    from symphony.control import START_TIMEOUT, start_wait
    from symphony.options import RENDEZVOUS_SECONDS

    monkeypatch.delenv("NNODES", raising=False)
    assert start_wait(argparse.Namespace(nnodes=None)) == START_TIMEOUT
    assert start_wait(argparse.Namespace(nnodes=2)) == START_TIMEOUT + RENDEZVOUS_SECONDS
    monkeypatch.setenv("NNODES", "3")
    assert start_wait(argparse.Namespace(nnodes=None)) == START_TIMEOUT + RENDEZVOUS_SECONDS


def meet_in_threads(rdv: Rendezvous, claims: list[Claim], stagger: float = 0.0
                    ) -> tuple[list[str], list]:
    """meet_as, the stores kept (a group formed keeps its store), each claim started
    `stagger` s after the one before."""
    said, stores = [""] * len(claims), []

    def one(i: int) -> None:
        try:
            stores.append(meet(rdv, claims[i]))
            said[i] = "met"
        except Bystander as e:  # a ModelError that run_follower does not print
            said[i] = f"silent: {e}"
        except ModelError as e:
            said[i] = str(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(claims))]
    for t in threads:
        t.start()
        time.sleep(stagger)
    for t in threads:
        t.join(60)
    return said, stores


class Planted:
    """A pickle that would create a file when unpickled."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.mark.parametrize("junk", ["pickle", "bytes"])
def test_a_claim_that_is_not_one_is_refused_in_a_line_and_never_unpickled(
        monkeypatch, tmp_path, junk):
    """Anyone who reaches the master port could put a pickle at a rank's claim, and rank 0
    unpickled it (code run as the kernel); junk there killed it with a traceback. A claim
    is JSON now, parsed strictly: either is refused in one line naming the rank's slot."""
    from symphony import ranks

    monkeypatch.setattr(ranks, "TIMEOUT", timedelta(seconds=10))
    planted = tmp_path / "planted"
    raw = pickle.dumps(Planted(str(planted))) if junk == "pickle" else b"not a pickle"
    rdv = Rendezvous(2, 2, 0, "127.0.0.1", free_port())
    said = [""]

    def kernel() -> None:
        try:
            meet(rdv, Claim(0, 2, 2, "a", "cpu", "/m", "ab"))
            said[0] = "met"
        except ModelError as e:
            said[0] = str(e)

    t = threading.Thread(target=kernel)
    t.start()
    ranks._reach(rdv, 1)
    client = dist.TCPStore("127.0.0.1", rdv.master_port, is_master=False,
                           timeout=timedelta(seconds=10), wait_for_workers=False)
    for key in ("claims", "claimed/1"):  # earlier protocols' counters
        client.add(key, 1)
    client.set("claim/1", raw)
    t.join(30)
    assert not planted.exists()
    assert said[0].startswith("rank 0: claim for rank 1 is not a claim: not JSON "), said
    assert "\n" not in said[0]


def test_claims_are_keyed_by_rank_and_a_second_claimant_is_refused(monkeypatch):
    """A counter bumped with no claim behind it left rank 0 waiting for claim/1; a second
    node with the same --node-rank (or one restarted after it claimed) killed the kernel
    ('came twice') or, once the group formed, joined it under the same rank. Now each rank
    claims its own key; a second claimant is refused at once and the first keeps its place."""
    from symphony import ranks

    monkeypatch.setattr(ranks, "TIMEOUT", timedelta(seconds=8))
    rdv = Rendezvous(3, 3, 0, "127.0.0.1", free_port())
    kernel = Claim(0, 3, 3, "a", "cpu", "/m", "ab")
    one, two = replace(kernel, rank=1, host="b"), replace(kernel, rank=2, host="c")
    # A bump of the old protocol's counter, before the ranks come.
    threading.Timer(0.2, lambda: dist.TCPStore(
        "127.0.0.1", rdv.master_port, is_master=False, timeout=timedelta(seconds=4),
        wait_for_workers=False).add("claims", 1)).start()
    again = replace(one, host="d")
    said, stores = meet_in_threads(rdv, [kernel, one, again, two], stagger=0.7)
    assert said == ["met", "met", claimed(rdv, 1, 1, "b"), "met"], said
    # A node that comes after the group formed: refused at once.
    start = time.monotonic()
    late, _ = meet_in_threads(rdv, [replace(two, host="e")])
    assert late == [claimed(rdv, 2, 2, "c")], late
    assert time.monotonic() - start < 3
    del stores


def claimed(rdv: Rendezvous, rank: int, node: int, host: str) -> str:
    """What a rank of a second claimant of `node` is refused with (its first claimant a
    thread of this process, on `host`)."""
    return (f"rank {rank}: refused by the kernel at 127.0.0.1:{rdv.master_port}: node {node} "
            f"was claimed already, by pid {os.getppid()} on host {host} (another node with "
            f"--node-rank {node}, this node before a restart, or a group formed already); "
            "the first claimant keeps its place")


def test_a_nodes_ranks_are_claimed_as_a_whole(monkeypatch):
    """Two `symphony rank` of node 1 started at once: each took one of its two ranks, the
    group formed from halves of two nodes and served, and each kept a rank. Now the first
    claim of a node's ranks makes the node its claimant's: the other's ranks are all
    refused, in one line each, and the first's all meet. (The claims interleave: A's rank 2,
    B's rank 3, B's rank 2, A's rank 3.)"""
    from symphony import ranks

    monkeypatch.setattr(ranks, "TIMEOUT", timedelta(seconds=20))
    rdv = Rendezvous(4, 2, 0, "127.0.0.1", free_port())
    kernel = Claim(0, 4, 2, "a", "cpu", "/m", "ab")
    a = replace(kernel, host="vm", fingerprint="ab", token="aa")
    b = replace(a, token="bb")  # another `symphony rank` on the same host
    said, stores = meet_in_threads(
        rdv, [kernel, replace(kernel, rank=1), replace(a, rank=2), replace(b, rank=3),
              replace(b, rank=2), replace(a, rank=3)], stagger=0.4)
    assert said == ["met", "met", "met", claimed(rdv, 3, 1, "vm"), claimed(rdv, 2, 1, "vm"),
                    "met"], said
    del stores


def test_node_0s_ranks_say_nothing_of_another_nodes_refusal(monkeypatch):
    """Rank 0 refused node 1's rank: node 0's rank 1, which did nothing wrong, said the
    refusal too (a second line in the kernel's log). It ends without a word now, and the
    refused rank is told."""
    from symphony import ranks

    monkeypatch.setattr(ranks, "TIMEOUT", timedelta(seconds=20))
    rdv = Rendezvous(4, 2, 0, "127.0.0.1", free_port())
    kernel = Claim(0, 4, 2, "a", "cpu", "/m", "ab")
    wrong = replace(kernel, rank=2, nnodes=4, host="vm", token="aa")
    said, _ = meet_in_threads(rdv, [kernel, replace(kernel, rank=1), wrong], stagger=0.4)
    why = "rank 2 (node 2, host vm) has --nnodes 4, the kernel --nnodes 2"
    assert said == [f"rank 0: {why}", "silent: rank 1: rank 0 refused another node's rank",
                    f"rank 2: refused by the kernel at 127.0.0.1:{rdv.master_port}: {why}"], said


def test_symphony_rank_with_cuda_on_a_node_without_says_so(monkeypatch, tmp_path):
    """`symphony rank --device cuda` on a CPU node: an AttributeError (_cuda_setDevice) in
    each rank; now one line before any rank starts. The ranks run with torch's C++ warnings
    off (a stopped kernel's TCPStore printed C++ frames before the rank's own line)."""
    from symphony import ranks

    started = []
    monkeypatch.setattr(ranks.subprocess, "Popen", lambda *a, **k: started.append(k))
    rdv = Rendezvous(2, 2, 1, "127.0.0.1", 1)
    if not torch.cuda.is_available():
        with pytest.raises(ModelError, match="--device cuda: no CUDA on this node"):
            ranks.start_node(rdv, "cuda", tmp_path, "ab")
        assert not started
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)
    ranks.start_node(rdv, "cpu", tmp_path, "ab")
    assert started[-1]["env"]["TORCH_CPP_LOG_LEVEL"] == "ERROR"
