"""Rows' top logprobs as PredOutput's `top` field on the wire, built with numpy.

A pred may ask thousands of top logprobs for each of thousands of rows; a protobuf
message an entry made the kernel's loop spend seconds on one reply, while every other
process waited. These bytes, merged into a PredOutput (MergeFromString appends to a
repeated field), give the TopLogprob messages. Every entry has the same 13 bytes: the id's
varint is written in 5 bytes however small the id (parsers take a varint of up to 10
bytes; the reply is serialized again, canonically, after the merge), so that the entries
are the columns of one array, with no per-entry offsets.
"""

from __future__ import annotations

import numpy as np

TOP_TAG = 4 << 3 | 2  # PredOutput.top: field 4, length-delimited
ID_TAG = 1 << 3 | 0  # TopLogprob.id: field 1, varint
LOGPROB_TAG = 2 << 3 | 5  # TopLogprob.logprob: field 2, 32 bits
ENTRY = 13  # tag, length, id's tag and 5 bytes, logprob's tag and 4 bytes


def encode_tops(ids: np.ndarray, logprobs: np.ndarray) -> list[bytes]:
    """Each row's `top` entries, from [rows, n] arrays of ids (each in [0, 2^31)) and
    their logprobs, in order."""
    ids = np.asarray(ids, dtype=np.int64)
    rows, n = ids.shape
    if ids.size and (ids.min() < 0 or ids.max() >= 1 << 31):
        raise ValueError("top ids must be in [0, 2^31)")
    out = np.empty((rows * n, ENTRY), dtype=np.uint8)
    out[:, 0] = TOP_TAG
    out[:, 1] = ENTRY - 2
    out[:, 2] = ID_TAG
    flat = ids.reshape(-1).astype(np.uint32)
    for k in range(5):
        out[:, 3 + k] = (flat >> (7 * k)) & 0x7F | (0x80 if k < 4 else 0)
    out[:, 8] = LOGPROB_TAG
    out[:, 9:] = np.ascontiguousarray(logprobs, dtype="<f4").reshape(-1, 1).view(np.uint8)
    data, size = out.tobytes(), n * ENTRY
    return [data[r * size:(r + 1) * size] for r in range(rows)]
