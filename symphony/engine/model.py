"""The Llama block, shared by the Llama 3, Qwen2 and Qwen3 families.

The model sees one flattened ragged batch of tokens ([T] ids, [T] positions). Attention is
delegated to an `Attention` backend object, so the same weights run paged inference in the
engine and dense causal attention in training. Built with a tensor-parallel `Group`, it
holds that rank's shard of every layer (symphony.engine.tensor_parallel).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from symphony.engine.config import ModelConfig
from symphony.engine.ops import TORCH_OPS, TorchOps, add_rms_norm
from symphony.engine.rope import Rotary
from symphony.engine.tensor_parallel import Group, whole


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] of the new tokens -> output [T, Hq, D]."""
        ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_rms_norm(x, None, self.weight, self.eps)[0]


class SelfAttention(nn.Module):
    """This rank's heads: q/k/v column-parallel, o row-parallel and all-reduced."""

    def __init__(self, cfg: ModelConfig, layer: int, group: Group):
        super().__init__()
        self.layer, self.group = layer, group
        self.num_heads, self.num_kv_heads, self.head_dim = (
            group.shard.num_heads,
            group.shard.num_kv_heads,
            cfg.head_dim,
        )
        q_size, kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        # q, k and v in one matmul: the checkpoint's three projections are stacked at load.
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        ops: TorchOps,
    ) -> torch.Tensor:
        qkv = ops.linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        heads = qkv.view(-1, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        qk, v = heads.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.qk_norm:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # Queries and keys rotate together: one pass over both.
        q, k = ops.rotary(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        out = attn.attend(self.layer, q, k, v)
        out = ops.linear(out.reshape(-1, self.num_heads * self.head_dim), self.o_proj.weight)
        return self.group.all_reduce(out)


class MLP(nn.Module):
    """This rank's features: gate/up column-parallel, down row-parallel and all-reduced."""

    def __init__(self, cfg: ModelConfig, group: Group):
        super().__init__()
        self.group, features = group, group.shard.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * features, bias=False)
        self.down_proj = nn.Linear(features, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ops: TorchOps) -> torch.Tensor:
        gate_up = ops.linear(x, self.gate_up_proj.weight)
        return self.group.all_reduce(ops.linear(ops.silu_mul(gate_up), self.down_proj.weight))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, group: Group):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg, layer, group)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, group)

    def forward(self, x, residual, cos, sin, attn: AttentionBackend, ops: TorchOps):
        """(this layer's output, the residual stream before it): the next norm adds them,
        so the add and the norm are one pass where the ops fuse them."""
        norm = self.input_layernorm
        h, residual = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
        h = self.self_attn(h, cos, sin, attn, ops)
        norm = self.post_attention_layernorm
        h, residual = ops.add_rms_norm(h, residual, norm.weight, norm.eps)
        return self.mlp(h, ops), residual


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig, group: Group):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)  # replicated
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, group) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """Parameter names follow the checkpoint's (`model.layers.N...`, `lm_head`). `group`:
    the tensor-parallel group whose rank's shard this is; None, the whole model."""

    def __init__(self, cfg: ModelConfig, group: Group | None = None):
        super().__init__()
        self.config = cfg
        self.group = group = group or Group(whole(cfg))
        self.model = Decoder(cfg, group)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        if not cfg.tie_word_embeddings:
            rows = group.shard.vocab[1] - group.shard.vocab[0]
            self.lm_head = nn.Linear(cfg.hidden_size, rows, bias=False)

    def forward(
        self,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        ops: TorchOps = TORCH_OPS,
    ) -> torch.Tensor:
        """token_ids, positions: [T] -> final hidden states [T, hidden]. `ops` does the
        per-token work (symphony.engine.ops)."""
        x, residual = self.model.embed_tokens(token_ids), None
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer in self.model.layers:
            x, residual = layer(x, residual, cos, sin, attn, ops)
        norm = self.model.norm
        return ops.add_rms_norm(x, residual, norm.weight, norm.eps)[0]

    def logits_weight(self) -> torch.Tensor:
        """This rank's vocab rows of the LM head."""
        if self.config.tie_word_embeddings:
            first, last = self.group.shard.vocab
            return self.model.embed_tokens.weight[first:last]
        return self.lm_head.weight

    def logits(self, hidden: torch.Tensor, ops: TorchOps = TORCH_OPS) -> torch.Tensor | None:
        """[rows, vocab]; under tensor parallelism on rank 0 only (None on the others)."""
        return self.group.gather_vocab(ops.linear(hidden, self.logits_weight()))
