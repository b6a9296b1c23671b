"""The per-token work of a layer and its matrix multiplies, as one swappable set: eager torch
(autograd, any device and dtype), or fp32 inference on the CPU (the C kernels, and oneDNN
matmuls on weights packed once)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import layer_cpu, quant_cpu
from kernels.quant_cpu import QuantWeight
from symphony.engine.rope import apply_rotary


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual); with no residual, (RMSNorm(x), x)."""
    if residual is not None:
        x = x + residual
    if x.dtype == weight.dtype == torch.float32:  # no casts: one call, weight included
        return F.rms_norm(x, x.shape[-1:], weight, eps), x
    # Normalise in fp32 whatever the weights' dtype, as the reference implementation does.
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype), x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of ``gate_up = [gate | up]`` along the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class TorchOps:
    name = "torch"
    add_rms_norm = staticmethod(add_rms_norm)
    silu_mul = staticmethod(silu_mul)
    rotary = staticmethod(apply_rotary)
    linear = staticmethod(F.linear)


TORCH_OPS = TorchOps()

# The batch size oneDNN lays packed weights out for; any batch runs on them.
_PACK_FOR_ROWS = 32


class CpuOps(TorchOps):
    """fp32 inference on the CPU. The C kernels do the per-token work in one pass each.
    Matmuls go through oneDNN on weights packed once at start: at decode batch sizes it was
    20 to 30% faster here than F.linear's MKL call (bench/RESULTS.md). The cost is a second
    copy of every weight matrix."""

    name = "c"
    add_rms_norm = staticmethod(layer_cpu.add_rms_norm_c)
    silu_mul = staticmethod(layer_cpu.silu_mul_c)
    rotary = staticmethod(layer_cpu.rotary_c)

    def __init__(self, weights: list[torch.Tensor]):
        """`weights`: the matrices `linear` will be called with, to pack now."""
        self._packed: dict[int, torch.Tensor] = {}
        if torch.backends.mkldnn.is_available():
            for w in weights:
                self._packed[w.data_ptr()] = torch.ops.mkldnn._reorder_linear_weight(
                    w.detach(), _PACK_FOR_ROWS
                )

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        packed = self._packed.get(weight.data_ptr())
        if packed is None:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class QuantCpuOps(CpuOps):
    """CpuOps on a model whose matrices a GGUF file keeps in blocks of Q4_0, Q4_1 or Q8_0
    live in those blocks alone (symphony/engine/quantized.py). Matmuls of up to
    `block_rows` rows read the blocks as they are (kernels/quant_cpu.py): decoding a token
    reads every weight once, and these are a quarter to a sixth of their fp32 bytes. Larger
    ones (prefill) multiply by an fp32 copy written for the call, faster once a weight is
    reused row after row. Both compute with the weights the loader's dequantization gives,
    up to the rounding of Q4's d * q + m (one in the block kernels, two in the copy), so
    the paths differ in the order of their sums and that rounding alone."""

    name = "c-quantized"

    def __init__(self, weights: list[torch.Tensor], quantized: dict[int, QuantWeight],
                 max_rows: int, block_rows: int):
        """`quantized`: weight.data_ptr() -> the weight's blocks; the other `weights` are
        packed. `max_rows`: the largest batch Engine.decode_step takes (for the engine)."""
        super().__init__([w for w in weights if w.data_ptr() not in quantized])
        self._quantized, self.max_rows, self.block_rows = quantized, max_rows, block_rows

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        q = self._quantized.get(weight.data_ptr())
        if q is None:
            return super().linear(x, weight, bias)
        if x.numel() > self.block_rows * x.shape[-1]:
            w = q.to_float()
            if not torch.backends.mkldnn.is_available():
                return F.linear(x, w, bias)
            # oneDNN takes the plain matrix too, about as fast as packed at prefill sizes
            return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
        y = quant_cpu.linear(x, q)
        return y if bias is None else y.add_(bias)


def matmul_weights(model: nn.Module) -> list[torch.Tensor]:
    """Every weight a model passes to `ops.linear`: its Linear layers' and its logits'."""
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Linear)]
    return weights + [model.logits_weight()]
