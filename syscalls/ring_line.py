"""Syscall rings (syscalls/ring.py) as pred's transport, for each client.

They take and give the same serialized PredRequest and PredReply as the lifeline's frames
(syscalls/lifeline.py), whose classes they extend: a pred goes into the submission ring,
or, too large for it or when it is full, as a frame on the lifeline behind a FRAMED record
that keeps its place in line; its reply comes in the completion ring, or as a frame when
that is full. The lifeline still tells a clean stop (SHUTDOWN) from a crash (end of file).

Neither client spins (docs/syscalls.md, "The clients"): the synchronous one looks at its
completions once, then sleeps on its bell and the lifeline; the asyncio one's bell is in
the event loop, and one ring of it hands out every completion of a step.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import os
import select
import socket
import time
from collections.abc import Callable

from syscalls import errors, ring, wire
from syscalls.lifeline import AsyncLifeline, Lifeline, Sending, _gone, _left, wait_slice
from syscalls.own_pid import own_pid

RING_FULL_PAUSE = 0.001  # seconds between looks at a full submission ring


def _not_ours(where: str, opener: int) -> OSError:
    return errors.error(errno.EPERM, f"{where}: pred from a forked child: the session's "
                        f"ring belongs to process {opener}; open a session of its own")


class RingLine(Lifeline):
    """The sync client's ring: calls from any number of threads; one thread sends at a
    time, one waiting thread at a time reads the completions and the lifeline."""

    def __init__(self, sock: socket.socket, where: str, rings: ring.ProcessRing):
        super().__init__(sock, where)
        self.rings = rings
        self._opener = own_pid()
        rings.sleeping(True)
        self._poll = select.poll()
        self._poll.register(rings.process_bell, select.POLLIN)
        self._poll.register(sock, select.POLLIN)

    def call(self, payload: bytes) -> bytes:
        if own_pid() != self._opener:
            raise _not_ours(self.where, self._opener)
        return super().call(payload)

    def _send_pred(self, call: int, payload: bytes, sending: Sending) -> None:
        """A pred's request into the ring, with no frame made, when it fits now; else as
        _send sends its frame."""
        if len(payload) <= ring.MAX_RECORD:
            with self._sending:
                if not self._closed and self.rings.room(len(payload)):
                    self._submit([(wire.PRED, call, payload)], [sending])
                    return
        self._send(wire.frame(wire.PRED, call, payload), sending)

    def _send(self, data: bytes, sending: Sending | None = None) -> None:
        """A PRED or CANCEL frame (wire.frame) goes into the ring if it fits, else on the
        lifeline behind a FRAMED record; a PRED's Sending says whether it went."""
        size, call, kind = wire.HEADER.unpack_from(data)
        payload = data[wire.HEADER.size:]
        with self._sending:
            if self._closed:
                raise errors.error(*self._closed)
            if size <= ring.MAX_RECORD and self.rings.room(size):
                self._submit([(kind, call, payload)], [sending])
                return
            if kind == wire.CANCEL:  # tiny: the ring is full of preds; wait for the kernel
                self._wait_for_room(lambda: self.rings.room(0))
                self._submit([(kind, call, b"")], [None])
                return
            self._frame(data, call, sending)

    def _wait_for_room(self, fits: Callable[[], bool]) -> None:
        """Until fits(): the ring is full of records the kernel, rung, takes at once, but
        not while this process's replies wait unread (docs/syscalls.md): this sender reads
        them meanwhile, unless another thread does."""
        while not fits():
            if self._closed:
                raise errors.error(*self._closed)
            if not self._become_reader():
                time.sleep(RING_FULL_PAUSE)
                continue
            try:
                self._read(time.monotonic() + RING_FULL_PAUSE)  # hands reading back
            except BaseException:
                self._stop_reading()
                raise

    def _send_many(self, frames: list[bytes], sendings: list[Sending]) -> None:
        """PRED frames: those that fit go into the ring together, with one bell; a pred too
        large goes as a frame in its place in line, as _send sends it."""
        with self._sending:
            if self._closed:
                raise errors.error(*self._closed)
            batch, marks, size = [], [], 0
            for data, sending in zip(frames, sendings, strict=True):
                length, call, kind = wire.HEADER.unpack_from(data)
                if length <= ring.MAX_RECORD and self.rings.room(length, size):
                    batch.append((kind, call, data[wire.HEADER.size:]))
                    marks.append(sending)
                    size += ring.record_bytes(length)
                    continue
                if batch:
                    self._submit(batch, marks)
                    batch, marks, size = [], [], 0
                self._frame(data, call, sending)
            if batch:
                self._submit(batch, marks)

    def _submit(self, records: list[tuple[int, int, bytes]],
                sendings: list[Sending | None]) -> None:
        """Publish records at once and mark their preds' Sendings published. Interrupted
        anywhere (a signal handler raising, perhaps the moment the kernel's bell woke it
        and took this CPU), they are marked as the ring's tail says: they went if it is
        past them, else they are dropped. Holds _sending."""
        start = self.rings.sq_tail
        try:
            self.rings.submit_many(records)
            for sending in sendings:
                if sending is not None:
                    sending.published = True
        except BaseException:
            if self.rings.resync() != start:
                for sending in sendings:
                    if sending is not None:
                        sending.published = True
            raise

    def _frame(self, data: bytes, call: int, sending: Sending | None) -> None:
        """A PRED too large for the ring, or with no room there: a FRAMED record, then the
        frame on the lifeline. Once the record went, the frame goes too whatever interrupts
        this (the kernel's ring waits for it). Holds _sending."""
        self._wait_for_room(self.rings.room_to_frame)
        start, progress = self.rings.sq_tail, []
        try:
            self.rings.submit(ring.FRAMED, call)
            self._push(data, progress, committed=True)
        except OSError:  # the kernel is gone
            raise
        except BaseException:
            if self.rings.resync() != start:  # the record went
                self._push(data, progress, committed=True)
                if sending is not None:
                    sending.published = True
            raise
        if sending is not None:
            sending.published = True

    def _read(self, deadline: float | None) -> None:
        """Take the completions that have come; if none, sleep on the bell and the lifeline
        (until the deadline at most), then hand out what came. The reader's (_wait made
        this thread it); what it takes goes into the inbox first (Lifeline._hand_out)."""
        why = None
        try:
            if not self.rings.take_completions(self._inbox):
                why = self._sleep(deadline)
                self.rings.take_completions(self._inbox)
        except ring.RingError as e:
            why = (errno.EPROTO, f"{self.where}: the ring is broken: {e}")
        with self._lock:
            self._reader = None
            self._hand_out(why)

    def _sleep(self, deadline: float | None) -> tuple[int, str] | None:
        """Wait for the bell or the lifeline, reading what the lifeline has; why it ended,
        if it did."""
        left = wait_slice(_left(deadline))
        try:
            for fd, _ in self._poll.poll(None if left is None else left * 1e3):
                if fd == self.rings.process_bell:
                    try:  # once a pred: a try is cheaper than contextlib.suppress
                        os.eventfd_read(fd)
                    except BlockingIOError:
                        pass
                else:
                    self._recv()
                    return None
        except OSError as e:
            return _gone(self.where, e.strerror or str(e))
        return None


class AsyncRingLine(AsyncLifeline):
    """The asyncio client's ring: preds from many tasks; the process's bell is a reader of
    the event loop, rung once per batch of completions."""

    def __init__(self, sock: socket.socket, where: str, rings: ring.ProcessRing):
        super().__init__(sock, where)
        self.rings = rings
        self._opener = own_pid()
        self._bell_loop: asyncio.AbstractEventLoop | None = None
        self._bell_due = False  # the kernel's bell is rung once per loop turn
        self._held: collections.deque[tuple[int, int, bytes]] = collections.deque()
        rings.sleeping(True)

    async def call(self, payload: bytes) -> bytes:
        if own_pid() != self._opener:
            raise _not_ours(self.where, self._opener)
        if self._bell_loop is None and not self._closed:
            self._bell_loop = asyncio.get_running_loop()
            self._bell_loop.add_reader(self.rings.process_bell, self._rung)
        return await super().call(payload)

    def _write(self, kind: int, call: int, payload: bytes) -> None:
        """Into the ring, the kernel's bell rung once per loop turn for every task's records;
        too large or no room: a FRAMED record and the frame. With the ring too full even for
        that (a batch larger than the ring), held, in order, until the kernel has taken
        records (it takes them as soon as it is rung)."""
        if self._held or not self._put(kind, call, payload):
            self._held.append((kind, call, payload))
            if len(self._held) == 1:
                asyncio.get_running_loop().call_later(RING_FULL_PAUSE, self._write_held)

    def _put(self, kind: int, call: int, payload: bytes) -> bool:
        """Whether the record went (or its FRAMED record and frame)."""
        if len(payload) <= ring.MAX_RECORD and self.rings.room(len(payload)):
            self.rings.submit(kind, call, payload, bell=False)
            if not self._bell_due:
                self._bell_due = True
                self._loop.call_soon(self._ring_kernel)
            return True
        # A CANCEL is never FRAMED: the kernel takes only a PRED frame in a record's place.
        if kind == wire.CANCEL or not self.rings.room_to_frame():
            return False
        self.rings.submit(ring.FRAMED, call)
        self._transport.write(wire.frame(kind, call, payload))
        return True

    def _write_held(self) -> None:
        while self._held and not self._closed and self._put(*self._held[0]):
            self._held.popleft()
        if self._closed:
            self._held.clear()  # their callers have the session's end
        elif self._held:
            asyncio.get_running_loop().call_later(RING_FULL_PAUSE, self._write_held)

    def _ring_kernel(self) -> None:
        self._bell_due = False
        if not self._closed:
            self.rings.ring_kernel()

    def _rung(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.rings.process_bell)
        try:
            done = self.rings.completions()
        except ring.RingError as e:
            self._fail((errno.EPROTO, f"{self.where}: the ring is broken: {e}"))
            self._transport.close()
            return
        for kind, call, payload in done:
            reply = self._waiting.get(call) if kind == wire.REPLY else None
            if reply is not None and not reply.done():
                reply.set_result(payload)

    def _fail(self, why: tuple[int, str]) -> None:
        super()._fail(why)
        if self._bell_loop is not None:
            self._bell_loop.remove_reader(self.rings.process_bell)
            self._bell_loop = None
