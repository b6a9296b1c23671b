"""Text <-> token ids, special tokens and the chat template of a checkpoint."""

from __future__ import annotations

import functools
import json
import logging
import re
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from symphony.engine.errors import ModelError

log = logging.getLogger(__name__)


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelError(f"{path}: not valid JSON ({e})") from e


def _token_text(entry) -> str | None:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts.
    return entry.get("content") if isinstance(entry, dict) else entry


# Byte-level BPE (GPT-2) spells each byte as one character: printable Latin-1 bytes as
# themselves, the other 68 as the characters from U+0100 on, in byte order.
_PRINTABLE = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
_BYTE_OF_CHAR = {chr(b): b for b in _PRINTABLE} | {
    chr(0x100 + i): b for i, b in enumerate(b for b in range(256) if b not in _PRINTABLE)
}
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def _decoder_types(decoder: dict | None) -> set[str]:
    if not decoder:
        return set()
    return {decoder["type"]}.union(*map(_decoder_types, decoder.get("decoders", [])))


def _byte_level_bytes(token: str) -> bytes:
    # As the ByteLevel decoder: a token with a character outside the alphabet is its UTF-8.
    if all(c in _BYTE_OF_CHAR for c in token):
        return bytes(_BYTE_OF_CHAR[c] for c in token)
    return token.encode()


def _sentencepiece_bytes(token: str) -> bytes:
    if m := _BYTE_TOKEN.fullmatch(token):
        return bytes([int(m[1], 16)])
    return token.replace("▁", " ").encode()


@functools.cache
def _warn_once(message: str) -> None:
    log.warning("%s", message)


class Tokenizer:
    def __init__(self, directory: str | Path):
        directory = Path(directory)
        path = directory / "tokenizer.json"
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises bare Exceptions for unreadable files
            raise ModelError(f"{path}: cannot load tokenizer ({e})") from e
        config = _read_json(directory / "tokenizer_config.json")
        generation = _read_json(directory / "generation_config.json")
        bos_token = _token_text(config.get("bos_token"))
        eos_token = _token_text(config.get("eos_token"))
        bos_id = tok.token_to_id(bos_token) if bos_token else None
        bos_id = generation.get("bos_token_id", bos_id)
        # The ids transformers' generate stops at: generation_config.json's, else config.json's
        # (GenerationConfig.from_model_config); and the tokenizer's EOS token besides.
        stops = (generation if (directory / "generation_config.json").exists()
                 else _read_json(directory / "config.json"))
        eos = stops.get("eos_token_id")
        eos = [eos] if isinstance(eos, int) else list(eos or [])
        if eos_token and (eos_id := tok.token_to_id(eos_token)) is not None:
            eos.append(eos_id)
        self._setup(
            tok,
            chat_template=config.get("chat_template"),
            bos_token=bos_token,
            eos_token=eos_token,
            bos_id=bos_id,
            eos_ids=tuple(dict.fromkeys(eos)),
            add_bos=bool(config.get("add_bos_token", False)) and bos_id is not None,
        )

    def _setup(self, tok: HFTokenizer, *, chat_template: str | None, bos_token: str | None,
               eos_token: str | None, bos_id: int | None, eos_ids: tuple[int, ...],
               add_bos: bool) -> None:
        self._tok = tok
        self.chat_template: str | None = chat_template
        self.bos_token, self.eos_token = bos_token, eos_token
        self.bos_id, self.eos_ids = bos_id, eos_ids
        self.add_bos = add_bos
        self._token_bytes: list[bytes] | None = None

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """The tokenizer in a GGUF file's metadata (symphony.engine.gguf_file builds it)."""
        from symphony.engine.gguf_file import build_tokenizer, open_gguf

        tok, settings = build_tokenizer(open_gguf(path))
        self = cls.__new__(cls)
        self._setup(tok, **settings)
        return self

    @classmethod
    def from_dir(cls, directory: str | Path) -> Tokenizer | None:
        """The checkpoint's tokenizer, or None where it has none this class reads (`missing`
        says why; for a GGUF file a warning says it, once a file, as its metadata is
        expected to hold one). `directory` may be a GGUF file, whose tokenizer is in its
        metadata."""
        from symphony.engine.gguf_file import is_gguf

        why = cls.missing(directory)
        if why is None:
            return cls.from_gguf(directory) if is_gguf(directory) else cls(directory)
        if is_gguf(directory):
            _warn_once(f"{directory}: {why}; the model takes token ids, not text")
        return None

    @staticmethod
    def missing(directory: str | Path) -> str | None:
        """Why `from_dir` finds no tokenizer in the checkpoint; None where it finds one."""
        from symphony.engine.gguf_file import is_gguf, open_gguf, unsupported_tokenizer

        if not is_gguf(directory):
            return None if (Path(directory) / "tokenizer.json").exists() else "no tokenizer.json"
        f = open_gguf(directory)
        if f.get("tokenizer.ggml.model") is None:
            return "no tokenizer in the GGUF metadata"
        return unsupported_tokenizer(f)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def special_tokens(self) -> dict[str, int]:
        return {t.content: i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def special_ids(self) -> list[int]:
        return sorted(self.special_tokens.values())

    def token_bytes(self) -> list[bytes]:
        """Per id below vocab_size, the bytes the token adds to decoded text in the middle of
        a sequence (SentencePiece's `▁` is a space even where decode strips the first one);
        added tokens are their content. Computed once; do not modify the list."""
        if self._token_bytes is None:
            decoder = json.loads(self._tok.to_str()).get("decoder")
            byte_level = "ByteLevel" in _decoder_types(decoder)
            spell = _byte_level_bytes if byte_level else _sentencepiece_bytes
            added = self._tok.get_added_tokens_decoder()
            self._token_bytes = [
                added[i].content.encode() if i in added else spell(self._tok.id_to_token(i) or "")
                for i in range(self.vocab_size)
            ]
        return self._token_bytes

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        # The post-processor is bypassed so that BOS follows tokenizer_config.json alone.
        # The batch calls release the GIL (encode and decode hold it: seconds for a long
        # text), so a thread of the kernel's tokenizes while its loop goes on.
        ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        return [self.bos_id, *ids] if (self.add_bos if add_bos is None else add_bos) else ids

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        return self._tok.decode_batch([ids], skip_special_tokens=skip_special)[0]

    @functools.cached_property
    def _chat_template(self) -> jinja2.Template:
        # Compiled once: compiling costs 1.7 ms, three times the rest of a chat tokenize.
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ModelError("this checkpoint has no chat template")
        return self._chat_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )
