"""A decode loop's preds, known by their bytes.

A LIP in a decode loop sends, pred after pred, the same request but for its one token: the
same fd, sampler and options, serialized the same way. So the lifeline and the rings keep,
per process, what the checks made of such a request (its fd, its sampler's parameters,
the bound on its reply), under its bytes with the token cut out; a pred whose bytes are
known skips protobuf's parse and the checks, and is queued with its token at once.

Only the token is read from the bytes, and only where a serializer in field order puts
it: right after the fd (field 1, absent when 0), the tokens' packed field (field 2) with
one varint. The rest is compared byte for byte with a request that was parsed and
checked, and whose tokens were that one varint alone, so the same bytes around another
token parse to the same request with that token (a field repeated further on would have
added tokens, and it had none). Anything else, or a token outside the vocabulary, goes
the whole way (syscall_table.submit_pred), which gives its errors.
"""

from __future__ import annotations

from dataclasses import dataclass

from symphony.engine.sampler import SamplingParams
from syscalls import symphony_pb2 as pb

FD_TAG, TOKENS_TAG = 0x08, 0x12
KNOWN_MAX = 64  # requests known per process: a process cycling through more is forgotten
# The longest request learned: a decode loop's is some 10 to 40 bytes (fd, token, sampler);
# a longer one (unknown fields protobuf skips) would make each key a copy of it to keep.
KNOWN_BYTES = 256


@dataclass(frozen=True, slots=True)
class KnownPred:
    fd: int
    params: SamplingParams
    bound: int  # the most bytes its reply can take (syscall_table.reply_bound)


def split(payload: bytes) -> tuple[bytes, int] | None:
    """The request's bytes with its one token cut out (the key), and the token; None when
    the bytes do not start as a one-token pred written in field order does."""
    at, end = 0, len(payload)
    if end and payload[0] == FD_TAG:  # the fd's varint: at most 5 bytes
        at = 1
        while at < 6 and at < end and payload[at] & 0x80:
            at += 1
        at += 1
    if at + 2 >= end or payload[at] != TOKENS_TAG:
        return None
    n = payload[at + 1]
    last = at + 2 + n
    if not 1 <= n <= 5 or last > end:
        return None
    # One varint: its last byte's high bit clear, every other's set; read from the last.
    token = payload[last - 1]
    if token & 0x80:
        return None
    for i in range(last - 2, at + 1, -1):
        byte = payload[i]
        if not byte & 0x80:
            return None
        token = token << 7 | byte & 0x7F
    return payload[:at + 1] + payload[last:], token


def plain_decode(req: pb.PredRequest) -> bool:
    """Whether a request is a decode loop's: one token at the file's next position, sampled
    at it, with nothing but a sampler."""
    return (len(req.tokens) == 1 and not req.positions and not req.outputs
            and not req.no_outputs and not req.controls and not req.score_next
            and not req.parents and not req.HasField("truncate"))


class KnownPreds:
    """One process's known decode requests (its lifeline's and its rings')."""

    def __init__(self) -> None:
        self.known: dict[bytes, KnownPred] = {}

    def match(self, payload: bytes, vocab: int) -> tuple[KnownPred, int] | None:
        """The known request these bytes are, with their token; None: parse them."""
        cut = split(payload)
        if cut is None:
            return None
        known = self.known.get(cut[0])
        if known is None or cut[1] >= vocab:
            return None
        return known, cut[1]

    def key(self, payload: bytes, req: pb.PredRequest) -> bytes | None:
        """The key to know a request by, once it was parsed and checked: None when it is
        not a decode loop's, its bytes are not as split() reads them, or it is known."""
        if len(payload) > KNOWN_BYTES or not plain_decode(req):
            return None
        cut = split(payload)
        if cut is None or cut[1] != req.tokens[0] or cut[0] in self.known:
            return None
        return cut[0]

    def learn(self, key: bytes, known: KnownPred) -> None:
        if len(self.known) >= KNOWN_MAX:
            self.known.clear()
        self.known[key] = known
