"""CUDA graphs of decode steps: a small model's decode step is hundreds of kernel launches,
which at batch 1 can take longer than its GPU work; a graph replays them in one launch.

A graph replays fixed shapes at fixed addresses, so a decode batch is padded to a bucket (a
batch size of BATCH_BUCKETS, a page table width of a power of two pages) and its inputs are
copied into that bucket's static buffers, which the graph reads. A padding row has kv_len 0
and slot -1: decode attention attends to nothing for it (its output is zeros) and store_kv
stores nothing, so padding needs no page of the pool. Each bucket's graph is captured the
first time a batch falls in it; all graphs share one memory pool, as steps run one at a time.
A capture that fails is logged and turns the graphs off: every later step runs eagerly.

With `capture=False` the same static-buffer step runs eagerly: what the CPU can test of it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from symphony.engine.attention import PagedAttention, PagedMetadata
from symphony.engine.ops import TorchOps

if TYPE_CHECKING:  # engine.py imports this module
    from kvfs.pool import KVPool
    from symphony.engine.engine import Batch

log = logging.getLogger(__name__)

ENV = "SYMPHONY_CUDA_GRAPHS"
SWITCH = ("on", "off")
# Fine steps where batches are common, coarser above: at most 3 rows in 8 are padding.
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_PAGES = 4  # the narrowest page table: fewer graphs for short sequences


def graphs_wanted(switch: str | None, device: torch.device, kernels: str, ranks: int = 1) -> bool:
    """Whether an engine on `device` with attention `kernels`, one of `ranks` tensor-parallel
    ranks, decodes through CUDA graphs: `switch` ("on" or "off"), else $SYMPHONY_CUDA_GRAPHS,
    else on where a single rank runs the Triton kernels on CUDA (the torch reference reads
    lengths back to the host, and a rank's collectives and rank-0-only logits are not
    captured). ValueError for "on" where graphs cannot be captured."""
    choice = switch or os.environ.get(ENV) or None
    if choice is not None and choice not in SWITCH:
        source = "cuda_graphs" if switch else ENV
        raise ValueError(f"{source} must be 'on' or 'off', not {choice!r}")
    capturable = device.type == "cuda" and kernels == "triton" and ranks == 1
    if choice == "on" and not capturable:
        group = f" as one of {ranks} tensor-parallel ranks" if ranks > 1 else ""
        raise ValueError(
            f"CUDA graphs capture a single rank's CUDA work of the Triton kernels; this engine "
            f"runs the {kernels} kernels on {device}{group}: they must be off"
        )
    return capturable if choice is None else choice == "on"


def batch_bucket(n: int) -> int | None:
    """The smallest bucket of at least n sequences; None past the largest."""
    return next((b for b in BATCH_BUCKETS if b >= n), None)


def pages_bucket(n: int) -> int:
    """The page table width for sequences of up to n pages: a power of two, >= MIN_PAGES."""
    return max(MIN_PAGES, 1 << max(0, n - 1).bit_length())


class StaticInputs:
    """One bucket's input buffers: a single int32 tensor (one copy from the host a step) viewed
    as token ids, positions, kv_lens and slots [batch], and the page table [batch, pages].
    Made as all padding."""

    def __init__(self, batch: int, pages: int, device: torch.device):
        self.batch, self.pages = batch, pages
        self.ints = torch.zeros(batch * (4 + pages), dtype=torch.int32, device=device)
        self.token_ids, self.positions, self.kv_lens, self.slots = (
            self.ints[i * batch : (i + 1) * batch] for i in range(4)
        )
        self.page_table = self.ints[4 * batch :].view(batch, pages)
        self.slots.fill_(-1)
        self.q_start = torch.arange(batch + 1, dtype=torch.int32, device=device)

    def fill(self, host: np.ndarray) -> None:
        self.ints.copy_(torch.from_numpy(host))


def pad(batch: Batch, rows: int, pages: int, page_size: int) -> np.ndarray:
    """A decode batch (one new token a sequence) laid out as StaticInputs.ints: padded to
    `rows` rows whose kv_len is 0 and slot -1, page tables cut or padded (with 0, never read)
    to `pages` entries; each new token's slot is at KV index kv_len - 1."""
    n = len(batch.token_ids)
    host = np.zeros(rows * (4 + pages), dtype=np.int32)
    ids, pos, lens, slots = (host[i * rows : (i + 1) * rows] for i in range(4))
    table = host[4 * rows :].reshape(rows, pages)
    ids[:n], pos[:n], lens[:n] = batch.token_ids, batch.positions, batch.kv_lens
    for b, row in enumerate(batch.page_tables):
        used = -(-batch.kv_lens[b] // page_size)  # the kernels read no page past kv_len
        table[b, :used] = row[:used]
    last = lens[:n] - 1
    slots[:n] = table[np.arange(n), last // page_size] * page_size + last % page_size
    slots[n:] = -1
    return host


@dataclass
class Captured:
    graph: torch.cuda.CUDAGraph
    inputs: StaticInputs


class DecodeGraphs:
    """Decode steps of a model over a pool, one graph per (batch, pages) bucket."""

    def __init__(
        self,
        model: nn.Module,
        pool: KVPool,
        kernels: SimpleNamespace,
        ops: TorchOps,
        scale: float,
        *,
        capture: bool = True,
    ):
        """`kernels`, `ops`, `scale`: the engine's. `capture=False`: the static-buffer
        step runs eagerly, on any device."""
        device = pool.k.device
        if capture and device.type != "cuda":
            raise ValueError(
                f"CUDA graphs cannot be captured on {device}: they need a CUDA "
                f"device (capture=False runs the same steps eagerly)"
            )
        self.model, self.pool, self.ops = model, pool, ops
        self.kernels, self.scale = kernels, scale
        self.device, self.capture = device, capture
        self.failed: str | None = None  # why a capture failed, which turned the graphs off
        self._graphs: dict[tuple[int, int], Captured] = {}
        self._eager: dict[tuple[int, int], StaticInputs] = {}
        self._logits: dict[int, torch.Tensor] = {}  # per batch bucket: every width shares it
        self._memory = None  # the graphs' memory pool, made at the first capture

    def bucket(self, batch: Batch) -> tuple[int, int] | None:
        """The (batch, pages) bucket of a checked batch; None for one that runs eagerly: a
        chunk longer than one token, excluded ranges or trees (shapes a graph does not hold),
        or more sequences than the largest bucket."""
        if (
            any(q != 1 for q in batch.q_lens)
            or (batch.excluded and any(batch.excluded))
            or (batch.trees and any(t is not None for t in batch.trees))
        ):
            return None
        rows = batch_bucket(len(batch.token_ids))
        if rows is None:
            return None
        return rows, pages_bucket(-(-max(batch.kv_lens) // self.pool.page_size))

    def forward(self, batch: Batch) -> torch.Tensor | None:
        """Logits [len(logit_rows), vocab] of a checked batch, its K/V written, as the
        engine's forward gives them; None for a batch without a bucket."""
        key = None if self.failed else self.bucket(batch)
        if key is None:
            return None
        host = pad(batch, *key, self.pool.page_size)
        if not self.capture:
            inputs = self._eager.get(key)
            if inputs is None:
                inputs = self._eager[key] = StaticInputs(*key, self.device)
            inputs.fill(host)
            return self.step(inputs)[batch.logit_rows]
        captured = self._graphs.get(key)
        if captured is None:
            try:
                captured = self._capture(key)
            except RuntimeError as e:  # a step that cannot be captured still runs, eagerly
                self.failed = f"capturing the decode step of bucket {key}: {e}"
                log.warning("CUDA graphs off: %s", self.failed)
                return None
        captured.inputs.fill(host)
        captured.graph.replay()
        # A copy, as the next replay overwrites the buffer. Rows in order (a decode's usual)
        # are a slice: a list as an index would wait for the replay to copy itself over.
        logits, rows = self._logits[key[0]], batch.logit_rows
        return logits[: len(rows)].clone() if rows == list(range(len(rows))) else logits[rows]

    def step(self, inputs: StaticInputs) -> torch.Tensor:
        """The decode step on static inputs, logits of every row: what a graph records."""
        meta = PagedMetadata(
            slot_mapping=inputs.slots,
            page_table=inputs.page_table,
            q_start=inputs.q_start,
            kv_lens=inputs.kv_lens,
            excluded=None,
            tree_start=None,
            tree_bits=None,
            max_q_len=1,
            decode_only=True,
        )
        attention = PagedAttention(self.pool, meta, self.kernels, self.scale)
        hidden = self.model(inputs.token_ids, inputs.positions, attention, self.ops)
        return self.model.logits(hidden, self.ops)

    def _capture(self, key: tuple[int, int]) -> Captured:
        with torch.cuda.device(self.device):  # the capture's streams are the current device's
            inputs = StaticInputs(*key, self.device)  # all padding: capturing stores nothing
            # One eager run first, on a side stream as torch's capture wants: Triton compiles
            # its kernels and cuBLAS picks its algorithms, which may not happen in a capture.
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                warm = self.step(inputs)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            logits = self._logits.get(key[0])
            if logits is None:
                logits = self._logits[key[0]] = torch.empty_like(warm)
            if self._memory is None:
                self._memory = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._memory):
                logits.copy_(self.step(inputs))
        captured = self._graphs[key] = Captured(graph, inputs)
        return captured

    @property
    def captured(self) -> list[tuple[int, int]]:
        """The buckets captured so far, in order of capture."""
        return list(self._graphs)
