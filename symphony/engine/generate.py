"""The in-process generation loop: prefill, then batched decode, with no daemon.

This is what `symphony generate` runs and what the kernel's LIPs are measured against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from symphony.engine.engine import Batch, Engine
from symphony.engine.sampler import SamplingParams, pick


@dataclass
class Sequence:
    index: int
    tokens: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    pages: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    done: bool = False


def _grow(engine: Engine, seq: Sequence, length: int) -> None:
    need = -(-length // engine.page_size) - len(seq.pages)
    if need > 0:
        seq.pages += engine.pool.allocate(need)


def generate(
    engine: Engine,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    max_new_tokens: int,
    stop_ids: tuple[int, ...] | None = None,
    prefill_budget: int = 4096,
    on_token: Callable[[int, int], None] | None = None,
) -> list[list[int]]:
    """New tokens for each prompt: up to max_new_tokens, ending early at a stop token.

    Prompts are prefilled in batches of at most `prefill_budget` tokens, then every live
    sequence decodes one token per forward pass. `on_token(i, token)` streams.
    """
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    for p in params:
        p.validate(engine.config.vocab_size)
    if any(not p for p in prompts):
        raise ValueError("generate: empty prompt")
    stop = set(engine.eos_ids() if stop_ids is None else stop_ids)
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    seqs = [
        Sequence(i, list(p), sp, sp.generator(engine.device))
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    try:
        pending = list(seqs)
        while pending:
            chunk, budget = [], prefill_budget
            while pending and (not chunk or len(pending[0].tokens) <= budget):
                budget -= len(pending[0].tokens)
                chunk.append(pending.pop(0))
            _step(engine, chunk, prefill=True, max_new=max_new_tokens, stop=stop, on_token=on_token)
        while live := [s for s in seqs if not s.done]:
            _step(engine, live, prefill=False, max_new=max_new_tokens, stop=stop, on_token=on_token)
    finally:
        for s in seqs:
            engine.pool.free(s.pages)
    return [s.output for s in seqs]


def _step(
    engine: Engine,
    seqs: list[Sequence],
    prefill: bool,
    max_new: int,
    stop: set,
    on_token: Callable[[int, int], None] | None,
) -> None:
    ids, pos, q_lens, kv_lens, rows = [], [], [], [], []
    for s in seqs:
        new = s.tokens if prefill else s.tokens[-1:]
        start = len(s.tokens) - len(new)
        _grow(engine, s, len(s.tokens))
        ids += new
        pos += range(start, len(s.tokens))
        q_lens.append(len(new))
        kv_lens.append(len(s.tokens))
        rows.append(len(ids) - 1)
    logits = engine.forward(Batch(ids, pos, q_lens, kv_lens, [s.pages for s in seqs], rows))
    picked = pick(logits, [s.params for s in seqs], [s.generator for s in seqs]).tolist()
    for s, token in zip(seqs, picked, strict=True):
        s.output.append(token)
        s.tokens.append(token)
        if on_token:
            on_token(s.index, token)
        s.done = token in stop or len(s.output) >= max_new
