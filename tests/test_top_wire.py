"""A pred's reply on the wire built without protobuf's messages (its top logprobs with numpy,
plain outputs directly): what protobuf's own messages give."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from symphony import syscall_table
from symphony.pred_job import Output
from symphony.syscall_table import pred_reply, reply_payload
from symphony.top_wire import encode_tops
from syscalls import symphony_pb2 as pb
from syscalls.convert import _plain_outputs, plain_reply

EDGES = [0, 1, 127, 128, 16383, 16384, 2**21 - 1, 2**21, 2**28 - 1, 2**28, 2**31 - 1]


def as_messages(ids, logprobs) -> pb.PredOutput:
    out = pb.PredOutput(row=2, token=5)
    for i, lp in zip(ids, logprobs, strict=True):
        out.top.add(id=int(i), logprob=float(lp))
    return out


def test_each_row_parses_to_the_messages_and_serializes_as_they_do():
    rng = np.random.default_rng(0)
    ids = np.array([EDGES, EDGES[::-1], rng.integers(0, 150_000, len(EDGES))])
    logprobs = rng.normal(size=ids.shape).astype(np.float32)
    logprobs[0, 0] = 0.0  # proto3 leaves a zero out; an explicit one parses alike
    for row, data in enumerate(encode_tops(ids, logprobs)):
        got = pb.PredOutput(row=2, token=5)
        got.MergeFromString(data)
        want = as_messages(ids[row], logprobs[row])
        assert got == want
        assert got.SerializeToString() == want.SerializeToString()


def test_no_entries_and_ids_out_of_range():
    assert encode_tops(np.zeros((3, 0), dtype=np.int64), np.zeros((3, 0))) == [b""] * 3
    for bad in (-1, 2**31):
        with pytest.raises(ValueError, match=r"\[0, 2\^31\)"):
            encode_tops(np.array([[bad]]), np.array([[0.5]]))


@pytest.mark.parametrize("few", [0, 256], ids=["numpy", "a message each"])
def test_a_reply_of_rows_with_and_without_tops(monkeypatch, few):
    monkeypatch.setattr(syscall_table, "FEW_TOPS", few)
    outputs = [Output(0, 7, -0.5, np.array([7, 300]), np.array([-0.5, -2.0])),
               Output(1, 9, -0.25, [9], [-0.25]),  # another count: encoded on its own
               Output(2, 4, -1.0, [], [], model_logprob=-3.0, scores=[-1.5])]
    want = pb.PredReply()
    for o in outputs:
        out = want.outputs.add(row=o.row, token=o.token, logprob=o.logprob)
        out.top.extend(as_messages(o.top_ids, o.top_logprobs).top)
    want.outputs[2].model_logprob, want.outputs[2].scores[:] = -3.0, [-1.5]
    assert pred_reply(outputs) == want


def test_plain_outputs_serialize_as_protobuf_does_and_parse_back():
    rng = np.random.default_rng(1)
    # Zero, negative zero (protobuf writes it), the infinities and NaN, a float32's
    # smallest and largest, doubles that round.
    logprobs = [0.0, -0.0, float("-inf"), float("inf"), float("nan"), -1e-45, -3.4e38,
                -0.1234567890123, *rng.uniform(-30, 0, 8)]
    for n in range(200):
        outputs = [(int(rng.choice(EDGES)), int(rng.choice(EDGES)),
                    float(logprobs[(n + i) % len(logprobs)])) for i in range(n % 4)]
        want = pb.PredReply()
        for row, token, logprob in outputs:
            want.outputs.add(row=row, token=token, logprob=logprob)
        data = plain_reply(outputs)
        assert data == want.SerializeToString(), outputs
        as_bits = struct.Struct("<f").pack  # NaN is not NaN; its bits are
        assert ([(o.row, o.token, as_bits(o.logprob)) for o in _plain_outputs(data)]
                == [(o.row, o.token, as_bits(o.logprob)) for o in want.outputs])


def test_a_reply_payload_is_the_serialized_reply_whatever_its_outputs():
    plain = [Output(0, 7, -0.5, [], []), Output(3, 0, 0.0, np.zeros(0), np.zeros(0))]
    rich = [Output(0, 7, -0.5, [7], [-0.5]), Output(1, 2, -1.0, [], [], model_logprob=-2.0),
            Output(2, 2, -1.0, [], [], scores=[-1.5]), Output(3, 2, -1.0, [], [],
                                                             next_logprob=-0.75)]
    for outputs in ([], plain, *([o] for o in rich), plain + rich):
        assert reply_payload(outputs) == pred_reply(outputs).SerializeToString()
