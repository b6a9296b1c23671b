"""CUDA graphs of decode steps (symphony/engine/cuda_graphs.py).

On the CPU: the buckets, the padding, the switch, the refusal to capture, and the static-buffer
step (what a graph records) run eagerly against the engine's normal decode path, with every
attention backend the CPU has (Triton's interpreted), and without an op that would wait for
the device (which a capture cannot hold). On CUDA (bench/gpu.sh's parity step)
also the captured graphs replayed against the normal path, and greedy decoding with and
without them. SYMPHONY_TEST_DEVICE picks the device.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from checkpoints import make_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from symphony.cli import KERNEL_OPTIONS, build_parser, main
from symphony.engine.cuda_graphs import (
    BATCH_BUCKETS,
    ENV,
    DecodeGraphs,
    StaticInputs,
    batch_bucket,
    graphs_wanted,
    pad,
    pages_bucket,
)
from symphony.engine.engine import Batch, Engine
from symphony.engine.generate import generate
from symphony.engine.sampler import GREEDY

DEVICE = os.environ.get("SYMPHONY_TEST_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
CUDA = DEVICE == "cuda"
PAGE = 16
cuda_only = pytest.mark.skipif(not CUDA, reason="needs CUDA")


@pytest.fixture(autouse=True)
def no_tf32(monkeypatch):
    """fp32 means fp32: TF32 matmuls would be 1e-3 off. And each test says whether it wants
    graphs, whatever the environment says."""
    monkeypatch.delenv(ENV, raising=False)
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 12, 13, 33, 256)] == [
        1, 2, 4, 8, 12, 16, 48, 256]  # fmt: skip
    assert batch_bucket(257) is None and BATCH_BUCKETS == tuple(sorted(BATCH_BUCKETS))
    assert [pages_bucket(n) for n in (1, 4, 5, 8, 9, 17, 1000)] == [4, 4, 8, 8, 16, 32, 1024]


def decode_batch(kv_lens: list[int], tables: list[list[int]], seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 300, len(kv_lens)).tolist()  # in every test model's vocabulary
    n = len(kv_lens)
    return Batch(ids, [k - 1 for k in kv_lens], [1] * n, kv_lens, tables, list(range(n)))


def test_pad_lays_out_rows_padding_and_slots():
    batch = decode_batch([5, 21, 40], [[7, 30], [3, 9], [12, 1, 5, 20]])
    host = pad(batch, 4, 8, PAGE)
    ids, pos, lens, slots = host[:4], host[4:8], host[8:12], host[12:16]
    table = host[16:].reshape(4, 8)
    assert ids[:3].tolist() == batch.token_ids and ids[3] == 0
    assert pos.tolist() == [4, 20, 39, 0] and lens.tolist() == [5, 21, 40, 0]
    # The page of KV index kv_len - 1, its row; the padding row stores nothing.
    assert slots.tolist() == [7 * PAGE + 4, 9 * PAGE + 4, 5 * PAGE + 7, -1]
    # Only the pages kv_len reaches: page 30 of a 5-token sequence is left out.
    assert table.tolist() == [[7, 0, 0, 0, 0, 0, 0, 0], [3, 9, 0, 0, 0, 0, 0, 0],
                              [12, 1, 5, 0, 0, 0, 0, 0], [0] * 8]  # fmt: skip


def test_static_inputs_start_as_padding():
    inputs = StaticInputs(4, 8, torch.device("cpu"))
    assert inputs.slots.tolist() == [-1] * 4 and inputs.kv_lens.tolist() == [0] * 4
    assert inputs.page_table.shape == (4, 8) and inputs.q_start.tolist() == [0, 1, 2, 3, 4]
    host = pad(decode_batch([3], [[2]]), 4, 8, PAGE)
    inputs.fill(host)
    assert inputs.ints.tolist() == host.tolist()


def test_the_switch(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv(ENV, raising=False)
    assert graphs_wanted(None, cuda, "triton") and not graphs_wanted("off", cuda, "triton")
    assert graphs_wanted("on", cuda, "triton")
    assert not graphs_wanted(None, cpu, "c") and not graphs_wanted("off", cpu, "torch")
    assert not graphs_wanted(None, cuda, "torch")  # the torch reference syncs: no capture
    with pytest.raises(ValueError, match="CUDA graphs .* the c kernels on cpu: they must be off"):
        graphs_wanted("on", cpu, "c")
    with pytest.raises(ValueError, match="the torch kernels on cuda"):
        graphs_wanted("on", cuda, "torch")
    assert not graphs_wanted(None, cuda, "triton", ranks=2)
    with pytest.raises(ValueError, match="triton kernels on cuda as one of 2 tensor-parallel"):
        graphs_wanted("on", cuda, "triton", ranks=2)
    with pytest.raises(ValueError, match="cuda_graphs must be 'on' or 'off', not 'yes'"):
        graphs_wanted("yes", cuda, "triton")
    monkeypatch.setenv(ENV, "off")
    assert not graphs_wanted(None, cuda, "triton") and graphs_wanted("on", cuda, "triton")
    monkeypatch.setenv(ENV, "1")
    with pytest.raises(ValueError, match=f"{ENV} must be 'on' or 'off', not '1'"):
        graphs_wanted(None, cuda, "triton")


def test_an_engine_on_the_cpu_has_no_graphs_and_refuses_them():
    engine = Engine(device="cpu", kv_pages=8)
    assert engine.decode_graphs is None
    with pytest.raises(ValueError, match="they must be off"):
        Engine(device="cpu", kv_pages=8, cuda_graphs="on")


@pytest.mark.parametrize("command", ["kernel", "start", "generate"])
def test_the_cli_flag(command, capsys):
    parser = build_parser()
    args = [command] + (["--prompt", "hi"] if command == "generate" else [])
    assert parser.parse_args(args).cuda_graphs is None  # the engine's default
    assert parser.parse_args([*args, "--cuda-graphs", "off"]).cuda_graphs == "off"
    with pytest.raises(SystemExit) as e:
        parser.parse_args([*args, "--cuda-graphs", "yes"])
    assert e.value.code == 2 and "--cuda-graphs" in capsys.readouterr().err
    assert "cuda_graphs" in KERNEL_OPTIONS  # start passes it on to the kernel


def test_generate_on_the_cpu_with_graphs_on_says_why(capsys):
    argv = ["generate", "--device", "cpu", "--prompt-ids", "1,2", "--max-new-tokens", "1"]
    assert main([*argv, "--cuda-graphs", "on"]) == 1
    assert "kernels on cpu: they must be off" in capsys.readouterr().err
    assert main([*argv, "--cuda-graphs", "off"]) == 0


@pytest.mark.slow
def test_a_kernel_asked_for_graphs_on_the_cpu_says_why(tmp_path):
    """The flag reaches the engine process (through its environment), which refuses."""
    run = subprocess.run(
        [sys.executable, "-m", "symphony.cli", "kernel", "--cuda-graphs", "on", "--device",
         "cpu", "--kv-pages", "8", "--socket", str(tmp_path / "k.sock"), "--state-dir",
         str(tmp_path / "state")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr
    assert "kernels on cpu: they must be off" in run.stderr


def test_capture_is_refused_off_cuda():
    engine = Engine(device="cpu", kv_pages=8)
    with pytest.raises(ValueError, match="cannot be captured on cpu: they need a CUDA device"):
        DecodeGraphs(engine.model, engine.pool, engine.kernels, engine.ops, engine.scale)


BACKENDS = [
    pytest.param("c", marks=pytest.mark.skipif(CUDA, reason="the C kernels are the CPU's")),
    "torch",
    pytest.param("triton", marks=() if CUDA else pytest.mark.slow),  # interpreted on the CPU
]


@pytest.fixture(scope="module")
def small_llama(tmp_path_factory):
    """Two layers: the Triton interpreter runs every program of every layer in Python."""
    directory = tmp_path_factory.mktemp("llama")
    make_checkpoint(directory, "llama")
    return directory


def engine_with(backend: str, model_dir, monkeypatch, **kw) -> Engine:
    monkeypatch.setenv("SYMPHONY_ATTENTION", backend)
    engine = Engine(
        model_dir, device=DEVICE, dtype=torch.float32, kv_pages=32, page_size=PAGE, **kw
    )
    assert engine.kernels.name == backend
    g = torch.Generator().manual_seed(1)
    engine.pool.k.copy_(torch.randn(engine.pool.k.shape, generator=g))  # as if prefilled
    engine.pool.v.copy_(torch.randn(engine.pool.v.shape, generator=g))
    return engine


def pool_state(engine: Engine) -> tuple[torch.Tensor, torch.Tensor]:
    return engine.pool.k.clone(), engine.pool.v.clone()


def restore(engine: Engine, state: tuple[torch.Tensor, torch.Tensor]) -> None:
    engine.pool.k.copy_(state[0])
    engine.pool.v.copy_(state[1])


def written_slots(engine: Engine, before: tuple[torch.Tensor, torch.Tensor]) -> list[int]:
    """The pool slots whose K or V differs from `before`, in any layer."""
    changed = torch.zeros(engine.pool.k.shape[1] * PAGE, dtype=torch.bool, device=DEVICE)
    for now, then in zip((engine.pool.k, engine.pool.v), before, strict=True):
        diff = (now != then).flatten(3).any(-1).any(0)  # [pages, page_size]
        changed |= diff.flatten()
    return changed.nonzero().flatten().tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_padded_static_step_gives_the_normal_paths_logits_and_kv(
    backend, small_llama, monkeypatch
):
    """The step a graph records, run eagerly: 3 sequences padded to a bucket of 4 (one row
    of padding) over page tables padded to 4 pages, against the engine's own forward."""
    engine = engine_with(backend, small_llama, monkeypatch, cuda_graphs="off")
    graphs = DecodeGraphs(
        engine.model, engine.pool, engine.kernels, engine.ops, engine.scale, capture=False
    )
    start = pool_state(engine)
    batch = decode_batch([5, 21, 40], [[7, 30], [3, 9], [12, 1, 5, 20]])
    batch.logit_rows = [2, 0]  # some rows, out of order
    assert graphs.bucket(batch) == (4, 4)
    want = engine.forward(batch)
    want_kv = pool_state(engine)
    restore(engine, start)
    with torch.inference_mode():
        got = graphs.forward(batch)
    assert got.shape == want.shape == (2, engine.config.vocab_size)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The new tokens' K/V where the normal path put them, and nothing else written.
    assert written_slots(engine, start) == [5 * PAGE + 7, 7 * PAGE + 4, 9 * PAGE + 4]
    torch.testing.assert_close(pool_state(engine), want_kv, atol=1e-5, rtol=1e-5)


# The ops that read a device tensor back to the host: a capture fails at the first of them.
SYNCING = {
    "aten.item.default", "aten._local_scalar_dense.default", "aten.is_nonzero.default",
    "aten.nonzero.default", "aten.masked_select.default", "aten.equal.default",
    "aten.repeat_interleave.Tensor", "aten._unique2.default", "aten.allclose.default",
}  # fmt: skip


class OpsSeen(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", [BACKENDS[2], "torch"])
def test_the_recorded_step_never_reads_the_device_back(backend, small_llama, monkeypatch):
    """What makes a step capturable, seen on the CPU: not one op of the static-buffer step
    (Triton's launches included, interpreted) waits for the device. The torch reference
    reads the longest length back, which is why graphs are refused for it."""
    engine = engine_with(backend, small_llama, monkeypatch, cuda_graphs="off")
    graphs = DecodeGraphs(
        engine.model, engine.pool, engine.kernels, engine.ops, engine.scale, capture=False
    )
    inputs = StaticInputs(4, 4, engine.pool.k.device)
    inputs.fill(pad(decode_batch([5, 21, 40], [[7], [3, 9], [12, 1, 5]]), 4, 4, PAGE))
    with torch.inference_mode(), OpsSeen() as seen:
        graphs.step(inputs)
    assert "aten.embedding.default" in seen.ops  # it saw the step
    if backend == "triton":
        assert not seen.ops & SYNCING
        assert graphs_wanted(None, torch.device("cuda"), backend)
    else:
        assert {"aten.item.default", "aten.is_nonzero.default"} <= seen.ops
        assert not graphs_wanted(None, torch.device("cuda"), backend)


def test_batches_without_a_bucket_take_the_normal_path():
    engine = Engine(device="cpu", kv_pages=8)
    graphs = DecodeGraphs(
        engine.model, engine.pool, engine.kernels, engine.ops, engine.scale, capture=False
    )
    prefill = Batch([5, 6], [0, 1], [2], [2], [[0]], [1])
    excluded = decode_batch([5], [[1]])
    excluded.excluded = [[(0, 2)]]
    many = decode_batch([1] * (BATCH_BUCKETS[-1] + 1), [[0]] * (BATCH_BUCKETS[-1] + 1))
    for batch in (prefill, excluded, many):
        assert graphs.bucket(batch) is None and graphs.forward(batch) is None


@cuda_only
def test_replayed_graphs_give_the_normal_paths_logits_and_kv(small_llama, monkeypatch):
    """Captured on CUDA, once per bucket, replayed for every batch that falls in it."""
    engine = engine_with("triton", small_llama, monkeypatch)
    graphs = engine.decode_graphs
    assert graphs is not None and graphs.capture
    start = pool_state(engine)
    cases = [
        ([5, 21, 40], [[7, 30], [3, 9], [12, 1, 5, 20]], None),  # bucket (4, 4)
        ([5, 21, 40, 2], [[7], [3, 9], [12, 1, 5], [25]], [3, 1]),  # the same, some rows
        ([70], [[2, 4, 6, 8, 10]], None),  # (1, 8)
        ([3] * 5, [[p] for p in (11, 13, 15, 17, 19)], None),  # (8, 4)
    ]
    for kv_lens, tables, rows in cases:
        batch = decode_batch(kv_lens, tables)
        batch.logit_rows = rows or batch.logit_rows
        got = engine.forward(batch)
        got_kv = pool_state(engine)
        restore(engine, start)
        engine.decode_graphs = None
        want = engine.forward(batch)
        engine.decode_graphs = graphs
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(got_kv, pool_state(engine), atol=1e-5, rtol=1e-5)
        restore(engine, start)
    assert graphs.failed is None and graphs.captured == [(4, 4), (1, 8), (8, 4)]


@cuda_only
def test_a_step_that_cannot_be_captured_runs_eagerly(small_llama, monkeypatch, caplog):
    """A host sync in the step (here an .item()) breaks the capture: logged, graphs off, the
    step and the ones after it computed eagerly, as without graphs."""
    engine = engine_with("triton", small_llama, monkeypatch)
    graphs, step = engine.decode_graphs, engine.decode_graphs.step

    def syncing(inputs):
        inputs.kv_lens.sum().item()
        return step(inputs)

    monkeypatch.setattr(graphs, "step", syncing)
    start = pool_state(engine)
    batch = decode_batch([5, 21, 40], [[7, 30], [3, 9], [12, 1, 5, 20]])
    got = engine.forward(batch)
    assert graphs.failed and "bucket (4, 4)" in graphs.failed and graphs.captured == []
    assert "CUDA graphs off" in caplog.text
    restore(engine, start)
    engine.decode_graphs = None
    torch.testing.assert_close(got, engine.forward(batch), atol=1e-4, rtol=1e-4)
    engine.decode_graphs = graphs
    assert graphs.forward(batch) is None  # off for good


@cuda_only
def test_greedy_decoding_is_the_same_with_and_without_graphs():
    prompts = [[5, 17, 99, 23, 42, 8, 150], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7], [11]]
    outs = []
    for switch in ("on", "off"):
        engine = Engine(device=DEVICE, dtype=torch.float32, kv_pages=64, cuda_graphs=switch)
        outs.append(generate(engine, prompts, GREEDY, 40, stop_ids=()))
        assert (engine.decode_graphs is not None) == (switch == "on")
    assert outs[0] == outs[1]
