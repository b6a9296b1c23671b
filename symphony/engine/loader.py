"""Hugging Face checkpoints in and out: config.json plus safetensors, single or sharded;
and GGUF files in (symphony.engine.gguf_file reads them, in Hugging Face names).

Our modules stack q/k/v and gate/up into one projection each; the checkpoint keeps them
apart. `_layout` is the one table that says where each checkpoint tensor lives in ours.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kernels import quant_cpu
from kernels.quant_cpu import QuantWeight
from symphony.engine.config import ModelConfig
from symphony.engine.errors import ModelError
from symphony.engine.gguf_file import is_gguf, open_gguf
from symphony.engine.model import CausalLM
from symphony.engine.tensor_parallel import Group, Shard, whole

# Tensors some checkpoints carry that we recompute rather than load.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"


@dataclass(frozen=True)
class Place:
    """Where a checkpoint tensor goes in our parameters: rows [start, start + rows) of
    `target` take the checkpoint tensor's slice [first, last) along `dim` (the whole tensor
    where `dim` is None)."""

    target: str
    start: int
    rows: int
    dim: int | None = None
    first: int = 0
    last: int = 0

    def cut(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part of a whole checkpoint tensor this rank holds."""
        if self.dim is None:
            return tensor
        return tensor.narrow(self.dim, self.first, self.last - self.first)


def _layout(cfg: ModelConfig, shard: Shard | None = None) -> dict[str, Place]:
    """checkpoint name -> its Place in our parameters, for rank `shard.rank`'s shard
    (symphony.engine.tensor_parallel; None: the whole model)."""
    s = shard or whole(cfg)
    d = cfg.head_dim
    q, kv, inter = s.num_heads * d, s.num_kv_heads * d, s.intermediate_size
    heads = [(h0 * d, h1 * d) for h0, h1 in (s.q_heads, s.kv_heads, s.kv_heads)]
    # One rank of one, or a dimension it holds whole: no cut (cheaper to read).
    split = s.world > 1
    out: dict[str, Place] = {}

    def whole_tensor(name: str, rows: int) -> None:
        out[name] = Place(name, 0, rows)

    def part(name: str, target: str, start: int, rows: int, dim: int, cut: tuple[int, int]):
        out[name] = Place(target, start, rows, dim if split else None, *cut)

    whole_tensor(_EMBED, cfg.vocab_size)
    whole_tensor("model.norm.weight", cfg.hidden_size)
    if not cfg.tie_word_embeddings:
        part(_HEAD, _HEAD, 0, s.vocab[1] - s.vocab[0], 0, s.vocab)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        kinds = ["weight", "bias"] if cfg.attention_bias else ["weight"]
        for kind in kinds:
            qkv = f"{p}self_attn.qkv_proj.{kind}"
            for proj, start, rows, cut in zip(
                "qkv", (0, q, q + kv), (q, kv, kv), heads, strict=True
            ):
                part(f"{p}self_attn.{proj}_proj.{kind}", qkv, start, rows, 0, cut)
        part(
            f"{p}self_attn.o_proj.weight",
            f"{p}self_attn.o_proj.weight",
            0,
            cfg.hidden_size,
            1,
            heads[0],
        )
        gate_up = f"{p}mlp.gate_up_proj.weight"
        part(f"{p}mlp.gate_proj.weight", gate_up, 0, inter, 0, s.features)
        part(f"{p}mlp.up_proj.weight", gate_up, inter, inter, 0, s.features)
        part(
            f"{p}mlp.down_proj.weight",
            f"{p}mlp.down_proj.weight",
            0,
            cfg.hidden_size,
            1,
            s.features,
        )
        whole_tensor(f"{p}input_layernorm.weight", cfg.hidden_size)
        whole_tensor(f"{p}post_attention_layernorm.weight", cfg.hidden_size)
        if cfg.qk_norm:
            whole_tensor(f"{p}self_attn.q_norm.weight", d)
            whole_tensor(f"{p}self_attn.k_norm.weight", d)
    return out


def _weight_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ModelError(f"{index}: malformed shard index ({e})") from e
        files = [directory / name for name in sorted(set(weight_map.values()))]
    else:
        files = [directory / "model.safetensors"]
    for f in files:
        if not f.exists():
            raise ModelError(f"{f}: no such file")
    return files


class _Filler:
    """Copies checkpoint tensors (Hugging Face names) into our stacked parameters, and checks
    that every row was filled."""

    def __init__(self, model: CausalLM, embedding: str = _EMBED):
        """`embedding`: the checkpoint name the embedding is read from (`_tie`)."""
        self.cfg = model.config
        self.layout = _layout(self.cfg, model.group.shard)
        self.layout[embedding] = self.layout.pop(_EMBED)
        self.params = dict(model.named_parameters())
        self.filled: dict[str, int] = {}

    def wants(self, name: str, source: object, shown: str | None = None) -> bool:
        if name.endswith(_IGNORED_SUFFIXES):
            return False
        if name not in self.layout:
            if self.cfg.tie_word_embeddings and name == _HEAD:
                return False  # a redundant copy of the tied embedding
            shown = shown or name
            raise ModelError(f"{source}: unexpected tensor {shown!r} for {self.cfg.architecture}")
        return True

    def put(self, name: str, tensor: torch.Tensor, source: object, shown: str | None = None):
        """`tensor`: the checkpoint's, cut to this rank's part already."""
        target, start, rows = (place := self.layout[name]).target, place.start, place.rows
        param = self.params[target]
        want = (rows, *param.shape[1:])
        if tuple(tensor.shape) != want:
            got, shown = tuple(tensor.shape), shown or name
            raise ModelError(f"{source}: tensor {shown!r} is {got}, expected {want}")
        with torch.no_grad():
            param[start : start + rows].copy_(tensor)
        self.filled[target] = self.filled.get(target, 0) + rows

    def check(self, source: object) -> None:
        for name, param in self.params.items():
            if self.filled.get(name, 0) != param.shape[0]:
                missing = [k for k, p in self.layout.items() if p.target == name]
                raise ModelError(f"{source}: checkpoint is missing tensor(s) {', '.join(missing)}")


def _empty_model(cfg: ModelConfig, device, dtype: torch.dtype, group: Group | None) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(cfg, group)
    return model.to_empty(device=device).to(dtype)


def load_config(path: str | Path) -> ModelConfig:
    """The config of a checkpoint directory (config.json) or of a GGUF file."""
    path = Path(path)
    if is_gguf(path):
        return open_gguf(path).config()
    return ModelConfig.from_file(path / "config.json")


def load_model(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    group: Group | None = None,
) -> CausalLM:
    """A checkpoint directory (config.json and safetensors) or a GGUF file. `group`: the
    tensor-parallel group whose rank's shard to load (None: the whole model). A rank reads
    only its slices of a safetensors file; a GGUF file's tensors are read whole, then cut
    (their blocks run along rows, and the gguf package reads a tensor at once)."""
    path = Path(path)
    if is_gguf(path):
        return _load_gguf(path, device, dtype, group)
    files = _weight_files(path)
    cfg, embedding = _tie(ModelConfig.from_file(path / "config.json"), files)
    model = _empty_model(cfg, device, dtype, group)
    filler = _Filler(model, embedding)
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if filler.wants(name, file):
                        filler.put(name, _read_slice(f, name, filler.layout[name]), file)
        except SafetensorError as e:
            raise ModelError(f"{file}: unreadable safetensors file ({e})") from e
    filler.check(path)
    return model.eval().requires_grad_(False)


def _tie(cfg: ModelConfig, files: list[Path]) -> tuple[ModelConfig, str]:
    """`cfg` with its tie of the embedding and the LM head settled against the checkpoint, as
    transformers settles it, and the checkpoint name to read the embedding from. A checkpoint
    that holds both, different, unties them (transformers' tie_weights keeps them apart then,
    the file's head computing the logits); one that holds only the head gives it as the
    embedding (transformers' tied parameter is one tensor under both names)."""
    if not cfg.tie_word_embeddings:
        return cfg, _EMBED
    both = {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in {_EMBED, _HEAD} & set(f.keys()):
                    both[name] = f.get_tensor(name)
        except SafetensorError as e:
            raise ModelError(f"{file}: unreadable safetensors file ({e})") from e
    if len(both) == 2 and not torch.equal(*both.values()):
        return replace(cfg, tie_word_embeddings=False), _EMBED
    return cfg, _HEAD if set(both) == {_HEAD} else _EMBED


def _read_slice(f, name: str, place: Place) -> torch.Tensor:
    """The part of checkpoint tensor `name` that `place` takes, and nothing more from disk."""
    if place.dim is None:
        return f.get_tensor(name)
    part = f.get_slice(name)
    cut = slice(place.first, place.last)
    return part[cut] if place.dim == 0 else part[:, cut]


def _load_gguf(path: Path, device, dtype: torch.dtype, group: Group | None) -> CausalLM:
    f = open_gguf(path)
    model = _empty_model(f.config(), device, dtype, group)
    filler = _Filler(model)
    for name, gguf_name, tensor in f.hf_tensors(model.config, dtype):
        if filler.wants(name, path, gguf_name):
            filler.put(name, filler.layout[name].cut(tensor), path, gguf_name)
    filler.check(path)
    return model.eval().requires_grad_(False)


def quantized_weights(path: str | Path, model: CausalLM) -> dict[str, QuantWeight]:
    """Our matrices (parameter name -> weight) that the GGUF file at `path` stores wholly in
    types kernels/quant_cpu.py multiplies by as they are (Q4_0, Q4_1, Q8_0), stacked as ours
    are; the others, and every matrix of a checkpoint directory, are not in it. Nor is any
    matrix of a tensor-parallel shard: the quantized matmuls take whole matrices."""
    path = Path(path)
    if not is_gguf(path) or model.group.world > 1:
        return {}
    layout, params = _layout(model.config), dict(model.named_parameters())
    parts: dict[str, list[tuple[int, QuantWeight]]] = {}
    for name, kind, blocks in open_gguf(path).hf_blocks(model.config, tuple(quant_cpu.KINDS)):
        if name in layout:
            place = layout[name]
            parts.setdefault(place.target, []).append(
                (place.start, quant_cpu.from_blocks(kind, blocks))
            )
    out = {}
    for target, pieces in parts.items():
        weight = quant_cpu.cat([w for _, w in sorted(pieces, key=lambda p: p[0])])
        if weight is not None and weight.shape == tuple(params[target].shape):
            out[target] = weight
    return out


def save_checkpoint(
    model: CausalLM, config: dict, directory: str | Path, dtype: torch.dtype = torch.bfloat16
) -> None:
    """Write config.json and model.safetensors in the Hugging Face layout."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ours = dict(model.state_dict())
    tensors = {
        name: ours[p.target][p.start : p.start + p.rows].to(dtype).contiguous()
        for name, p in _layout(model.config).items()
    }
    (directory / "config.json").write_text(
        json.dumps({**config, "torch_dtype": str(dtype).removeprefix("torch.")}, indent=2) + "\n"
    )
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
