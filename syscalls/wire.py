"""Frames on the lifeline: pred's fast path, and the kernel's shutdown notice.

After the hello line, both ends of a lifeline speak in frames: a header (payload length,
call id, kind) and the payload. A process sends PRED frames holding a serialized
PredRequest; the kernel answers each with a REPLY frame of the same call id holding the
PredReply. These are the Pred rpc's own messages, and the kernel checks, schedules and
accounts them as it does the rpc: only the transport differs. A process may have many
preds in flight; replies come in the order they finish. A CANCEL frame takes back the pred
of its call id: that pred's one reply is then ECANCELED, sent once its file is as before
(or its answer, when the CANCEL came too late). The kernel sends SHUTDOWN when it stops
cleanly, so that a client can tell a clean stop from a crash (end of file). RING_SETUP
(the process's, call id 0, no payload) asks for syscall rings: the kernel answers with a
RING frame whose payload is their geometry and whose ancillary data (SCM_RIGHTS) holds the
ring's memfd and its two eventfds (syscalls/ring.py), or with a REPLY frame of call id 0
holding the error.

Why a second transport for one call: a LIP makes one pred per token. A gRPC round trip
costs about 1 ms of Python on each side on a small CPU, which is most of a decode step of
a small model and most of the CPU of a batch; a frame on an open Unix socket costs a
tenth of that. Every other syscall, and pred too for any gRPC client, stays on gRPC.
"""

from __future__ import annotations

import errno
import struct

HEADER = struct.Struct("<IIB")  # payload bytes, call id, kind
PRED, REPLY, SHUTDOWN, CANCEL, RING_SETUP, RING = 1, 2, 3, 4, 5, 6
# A longer frame means the stream is not frames: drop the connection. It is also the most a
# gRPC message may carry either way (syscalls.client.CHANNEL_OPTIONS, the kernel's server), so
# every message has the same limit whichever transport takes it.
MAX_PAYLOAD = 64 << 20


class FrameError(ValueError):
    """The byte stream is not frames; nothing after this point can be trusted."""


def frame(kind: int, call: int, payload: bytes = b"") -> bytes:
    """The frame; EMSGSIZE when the payload is over MAX_PAYLOAD (the other end would take it
    for garbage and hang up)."""
    if len(payload) > MAX_PAYLOAD:
        raise OSError(errno.EMSGSIZE, f"a frame of {len(payload)} bytes is over the "
                      f"{MAX_PAYLOAD >> 20} MiB limit of a message")
    return HEADER.pack(len(payload), call, kind) + payload


class Frames:
    """Cuts a byte stream into (kind, call id, payload) frames as its bytes arrive."""

    def __init__(self) -> None:
        self._buf = bytearray()

    @property
    def held(self) -> int:
        """Bytes of a frame not yet whole."""
        return len(self._buf)

    def feed(self, data: bytes) -> list[tuple[int, int, bytes]]:
        self._buf += data
        out, at = self._cut()
        del self._buf[:at]
        return out

    def absorb(self, chunks: list[bytes], into: list) -> None:
        """feed() for a reader that a signal handler may interrupt anywhere (the sync
        client): the `chunks` (bytes read, in order) move into the buffer, and its whole
        frames are appended to `into` before they leave the buffer. Interrupted, it loses
        nothing and duplicates no byte; a frame may be appended twice."""
        while chunks:
            self._buf += chunks[0]  # no call between the two: no interruption either
            del chunks[0]
        if len(self._buf) >= HEADER.size:
            out, at = self._cut()
            into.extend(out)
            del self._buf[:at]

    def _cut(self) -> tuple[list[tuple[int, int, bytes]], int]:
        """The buffer's whole frames, and the bytes they take."""
        out, at = [], 0
        while len(self._buf) - at >= HEADER.size:
            size, call, kind = HEADER.unpack_from(self._buf, at)
            if size > MAX_PAYLOAD:
                raise FrameError(f"frame of {size} bytes (at most {MAX_PAYLOAD})")
            end = at + HEADER.size + size
            if len(self._buf) < end:
                break
            out.append((kind, call, bytes(self._buf[at + HEADER.size : end])))
            at = end
        return out, at
