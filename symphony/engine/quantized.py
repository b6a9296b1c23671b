"""A GGUF model whose matrices live only in the file's blocks (the engine's --weights
quantized): the loader's fp32 copy of each matrix that kernels/quant_cpu.py multiplies by is
dropped, so that the weights take the file's bytes, not four to six times them.

Each such parameter becomes a placeholder of its shape: one NaN of its own, broadcast (4
bytes; a computation that reaches it by mistake gives NaN, never plausible numbers). The
ops find its blocks by its data_ptr(), which views of it (a rank's rows of the logits)
share. An embedding in blocks looks its rows up in them.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from kernels.quant_cpu import QuantWeight
from symphony.engine.model import CausalLM


class QuantEmbedding(nn.Module):
    """nn.Embedding's lookup on a matrix in blocks: each row dequantized as the loader would
    have (bit for bit). `weight` is the placeholder parameter, for tied logits."""

    def __init__(self, weight: nn.Parameter, blocks: QuantWeight):
        super().__init__()
        self.weight, self.blocks = weight, blocks

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.blocks.rows(token_ids)


def keep_blocks_only(model: CausalLM, blocks: dict[str, QuantWeight]) -> dict[int, QuantWeight]:
    """Replace each parameter named in `blocks` (loader.quantized_weights's names) with a meta
    placeholder of its shape, the embedding module with a QuantEmbedding if its weight is one
    of them; return the placeholder's data_ptr() -> its blocks, as ops.QuantCpuOps takes
    them."""
    out: dict[int, QuantWeight] = {}
    for name, w in blocks.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        old = getattr(module, attr)
        if tuple(old.shape) != w.shape:
            raise ValueError(f"{name}: blocks of shape {w.shape}, parameter {tuple(old.shape)}")
        nan = torch.full((1,), float("nan"), dtype=old.dtype, device=old.device)
        placeholder = nn.Parameter(nan.expand(old.shape), requires_grad=False)
        setattr(module, attr, placeholder)
        out[placeholder.data_ptr()] = w
        del old
    embed = model.model.embed_tokens
    if embed.weight.data_ptr() in out:
        model.model.embed_tokens = QuantEmbedding(embed.weight, out[embed.weight.data_ptr()])
    _trim_heap()
    return out


def _trim_heap() -> None:
    """Hand the heap's free memory back to the OS: glibc keeps what the dropped copies held
    (hundreds of MB that nothing reuses) unless asked."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
