"""The vocabulary's bytes: concatenating the tokens' bytes gives back the encoded text's
bytes, for byte-level BPE (the default model, the test checkpoints) and SentencePiece-style
byte fallback; the special ids are those tokenizer.json marks special."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from checkpoints import add_tokenizer
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers

from symphony.engine.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "models"))
from default_tokenizer import SPECIAL_TOKENS  # noqa: E402  (models/ is not a package)

TEXTS = [
    "naïve café, 日本語 and 🎉",
    "def größe(x):\n    return x  # ½ → ¾\n",
    "<|user|>\nhé, ça va?<|eos|>",
    "\u00a0\ttabs\r\n  and   spaces ",
]


def split_characters(tok: Tokenizer, text: str) -> bool:
    """Whether some token of text carries part of a multi-byte character."""
    pieces = [tok.token_bytes()[i] for i in tok.encode(text, add_bos=False)]
    try:
        [p.decode() for p in pieces]
    except UnicodeDecodeError:
        return True
    return False


def marked_special(directory: Path) -> list[int]:
    added = json.loads((directory / "tokenizer.json").read_text())["added_tokens"]
    return sorted(t["id"] for t in added if t["special"])


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("vocab")
    add_tokenizer(directory)
    return directory


@pytest.mark.parametrize("which", ["tiny", "checkpoint"])
def test_byte_level_tokens_concatenate_to_the_text(which, checkpoint_dir):
    directory = ROOT / "models" / "tiny" if which == "tiny" else checkpoint_dir
    tok = Tokenizer(directory)
    vocab = tok.token_bytes()
    assert len(vocab) == tok.vocab_size
    assert tok.token_bytes() is vocab  # computed once
    for text in TEXTS:
        assert b"".join(vocab[i] for i in tok.encode(text, add_bos=False)) == text.encode()
    assert split_characters(tok, TEXTS[0])
    # The whole byte alphabet is in the vocabulary, each byte its own token.
    assert {v for v in vocab if len(v) == 1} == {bytes([b]) for b in range(256)}
    assert tok.special_ids() == marked_special(directory)


def test_tiny_models_specials_are_its_chat_markers():
    tok = Tokenizer(ROOT / "models" / "tiny")
    assert [tok.token_bytes()[i] for i in tok.special_ids()] == [
        t.encode() for t in SPECIAL_TOKENS
    ]


def sentencepiece_dir(directory: Path) -> Path:
    """A Llama-2-style tokenizer.json: `▁` for spaces, bytes outside the vocabulary spelled
    as <0xNN> tokens."""
    specials = ["<unk>", "<s>", "</s>"]
    pieces = [*specials, *(f"<0x{b:02X}>" for b in range(256)), *"▁helowrd", "▁h", "ll", "▁w"]
    merges = [("▁", "h"), ("l", "l"), ("▁", "w")]
    bpe = models.BPE(
        {p: i for i, p in enumerate(pieces)}, merges, unk_token="<unk>", byte_fallback=True
    )
    tok = HFTokenizer(bpe)
    tok.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(specials)
    tok.save(str(directory / "tokenizer.json"))
    return directory


def test_sentencepiece_byte_tokens_and_spaces(tmp_path):
    tok = Tokenizer(sentencepiece_dir(tmp_path))
    vocab = tok.token_bytes()
    assert vocab[3 + 0x0A] == b"\n" and vocab[3 + 0xC3] == b"\xc3"
    for text in ["hello world", "héllo wörld ✓", "hello\n日本"]:
        ids = tok.encode(text, add_bos=False)
        assert any(3 <= i < 259 for i in ids) == (not text.isascii())
        # Mid-sequence bytes: the space the normalizer prepends stays (decode strips it).
        assert b"".join(vocab[i] for i in ids) == b" " + text.encode()
        assert tok.decode(ids) == text
    assert tok.special_ids() == [0, 1, 2] == marked_special(tmp_path)
