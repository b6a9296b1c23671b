"""Random-weight Hugging Face checkpoints made with transformers, for parity tests."""

from __future__ import annotations

from pathlib import Path

import torch

SMALL = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
)

FAMILIES = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "llama-tied-mha": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            tie_word_embeddings=True,
            num_key_value_heads=8,
        ),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, num_key_value_heads=1)),
}


def make_checkpoint(directory: Path, family: str, weight_scale: float = 1.0, seed: int = 0):
    """Save a random model of `family`; returns the transformers model (fp32, eval).

    weight_scale > 1 sharpens the logits so greedy decoding is never decided by a tie.
    """
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(**{**SMALL, **extra})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    if weight_scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" not in name:
                    p.mul_(weight_scale)
    model.save_pretrained(directory)
    return model


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def add_tokenizer(directory: Path, vocab_size: int = 300) -> None:
    """Train a small byte-level BPE into `directory`, with special tokens and a chat template."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = ["def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)\n"] * 20
    tok.train_from_iterator(text + ["The quick brown fox jumps over the lazy dog."] * 20, trainer)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": "<|bos|>",
        "eos_token": {"content": "<|eos|>"},
        "add_bos_token": True,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
