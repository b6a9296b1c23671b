"""--weights quantized where the engine cannot multiply by the blocks: it says why, and
computes on copies of the weights in its dtype (as --weights float)."""

from __future__ import annotations

import pytest
import torch
from test_gguf import Q, write_gguf

from symphony.engine.engine import Engine


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "symphony.engine.engine"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_a_dtype_other_than_fp32_says_why_the_blocks_go_unused(tmp_path, caplog, dtype):
    path = tmp_path / "model.gguf"
    write_gguf(path, "llama-tied", Q.Q8_0)
    with caplog.at_level("WARNING", logger="symphony.engine.engine"):
        engine = Engine(path, device="cpu", dtype=dtype, kv_pages=4)
    assert engine.decode_step is None
    name = str(dtype).removeprefix("torch.")
    assert warnings(caplog) == [
        f"--weights quantized: the quantized matmuls compute in float32, not {name} "
        f"(--dtype float32); computing on {name} copies of the weights (--weights float)"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="symphony.engine.engine"):
        Engine(path, device="cpu", dtype=dtype, kv_pages=4, weights="float")
    assert warnings(caplog) == []
