"""The per-token layer work of ``layer_cpu.c`` (fp32, CPU), called through ctypes: one
call each where eager torch runs several ops."""

from __future__ import annotations

import ctypes
import functools

import torch

from kernels.cbuild import check, load


@functools.cache
def library() -> ctypes.CDLL:
    """The built ``layer_cpu.c``; RuntimeError if it won't build."""
    lib = load("layer_cpu")
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.add_rms_norm_f32.argtypes = [p, p, p, p, i64, i64, ctypes.c_float]
    lib.silu_mul_f32.argtypes = [p, p, i64, i64]
    lib.rotary_f32.argtypes = [p, i64, i64, p, p, i64, i64, i64]
    for fn in (lib.add_rms_norm_f32, lib.silu_mul_f32, lib.rotary_f32):
        fn.restype = None
    return lib


def add_rms_norm_c(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual), the sum written into ``residual``;
    with no residual, (RMSNorm(x) * weight, x)."""
    check("x", x, contiguous=True)
    check("weight", weight, contiguous=True)
    if residual is not None:
        check("residual", residual, contiguous=True)
    n = x.shape[-1]
    if n == 0 or weight.shape != (n,) or (residual is not None and residual.shape != x.shape):
        raise ValueError("x, residual and weight disagree in shape, or are empty")
    residual = x if residual is None else residual
    out = torch.empty_like(x)
    library().add_rms_norm_f32(x.data_ptr(), residual.data_ptr(), weight.data_ptr(),
                               out.data_ptr(), x.numel() // n, n, eps)
    return out, residual


def silu_mul_c(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of ``gate_up = [gate | up]`` along the last dimension."""
    check("gate_up", gate_up, contiguous=True)
    if gate_up.shape[-1] == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up's last dimension must be even and > 0, got {gate_up.shape[-1]}")
    n = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], n)
    library().silu_mul_f32(gate_up.data_ptr(), out.data_ptr(), gate_up.numel() // (2 * n), n)
    return out


def rotary_c(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`symphony.engine.rope.apply_rotary` in place on ``x`` [T, heads, head_dim]
    (any token and head strides); cos and sin [T, 1, head_dim]. Returns ``x``."""
    check("x", x)
    if x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"x must be [tokens, heads, head_dim] with an even head_dim, "
                         f"got {list(x.shape)}")
    tokens, heads, head_dim = x.shape
    for name, t in (("cos", cos), ("sin", sin)):
        check(name, t, contiguous=True)
        if t.shape != (tokens, 1, head_dim):
            raise ValueError(f"{name} must be [tokens, 1, head_dim] to match x")
    library().rotary_f32(x.data_ptr(), *x.stride()[:2], cos.data_ptr(), sin.data_ptr(),
                         tokens, heads, head_dim)
    return x
