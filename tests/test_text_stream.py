"""TextStream (syscalls/context.py): its pieces join to what detokenize of the whole list
gives, on real tokenizers (byte-level BPE and SentencePiece-style byte fallback, whose
decoder strips the text's first space), while each push decodes a bounded window."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from test_vocab import TEXTS, sentencepiece_dir

from symphony.engine.tokenizer import Tokenizer
from syscalls.context import TextStream

ROOT = Path(__file__).resolve().parent.parent


class Detokenizing:
    """The kernel's detokenize syscall as the kernel computes it (Tokenizer.decode, specials
    left out), with the length of every list it was given."""

    def __init__(self, tok: Tokenizer):
        self.tok = tok
        self.lengths: list[int] = []

    def detokenize(self, ids: list[int]) -> str:
        self.lengths.append(len(ids))
        return self.tok.decode(list(ids))


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece"])
def tok(request, tmp_path_factory) -> Tokenizer:
    if request.param == "byte-level":
        return Tokenizer(ROOT / "models" / "tiny")
    return Tokenizer(sentencepiece_dir(tmp_path_factory.mktemp("sp")))


def streamed(tok: Tokenizer, ids: list[int]) -> tuple[str, Detokenizing, TextStream]:
    k = Detokenizing(tok)
    stream = TextStream(k)
    pieces = [stream.push(i) for i in ids]
    pieces.append(stream.finish())
    assert "".join(pieces) == stream.text
    return stream.text, k, stream


def text_ids(tok: Tokenizer, rng: random.Random, n: int) -> list[int]:
    """n tokens of the test texts (multi-byte characters split across tokens), specials
    strewn in."""
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(rng.choice(TEXTS), add_bos=False)
        if rng.random() < 0.3:
            ids += [rng.choice(tok.special_ids())] * rng.randrange(1, 4)
    return ids[:n]


@pytest.mark.parametrize("seed", range(6))
def test_pieces_join_to_the_whole_decode(tok, seed):
    rng = random.Random(seed)
    ids = text_ids(tok, rng, rng.randrange(1, 400))
    assert streamed(tok, ids)[0] == tok.decode(ids)


def test_random_ids_join_to_the_whole_decode():
    # Byte-level only: a byte-fallback decoder turns a whole run of byte tokens into U+FFFDs
    # when a later byte of the run is not UTF-8, changing text already shown, whichever way
    # it is decoded (a model's text is UTF-8).
    tok = Tokenizer(ROOT / "models" / "tiny")
    rng = random.Random(7)
    ids = [rng.randrange(tok.vocab_size) for _ in range(300)]
    assert streamed(tok, ids)[0] == tok.decode(ids)


def test_a_long_stream_decodes_a_bounded_window(tok):
    ids = text_ids(tok, random.Random(1), 3000)
    text, k, _ = streamed(tok, ids)
    assert text == tok.decode(ids)
    # The whole list each push was 3000 ids at the end, 4.5 million in all; the window
    # moves once its text is shown (past a split character or a run of specials).
    assert max(k.lengths) <= TextStream.WINDOW + 8
    assert sum(k.lengths) < 3000 * (TextStream.WINDOW + 8)


def test_a_run_of_specials_keeps_the_space_after_it(tmp_path):
    # A window that started at text-less tokens would decode "▁w" as a text's start, where
    # this decoder strips the space.
    tok = Tokenizer(sentencepiece_dir(tmp_path))
    eos = tok.special_ids()[-1]
    hello, world = tok.encode("hello", add_bos=False), tok.encode("world", add_bos=False)
    ids = hello * 10 + [eos] * (TextStream.WINDOW + TextStream.CONTEXT) + world
    text = streamed(tok, ids)[0]
    assert text == tok.decode(ids) and text.endswith("hello world")


def test_an_incomplete_character_waits_and_finish_gives_the_rest(tok):
    byte = {b: tok.token_bytes().index(bytes([b])) for b in "日".encode()}  # e6 97 a5
    stream = TextStream(Detokenizing(tok))
    assert [stream.push(byte[b]) for b in "日".encode()] == ["", "", "日"]
    assert stream.finish() == ""
    cut = TextStream(Detokenizing(tok))
    assert cut.push(byte[0xE6]) == "" and cut.push(byte[0x97]) == ""
    assert cut.finish() == tok.decode([byte[0xE6], byte[0x97]]) == cut.text
    assert "\ufffd" in cut.text
