"""A decode loop's preds known by their bytes (symphony/known_preds.py): the token read
where the client's serializer writes it, nothing known that would parse differently, and,
on a real kernel, the errors of a known request's pred the same as a parsed one's."""

from __future__ import annotations

import errno
import os
import random

import pytest
from daemon import prompt

from symphony.engine.sampler import SamplingParams
from symphony.known_preds import KnownPred, KnownPreds, split
from syscalls import convert
from syscalls import symphony_pb2 as pb
from syscalls.client import Kernel

VOCAB = 50_000
PARAMS = SamplingParams()


def request(fd: int, tokens: list[int], **sampling) -> bytes:
    return convert.pred_request(fd, tokens, None, None, convert.sampler(None, sampling), False)


@pytest.mark.parametrize("fd", [0, 1, 127, 128, 300_000])
@pytest.mark.parametrize("token", [0, 1, 127, 128, 16_383, 16_384, 49_999])
def test_the_token_is_read_where_the_client_writes_it(fd, token):
    payload = request(fd, [token], temperature=0.7, seed=5)
    key, read = split(payload)
    assert read == token
    assert split(request(fd, [7], temperature=0.7, seed=5))[0] == key
    assert split(request(fd, [token], temperature=0.8, seed=5))[0] != key
    assert split(request(fd + 1, [token], temperature=0.7, seed=5))[0] != key


@pytest.mark.parametrize("payload", [
    b"", b"\x08", b"\x08\x01", b"\x08\x01\x12", b"\x08\x01\x12\x00", b"\x12\x01",
    b"\x12\x02\x81", b"\x12\x02\x01\x01", b"\x12\x06\x81\x81\x81\x81\x81\x01",
    b"\x08\x81\x81\x81\x81\x81\x81\x01\x12\x01\x05", b"\x1a\x01\x05",
])
def test_bytes_that_are_not_one_token_in_field_order_are_not_split(payload):
    assert split(payload) is None


def learned(payload: bytes) -> KnownPreds:
    known = KnownPreds()
    req = pb.PredRequest.FromString(payload)
    key = known.key(payload, req)
    assert key is not None
    known.learn(key, KnownPred(req.fd, PARAMS, 23))
    return known


@pytest.mark.parametrize("other", [
    pb.PredRequest(positions=[9]), pb.PredRequest(outputs=[0]),
    pb.PredRequest(no_outputs=True), pb.PredRequest(score_next=True),
    pb.PredRequest(parents=[-1]), pb.PredRequest(truncate=0),
    pb.PredRequest(controls=[pb.LogitControl(bias_ids=[1], bias_values=[1.0])]),
    pb.PredRequest(tokens=[4]),  # a second token, further on
])
def test_only_a_decode_loop_s_request_is_learned(other):
    payload = request(3, [5]) + other.SerializeToString()
    known = KnownPreds()
    assert known.key(payload, pb.PredRequest.FromString(payload)) is None


def test_what_is_known_parses_to_the_request_it_stands_for():
    """Random bytes around a learned request: whenever they match, protobuf's own parse of
    them is that request with the token read."""
    rng = random.Random(27)
    base = request(3, [5], temperature=0.5, top_k=40, seed=11)
    known = learned(base)
    expected = pb.PredRequest.FromString(base)
    matched = 0
    for _ in range(20_000):
        payload = bytearray(request(3, [rng.randrange(VOCAB)], temperature=0.5, top_k=40,
                                    seed=11))
        for _ in range(rng.choice([0, 0, 1, 2])):  # damage a byte, or cut or add some
            at = rng.randrange(len(payload) + 1)
            match rng.randrange(3):
                case 0 if at < len(payload):
                    payload[at] = rng.randrange(256)
                case 1:
                    del payload[at:at + rng.randrange(1, 4)]
                case _:
                    payload[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4)))
        found = known.match(bytes(payload), VOCAB)
        if found is None:
            continue
        matched += 1
        _, token = found
        parsed = pb.PredRequest.FromString(bytes(payload))
        expected.tokens[:] = [token]
        assert parsed == expected
    assert matched > 10_000


def test_a_token_outside_the_vocabulary_is_not_known():
    known = learned(request(3, [5]))
    assert known.match(request(3, [VOCAB - 1]), VOCAB) is not None
    assert known.match(request(3, [VOCAB]), VOCAB) is None


def test_a_long_request_is_not_learned():
    """Bytes protobuf skips (an unknown field) make a decode request as long as its sender
    likes: kept as a key, 64 of them could hold gigabytes."""
    padding = b"\xfa\x0f" + bytes([0x80 | 300 & 0x7F, 300 >> 7]) + b"x" * 300  # field 255
    payload = request(3, [5]) + padding
    req = pb.PredRequest.FromString(payload)
    assert len(req.tokens) == 1  # protobuf takes it, unknown field and all
    assert KnownPreds().key(payload, req) is None
    short = request(3, [5]) + padding[:2] + b"\x04" + b"x" * 4
    assert KnownPreds().key(short, pb.PredRequest.FromString(short)) is not None


def test_a_process_knows_a_bounded_number_of_requests():
    known = KnownPreds()
    for seed in range(200):
        payload = request(3, [5], seed=seed)
        known.learn(known.key(payload, pb.PredRequest.FromString(payload)),
                    KnownPred(3, PARAMS, 23))
    assert 0 < len(known.known) <= 64


def test_a_known_request_s_pred_fails_as_a_parsed_one_does(daemon):
    """After a decode loop made its request known: its fd closed, a token past the
    vocabulary; each error as a parsed pred's."""
    for rings in (True, False):
        with Kernel.connect(daemon.socket, rings=rings) as k:
            f = k.open("", os.O_RDWR)
            fd = f.fd
            token = f.pred(prompt(8))[0].token
            for _ in range(4):  # known from the first of these
                token = f.pred([token])[0].token
            f.close()
            with pytest.raises(OSError) as e:
                k.pred(fd, [token])
            assert e.value.errno == errno.EBADF and f"fd {fd}" in str(e.value)
            g = k.open("", os.O_RDWR)
            g.pred(prompt(8))
            with pytest.raises(OSError) as e:
                g.pred([1 << 20])
            assert e.value.errno == errno.EINVAL and "1048576" in str(e.value)
            assert len(g.pred([token])) == 1  # the session goes on
