"""Hugging Face checkpoints in and out: config.json plus safetensors, single or sharded;
and GGUF files in (symphony.engine.gguf_file reads them, in Hugging Face names).

Our modules stack q/k/v and gate/up into one projection each; the checkpoint keeps them
apart. `_layout` is the one table that says where each checkpoint tensor lives in ours.
"""

from __future__ import annotations

import json
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

# Tensors some checkpoints carry that we recompute rather than load.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _layout(cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """checkpoint name -> (our parameter name, first row, row count)."""
    q, kv, inter = (
        cfg.num_heads * cfg.head_dim,
        cfg.num_kv_heads * cfg.head_dim,
        cfg.intermediate_size,
    )
    out: dict[str, tuple[str, int, int]] = {}

    def whole(name: str, rows: int) -> None:
        out[name] = (name, 0, rows)

    whole("model.embed_tokens.weight", cfg.vocab_size)
    whole("model.norm.weight", cfg.hidden_size)
    if not cfg.tie_word_embeddings:
        whole("lm_head.weight", cfg.vocab_size)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        kinds = ["weight", "bias"] if cfg.attention_bias else ["weight"]
        for kind in kinds:
            qkv = f"{p}self_attn.qkv_proj.{kind}"
            out[f"{p}self_attn.q_proj.{kind}"] = (qkv, 0, q)
            out[f"{p}self_attn.k_proj.{kind}"] = (qkv, q, kv)
            out[f"{p}self_attn.v_proj.{kind}"] = (qkv, q + kv, kv)
        whole(f"{p}self_attn.o_proj.weight", cfg.hidden_size)
        out[f"{p}mlp.gate_proj.weight"] = (f"{p}mlp.gate_up_proj.weight", 0, inter)
        out[f"{p}mlp.up_proj.weight"] = (f"{p}mlp.gate_up_proj.weight", inter, inter)
        whole(f"{p}mlp.down_proj.weight", cfg.hidden_size)
        whole(f"{p}input_layernorm.weight", cfg.hidden_size)
        whole(f"{p}post_attention_layernorm.weight", cfg.hidden_size)
        if cfg.qk_norm:
            whole(f"{p}self_attn.q_norm.weight", cfg.head_dim)
            whole(f"{p}self_attn.k_norm.weight", cfg.head_dim)
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

    def __init__(self, model: CausalLM):
        self.cfg = model.config
        self.layout = _layout(self.cfg)
        self.params = dict(model.named_parameters())
        self.filled: dict[str, int] = {}

    def wants(self, name: str, source: object, shown: str | None = None) -> bool:
        if name.endswith(_IGNORED_SUFFIXES):
            return False
        if name not in self.layout:
            if self.cfg.tie_word_embeddings and name == "lm_head.weight":
                return False  # a redundant copy of the tied embedding
            shown = shown or name
            raise ModelError(f"{source}: unexpected tensor {shown!r} for {self.cfg.architecture}")
        return True

    def put(self, name: str, tensor: torch.Tensor, source: object, shown: str | None = None):
        target, start, rows = self.layout[name]
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
                missing = [k for k, (t, _, _) in self.layout.items() if t == name]
                raise ModelError(f"{source}: checkpoint is missing tensor(s) {', '.join(missing)}")


def _empty_model(cfg: ModelConfig, device, dtype: torch.dtype) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(cfg)
    return model.to_empty(device=device).to(dtype)


def load_config(path: str | Path) -> ModelConfig:
    """The config of a checkpoint directory (config.json) or of a GGUF file."""
    path = Path(path)
    if is_gguf(path):
        return open_gguf(path).config()
    return ModelConfig.from_file(path / "config.json")


def load_model(
    path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> CausalLM:
    """A checkpoint directory (config.json and safetensors) or a GGUF file."""
    path = Path(path)
    if is_gguf(path):
        return _load_gguf(path, device, dtype)
    cfg = ModelConfig.from_file(path / "config.json")
    model = _empty_model(cfg, device, dtype)
    filler = _Filler(model)
    for file in _weight_files(path):
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if filler.wants(name, file):
                        filler.put(name, f.get_tensor(name), file)
        except SafetensorError as e:
            raise ModelError(f"{file}: unreadable safetensors file ({e})") from e
    filler.check(path)
    return model.eval().requires_grad_(False)


def _load_gguf(path: Path, device, dtype: torch.dtype) -> CausalLM:
    f = open_gguf(path)
    model = _empty_model(f.config(), device, dtype)
    filler = _Filler(model)
    for name, gguf_name, tensor in f.hf_tensors(model.config, dtype):
        if filler.wants(name, path, gguf_name):
            filler.put(name, tensor, path, gguf_name)
    filler.check(path)
    return model.eval().requires_grad_(False)


def quantized_weights(path: str | Path, model: CausalLM) -> dict[str, QuantWeight]:
    """Our matrices (parameter name -> weight) that the GGUF file at `path` stores wholly in
    types kernels/quant_cpu.py multiplies by as they are (Q4_0, Q4_1, Q8_0), stacked as ours
    are; the others, and every matrix of a checkpoint directory, are not in it."""
    path = Path(path)
    if not is_gguf(path):
        return {}
    layout, params = _layout(model.config), dict(model.named_parameters())
    parts: dict[str, list[tuple[int, QuantWeight]]] = {}
    for name, kind, blocks in open_gguf(path).hf_blocks(model.config, tuple(quant_cpu.KINDS)):
        if name in layout:
            target, start, _ = layout[name]
            parts.setdefault(target, []).append((start, quant_cpu.from_blocks(kind, blocks)))
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
        name: ours[target][start : start + rows].to(dtype).contiguous()
        for name, (target, start, rows) in _layout(model.config).items()
    }
    (directory / "config.json").write_text(
        json.dumps({**config, "torch_dtype": str(dtype).removeprefix("torch.")}, indent=2) + "\n"
    )
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
