"""Tensor parallelism, Megatron-style, over a torch.distributed group.

Each of N ranks holds a shard of every layer. Column-parallel matrices (q/k/v and gate/up)
keep whole heads, or a contiguous block of the MLP's intermediate features, so attention
and the SiLU product run on a rank's own columns with no communication. Row-parallel
matrices (o and down) take those columns as their input and produce partial sums of the
full hidden state: one all-reduce after each makes them whole. Two all-reduces a layer.

KV heads split in contiguous blocks; a model with fewer KV heads than ranks replicates
them: rank r holds KV head r * kv_heads // N, the one its query heads read (vLLM's rule).

The embedding is replicated: a lookup costs nothing to repeat, and splitting it by vocab
would cost a third all-reduce of [tokens, hidden] a step. The LM head is split by vocab
rows: it is the largest matmul of a decode step, and its output is gathered on rank 0 for
sampling, only for the logit rows asked for. Tied embeddings use their rank's rows of the
replicated embedding as their LM-head shard.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvfs.pool import shard_heads
from symphony.engine.config import ModelConfig
from symphony.engine.errors import ModelError


@dataclass(frozen=True)
class Shard:
    """What rank `rank` of `world` holds of a model: heads, features and vocab rows as
    [first, last) ranges of the whole model's."""

    rank: int
    world: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    features: tuple[int, int]  # of the MLP's intermediate size
    vocab: tuple[int, int]
    vocab_chunk: int  # every rank's LM-head rows, padded: the gather's row width
    vocab_size: int

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.features[1] - self.features[0]


def shard_of(cfg: ModelConfig, rank: int, world: int) -> Shard:
    """Rank `rank`'s shard of the model; ModelError naming the dimension that N does not
    divide."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} of a tensor-parallel group of {world}")
    for what, n in (
        ("attention heads", cfg.num_heads),
        ("intermediate size", cfg.intermediate_size),
    ):
        if n % world:
            raise ModelError(
                f"--tensor-parallel {world}: the model's {what} ({n}) do not divide by {world}"
            )
    kv = cfg.num_kv_heads
    if kv >= world and kv % world or kv < world and world % kv:
        raise ModelError(
            f"--tensor-parallel {world}: the model's {kv} KV heads neither "
            f"divide by {world} nor divide it"
        )
    q, f = cfg.num_heads // world, cfg.intermediate_size // world
    chunk = -(-cfg.vocab_size // world)
    heads = shard_heads(kv, world, rank)  # the pool's rule, so that the two agree
    return Shard(
        rank,
        world,
        (rank * q, (rank + 1) * q),
        (heads.start, heads.stop),
        (rank * f, (rank + 1) * f),
        (min(rank * chunk, cfg.vocab_size), min((rank + 1) * chunk, cfg.vocab_size)),
        chunk,
        cfg.vocab_size,
    )


def whole(cfg: ModelConfig) -> Shard:
    """The one shard of a model on one rank."""
    return shard_of(cfg, 0, 1)


class Group:
    """A rank's view of its tensor-parallel group, the default torch.distributed group of
    its process: the collectives the model and the engine process call. The forward pass
    reduces over the default group (NCCL on GPUs, gloo on the CPU); Python objects (the
    step's work) go over `cpu_group`, a gloo group of the same ranks where the default one
    is NCCL."""

    def __init__(self, shard: Shard, cpu_group: dist.ProcessGroup | None = None):
        self.shard, self.cpu_group = shard, cpu_group

    @property
    def rank(self) -> int:
        return self.shard.rank

    @property
    def world(self) -> int:
        return self.shard.world

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's partial x, in place."""
        if self.world > 1:
            dist.all_reduce(x)
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Every rank's [rows, its vocab] logits as [rows, vocab] on rank 0; None elsewhere."""
        s = self.shard
        if s.world == 1:
            return logits
        pad = s.vocab_chunk - logits.shape[1]  # the last rank's rows may be fewer
        logits = torch.nn.functional.pad(logits, (0, pad)) if pad else logits.contiguous()
        parts = [torch.empty_like(logits) for _ in range(s.world)] if s.rank == 0 else None
        dist.gather(logits, parts, dst=0)
        return None if parts is None else torch.cat(parts, dim=1)[:, : s.vocab_size]

    def broadcast(self, obj: object) -> object:
        """Rank 0's obj, on every rank."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]
