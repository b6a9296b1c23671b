"""lips/serving/text.py without a daemon: the local detokenizer against a whole decode, and
stop strings cut exactly whichever way the text arrives."""

from __future__ import annotations

import random

import pytest

from lips.serving.text import Detokenizer, StopStrings, text_bytes
from syscalls.convert import Vocabulary

# A byte-level vocabulary: one id per byte, a few multi-byte pieces, special ids.
BYTES = [bytes([b]) for b in range(256)]
PIECES = [b"\xc3\xa9", b"\xe2\x82", b"\xac", b"\xf0\x9f", b"\x98\x80", b"ab", b" the"]
SPECIAL = [b"<|bos|>", b"<|eos|>"]
PIECE = {p: 256 + i for i, p in enumerate(PIECES)}
BOS, EOS = 256 + len(PIECES), 256 + len(PIECES) + 1
VOCAB = Vocabulary(BYTES + PIECES + SPECIAL, frozenset({BOS, EOS}))


def whole(ids: list[int]) -> str:
    """What detokenize of the whole list gives: the bytes joined, specials left out."""
    return b"".join(b"" if i in VOCAB.special_ids else VOCAB.tokens[i] for i in ids).decode(
        "utf-8", errors="replace")


def streamed(ids: list[int]) -> list[str]:
    d = Detokenizer(text_bytes(VOCAB))
    return [d.push(i) for i in ids] + [d.finish()]


def test_special_ids_give_no_text():
    assert text_bytes(VOCAB)[EOS] == b"" and text_bytes(VOCAB)[PIECE[b"ab"]] == b"ab"
    assert streamed([BOS, PIECE[b"ab"], EOS]) == ["", "ab", "", ""]


def test_a_character_split_across_tokens_waits_for_its_end():
    # "€" is e2 82 ac: two tokens; "😀" is f0 9f 98 80: two tokens, or four bytes.
    ids = [PIECE[b"\xe2\x82"], PIECE[b"\xac"], 0xF0, 0x9F, PIECE[b"\x98\x80"], PIECE[b"ab"]]
    assert streamed(ids) == ["", "€", "", "", "😀", "ab", ""]
    assert "".join(streamed(ids)) == whole(ids) == "€😀ab"


def test_a_special_id_inside_a_character_does_not_break_it():
    ids = [PIECE[b"\xe2\x82"], EOS, PIECE[b"\xac"]]
    assert "".join(streamed(ids)) == whole(ids) == "€"


def test_incomplete_and_invalid_bytes_are_replaced_as_a_whole_decode_does():
    for ids in ([PIECE[b"\xf0\x9f"]], [0xFF, 0x41], [0xE2, 0x41, 0x82], [0xC3, PIECE[b"ab"]]):
        assert "".join(streamed(ids)) == whole(ids)


@pytest.mark.parametrize("seed", range(20))
def test_random_sequences_equal_a_whole_decode(seed):
    rng = random.Random(seed)
    ids = [rng.choice([*range(0x80, 0x100), *PIECE.values(), BOS, EOS, 0x61])
           for _ in range(rng.randrange(1, 40))]
    pieces = streamed(ids)
    assert "".join(pieces) == whole(ids)
    # Each piece is the text that was certain by then: a prefix of the whole decode.
    text = ""
    for piece in pieces[:-1]:
        text += piece
        assert whole(ids).startswith(text)


def cut(stops: tuple[str, ...], parts: list[str]) -> tuple[list[str], bool]:
    """The pieces shown for `parts` pushed in order, and whether a stop string matched
    (the held text flushed at the end otherwise)."""
    s, shown = StopStrings(stops), []
    for part in parts:
        piece, matched = s.push(part)
        shown.append(piece)
        if matched:
            return shown, True
    return [*shown, s.flush()], False


def test_without_a_match_everything_comes_out():
    assert cut(("STOP",), ["ab", "cd"]) == (["ab", "cd", ""], False)
    assert "".join(cut(("STOP",), ["xST", "O", "x"])[0]) == "xSTOx"


def test_the_text_is_cut_before_the_first_match():
    assert cut(("STOP",), ["abSTOPcd"]) == (["ab"], True)
    assert cut(("b", "STOP"), ["aSTOPb"]) == (["a"], True)
    assert cut(("cd", "bc"), ["abcd"]) == (["a"], True)  # the earliest match wins


def test_a_stop_string_spanning_pieces_is_never_shown_in_part():
    shown, matched = cut(("STOP",), ["ab", "S", "T", "O", "P", "never"])
    assert matched and shown == ["ab", "", "", "", ""]
    shown, matched = cut(("\n\n",), ["a\n", "\nb"])
    assert matched and "".join(shown) == "a"


def test_a_partial_match_that_fails_comes_out_at_once():
    assert cut(("STOP",), ["ST", "OX", "y"]) == (["", "STOX", "y", ""], False)
    # The held part shrinks to what could still begin a stop string.
    assert cut(("aab",), ["a", "a", "a", "b"]) == (["", "", "a", ""], True)


@pytest.mark.parametrize("seed", range(30))
def test_random_splits_show_the_text_before_the_first_match(seed):
    rng = random.Random(seed)
    stops = tuple("".join(rng.choice("ab") for _ in range(rng.randrange(1, 4)))
                  for _ in range(rng.randrange(1, 3)))
    text = "".join(rng.choice("abc") for _ in range(rng.randrange(0, 20)))
    bounds = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, 4))) if text else []
    parts = [text[i:j] for i, j in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    shown, matched = cut(stops, parts)
    assert matched == bool(found)
    assert "".join(shown) == (text[: min(found)] if found else text)
