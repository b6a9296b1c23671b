"""Syscall rings: pred's path through memory the process shares with the kernel.

As io_uring does for Linux I/O, a process that asks at hello (a RING_SETUP frame on its
lifeline, syscalls/wire.py) gets a memfd holding two rings and two eventfds, passed with
SCM_RIGHTS in the kernel's RING frame (the kernel bell, the one the process rings, is the
same eventfd for every ring of one process):

    offset 0      header: one 64-byte line per counter (little-endian u64)
                    0 magic    1 sq_head (kernel)   2 sq_tail (process)
                    3 cq_head (process)   4 cq_tail (kernel)
                    5 kernel_wake (kernel)   6 process_wake (process)
    offset 4096   submission ring, SQ_BYTES: records the process writes
    then          completion ring, CQ_BYTES: records the kernel writes

A record is a 16-byte header (payload bytes, call id, kind, 0) and its payload, padded to
a multiple of 16 bytes; a record may wrap around the ring's end. Kinds and payloads are the
lifeline's (PRED: a serialized PredRequest, CANCEL: none, REPLY: a serialized PredReply),
plus FRAMED: the pred of that call id went on the lifeline as a frame (too large for the
ring, or the ring full), and the kernel takes it in its place, so a file's preds arrive in
the order they were made whichever way each travelled. Heads and tails count bytes
forever (they are never wrapped); a ring holds `tail - head` bytes.

Doorbells: each side writes its tail, then reads the other side's wake flag, and writes
the other side's eventfd only when the flag is 1 (the kernel bell: the kernel is not
draining this ring; the process bell: the process sleeps on its completions). A side that
goes to sleep sets its flag, then looks at the ring once more. So one bell wakes a process
for every completion a step made. This kernel keeps its own flag at 1, and is rung for
every submission (docs/syscalls.md, "When the kernel looks", says why).

Memory the process can write is untrusted: the kernel copies what lies between sq_head and
sq_tail out once, then checks the copy; a tail or head that is not possible, or records
that do not parse, break the ring, and the kernel drops the process as it does a lifeline
that is not frames.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import threading

MAGIC = 0x53594D52494E4731  # "SYMRING1"
HEADER_BYTES = 4096
LINE = 64  # each counter on a cache line of its own
WORDS = LINE // 8  # a counter's index among the header's u64s: counter * WORDS
MAGIC_AT, SQ_HEAD, SQ_TAIL, CQ_HEAD, CQ_TAIL, KERNEL_WAKE, PROCESS_WAKE = range(7)
SQ_BYTES = 256 << 10
CQ_BYTES = 256 << 10
RECORD = struct.Struct("<IIII")  # payload bytes, call id, kind, 0
ALIGN = 16
# Kinds of the lifeline's frames (wire.py), and FRAMED.
PRED, REPLY, CANCEL, FRAMED = 1, 2, 4, 7
# The largest payload a ring takes: more goes as a frame on the lifeline.
MAX_RECORD = SQ_BYTES // 4
GEOMETRY = struct.Struct("<QQ")  # the RING frame's payload: SQ_BYTES, CQ_BYTES


class RingError(ValueError):
    """The shared memory is not a ring any more; nothing in it can be trusted."""


def padded(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def record_bytes(payload: int) -> int:
    return RECORD.size + padded(payload)


def fence() -> None:
    """A full memory barrier between a store to the ring and a load of the other side's
    flag: taking an uncontended lock is a locked compare-and-swap (a full barrier on x86).
    Both sides also sleep with a timeout and look again, so a reordering elsewhere can
    delay a wake-up, never lose it. The lock is a new one each time, never released: a
    signal handler that raises between a shared lock's acquire and release would leave it
    held, and the next fence would wait forever."""
    threading.Lock().acquire()


class RingMemory:
    """The mapped memfd: counters, and copying bytes in and out of either ring."""

    def __init__(self, fd: int, sq_bytes: int = SQ_BYTES, cq_bytes: int = CQ_BYTES):
        self.sq_bytes, self.cq_bytes = sq_bytes, cq_bytes
        self.map = mmap.mmap(fd, HEADER_BYTES + sq_bytes + cq_bytes)
        self.buf = memoryview(self.map)
        self.counters = self.buf[:HEADER_BYTES].cast("Q")
        self.sq = self.buf[HEADER_BYTES:HEADER_BYTES + sq_bytes]
        self.cq = self.buf[HEADER_BYTES + sq_bytes:]

    @classmethod
    def create(cls, sq_bytes: int = SQ_BYTES, cq_bytes: int = CQ_BYTES
               ) -> tuple[RingMemory, int]:
        """A new ring in a new memfd; returns it and the memfd (the caller closes it)."""
        fd = os.memfd_create("symphony-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, HEADER_BYTES + sq_bytes + cq_bytes)
            # Sealed at its size: a process that shrank it would fault the kernel's loads.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            ring = cls(fd, sq_bytes, cq_bytes)
        except BaseException:
            os.close(fd)
            raise
        ring.set(MAGIC_AT, MAGIC)
        return ring, fd

    def get(self, counter: int) -> int:
        return self.counters[counter * WORDS]

    def set(self, counter: int, value: int) -> None:
        self.counters[counter * WORDS] = value

    def close(self) -> None:
        self.counters.release()
        self.sq.release()
        self.cq.release()
        self.buf.release()
        self.map.close()


def _put(ring: memoryview, at: int, data: bytes) -> None:
    """Copy data into a ring at byte count `at`, wrapping at its end."""
    size = len(ring)
    start = at % size
    first = min(len(data), size - start)
    ring[start:start + first] = data[:first]
    if first < len(data):
        ring[:len(data) - first] = data[first:]


def _copy_out(ring: memoryview, head: int, tail: int) -> bytes:
    """The bytes [head, tail) of a ring, copied."""
    size = len(ring)
    start, n = head % size, tail - head
    if start + n <= size:
        return bytes(ring[start:start + n])
    return bytes(ring[start:]) + bytes(ring[:n - (size - start)])


def _records(data: bytes) -> list[tuple[int, int, bytes]]:
    """Cut copied ring bytes into (kind, call, payload); RingError if they do not parse."""
    out, at, n, header = [], 0, len(data), RECORD.size  # once a pred: names kept local
    while at < n:
        if n - at < header:
            raise RingError(f"a record header cut short at byte {at}")
        size, call, kind, zero = RECORD.unpack_from(data, at)
        start = at + header
        end = start + ((size + ALIGN - 1) & ~(ALIGN - 1))  # padded()
        if zero:
            raise RingError(f"record at byte {at}: its fourth field is {zero}, not 0")
        if end > n:
            raise RingError(f"record at byte {at}: {size} payload bytes, {n - start} left")
        out.append((kind, call, data[start:start + size]))
        at = end
    return out


def _write(ring: memoryview, tail: int, kind: int, call: int, payload: bytes) -> int:
    """Write one record at tail; the new tail."""
    _put(ring, tail, RECORD.pack(len(payload), call, kind, 0) + payload)
    return tail + record_bytes(len(payload))


class ProcessRing:
    """The process's side: it produces submissions and consumes completions. Not
    thread-safe: the clients hold their own locks around it."""

    def __init__(self, mem: RingMemory, kernel_bell: int, process_bell: int):
        self.mem, self.kernel_bell, self.process_bell = mem, kernel_bell, process_bell
        self.sq_tail = mem.get(SQ_TAIL)
        self.cq_head = mem.get(CQ_HEAD)

    def room(self, payload: int, before: int = 0) -> bool:
        """Whether a record of `payload` bytes fits now after `before` bytes of records not
        published yet, leaving room for a FRAMED one."""
        used = self.sq_tail + before - self.mem.get(SQ_HEAD)
        return used + record_bytes(payload) + RECORD.size <= self.mem.sq_bytes

    def room_to_frame(self) -> bool:
        """Whether a FRAMED record fits now: room() keeps room for one, not for one per pred
        that found no room (a batch larger than the ring)."""
        return self.sq_tail - self.mem.get(SQ_HEAD) + RECORD.size <= self.mem.sq_bytes

    def submit(self, kind: int, call: int, payload: bytes = b"", bell: bool = True) -> None:
        """Write a record (room() said it fits, or it is FRAMED), publish it, and ring the
        kernel if it asked to be rung (bell=False: the caller calls ring_kernel later, once
        for many)."""
        self.publish(_write(self.mem.sq, self.sq_tail, kind, call, payload))
        if bell:
            self.ring_kernel()

    def submit_many(self, records: list[tuple[int, int, bytes]]) -> None:
        """Write records that room() said fit together, publish them at once, and ring the
        kernel once. Interrupted before they are published, none was submitted."""
        tail = self.sq_tail
        for kind, call, payload in records:
            tail = _write(self.mem.sq, tail, kind, call, payload)
        self.publish(tail)
        self.ring_kernel()

    def publish(self, tail: int) -> None:
        """The kernel may take the records written up to `tail`."""
        self.sq_tail = tail
        self.mem.set(SQ_TAIL, tail)

    def resync(self) -> int:
        """After submit was interrupted (a signal handler raising: it may land between any
        two of its calls): the tail the kernel sees, which the next record follows, so a
        record written but not published is dropped. The process is the tail's only
        writer, so it went if and only if this tail is past it."""
        self.sq_tail = self.mem.get(SQ_TAIL)
        return self.sq_tail

    def ring_kernel(self) -> None:
        """Ring the kernel's bell if it asked to be rung (after what was published)."""
        fence()
        if self.mem.get(KERNEL_WAKE):
            os.eventfd_write(self.kernel_bell, 1)

    def ready(self) -> bool:
        """Whether completions are waiting."""
        return self.mem.get(CQ_TAIL) != self.cq_head

    def completions(self) -> list[tuple[int, int, bytes]]:
        """The completions that have come, consumed."""
        tail = self.mem.get(CQ_TAIL)
        if tail == self.cq_head:
            return []
        records = _records(_copy_out(self.mem.cq, self.cq_head, tail))
        self.cq_head = tail
        self.mem.set(CQ_HEAD, tail)
        return records

    def take_completions(self, into: list) -> bool:
        """completions() appended to `into` before they are consumed, so that an
        interruption the moment they are taken loses none (it may leave them to be taken
        again); whether there were any."""
        tail = self.mem.get(CQ_TAIL)
        if tail == self.cq_head:
            return False
        into.extend(_records(_copy_out(self.mem.cq, self.cq_head, tail)))
        self.cq_head = tail
        self.mem.set(CQ_HEAD, tail)
        return True

    def sleeping(self, asleep: bool) -> None:
        """Say whether the kernel must ring this process's bell on a completion. A process
        that sets it only when about to sleep must fence, then look at the ring once more."""
        self.mem.set(PROCESS_WAKE, int(asleep))

    def close(self) -> None:
        self.mem.close()
        for fd in (self.kernel_bell, self.process_bell):
            os.close(fd)


class KernelRing:
    """The kernel's side: it consumes submissions (copied out, then checked) and produces
    completions. The process can write the whole memory at any time.

    `kernel_bell`: the eventfd the process rings, its caller's (the kernel gives all the
    rings of one process one bell, symphony/kernel_bell.py), or, None, one of the ring's
    own, closed with it."""

    def __init__(self, kernel_bell: int | None = None) -> None:
        self.mem, fd = RingMemory.create()
        made = []
        try:
            for _ in range(1 + (kernel_bell is None)):
                made.append(os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC))
        except OSError:
            for bell in [fd, *made]:
                os.close(bell)
            self.mem.close()
            raise
        self.process_bell = made[0]
        self.own_bell = kernel_bell is None
        self.kernel_bell = made[1] if self.own_bell else kernel_bell
        self.memfd = fd
        self.sq_head = 0
        self.cq_tail = 0
        self.mem.set(KERNEL_WAKE, 1)

    def fds(self) -> list[int]:
        """What the process is sent: the memfd and both bells."""
        return [self.memfd, self.kernel_bell, self.process_bell]

    def sent(self) -> None:
        """The process has its copies: the kernel needs the memfd no more."""
        os.close(self.memfd)
        self.memfd = -1

    def take(self) -> list[tuple[int, int, bytes]]:
        """Every record submitted since the last take, copied and checked; RingError when
        the ring is broken. (Its counters read and written in place: once a pred.)"""
        mem = self.mem
        tail = mem.counters[SQ_TAIL * WORDS]
        if tail == self.sq_head:
            return []
        if not 0 < tail - self.sq_head <= mem.sq_bytes:
            raise RingError(f"sq_tail {tail} with sq_head {self.sq_head} and a ring of "
                            f"{mem.sq_bytes} bytes")
        data = _copy_out(mem.sq, self.sq_head, tail)
        self.sq_head = mem.counters[SQ_HEAD * WORDS] = tail
        return _records(data)

    def post(self, kind: int, call: int, payload: bytes) -> bool:
        """Write a completion; False when it does not fit now (the caller sends a frame).
        RingError when the process's cq_head is not possible."""
        mem, tail = self.mem, self.cq_tail  # one call a pred: written out, not in helpers
        head = mem.counters[CQ_HEAD * WORDS]
        if not 0 <= tail - head <= mem.cq_bytes:
            raise RingError(f"cq_head {head} with cq_tail {tail} and a ring of "
                            f"{mem.cq_bytes} bytes")
        end = tail + RECORD.size + ((len(payload) + ALIGN - 1) & ~(ALIGN - 1))  # padded()
        if end - head > mem.cq_bytes:
            return False
        at = tail % mem.cq_bytes
        if at + RECORD.size + len(payload) <= mem.cq_bytes:
            RECORD.pack_into(mem.cq, at, len(payload), call, kind, 0)
            mem.cq[at + RECORD.size:at + RECORD.size + len(payload)] = payload
        else:
            _put(mem.cq, tail, RECORD.pack(len(payload), call, kind, 0) + payload)
        self.cq_tail = mem.counters[CQ_TAIL * WORDS] = end
        return True

    def ring_process(self) -> None:
        """Ring the process's bell if it sleeps on its completions."""
        fence()
        if self.mem.counters[PROCESS_WAKE * WORDS]:
            os.eventfd_write(self.process_bell, 1)

    def close(self) -> None:
        self.mem.close()
        for fd in (self.memfd, self.process_bell, self.kernel_bell if self.own_bell else -1):
            if fd >= 0:
                os.close(fd)
