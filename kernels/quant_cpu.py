"""Matrix multiplies on weights kept as GGUF stores them (``quant_cpu.c``: Q4_0, Q4_1 and
Q8_0 blocks of 32; fp32 activations, CPUs with AVX-512), called through ctypes; and the
same matrices written out in fp32 for one call, for batches where fp32 matmuls win.

A block of 32 weights is a scale d (fp16), for Q4_1 a minimum m (fp16), and 32 quants:
Q4_0 nibbles q with weights d * (q - 8); Q4_1 nibbles, d * q + m; Q8_0 int8, d * q. Both Q4
types become one layout here, nibbles with fp16 (d, m) pairs (Q4_0's m is -8d, exact), so
that the q, k and v projections of one file stack into one matrix whichever of the two each
is stored in. The bytes are the file's: 20 a block of Q4, 34 of Q8_0.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from kernels.cbuild import check, load

BLOCK = 32
# GGUF type name -> (our format, bytes a block)
KINDS = {"Q4_0": ("q4", 18), "Q4_1": ("q4", 20), "Q8_0": ("q8", 34)}


@functools.cache
def library() -> ctypes.CDLL:
    """The built ``quant_cpu.c``; RuntimeError if it won't build."""
    lib = load("quant_cpu")
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for fn in (lib.q4_linear_f32, lib.q8_linear_f32):
        fn.argtypes = [p, i64, i64, p, p, p, i64]
        fn.restype = None
    for fn in (lib.q4_dequantize_f32, lib.q8_dequantize_f32):
        fn.argtypes = [p, p, p, i64, i64]
        fn.restype = None
    lib.quant_simd.restype = ctypes.c_int
    return lib


def unavailable() -> str | None:
    """Why the kernels cannot be the fast path here, or None if they can: they are written
    for AVX-512, and built without it (another CPU, or a compiler that does not target it)
    they compute the same sums slower than fp32 matmuls."""
    try:
        simd = library().quant_simd()
    except (RuntimeError, OSError) as e:
        return f"kernels/quant_cpu.c did not build ({str(e).splitlines()[0]})"
    if not simd:
        return "this CPU, or the C compiler's -march=native for it, has no AVX-512 (AVX512F)"
    return None


def fast() -> bool:
    """Whether the kernels build here with the vector code they are written for."""
    return unavailable() is None


@dataclass
class QuantWeight:
    """A [rows, cols] matrix in format "q4" (qs: uint8 [rows, cols/2] nibbles; scales: fp16
    [rows, cols/32, 2] of (d, m)) or "q8" (qs: int8 [rows, cols]; scales: fp16 [rows,
    cols/32] of d)."""

    format: str
    qs: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.scales.shape[1] * BLOCK

    def dequantize(self) -> torch.Tensor:
        """The fp32 matrix, as GGUF's reader computes it (d * q + m; d * q)."""
        rows, cols = self.shape
        scales = self.scales.float()
        if self.format == "q8":
            q = self.qs.view(rows, -1, BLOCK).float()
            return (q * scales[..., None]).view(rows, cols)
        nibbles = self.qs.view(rows, -1, 1, 16)
        q = torch.cat([nibbles & 15, nibbles >> 4], dim=2).view(rows, -1, BLOCK).float()
        return (q * scales[..., :1] + scales[..., 1:]).view(rows, cols)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` (int64 [T]) in fp32, as `dequantize` computes them: an embedding lookup."""
        return QuantWeight(self.format, self.qs[ids], self.scales[ids]).dequantize()

    def to_float(self) -> torch.Tensor:
        """The fp32 matrix, as `dequantize` computes it, written by the C kernels (threads,
        one pass) for a matmul too large for `linear`."""
        rows, cols = self.shape
        w = torch.empty(rows, cols)
        lib = library()
        fn = lib.q4_dequantize_f32 if self.format == "q4" else lib.q8_dequantize_f32
        fn(self.qs.data_ptr(), self.scales.data_ptr(), w.data_ptr(), rows, cols)
        return w


def from_blocks(kind: str, blocks: torch.Tensor) -> QuantWeight | None:
    """A matrix of GGUF blocks, uint8 [rows, bytes a row], of type `kind` (a name in KINDS);
    None for a Q4_0 block whose -8d is past fp16's range."""
    fmt, size = KINDS[kind]
    rows = blocks.shape[0]
    b = blocks.reshape(rows, -1, size)

    def fp16(offset: int) -> torch.Tensor:
        return b[..., offset : offset + 2].contiguous().view(torch.float16)

    d = fp16(0)
    if fmt == "q8":
        return QuantWeight(fmt, b[..., 2:].reshape(rows, -1).view(torch.int8).contiguous(),
                           d[..., 0].contiguous())
    m = fp16(2) if kind == "Q4_1" else -8 * d
    if not torch.isfinite(m).all():
        return None
    return QuantWeight(fmt, b[..., size - 16 :].reshape(rows, -1).contiguous(),
                       torch.cat([d, m], dim=-1).contiguous())


def cat(parts: list[QuantWeight | None]) -> QuantWeight | None:
    """The parts stacked by rows; None if one is None, or their formats or widths differ."""
    if None in parts or len({(p.format, p.shape[1]) for p in parts}) != 1:
        return None
    return QuantWeight(parts[0].format, torch.cat([p.qs for p in parts]),
                       torch.cat([p.scales for p in parts]))


def linear(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """x [..., cols] fp32 @ w.T -> [..., rows]."""
    rows, cols = w.qs.shape[0], x.shape[-1]
    if cols != w.scales.shape[1] * BLOCK:
        raise ValueError(f"x has {cols} columns, the weight {w.shape[1]}")
    x = x.contiguous()
    check("x", x, contiguous=True)
    y = x.new_empty(*x.shape[:-1], rows)
    lib = library()
    fn = lib.q4_linear_f32 if w.format == "q4" else lib.q8_linear_f32
    fn(x.data_ptr(), x.numel() // cols, cols, w.qs.data_ptr(), w.scales.data_ptr(),
       y.data_ptr(), rows)
    return y


# ---------------------------------------------------------------------------------------
# A whole decode step in one call (quant_cpu.c's decode_step_f32).

class _QMat(ctypes.Structure):
    _fields_ = [("format", ctypes.c_int32), ("qs", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("rows", ctypes.c_int64), ("cols", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "input_norm", "post_norm", "qkv_bias", "q_norm", "k_norm", "cache")] + [
        (name, _QMat) for name in ("qkv", "o", "gate_up", "down")]


class _Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in (
        "num_layers", "hidden", "heads", "kv_heads", "head_dim", "inter")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("layers", ctypes.POINTER(_Layer)),
        ("final_norm", ctypes.c_void_p), ("logits", _QMat)] + [
        (name, ctypes.c_void_p) for name in (
            "add_rms_norm", "silu_mul", "rotary", "store_kv", "decode")]


def _qmat(w: QuantWeight) -> _QMat:
    rows, cols = w.shape
    return _QMat(4 if w.format == "q4" else 8, w.qs.data_ptr(), w.scales.data_ptr(), rows, cols)


def _ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    check("a weight", t, contiguous=True)
    return t.data_ptr()


@dataclass
class LayerWeights:
    """One decoder layer: its norms' weights (fp32), matrices in blocks, optional q/k/v bias
    and q/k norms, and its KV cache (k and v [pages, page_size, kv_heads, head_dim])."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: QuantWeight
    o: QuantWeight
    gate_up: QuantWeight
    down: QuantWeight
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor


class DecodeStep:
    """Decode steps of a Llama-family model whose every matrix is in blocks: the layers, the
    final norm and the logits, in one C call. The tensors given must outlive it."""

    def __init__(self, layers: list[LayerWeights], final_norm: torch.Tensor,
                 logits: QuantWeight, heads: int, kv_heads: int, head_dim: int, eps: float,
                 scale: float):
        from kernels import layer_cpu, paged_cpu

        self._keep = (layers, final_norm, logits)
        self._caches = [paged_cpu._cache(w.k_cache, w.v_cache) for w in layers]
        self._layers = (_Layer * len(layers))(*(
            _Layer(_ptr(w.input_norm), _ptr(w.post_norm), _ptr(w.qkv_bias), _ptr(w.q_norm),
                   _ptr(w.k_norm), ctypes.addressof(cache), _qmat(w.qkv), _qmat(w.o),
                   _qmat(w.gate_up), _qmat(w.down))
            for w, cache in zip(layers, self._caches, strict=True)))
        first = layers[0]
        self.hidden, self.vocab, self.head_dim = first.qkv.shape[1], logits.shape[0], head_dim

        def fn(lib, name):
            return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value

        lc, pc = layer_cpu.library(), paged_cpu.library()
        self._model = _Model(
            len(layers), self.hidden, heads, kv_heads, head_dim, first.down.shape[1], eps, scale,
            self._layers, _ptr(final_norm), _qmat(logits), fn(lc, "add_rms_norm_f32"),
            fn(lc, "silu_mul_f32"), fn(lc, "rotary_f32"), fn(pc, "store_kv_f32"),
            fn(pc, "decode_attention_f32"))
        lib = library()
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.decode_step_f32.argtypes = [ctypes.POINTER(_Model), p, i64, p, p, p, p, i64, i64, p,
                                        p, i64, p, i64, p]
        lib.decode_step_f32.restype = ctypes.c_int

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 slots: torch.Tensor, page_table: torch.Tensor, kv_lens: torch.Tensor,
                 excluded: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
        """x [B, hidden] (the embeddings; overwritten), cos/sin [B, 1, head_dim], one new token
        a sequence: slots [B] int64, page_table [B, width] and kv_lens [B] int32, excluded
        [B, ranges, 2] int32 or None, as paged_cpu's decode takes them; logits of x's `rows`
        (int64)."""
        batch = x.shape[0]
        for name, t, dtype in (("x", x, torch.float32), ("cos", cos, torch.float32),
                               ("sin", sin, torch.float32), ("slots", slots, torch.int64),
                               ("page_table", page_table, torch.int32),
                               ("kv_lens", kv_lens, torch.int32), ("rows", rows, torch.int64)):
            check(name, t, dtype, contiguous=True)
        if (x.shape != (batch, self.hidden) or cos.shape != (batch, 1, self.head_dim)
                or sin.shape != cos.shape or slots.shape != (batch,) or kv_lens.shape != (batch,)
                or page_table.dim() != 2 or page_table.shape[0] != batch
                or (rows.numel() and not 0 <= int(rows.min()) <= int(rows.max()) < batch)):
            raise ValueError("decode step: x, slots, page_table, kv_lens and rows disagree")
        ranges = 0
        if excluded is not None and excluded.shape[1]:
            check("excluded", excluded, torch.int32, contiguous=True)
            ranges = excluded.shape[1]
        logits = x.new_empty(len(rows), self.vocab)
        err = library().decode_step_f32(
            ctypes.byref(self._model), x.data_ptr(), batch, cos.data_ptr(), sin.data_ptr(),
            slots.data_ptr(), page_table.data_ptr(), page_table.stride(0), page_table.shape[1],
            kv_lens.data_ptr(), excluded.data_ptr() if ranges else None, ranges,
            rows.data_ptr(), len(rows), logits.data_ptr())
        if err == -2:
            raise MemoryError("decode step: no memory for the activations")
        if err:
            raise ValueError("decode step: a slot or page outside the pool, or a sequence "
                             "longer than its page table")
        return logits
