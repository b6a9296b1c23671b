"""Sampling on the device: greedy, temperature, top-k, top-p, min-p, seeds, top-n logprobs, and
per-row logit control (allowed-token masks, sparse biases, logprobs of named tokens)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SEED_BOUND = 1 << 63  # seeds are the proto's int64 (torch would take [-2**63, 2**64))


# A temperature under this samples as greedy does, as vLLM's does: dividing the logits by
# one near float32's smallest made them infinite and the draw NaN (a token of any
# likelihood came back).
GREEDY_BELOW = 1e-5


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
        return self.temperature < GREEDY_BELOW

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


def mask_words(vocab_size: int) -> int:
    """Length of a packed allowed-token mask: one bit per token in 32-bit words."""
    return -(-vocab_size // 32)


@dataclass(frozen=True, eq=False)
class RowControl:
    """What one logit row samples from: `allowed` is packed bits, bit t % 32 of word t // 32
    allowing token t (xgrammar's and llguidance's layout; bits past the vocabulary are ignored),
    None allowing every token; the biases are added to the logits (a repeated id adds up);
    `score_ids` are tokens whose logprobs under the model's own distribution the row returns."""

    allowed: torch.Tensor | None = None  # [>= mask_words(vocab)] int32
    bias_ids: tuple[int, ...] = ()
    bias_values: tuple[float, ...] = ()
    score_ids: tuple[int, ...] = ()

    def validate(self, vocab_size: int) -> None:
        """Raise ValueError naming the bad field."""
        if self.allowed is not None:
            self._validate_allowed(self.allowed, vocab_size)
        if len(self.bias_ids) != len(self.bias_values):
            raise ValueError(f"bias_ids has {len(self.bias_ids)} ids but bias_values "
                             f"{len(self.bias_values)} values")
        for field, ids in (("bias_ids", self.bias_ids), ("score_ids", self.score_ids)):
            if ids and not 0 <= min(ids) <= max(ids) < vocab_size:
                bad = next(t for t in ids if not 0 <= t < vocab_size)
                raise ValueError(f"{field}: token {bad} is outside [0, {vocab_size})")
        if self.bias_values and not math.isfinite(sum(map(abs, self.bias_values))):
            bad = next(v for v in self.bias_values if not math.isfinite(v))
            raise ValueError(f"bias_values must be finite, got {bad}")

    @staticmethod
    def _validate_allowed(allowed: torch.Tensor, vocab_size: int) -> None:
        words = mask_words(vocab_size)
        if allowed.dtype != torch.int32 or allowed.dim() != 1:
            raise ValueError(f"allowed must be a 1-D int32 tensor, got {allowed.dtype} "
                             f"of shape {tuple(allowed.shape)}")
        if len(allowed) < words:
            raise ValueError(f"allowed has {len(allowed)} words, want at least {words} "
                             f"(one bit per token of {vocab_size})")
        # A mask a pred brings: numpy is faster for 128 words (this runs once a pred).
        # Words past the vocabulary's are ignored: llguidance's masks carry one more when
        # it is a multiple of 32.
        words = allowed.cpu().numpy()[:words]
        tail = vocab_size % 32
        last = int(words[-1]) & ((1 << tail) - 1) if tail else int(words[-1])
        if not (last or words[:-1].any()):
            raise ValueError(f"allowed allows no token below vocab size {vocab_size}")


@dataclass
class Samples:
    tokens: torch.Tensor  # [N] int64
    # [N] log p(token) under the row's distribution: the model's own with its control's mask
    # and bias applied (no temperature or cut-offs)
    logprobs: torch.Tensor
    top_ids: torch.Tensor  # [N, n] for the largest top_logprobs asked in the batch
    top_logprobs: torch.Tensor  # [N, n], of the same distribution as logprobs
    # [N] log p(token) under the model's own distribution; set only when some row has a mask or
    # a bias (else it equals logprobs)
    model_logprobs: torch.Tensor | None = None
    # [N, S] the model's own logprobs at each row's score_ids, S the most any row names, padded
    # with NaN; None when no row names any
    scores: torch.Tensor | None = None


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    controls: list[RowControl | None] | None = None,
) -> Samples:
    """Sample a token per logit row; `controls` (per row, checked by RowControl.validate) mask,
    bias and name tokens to score."""
    raw = logits.float()
    logits = _controlled(raw, controls)
    tokens = _pick(logits, params, generators)
    logprobs = torch.log_softmax(logits, dim=-1)
    n_rows = logits.shape[0]
    n_top = max((p.top_logprobs for p in params), default=0)
    top_lp, top_ids = (
        logprobs.topk(n_top, dim=-1)
        if n_top
        else (logprobs.new_empty(n_rows, 0), tokens.new_empty(n_rows, 0))
    )
    out = Samples(tokens, logprobs.gather(1, tokens[:, None])[:, 0], top_ids, top_lp)
    if controls is None or not any(controls):
        return out
    # Without a mask or a bias the sampled distribution is the model's own.
    model_lp = logprobs
    if logits is not raw:
        model_lp = torch.log_softmax(raw, dim=-1)
        out.model_logprobs = model_lp.gather(1, tokens[:, None])[:, 0]
    out.scores = _scores(model_lp, controls)
    return out


def _scores(model_lp: torch.Tensor, controls: list[RowControl | None]) -> torch.Tensor | None:
    named = [c.score_ids if c else () for c in controls]
    width = max(map(len, named))
    if not width:
        return None
    device = model_lp.device
    ids = torch.tensor([list(s) + [0] * (width - len(s)) for s in named], device=device)
    lengths = torch.tensor([len(s) for s in named], device=device)
    pad = torch.arange(width, device=device) >= lengths[:, None]
    return model_lp.gather(1, ids).masked_fill_(pad, math.nan)


def _controlled(raw: torch.Tensor, controls: list[RowControl | None] | None) -> torch.Tensor:
    """`raw` with each row's disallowed tokens at -inf and its biases added: a new tensor when
    some row has a mask or a bias, else `raw` itself."""
    if controls is None or not any(controls):
        return raw
    if len(controls) != raw.shape[0]:
        raise ValueError(f"controls has {len(controls)} entries for {raw.shape[0]} logit rows")
    n_rows, vocab = raw.shape
    device = raw.device
    logits = raw
    masks = [c.allowed if c else None for c in controls]
    first = next((m for m in masks if m is not None), None)
    if first is not None:
        # Rows without a mask get all ones. The little-endian words read as bytes put token t
        # at bit t % 8 of byte t // 8: unpacking bytes needs no sign bit.
        width = mask_words(vocab)
        everything = torch.full((width,), -1, dtype=torch.int32)
        words = torch.stack([everything if m is None else m[:width] for m in masks]).to(device)
        bit = 1 << torch.arange(8, dtype=torch.uint8, device=device)
        allowed = (words.view(torch.uint8)[:, :, None] & bit).view(n_rows, -1)[:, :vocab]
        logits = raw.where(allowed.bool(), -math.inf)
    flat = [i * vocab + t for i, c in enumerate(controls) if c for t in c.bias_ids]
    if flat:
        if logits is raw:
            logits = raw.clone()
        values = [v for c in controls if c for v in c.bias_values]
        logits.view(-1).index_add_(
            0, torch.tensor(flat, device=device), torch.tensor(values, device=device)
        )
    return logits


def pick(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    controls: list[RowControl | None] | None = None,
) -> torch.Tensor:
    """The tokens `sample` picks (with the same controls), [N] int64, without the logprobs (a
    pass over the vocabulary that a caller wanting only tokens need not pay)."""
    return _pick(_controlled(logits.float(), controls), params, generators)


def _pick(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> torch.Tensor:
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
