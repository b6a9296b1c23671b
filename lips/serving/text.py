"""A generation's text, token by token: detokenized locally from the vocabulary's bytes
(no syscall per token), and cut at stop strings.

A token's bytes may be part of a UTF-8 character: they are joined and decoded
incrementally, so an incomplete character waits for the tokens that complete it, as
`k.detokenize` of the whole list would decode it. Special ids (BOS, EOS, chat markers)
give no text, as `detokenize` without `keep_special`.

A stop string may span tokens, so streamed text holds back its end while that end could
still begin a stop string: no part of a stop string that later matches is ever shown.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Sequence

from syscalls.convert import Vocabulary


def text_bytes(vocab: Vocabulary) -> list[bytes]:
    """Per id, the bytes it adds to generated text: special ids none."""
    return [b"" if i in vocab.special_ids else piece for i, piece in enumerate(vocab.tokens)]


class Detokenizer:
    """Token ids to text, piece by piece; `pieces` is text_bytes(vocab)."""

    def __init__(self, pieces: Sequence[bytes]):
        self._pieces = pieces
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token: int) -> str:
        """The text `token` adds ("" while a character is incomplete)."""
        return self._utf8.decode(self._pieces[token])

    def finish(self) -> str:
        """What an incomplete character at the very end decodes to (U+FFFD), or ""."""
        return self._utf8.decode(b"", final=True)


def token_pieces(pieces: Sequence[bytes], ids: Sequence[int]) -> list[str]:
    """Per token of `ids`, the text it adds to the whole's decode (special ids and the
    first bytes of a character none; what an incomplete character at the end decodes to
    goes with the last token): "".join of them is the decode of `ids`."""
    text = Detokenizer(pieces)
    out = [text.push(t) for t in ids]
    if out:
        out[-1] += text.finish()
    return out


class StopStrings:
    """Cuts text before the first stop string, holding back what could begin one."""

    def __init__(self, stops: Iterable[str]):
        self._stops = tuple(s for s in stops if s)
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """The text that may be shown now, and whether a stop string matched: then the
        text is what came before it, and nothing more may be pushed."""
        buf = self._held + text
        # Only the held text and the new can hold a match: anything shown before could
        # not begin a stop string.
        found = [at for at in (buf.find(s) for s in self._stops) if at >= 0]
        if found:
            self._held = ""
            return buf[: min(found)], True
        keep = self._partial(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep], False

    def _partial(self, buf: str) -> int:
        """The length of the longest end of `buf` that begins some stop string."""
        longest = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(buf)), longest, -1):
                if buf.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def flush(self) -> str:
        """The text held back, at the end of the generation (no stop string came)."""
        held, self._held = self._held, ""
        return held
