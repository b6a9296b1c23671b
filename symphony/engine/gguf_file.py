"""GGUF checkpoints (llama.cpp's single-file format): the config, the weights and the tokenizer.

The file is read with ggml's own `gguf` package. Weights are dequantized once, at load, to
the engine's dtype; the q and k projections of llama-architecture files are stored with their
rows permuted (llama.cpp's converter interleaves each head's two rotary halves), which is
undone here. Qwen2 and Qwen3 files are written unpermuted. The tokenizer is rebuilt from the
metadata (`tokenizer.ggml.*`) as a byte-level BPE with the pre-tokenizer llama.cpp uses for
the file's `tokenizer.ggml.pre`.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from symphony.engine.config import ModelConfig
from symphony.engine.errors import ModelError

MAGIC = b"GGUF"

# general.architecture -> the Hugging Face architecture of the same block.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# GGUF tensor names (blk.N.<name>) -> Hugging Face names (model.layers.N.<name>).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


# `<arch>.rope.scaling.type` values read; any other is a ModelError naming it.
ROPE_SCALING_TYPES = ("none", "linear")

# The tensor types loaded, each dequantized by the gguf package (F64 by numpy); any other is a
# ModelError naming the tensor and its type.
TENSOR_TYPES = (
    "F32", "F16", "BF16", "F64", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
    "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS",
    "TQ1_0", "TQ2_0", "MXFP4", "NVFP4",
)


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a GGUF file (a file that starts with GGUF's magic) rather than a
    checkpoint directory. A path named *.gguf that is no such file raises ModelError."""
    path = Path(path)
    if path.is_file():
        with open(path, "rb") as f:
            if f.read(4) == MAGIC:
                return True
    if path.suffix.lower() == ".gguf" and not path.is_dir():
        raise ModelError(f"{path}: not a GGUF file" if path.exists() else f"{path}: no such file")
    return False


def _gguf_package():
    try:
        import gguf
    except ImportError as e:  # a declared dependency; say so rather than fail obscurely
        raise ModelError("reading GGUF files needs the `gguf` package (pip install gguf)") from e
    return gguf


class GGUFFile:
    """One GGUF file's metadata (a dict of plain Python values) and tensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        gguf = _gguf_package()
        try:
            self._reader = gguf.GGUFReader(self.path)
        except FileNotFoundError as e:
            raise ModelError(f"{self.path}: no such file") from e
        except (ValueError, IndexError, OSError) as e:
            raise ModelError(f"{self.path}: unreadable GGUF file ({e})") from e
        self.metadata = {
            name: field.contents()
            for name, field in self._reader.fields.items()
            if not name.startswith("GGUF.")
        }
        self.tensors = {t.name: t for t in self._reader.tensors}

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        arch = self.get("general.architecture")
        if arch not in ARCHITECTURES:
            raise ModelError(
                f"{self.path}: unsupported GGUF architecture {arch!r}; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        return arch

    def config(self) -> ModelConfig:
        """The model's shape from the `<arch>.*` keys, as a Hugging Face config would say it."""
        arch, src = self.architecture, str(self.path)

        def number(name: str, value, kind=int):
            try:
                return kind(value)
            except (TypeError, ValueError, OverflowError):
                raise ModelError(f"{src}: metadata {arch}.{name} is {value!r}, not a "
                                 "number") from None

        def key(name: str, kind=int, default=None):
            """The `<arch>.name` value as `kind`; ModelError naming it where it is missing
            (and has no default) or not a number."""
            value = self.get(f"{arch}.{name}", default)
            if value is None:
                raise ModelError(f"{src}: missing metadata {arch}.{name}")
            return number(name, value, kind)

        heads, hidden = key("attention.head_count"), key("embedding_length")
        if heads <= 0:
            raise ModelError(f"{src}: metadata {arch}.attention.head_count is {heads}, not a "
                             "positive count")
        head_dim = key("attention.key_length", default=0) or hidden // heads
        rope_dims = key("rope.dimension_count", default=head_dim)
        if rope_dims != head_dim:
            raise ModelError(f"{src}: partial rotary embeddings ({rope_dims} of {head_dim}) "
                             "are not supported")
        # Read as llama.cpp reads it: no type is linear, the factor (rope.scale_linear in older
        # files) divides the frequencies, and none or 0 is no scaling.
        scaling = self.get(f"{arch}.rope.scaling.type", "linear")
        if scaling not in ROPE_SCALING_TYPES:
            raise ModelError(f"{src}: unsupported rope scaling {scaling!r} "
                             f"(supported: {', '.join(ROPE_SCALING_TYPES)})")
        factor = (key("rope.scaling.factor", float, 0.0)
                  or key("rope.scale_linear", float, 0.0))
        if factor < 0:
            raise ModelError(f"{src}: rope scaling factor {factor} is negative")
        if self.get(f"{arch}.attention.sliding_window"):
            raise ModelError(f"{src}: sliding-window attention is not supported")
        heads_kv = self.get(f"{arch}.attention.head_count_kv", heads)
        if isinstance(heads_kv, list):  # some files give one count per layer
            if len(set(heads_kv)) != 1:
                raise ModelError(f"{src}: per-layer KV head counts are not supported")
            heads_kv = heads_kv[0]
        heads_kv = number("attention.head_count_kv", heads_kv)
        embed = self.tensors.get("token_embd.weight")  # GGUF's shape: [hidden, vocab]
        vocab = int(embed.shape[-1]) if embed is not None else (
            key("vocab_size", default=0) or len(self.get("tokenizer.ggml.tokens", []))
        )
        eos = [self.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        raw = {
            "architectures": [ARCHITECTURES[arch]],
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": key("feed_forward_length"),
            "num_hidden_layers": key("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": heads_kv,
            "head_dim": head_dim,
            "rms_norm_eps": key("attention.layer_norm_rms_epsilon", float),
            "rope_theta": key("rope.freq_base", float, 10000.0),
            "rope_scaling": {"rope_type": "linear", "factor": factor}
            if scaling == "linear" and factor else None,
            "max_position_embeddings": key("context_length", default=2048),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "bos_token_id": self.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": list(dict.fromkeys(i for i in eos if i is not None)),
        }
        cfg = ModelConfig.from_dict(raw, src)
        if "rope_freqs.weight" in self.tensors:
            # Llama 3.1's frequency scaling, written by the converter as one factor per
            # frequency rather than as its parameters: the frequencies are divided by them.
            factors = self.dequantize("rope_freqs.weight", torch.float32).flatten()
            if factors.numel() != head_dim // 2:
                raise ModelError(f"{src}: rope_freqs.weight has {factors.numel()} factors, "
                                 f"expected {head_dim // 2}")
            # A linear factor divides them all once more (llama.cpp's freq_scale).
            factors = factors * cfg.rope_scaling.get("factor", 1.0)
            scaling = {"rope_type": "factors", "factors": tuple(factors.tolist())}
            cfg = _replace(cfg, rope_scaling=scaling)
        return cfg

    def dequantize(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The tensor in numpy (row-major, GGUF's shape reversed) order, as `dtype`."""
        gguf = _gguf_package()
        tensor = self.tensors[name]
        kind = tensor.tensor_type
        types = gguf.GGMLQuantizationType
        try:
            if kind.name not in TENSOR_TYPES:
                raise NotImplementedError
            if kind == types.F64:
                array = np.asarray(tensor.data, dtype=np.float64).astype(np.float32)
            else:
                array = gguf.quants.dequantize(tensor.data, kind)
        except NotImplementedError:  # also where an older gguf package lacks the type
            raise ModelError(
                f"{self.path}: tensor {name!r} has type {kind.name}, which cannot be dequantized "
                f"(supported: {', '.join(TENSOR_TYPES)})"
            ) from None
        shape = tuple(int(d) for d in reversed(tensor.shape))
        array = np.ascontiguousarray(array).reshape(shape)
        if not array.flags.writeable:  # F32 data is a view of the read-only file
            array = array.copy()
        return torch.from_numpy(array).to(dtype)

    def hf_tensors(
        self, cfg: ModelConfig, dtype: torch.dtype
    ) -> Iterator[tuple[str, str, torch.Tensor]]:
        """(Hugging Face name, GGUF name, tensor) for each weight: dequantized, q/k
        unpermuted. Tensors are read one at a time, so the file is never all in memory."""
        permuted = self.architecture == "llama"
        for name in self.tensors:
            if name == "rope_freqs.weight":
                continue  # in the config
            hf = _hf_name(name)
            if hf is None:
                raise ModelError(f"{self.path}: unexpected tensor {name!r} for {cfg.architecture}")
            tensor = self.dequantize(name, dtype)
            if permuted and (".attn_q." in name or ".attn_k." in name):
                heads = cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads
                tensor = unpermute(tensor, heads)
            yield hf, name, tensor

    def hf_blocks(
        self, cfg: ModelConfig, kinds: tuple[str, ...]
    ) -> Iterator[tuple[str, str, torch.Tensor]]:
        """(Hugging Face name, type name, blocks) for each matrix stored in one of `kinds`
        (type names: "Q4_1"), as the file stores it: uint8 [rows, bytes a row], q/k rows
        unpermuted (the permutation moves whole rows)."""
        permuted = self.architecture == "llama"
        for name, tensor in self.tensors.items():
            hf = _hf_name(name)
            if hf is None or tensor.tensor_type.name not in kinds or len(tensor.shape) != 2:
                continue
            blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8))  # a copy
            if permuted and (".attn_q." in name or ".attn_k." in name):
                blocks = unpermute(blocks, cfg.num_heads if ".attn_q." in name
                                   else cfg.num_kv_heads)
            yield hf, tensor.tensor_type.name, blocks


def _replace(cfg: ModelConfig, **changes) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(cfg, **changes)


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter, which stores each head's rows as (half, pair) -> (pair,
    half): rows 2i and 2i+1 of a head are rows i and i + head_dim/2 of the checkpoint."""
    rows = tensor.shape[0]
    return (
        tensor.reshape(heads, rows // heads // 2, 2, *tensor.shape[1:])
        .transpose(1, 2)
        .reshape(tensor.shape)
        .contiguous()
    )


def permute(tensor: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter's permutation (the inverse of `unpermute`), for writing files."""
    rows = tensor.shape[0]
    return (
        tensor.reshape(heads, 2, rows // heads // 2, *tensor.shape[1:])
        .transpose(1, 2)
        .reshape(tensor.shape)
        .contiguous()
    )


@functools.lru_cache(maxsize=1)
def _open(path: str, stamp: tuple[int, int]) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str | Path) -> GGUFFile:
    """The parsed file, kept for the next caller in this process while the file is unchanged:
    parsing a real vocabulary's metadata takes seconds, and the config, the weights and the
    tokenizer each need it."""
    path = Path(path).resolve()
    try:
        st = os.stat(path)
    except FileNotFoundError as e:
        raise ModelError(f"{path}: no such file") from e
    return _open(str(path), (st.st_mtime_ns, st.st_size))


# ---------------------------------------------------------------------------------------
# The tokenizer

# llama.cpp's pre-tokenizers (llama-vocab.cpp), by `tokenizer.ggml.pre`: the regexes that
# split text before BPE, applied in turn. Where llama.cpp rewrote a model's own regex for its
# regex engine, the model's original (from its tokenizer.json) is used: Oniguruma takes it.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
          r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]

# name -> (regexes, whether whole words found in the vocabulary skip the merges, default BOS)
_PRE_TOKENIZERS: dict[str, tuple[list[str], bool, bool]] = {
    "default": (_DEFAULT, False, False),
    **{n: ([_LLAMA3], True, True) for n in (
        "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
        "lfm2", "dbrx", "smaug-bpe")},
    **{n: ([_GPT2], False, False) for n in (
        "gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "exaone4", "mellum", "a.x-4.0")},
    **{n: ([r"\p{N}", _GPT2], False, False) for n in (
        "starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b")},
    **{n: ([_QWEN2], False, False) for n in (
        "qwen2", "deepseek-r1-qwen", "megrez", "stablelm2", "hunyuan", "kormo", "f2llmv2")},
    **{n: ([_GPT4O], False, False) for n in ("gpt-4o", "llama4", "kanana2", "minimax-m2")},
}

# tokenizer.ggml.token_type values
_CONTROL, _USER_DEFINED = 3, 4


def unsupported_tokenizer(f: GGUFFile) -> str | None:
    """Why the file's `tokenizer.ggml.model` is not one `build_tokenizer` builds, or None."""
    kind = f.get("tokenizer.ggml.model")
    if kind == "gpt2":
        return None
    return f"unsupported GGUF tokenizer {kind!r} (supported: gpt2, a byte-level BPE)"


def build_tokenizer(f: GGUFFile):
    """(tokenizers.Tokenizer, settings) from the file's `tokenizer.*` metadata; settings are
    the chat template, the BOS/EOS tokens and ids, and whether encoding adds BOS."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    src = str(f.path)
    if why := unsupported_tokenizer(f):
        raise ModelError(f"{src}: {why}")
    tokens: list[str] = f.get("tokenizer.ggml.tokens") or []
    merges: list[str] = f.get("tokenizer.ggml.merges") or []
    types: list[int] = f.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if not tokens or len(types) != len(tokens):
        raise ModelError(f"{src}: tokenizer.ggml.tokens missing or disagreeing with token_type")
    pre = f.get("tokenizer.ggml.pre") or "default"
    if pre not in _PRE_TOKENIZERS:
        raise ModelError(f"{src}: unsupported pre-tokenizer {pre!r}; supported: "
                         f"{', '.join(sorted(_PRE_TOKENIZERS))}")
    regexes, ignore_merges, default_bos = _PRE_TOKENIZERS[pre]
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>) are special; user-defined ones (<think>) are matched whole
    # in text but are not special, as llama.cpp treats them.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types, strict=True) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types, strict=True) if k == _USER_DEFINED])

    def token(key: str) -> tuple[int | None, str | None]:
        i = f.get(f"tokenizer.ggml.{key}_token_id")
        if i is None or not 0 <= i < len(tokens):
            return None, None
        return int(i), tokens[i]

    bos_id, bos = token("bos")
    eos_ids = [i for i, _ in map(token, ("eos", "eot", "eom")) if i is not None]
    add_bos = bool(f.get("tokenizer.ggml.add_bos_token", default_bos)) and bos_id is not None
    settings = {
        "chat_template": f.get("tokenizer.chat_template"),
        "bos_token": bos,
        "eos_token": token("eos")[1],
        "bos_id": bos_id,
        "eos_ids": tuple(dict.fromkeys(eos_ids)),
        "add_bos": add_bos,
    }
    return tok, settings
