"""Matmuls on weights kept quantized (kernels/quant_cpu.py, the engine's --weights quantized):
against the same weights dequantized, from the kernel up to the engine's greedy tokens."""

from __future__ import annotations

import copy
import ctypes
import platform
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_gguf import IDS, Dense, Q, gguf, write_gguf

from kernels import quant_cpu
from kernels.cbuild import FLAGS
from symphony.engine.engine import Batch, Engine
from symphony.engine.generate import generate
from symphony.engine.loader import quantized_weights
from symphony.engine.ops import CpuOps, QuantCpuOps
from symphony.engine.quantized import QuantEmbedding
from symphony.engine.sampler import GREEDY


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def blocks(kind, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """(the file's blocks, uint8 [rows, bytes]; the weights gguf's reader dequantizes them to)"""
    w = np.random.default_rng(seed).normal(0, 0.05, (rows, cols)).astype(np.float32)
    stored = gguf.quants.quantize(w, kind)
    return torch.from_numpy(stored), gguf.quants.dequantize(stored, kind).reshape(rows, cols)


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda k: k.name)
def test_blocks_dequantize_as_gguf_reads_them(kind):
    stored, want = blocks(kind, 48, 320)
    w = quant_cpu.from_blocks(kind.name, stored)
    assert w.shape == (48, 320)
    # Q4_0's d * (q - 8) is d * q + (-8d) here: the same float, -8d being exact.
    assert torch.equal(w.dequantize(), torch.from_numpy(want))
    # The C kernels' copy for large batches, and an embedding's rows, bit for bit.
    assert torch.equal(w.to_float(), torch.from_numpy(want))
    ids = torch.tensor([5, 0, 47, 5])
    assert torch.equal(w.rows(ids), torch.from_numpy(want)[ids])


@pytest.mark.parametrize("kind", [Q.Q4_0, Q.Q4_1, Q.Q8_0], ids=lambda k: k.name)
def test_linear_equals_the_dequantized_matmul_whatever_the_batch(kind):
    stored, dense = blocks(kind, 70, 576, seed=1)
    w, dense = quant_cpu.from_blocks(kind.name, stored), torch.from_numpy(dense).double()
    x = torch.randn(37, 576, generator=torch.Generator().manual_seed(2))
    want = (x.double() @ dense.T).float()
    y = quant_cpu.linear(x, w)
    assert (y - want).abs().max() <= 1e-5 * want.abs().max()
    # A token's result does not depend on the batch it came in (tiles of 4 rows, and tails).
    for rows in (1, 3, 5, 8):
        assert torch.equal(quant_cpu.linear(x[:rows], w), y[:rows])
    with pytest.raises(ValueError, match="x has 64 columns, the weight 576"):
        quant_cpu.linear(x[:, :64], w)


def test_cat_needs_one_format_and_width():
    a = quant_cpu.from_blocks("Q4_1", blocks(Q.Q4_1, 8, 64)[0])
    b = quant_cpu.from_blocks("Q4_0", blocks(Q.Q4_0, 4, 64)[0])
    stacked = quant_cpu.cat([a, b])
    assert stacked.shape == (12, 64)
    assert torch.equal(stacked.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    assert quant_cpu.cat([a, quant_cpu.from_blocks("Q8_0", blocks(Q.Q8_0, 4, 64)[0])]) is None
    assert quant_cpu.cat([a, quant_cpu.from_blocks("Q4_1", blocks(Q.Q4_1, 4, 96)[0])]) is None
    # Q4_0's -8d, past fp16's range: that matrix stays dequantized.
    huge = blocks(Q.Q4_0, 4, 64)[0].clone()
    huge.view(4, 2, 18)[0, 0, :2] = torch.tensor([60000.0], dtype=torch.float16).view(torch.uint8)
    assert quant_cpu.from_blocks("Q4_0", huge) is None and quant_cpu.cat([a, None]) is None


def engines(path) -> tuple[Engine, Engine]:
    return (Engine(path, device="cpu", kv_pages=32, weights="quantized"),
            Engine(path, device="cpu", kv_pages=32, weights="float"))


@pytest.mark.parametrize("family,kind,embedding", [
    ("llama-tied", Q.Q4_1, Q.Q8_0),  # SmolLM2's types: q/k rows permuted, logits in Q8_0
    ("qwen2", Q.Q4_0, Q.Q4_1),  # biases on q, k and v
    ("qwen3", Q.Q8_0, Q.F16),  # q/k norms; an embedding stays dequantized
], ids=lambda p: getattr(p, "name", p))
def test_engine_logits_and_greedy_tokens_equal_the_dequantized_model(
        tmp_path, family, kind, embedding):
    path = tmp_path / "model.gguf"
    write_gguf(path, family, kind, seed=7, raw_types={"token_embd.weight": embedding})
    quantized, dense = engines(path)
    # Without AVX-512 the kernels are slower than fp32 matmuls: the engine keeps to those.
    if not quant_cpu.fast():
        assert type(quantized.ops) is CpuOps
        pytest.skip("no AVX-512: the engine keeps to fp32 matmuls")
    assert type(quantized.ops) is QuantCpuOps and type(dense.ops) is CpuOps
    tied = embedding != Q.F16
    assert isinstance(quantized.model.model.embed_tokens, QuantEmbedding) == tied
    ids, positions = torch.tensor(IDS), torch.arange(len(IDS))
    want = dense.model.logits(dense.model(ids, positions, Dense(), dense.ops), dense.ops)
    # Every matmul of the forward on the blocks, then every one on fp32 copies made for the
    # call (the engine's threshold between them is for speed alone).
    for block_rows in (len(IDS), 0):
        ops = copy.copy(quantized.ops)
        ops.block_rows = block_rows
        got = quantized.model.logits(quantized.model(ids, positions, Dense(), ops), ops)
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    prompts = [IDS, [5, 4, 3, 2, 200]]
    assert generate(quantized, prompts, GREEDY, 12, stop_ids=()) == \
        generate(dense, prompts, GREEDY, 12, stop_ids=())


def storage_bytes(model: torch.nn.Module) -> int:
    return sum(p.untyped_storage().nbytes() for p in model.parameters())


def test_quantized_matrices_keep_no_fp32_copy(tmp_path):
    """--weights quantized holds each matrix in the file's blocks alone: the model's
    parameters of those matrices are 4-byte NaN placeholders, and the embedding looks its rows
    up in the blocks, bit for bit the loader's."""
    if not quant_cpu.fast():
        pytest.skip("no AVX-512: the engine keeps to fp32 matmuls")
    path = tmp_path / "model.gguf"
    write_gguf(path, "llama-tied", Q.Q4_1, raw_types={"token_embd.weight": Q.Q8_0})
    quantized, dense = engines(path)
    norms = sum(p.numel() * 4 for n, p in dense.model.named_parameters() if "norm" in n)
    assert storage_bytes(dense.model) > 100 * norms
    matrices = [p for n, p in quantized.model.named_parameters() if "norm" not in n]
    assert matrices and all(p.untyped_storage().nbytes() == 4 and p.isnan().all()
                            for p in matrices)
    assert storage_bytes(quantized.model) == norms + 4 * len(matrices)
    ids = torch.tensor(IDS)
    assert torch.equal(quantized.model.model.embed_tokens(ids), dense.model.model.embed_tokens(ids))


def test_matrices_in_other_types_stay_dequantized(tmp_path):
    """A K-quant file has nothing to multiply quantized; q, k and v in two formats stack into
    no one matrix, while the rest of the file still goes quantized."""
    path = tmp_path / "k.gguf"
    write_gguf(path, "qwen2", Q.Q4_K)
    quantized, _ = engines(path)
    assert type(quantized.ops) is CpuOps
    path = tmp_path / "mixed.gguf"
    write_gguf(path, "llama", Q.Q4_1, raw_types={"blk.0.attn_v.weight": Q.Q8_0,
                                                 "blk.1.ffn_up.weight": Q.Q4_K})
    model = Engine(path, device="cpu", kv_pages=8, weights="float").model
    names = set(quantized_weights(path, model))
    assert "model.layers.0.self_attn.qkv_proj.weight" not in names
    assert "model.layers.1.mlp.gate_up_proj.weight" not in names
    assert {"model.layers.1.self_attn.qkv_proj.weight", "model.layers.0.mlp.gate_up_proj.weight",
            "model.layers.1.mlp.down_proj.weight", "lm_head.weight"} <= names


def test_checkpoint_directories_have_no_quantized_weights():
    engine = Engine(device="cpu", kv_pages=8)  # the suite's model, a safetensors directory
    assert quantized_weights(engine.model_dir, engine.model) == {}
    assert type(engine.ops) is CpuOps
    with pytest.raises(ValueError, match="weights must be one of quantized, float"):
        Engine(device="cpu", kv_pages=8, weights="int8")


@pytest.mark.parametrize("family", ["llama-tied", "qwen2", "qwen3"])
def test_decode_step_in_one_call_equals_the_layer_by_layer_path(tmp_path, family):
    """Engine.decode_step (every matrix in blocks: the whole step in C) against the model's
    modules on the same quantized matmuls: a decode batch with excluded ranges."""
    path = tmp_path / "model.gguf"
    write_gguf(path, family, Q.Q4_1, seed=9, raw_types={"token_embd.weight": Q.Q8_0,
                                                        "output.weight": Q.Q8_0})
    engine = Engine(path, device="cpu", kv_pages=32)
    if not quant_cpu.fast():
        assert engine.decode_step is None
        pytest.skip("no AVX-512: the engine keeps to fp32 matmuls")
    assert engine.decode_step is not None
    prompts = [IDS[:5], IDS[3:10], [7, 8, 9]]
    pages = [engine.pool.allocate(2) for _ in prompts]
    lens = [len(p) for p in prompts]
    engine.forward(Batch([t for p in prompts for t in p], [i for n in lens for i in range(n)],
                         lens, lens, pages, [0]))
    decode = Batch([11, 12, 13], lens, [1, 1, 1], [n + 1 for n in lens], pages, [2, 0],
                   excluded=[[(1, 3)], [], [(0, 1), (2, 3)]])
    got = engine.forward(decode)
    step, engine.decode_step = engine.decode_step, None
    want = engine.forward(decode)
    assert got.shape == want.shape == (2, engine.config.vocab_size)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    engine.decode_step = step
    bad = Batch([11], [5], [1], [6], [[engine.pool.num_pages]], [0])
    with pytest.raises(ValueError):
        engine.forward(bad)


def build(tmp_path, *flags: str) -> ctypes.CDLL:
    """kernels/quant_cpu.c built as kernels/cbuild.py builds it, plus `flags` (later flags
    win over -march=native's)."""
    out = tmp_path / f"quant{len(flags)}.so"
    source = quant_cpu.__file__.replace(".py", ".c")
    subprocess.run(["cc", *FLAGS, *flags, "-Werror", "-o", str(out), source, "-lm"],
                   check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(str(out))
    for fn in (lib.q4_linear_f32, lib.q8_linear_f32):
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    for fn in (lib.q4_dequantize_f32, lib.q8_dequantize_f32):
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2
    return lib


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 flags")
@pytest.mark.parametrize("kind", [Q.Q4_1, Q.Q8_0], ids=lambda k: k.name)
def test_the_portable_build_computes_the_same(tmp_path, kind):
    """Built for a CPU without AVX-512 (x86-64's baseline: no _Float16 support needed, no
    intrinsics), the kernels say so, and compute what the vector code does: the same copy bit
    for bit, the same products up to the order of the sums."""
    lib = build(tmp_path, "-march=x86-64", "-mtune=generic")
    assert lib.quant_simd() == 0
    stored, dense = blocks(kind, 40, 256, seed=4)
    w = quant_cpu.from_blocks(kind.name, stored)
    q4 = w.format == "q4"
    copy_ = torch.empty(40, 256)
    (lib.q4_dequantize_f32 if q4 else lib.q8_dequantize_f32)(
        w.qs.data_ptr(), w.scales.data_ptr(), copy_.data_ptr(), 40, 256)
    assert torch.equal(copy_, torch.from_numpy(dense))
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(5))
    y = torch.empty(7, 40)
    (lib.q4_linear_f32 if q4 else lib.q8_linear_f32)(
        x.data_ptr(), 7, 256, w.qs.data_ptr(), w.scales.data_ptr(), y.data_ptr(), 40)
    want = (x.double() @ torch.from_numpy(dense).double().T).float()
    assert (y - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 flags")
def test_without_avx512_the_engine_says_so_and_computes_in_fp32(tmp_path):
    """A compiler told not to use AVX-512 (as on a CPU without it) builds the kernels' portable
    code: the engine logs why it keeps to fp32 matmuls, and answers as --weights float."""
    path = tmp_path / "model.gguf"
    write_gguf(path, "llama-tied", Q.Q4_1, raw_types={"token_embd.weight": Q.Q8_0})
    cc = tmp_path / "cc"
    cc.write_text('#!/bin/sh\nexec cc "$@" -mno-avx512f\n')
    cc.chmod(0o755)
    script = (
        "import logging\n"
        "from symphony.engine.engine import Engine\n"
        "from symphony.engine.generate import generate\n"
        "from symphony.engine.sampler import GREEDY\n"
        "logging.basicConfig(level=logging.WARNING)\n"
        f"e = Engine({str(path)!r}, device='cpu', kv_pages=16)\n"
        "print(type(e.ops).__name__, generate(e, [[1, 17, 250, 3]], GREEDY, 6, stop_ids=()))\n")
    env = {"CC": str(cc), "SYMPHONY_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, check=True)
    assert "--weights quantized: this CPU, or the C compiler's -march=native for it, has no " \
           "AVX-512 (AVX512F); computing on fp32 copies of the weights" in done.stderr
    dense = Engine(path, device="cpu", kv_pages=16, weights="float")
    want = generate(dense, [[1, 17, 250, 3]], GREEDY, 6, stop_ids=())
    assert done.stdout.split(maxsplit=1) == ["CpuOps", f"{want}\n"]
