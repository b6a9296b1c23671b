"""Sampling on the device: greedy, temperature, top-k, top-p, min-p, seeds, top-n logprobs."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SEED_BOUND = 1 << 63  # seeds are the proto's int64 (torch would take [-2**63, 2**64))


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # greedy, as the client's Sampling and the wire's default
    top_k: int = 0  # 0: no limit
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    top_logprobs: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the bad field."""
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if not 0 <= self.top_k <= vocab_size:
            raise ValueError(f"top_k must be in [0, {vocab_size}], got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.top_logprobs <= vocab_size:
            raise ValueError(f"top_logprobs must be in [0, {vocab_size}], got {self.top_logprobs}")
        if self.seed is not None and not -SEED_BOUND <= self.seed < SEED_BOUND:
            raise ValueError(f"seed must be a signed 64-bit integer, got {self.seed}")

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The request's own random stream: the same seed gives the same tokens."""
        return None if self.seed is None else torch.Generator(device).manual_seed(self.seed)


GREEDY = SamplingParams()


@dataclass
class Samples:
    tokens: torch.Tensor  # [N] int64
    logprobs: torch.Tensor  # [N] log p(token) under the model's unmodified distribution
    top_ids: torch.Tensor  # [N, n] for the largest top_logprobs asked in the batch
    top_logprobs: torch.Tensor  # [N, n]


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> Samples:
    logits = logits.float()
    tokens = pick(logits, params, generators)
    logprobs = torch.log_softmax(logits, dim=-1)
    n_rows = logits.shape[0]
    n_top = max((p.top_logprobs for p in params), default=0)
    top_lp, top_ids = (
        logprobs.topk(n_top, dim=-1)
        if n_top
        else (logprobs.new_empty(n_rows, 0), tokens.new_empty(n_rows, 0))
    )
    return Samples(tokens, logprobs.gather(1, tokens[:, None])[:, 0], top_ids, top_lp)


def pick(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    """The tokens `sample` picks, [N] int64, without the logprobs (a pass over the vocabulary
    that a caller wanting only tokens need not pay)."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        tokens[rows] = _draw(
            logits[rows], [params[i] for i in sampled_rows], [generators[i] for i in sampled_rows]
        )
    return tokens


def _draw(logits: torch.Tensor, params: list[SamplingParams], gens: list) -> torch.Tensor:
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device)[:, None]
    probs, order = torch.softmax(logits / temps, dim=-1).sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[1], device=device)[None, :]
    top_k = torch.tensor([p.top_k or probs.shape[1] for p in params], device=device)[:, None]
    top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
    min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
    # A token stays if the mass before it is under top_p: the most likely one always stays.
    drop = (rank >= top_k) | (probs.cumsum(-1) - probs >= top_p) | (probs < min_p * probs[:, :1])
    probs = probs.masked_fill(drop, 0.0)
    # Exponential race (argmax p/E) samples from p; each seeded request draws its own noise.
    noise = torch.empty_like(probs)
    shared = [i for i, g in enumerate(gens) if g is None]
    if shared:
        noise[shared] = torch.empty(len(shared), probs.shape[1], device=device).exponential_()
    for i, g in enumerate(gens):
        if g is not None:
            noise[i].exponential_(generator=g)
    choice = (probs / noise).argmax(dim=-1)
    return order.gather(1, choice[:, None])[:, 0]
