"""Rotary position embeddings, computed from arbitrary (gappy) positions."""

from __future__ import annotations

import math

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim)
    )
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        inv_freq = _llama3_scaled(inv_freq, scaling)
    elif kind == "linear":  # positions divided by the factor
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "factors":  # one divisor per frequency, as GGUF files give Llama 3.1's
        inv_freq = inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32, device="cpu")
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
    # them interpolated, so the model stretches to long contexts without losing locality.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class Rotary:
    """Not a module on purpose: the frequencies stay fp32 whatever dtype the weights take."""

    def __init__(self, head_dim: int, theta: float, scaling: dict):
        self.inv_freq = inverse_frequencies(head_dim, theta, scaling)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """[T, 1, head_dim] cos and sin for `apply_rotary`; sin's first half comes negated,
        so that each layer's rotation needs no negation of its own."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        return (
            torch.cat((cos, cos), dim=-1).to(dtype)[:, None, :],
            torch.cat((-sin, sin), dim=-1).to(dtype)[:, None, :],
        )


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; the halves-rotation layout of Hugging Face checkpoints,
    x * cos + (-x2, x1) * sin, written as x * cos + (x2, x1) * sin with the sign in sin."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin)


def rotate_keys(k_cache: torch.Tensor, rows: torch.Tensor, delta: int, rotary: Rotary) -> None:
    """Move the keys at pool rows `rows` of one layer's cache [pages, page_size, heads, dim]
    by `delta` positions, in place. A stored key is rotated by angle p * freq; rotating it by
    delta * freq gives the key at p + delta (llama3 scaling only changes freq), exact up to
    rounding: computed in fp32 with the frequencies of `cos_sin`, then cast back."""
    flat = k_cache.view(-1, *k_cache.shape[2:])
    rows = rows.to(flat.device)
    cos, sin = rotary.cos_sin(torch.tensor([delta], device=flat.device), torch.float32)
    flat[rows] = apply_rotary(flat[rows].float(), cos, sin).to(flat.dtype)
