"""The model's shape, read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from symphony.engine.errors import ModelError

# Architectures that share the Llama block; they differ only in the flags below.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# rope_scaling's rope_type values rope.py computes, as transformers does.
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict = field(default_factory=dict)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        family = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
        if family is None:
            raise ModelError(
                f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
            theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type not in ROPE_TYPES:
                raise ModelError(f"{source}: rope_scaling: rope_type {rope_type!r} is not "
                                 f"supported (supported: {', '.join(ROPE_TYPES)})")
            if raw.get("use_sliding_window") or "sliding_attention" in (
                raw.get("layer_types") or []
            ):
                raise ModelError(f"{source}: sliding-window attention is not supported")
            if raw.get("mlp_bias"):
                raise ModelError(f"{source}: mlp_bias is not supported")
            if raw.get("hidden_act", "silu") != "silu":
                raise ModelError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported")
            eos = raw.get("eos_token_id")
            return cls(
                architecture=family,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=rope if rope_type != "default" else {},
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases; Llama and Qwen3 say so in the config.
                attention_bias=family == "qwen2" or bool(raw.get("attention_bias", False)),
                qk_norm=family == "qwen3",
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
            )
        except ModelError:
            raise
        except (KeyError, TypeError, ValueError) as e:
            raise ModelError(f"{source}: missing or malformed field {e}") from e

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """A config.json; or a GGUF file's metadata, given the file or `FILE.gguf/config.json`
        (so that code which joins "config.json" onto a checkpoint path takes GGUF files too)."""
        from symphony.engine.gguf_file import is_gguf, open_gguf  # it imports this module

        path = Path(path)
        for candidate in (path, path.parent) if path.name == "config.json" else (path,):
            if is_gguf(candidate):
                return open_gguf(candidate).config()
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise ModelError(f"{path}: no such file") from e
        except json.JSONDecodeError as e:
            raise ModelError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(raw, str(path))
