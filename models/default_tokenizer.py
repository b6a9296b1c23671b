"""The default model's tokenizer: byte-level BPE, its special tokens and its chat format.

The chat format lives here twice on purpose: as the Jinja template that ships in
`tokenizer_config.json` (what chat.py and transformers render) and as `render_chat`, which
writes the chat examples of the training corpus. `check_chat_template` keeps them equal.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
ROLES = ("system", "user", "assistant")
# Ids follow this order: pad 0, bos 1, eos 2, then one marker per chat role.
SPECIAL_TOKENS = [PAD, BOS, EOS, *(f"<|{role}|>" for role in ROLES)]
SPECIAL_RE = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))

# Every turn is `<|role|>\n{content}<|eos|>`, with nothing between turns: a program that
# appends turns to a KV file one at a time builds exactly what the template renders, and
# generation stops at the eos that closes the assistant's turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """What CHAT_TEMPLATE renders, in Python (the corpus is written without Jinja)."""
    turns = "".join(f"<|{m['role']}|>\n{m['content']}{EOS}" for m in messages)
    return BOS + turns + ("<|assistant|>\n" if add_generation_prompt else "")


def plain_pieces(stream: str) -> Iterable[str]:
    """The text between special-token markers: what BPE merges are learned from."""
    for piece in SPECIAL_RE.split(stream):
        if piece:
            yield piece


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    # No normalizer: decoding must give back the exact bytes, indentation and all.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    # Encoding adds bos, as Llama 3's tokenizer does; the chat template writes its own.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A",
                pair=f"{BOS} $A {BOS} $B",
                special_tokens=[(BOS, tok.token_to_id(BOS))],
            ),
        ]
    )
    return tok


def save_tokenizer(tok: Tokenizer, directory: Path, max_length: int) -> None:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json, as HF writes them."""
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    (directory / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def check_chat_template(directory: Path) -> None:
    """Fail loudly if the shipped template and `render_chat` ever disagree."""
    from transformers import AutoTokenizer  # test-only dependency, imported late

    hf = AutoTokenizer.from_pretrained(str(directory))
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What does `len` do?"},
        {"role": "assistant", "content": "It returns the number of items."},
        {"role": "user", "content": "Thanks"},
    ]
    for gen in (False, True):
        ours = render_chat(messages, add_generation_prompt=gen)
        theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        if ours != theirs:
            raise AssertionError(f"chat template mismatch:\n{ours!r}\n{theirs!r}")
