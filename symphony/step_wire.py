"""A step on the engine's socket: its work and its result as fixed-layout bytes, or pickled.

Most steps are plain: token ids, positions, page tables and unseeded samplers in, a token
and a logprob a row (and top logprobs) out. Those go as arrays of 64-bit numbers (packed
by `struct`, read back by `array`, each in one C loop), with no object graph for pickle to
walk: right after a forward pass, with the caches cold, pickling and unpickling a step's
objects was the loop's largest item at batch 1, and in the engine process it lies between
two steps (bench/RESULTS.md, Session 27). A step with anything else (logit controls, a
tree, kept logits, seeded generators, a tensor-parallel engine's dirty rows) and every
other message (setup, errors) is pickled, as `pickle_dumps` writes it; a pickle starts
with its PROTO opcode (0x80), never with WORK or RESULT.

WORK, after its kind byte: int64s

    n_seqs, n_tokens, n_rows, n_table, n_excluded (-1: Batch.excluded is None),
    n_placeholders, then
    token_ids[n_tokens], positions[n_tokens], q_lens[n_seqs], kv_lens[n_seqs],
    table_lens[n_seqs], the page tables' ids[n_table], logit_rows[n_rows],
    excluded_counts[n_seqs] and the ranges' (start, end)[n_excluded] (when not None),
    placeholders' (at, row)[n_placeholders], the rows' top_k[n_rows], top_logprobs[n_rows]

then float64s: the rows' temperature[n_rows], top_p[n_rows], min_p[n_rows].

RESULT, after its kind byte: int64s n_rows, top_width, tokens[n_rows], top_ids[n_rows *
top_width]; float64s seconds, logprobs[n_rows]; float32s top_logprobs[n_rows * top_width].
"""

from __future__ import annotations

import io
import pickle
import struct
from array import array

import numpy as np
import torch

from symphony.engine.engine import Batch
from symphony.engine.sampler import SamplingParams
from symphony.step import StepResult, StepWork

WORK, RESULT = 0x01, 0x02
WORK_HEAD = 6  # the work's counts, at the start of its int64s
RESULT_HEAD = 2
# What a row's sampler is sent as: a field added to SamplingParams must be added here (a
# test holds this list to the dataclass's fields, seed being pickled only).
PARAM_INTS = ("top_k", "top_logprobs")
PARAM_FLOATS = ("temperature", "top_p", "min_p")


class _Pickler(pickle.Pickler):
    """Pickles a CPU tensor as a numpy array of its own elements. torch's own pickling writes
    a tensor's whole storage, so each kept logit row, a view of the step's logits, would carry
    all of them (32 rows: 16 MB a step, 37 ms), and it goes through torch.save's archive
    format, about 60 us a tensor even when small (a pred's mask)."""

    def reducer_override(self, obj: object) -> object:
        if (type(obj) is torch.Tensor and obj.device.type == "cpu" and not obj.requires_grad
                and obj.dtype in _NUMPY_DTYPES):
            return torch.from_numpy, (obj.numpy(),)
        return NotImplemented


_NUMPY_DTYPES = {torch.float32, torch.float64, torch.float16, torch.int64, torch.int32,
                 torch.int16, torch.int8, torch.uint8, torch.bool}


def pickle_dumps(message: object) -> bytes:
    """Any message as pickle.loads reads it back."""
    out = io.BytesIO()
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return out.getvalue()


def dumps(message: object) -> bytes:
    """A message for the engine's socket: a step's (work, dirty) or ("done", result) as fixed
    layout when plain, anything else pickled."""
    if type(message) is tuple and len(message) == 2:
        first, second = message
        if type(first) is StepWork and not second and _plain_work(first):
            return _work_bytes(first)
        if first == "done" and type(second) is StepResult and _plain_result(second):
            return _result_bytes(second)
    return pickle_dumps(message)


def loads(data: bytes | bytearray | memoryview) -> object:
    """What dumps wrote: (work, []) for WORK, ("done", result) for RESULT, else unpickled."""
    kind = data[0]
    if kind == WORK:
        return _work(memoryview(data)[1:]), []
    if kind == RESULT:
        return "done", _result(memoryview(data)[1:])
    return pickle.loads(data)


def _numbers(typecode: str, data: memoryview) -> list:
    numbers = array(typecode)
    numbers.frombytes(data)
    return numbers.tolist()


def _plain_work(work: StepWork) -> bool:
    return (work.controls is None and not work.kept and work.batch.trees is None
            and all(g is None for g in work.generators)
            and all(p.seed is None for p in work.params))


def _plain_result(result: StepResult) -> bool:
    return (result.model_logprobs is None and result.scores is None and not result.kept
            and all(g is None for g in result.generators)
            and len(result.generators) == len(result.tokens))


def _work_bytes(work: StepWork) -> bytes:
    b, params = work.batch, work.params
    ints = [len(b.q_lens), len(b.token_ids), len(b.logit_rows), sum(map(len, b.page_tables)),
            -1 if b.excluded is None else sum(map(len, b.excluded)), len(work.placeholders)]
    ints += b.token_ids
    ints += b.positions
    ints += b.q_lens
    ints += b.kv_lens
    ints += map(len, b.page_tables)
    for table in b.page_tables:
        ints += table
    ints += b.logit_rows
    if b.excluded is not None:
        ints += map(len, b.excluded)
        for ranges in b.excluded:
            for pair in ranges:
                ints += pair
    for pair in work.placeholders:
        ints += pair
    ints += [p.top_k for p in params]
    ints += [p.top_logprobs for p in params]
    floats = [p.temperature for p in params]
    floats += [p.top_p for p in params]
    floats += [p.min_p for p in params]
    # struct packs a list of numbers in one C loop (array.extend takes one at a time).
    return bytes((WORK,)) + struct.pack(f"<{len(ints)}q{len(floats)}d", *ints, *floats)


def _pairs(flat: list[int]) -> list[tuple[int, int]]:
    return list(zip(flat[::2], flat[1::2], strict=True))


def _work(data: memoryview) -> StepWork:
    seqs, tokens, rows, table, excluded, placeholders = _numbers("q", data[:8 * WORK_HEAD])
    count = (WORK_HEAD + 2 * tokens + 3 * seqs + table + rows + 2 * placeholders + 2 * rows
             + (seqs + 2 * excluded if excluded >= 0 else 0))
    ints = _numbers("q", data[:8 * count])
    floats = _numbers("d", data[8 * count:8 * count + 8 * 3 * rows])
    runs, at = [], WORK_HEAD
    for n in (tokens, tokens, seqs, seqs, seqs):
        runs.append(ints[at:at + n])
        at += n
    token_ids, positions, q_lens, kv_lens, table_lens = runs
    page_tables = []
    for n in table_lens:
        page_tables.append(ints[at:at + n])
        at += n
    logit_rows = ints[at:at + rows]
    at += rows
    ranges = None
    if excluded >= 0:
        counts, at = ints[at:at + seqs], at + seqs
        ranges = []
        for n in counts:
            ranges.append(_pairs(ints[at:at + 2 * n]) if n else [])
            at += 2 * n
    spots = _pairs(ints[at:at + 2 * placeholders])
    at += 2 * placeholders
    samplers: dict[tuple, SamplingParams] = {}  # a step's rows mostly share one
    params = []
    for key in zip(ints[at:at + rows], ints[at + rows:at + 2 * rows], floats[:rows],
                   floats[rows:2 * rows], floats[2 * rows:], strict=True):
        p = samplers.get(key)
        if p is None:
            p = samplers[key] = SamplingParams(temperature=key[2], top_k=key[0], top_p=key[3],
                                               min_p=key[4], top_logprobs=key[1])
        params.append(p)
    batch = Batch(token_ids, positions, q_lens, kv_lens, page_tables, logit_rows, ranges)
    return StepWork(batch, params, [None] * rows, None, [], spots)


def _result_bytes(result: StepResult) -> bytes:
    rows = len(result.tokens)
    width = len(result.top_ids[0]) if rows else 0
    parts = [bytes((RESULT,)), struct.pack(f"<2q{rows}q", rows, width, *result.tokens)]
    if width:
        parts.append(np.ascontiguousarray(result.top_ids, dtype=np.int64).tobytes())
    parts.append(struct.pack(f"<{1 + rows}d", result.seconds, *result.logprobs))
    if width:
        parts.append(np.ascontiguousarray(result.top_logprobs, dtype=np.float32).tobytes())
    return b"".join(parts)


def _result(data: memoryview) -> StepResult:
    rows, width = _numbers("q", data[:8 * RESULT_HEAD])
    at = 8 * RESULT_HEAD
    tokens = _numbers("q", data[at:at + 8 * rows])
    at += 8 * rows
    top_ids: np.ndarray | list[list[int]]
    top_logprobs: np.ndarray | list[list[float]]
    if width:
        top_ids = np.frombuffer(data, np.int64, rows * width, at).reshape(rows, width)
        at += 8 * rows * width
    floats = _numbers("d", data[at:at + 8 * (1 + rows)])
    at += 8 * (1 + rows)
    if width:
        top_logprobs = np.frombuffer(data, np.float32, rows * width, at).reshape(rows, width)
    else:  # no row asked for any: each row's slice is empty, as the arrays' would be
        top_ids, top_logprobs = [[]] * rows, [[]] * rows
    return StepResult(tokens, floats[1:], top_ids, top_logprobs, floats[0],
                      generators=[None] * rows)

