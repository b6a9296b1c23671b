"""Hugging Face checkpoints in and out: config.json plus safetensors, single or sharded.

Our modules stack q/k/v and gate/up into one projection each; the checkpoint keeps them
apart. `_layout` is the one table that says where each checkpoint tensor lives in ours.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from symphony.engine.config import ModelConfig
from symphony.engine.errors import ModelError
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


def load_model(
    directory: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> CausalLM:
    directory = Path(directory)
    cfg = ModelConfig.from_file(directory / "config.json")
    layout = _layout(cfg)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.to_empty(device=device).to(dtype)
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}
    for path in _weight_files(directory):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    if name not in layout:
                        if cfg.tie_word_embeddings and name == "lm_head.weight":
                            continue  # a redundant copy of the tied embedding
                        raise ModelError(
                            f"{path}: unexpected tensor {name!r} for {cfg.architecture}"
                        )
                    target, start, rows = layout[name]
                    tensor = f.get_tensor(name)
                    param = params[target]
                    want = (rows, *param.shape[1:])
                    if tuple(tensor.shape) != want:
                        got = tuple(tensor.shape)
                        raise ModelError(f"{path}: tensor {name!r} is {got}, expected {want}")
                    with torch.no_grad():
                        param[start : start + rows].copy_(tensor)
                    filled[target] = filled.get(target, 0) + rows
        except SafetensorError as e:
            raise ModelError(f"{path}: unreadable safetensors file ({e})") from e
    for name, param in params.items():
        if filled.get(name, 0) != param.shape[0]:
            missing = [k for k, (t, _, _) in layout.items() if t == name]
            raise ModelError(f"{directory}: checkpoint is missing tensor(s) {', '.join(missing)}")
    return model.eval().requires_grad_(False)


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
