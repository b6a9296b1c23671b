"""The torch and Triton names the GPU path touches exist in the installed versions.

The GPU image has torch 2.11 and Triton 3.6; this machine torch 2.13 and a newer Triton. The
names are found by reading the code (symphony/, kernels/, bench/), not listed by hand, so a
call added there is checked here too; bench/gpu.py runs this file first on the GPU, where a
missing name costs seconds instead of a failed step minutes later.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ["symphony", "kernels", "bench", "kvfs", "syscalls", "lips"]
# Dotted names that the code says but that are not attributes to look up.
NOT_NAMES = {"torch.cuda.graphs"}


def code_files() -> list[Path]:
    return [p for d in SOURCES for p in sorted((ROOT / d).rglob("*.py"))]


def names(pattern: str) -> set[str]:
    """Every dotted name matching pattern in the code, comments and docstrings left out."""
    found = set()
    for path in code_files():
        for line in path.read_text().splitlines():
            code = line.split("#", 1)[0]
            found.update(m.rstrip(".") for m in re.findall(pattern, code))
    return found - NOT_NAMES


def resolve(dotted: str):
    """The object a dotted name names, importing submodules on the way."""
    parts = dotted.split(".")
    obj = importlib.import_module(parts[0])
    for i, part in enumerate(parts[1:], 1):
        if not hasattr(obj, part):
            obj = importlib.import_module(".".join(parts[: i + 1]))
        else:
            obj = getattr(obj, part)
    return obj


def test_torch_cuda_and_backends_names_exist():
    used = names(r"\btorch\.(?:cuda|backends|multiprocessing)(?:\.[A-Za-z_]\w*)*")
    assert "torch.cuda.is_available" in used  # the grep finds what it should
    missing = []
    for dotted in sorted(used):
        try:
            resolve(dotted)
        except (AttributeError, ImportError):
            missing.append(dotted)
    assert not missing, f"not in torch {torch.__version__}: {missing}"


def test_triton_language_names_exist():
    triton = pytest.importorskip("triton")
    import triton.language as tl

    used = names(r"\btriton\.[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
    used_tl = names(r"\btl\.[A-Za-z_]\w*")
    assert "triton.jit" in used and "tl.load" in used_tl
    missing = [n for n in sorted(used) if not _exists(n)]
    missing += [n for n in sorted(used_tl) if not hasattr(tl, n.split(".", 1)[1])]
    assert not missing, f"not in triton {triton.__version__}: {missing}"


def _exists(dotted: str) -> bool:
    try:
        resolve(dotted)
        return True
    except (AttributeError, ImportError):
        return False


def test_cuda_ipc_of_the_kv_pool_has_what_it_needs():
    """symphony/engine_process.py: the pool's device tier crosses to the engine process as
    pickled CUDA tensors (ForkingPickler after torch.multiprocessing registers its
    reducers), on the CPU as a memfd."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401
    from torch.multiprocessing import reductions

    assert hasattr(os, "memfd_create")
    assert callable(reductions.rebuild_cuda_tensor)
    assert callable(reductions.reduce_tensor)
    assert torch.Tensor in ForkingPickler._extra_reducers
    assert "enable_timing" in inspect.signature(torch.cuda.Event.__init__).parameters \
        or "enable_timing" in inspect.signature(torch.cuda.Event.__new__).parameters


def test_other_torch_names_the_gpu_path_uses_exist():
    for dotted in ("torch.nn.functional.scaled_dot_product_attention", "torch.inference_mode",
                   "torch.Tensor.untyped_storage", "torch.cuda.mem_get_info",
                   "torch.cuda.get_device_name", "torch.cuda.Event.elapsed_time"):
        assert _exists(dotted), dotted


def test_what_the_decode_graphs_call_exists():
    """symphony/engine/cuda_graphs.py: a warm-up on a side stream, a capture into a memory
    pool every graph shares, replays (methods and keywords the grep above cannot see)."""
    assert "pool" in inspect.signature(torch.cuda.graph.__init__).parameters
    for dotted in ("torch.cuda.CUDAGraph.replay", "torch.cuda.Stream.wait_stream",
                   "torch.cuda.graph_pool_handle", "torch.cuda.current_stream",
                   "torch.cuda.stream"):
        assert _exists(dotted), dotted


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_graph_captures_and_replays():
    """As cuda_graphs.py does it, in small: static input, warm-up, capture, refill, replay."""
    x = torch.zeros(8, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x * 2 + 1
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=torch.cuda.graph_pool_handle()):
        y = x * 2 + 1
    x.copy_(torch.arange(8.0))
    graph.replay()
    torch.cuda.synchronize()
    assert y.tolist() == [2.0 * i + 1 for i in range(8)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_ipc_round_trip():
    """A CUDA tensor pickled here and unpickled in a spawned process maps the same memory."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    t = torch.zeros(4, device="cuda")
    q = ctx.Queue()
    p = ctx.Process(target=_fill, args=(t, q))
    p.start()
    assert q.get(timeout=60) == "done"
    p.join(60)
    torch.cuda.synchronize()
    assert t.tolist() == [1.0, 2.0, 3.0, 4.0]


def _fill(t, q):
    t.copy_(torch.arange(1, 5, dtype=t.dtype, device=t.device))
    torch.cuda.synchronize()
    q.put("done")
