"""The engine process: the forward passes run in a process of their own, beside the kernel.

Why not a thread of the kernel: the GIL. torch releases it for every op, so while a step
runs, the event loop's thread takes it whenever a pred, a reply or any syscall wants Python,
and the forward pass then waits for the loop's work to finish before its next op. With 32
LIPs the loop runs Python for about 3 ms of a 10 ms decode step, and a step on a thread took
40% more CPU and wall time than the same step alone (docs/architecture.md, "The GIL"). In a
process of its own the engine has a GIL to itself: the loop's work runs beside the forward
pass instead of inside it, as vLLM v1's engine core runs apart from its API server.

What the two share is the KV pool's device tier: on the CPU an anonymous shared file
(memfd) that both map, on a GPU device memory shared by CUDA IPC. The kernel allocates,
copies, moves and rotates pages there (kvfs), and the engine writes the running step's K/V
rows there. Nothing else is shared. A step goes over a socket pair as its StepWork, and
its StepResult comes back the same way (step_wire.py: fixed-layout bytes, or a pickle).
The kernel never touches the rows of the running step, as before (scheduler.py: quiesce
and settle wait for the step).

The engine process is the kernel's child (`python -m symphony.engine_process`): it exits
when its socket closes (the kernel's close()) or, killed or crashed, when the kernel dies
(PR_SET_PDEATHSIG); it ignores SIGINT and SIGTERM. If it dies first, the step it ran fails
with EIO and the kernel stops (daemon.py), as a kernel whose accelerator is gone must.

With `--engine sleep:MS` the engine process is a simulated accelerator (SleepEngine): it
loads no weights, and each step sleeps MS and answers tokens from a rule, so that the
kernel's own path can be measured at a fast accelerator's step time on a machine whose CPU
would otherwise spend itself on forward passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import math
import os
import pickle
import select
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing  # noqa: F401  (CUDA tensors pickle as IPC handles)

from kvfs.errors import FSError
from kvfs.pool import KVPool, PageShape, pool_shard_shape
from symphony import step_wire
from symphony.engine.config import ModelConfig
from symphony.engine.engine import Engine
from symphony.engine.fingerprint import fingerprint
from symphony.engine.rope import Rotary, rotate_keys
from symphony.engine.sampler import mask_words
from symphony.engine.settings import PAGE_SIZE, EngineSettings, HasSettings
from symphony.engine.tensor_parallel import Group, shard_of
from symphony.engine.tokenizer import Tokenizer
from symphony.ranks import (
    FollowerLaunch,
    Leader,
    Mirror,
    MirroredPool,
    RankInfo,
    RankSetup,
    Rendezvous,
    claim,
    die_with_parent,
    gather_infos,
    info,
    join,
    rank_device,
)
from symphony.step import StepResult, StepWork, fill_placeholders, forward

LENGTH = struct.Struct("<Q")  # each message: its length, then it (step_wire.py)


class EngineDied(FSError):
    """The engine process exited: no step can run any more."""


LN2 = math.log(2.0)


@dataclass(frozen=True)
class SleepEngine:
    """A simulated accelerator (--engine sleep:MS): a step sleeps `seconds` and answers
    each logit row with a token from a rule, doing no math, and writes no K/V.

    The token of a row whose input is token x at position p is (31 x + p + 1) mod `tokens`,
    moved up past the special ids (EOS among them), so that a decode loop runs to its length;
    with a mask, the first allowed id from there on (wrapping round). Its "distribution" is
    log p(id) = -(1 + (id - token) mod vocab) ln 2: what top-n, scores and a kept row show.
    The sampler's temperature, seed and cut-offs and the controls' biases change nothing."""

    seconds: float
    vocab: int  # the logit rows' width: the model's vocab_size
    tokens: int  # the rule's tokens are below this: ids the tokenizer knows
    special: frozenset[int]  # ids the rule skips

    def token(self, last: int, position: int) -> int:
        t = (31 * last + position + 1) % self.tokens
        while t in self.special:
            t = (t + 1) % self.tokens
        return t

    def logprob(self, token: int, other: int) -> float:
        return -(1 + (other - token) % self.vocab) * LN2

    def logits(self, token: int) -> torch.Tensor:
        """A kept row: sampled again with a mask, greedily, it gives what the rule does."""
        return (-(1 + (torch.arange(self.vocab) - token) % self.vocab) * LN2).float()

    def allowed(self, mask: torch.Tensor, token: int) -> int:
        """The first id at or after `token`, wrapping round, that `mask` allows."""
        words = mask[:mask_words(self.vocab)].cpu().numpy().view(np.uint8)
        ids = np.flatnonzero(np.unpackbits(words, bitorder="little")[:self.vocab])
        i = int(np.searchsorted(ids, token))
        return int(ids[i] if i < len(ids) else ids[0])

    def forward(self, work: StepWork) -> StepResult:
        """A step's result, returned `seconds` after the step began (or when it is ready)."""
        done_at = time.monotonic() + self.seconds
        b = work.batch
        controls = work.controls or [None] * len(work.params)
        tokens = []
        for r, c in zip(b.logit_rows, controls, strict=True):
            t = self.token(b.token_ids[r], b.positions[r])
            tokens.append(t if c is None or c.allowed is None else self.allowed(c.allowed, t))
        n_top = max((p.top_logprobs for p in work.params), default=0)
        top = [-(j + 1) * LN2 for j in range(n_top)]
        result = StepResult(tokens, [-LN2] * len(tokens),
                            [[(t + j) % self.vocab for j in range(n_top)] for t in tokens],
                            [list(top) for _ in tokens], generators=work.generators)
        if any(c is not None and (c.allowed is not None or c.bias_ids) for c in controls):
            result.model_logprobs = list(result.logprobs)  # no mask or bias changes them
        width = max((len(c.score_ids) for c in controls if c is not None), default=0)
        if width:
            result.scores = [
                [self.logprob(t, s) for s in c.score_ids] + [math.nan] * (width - len(c.score_ids))
                if c is not None else [math.nan] * width
                for t, c in zip(tokens, controls, strict=True)]
        result.kept = {i: self.logits(tokens[i]) for i in work.kept}
        time.sleep(max(0.0, done_at - time.monotonic()))
        return result


def sleep_engine(config: ModelConfig, tokenizer: Tokenizer | None, seconds: float
                 ) -> SleepEngine:
    """The simulated accelerator of a model: its rule's tokens are the tokenizer's ids but
    for the special ones and EOS."""
    tokens = min(config.vocab_size, tokenizer.vocab_size) if tokenizer else config.vocab_size
    special = set(tokenizer.eos_ids) | set(tokenizer.special_ids()) if tokenizer else set()
    special |= set(config.eos_token_ids)
    if not set(range(tokens)) - special:
        raise ValueError(f"--engine sleep: every token of {tokens} is special")
    return SleepEngine(seconds, config.vocab_size, tokens, frozenset(special))


class EngineProcess(HasSettings):
    """The kernel's view of its engine: what the model is (config, tokenizer, device, dtype),
    the KV pool, and step() to run a StepWork in the engine process. Built before the event
    loop starts; it raises what building the Engine raised there (ModelError, ...).
    `sleep_ms`: a simulated accelerator (SleepEngine) whose steps take that long; `weights`:
    as the Engine's. `rendezvous`: the ranks of a tensor-parallel engine (symphony.ranks),
    of which this node's are started here."""

    def __init__(self, model_dir: str | Path | None = None, *, device: str | None = None,
                 dtype: torch.dtype | None = None, kv_pages: int | None = None,
                 host_pages: int = 0, page_size: int = PAGE_SIZE, sleep_ms: float | None = None,
                 weights: str = "quantized", rendezvous: Rendezvous | None = None):
        self.settings = EngineSettings.resolve(model_dir, device=device, dtype=dtype,
                                               page_size=page_size)
        self.fingerprint = fingerprint(self.model_dir)  # the kernel's, and each node's to match
        self.mode = "model" if sleep_ms is None else f"sleep:{sleep_ms:g}"  # as --engine
        simulated = None if sleep_ms is None else sleep_engine(self.config, self.tokenizer,
                                                                sleep_ms / 1e3)
        rdv = rendezvous or Rendezvous()
        if rdv.world > 1:
            if simulated is not None:
                raise ValueError("--engine sleep:MS loads no model to split over ranks: "
                                 "it takes no --tensor-parallel")
            shard_of(self.config, 0, rdv.world)  # a model N does not divide: refused now
            rdv = rdv.with_port()
        self.rendezvous, world = rdv, rdv.world
        if kv_pages is None:
            kv_pages = self.settings.kv_pages()
        # Each shard in memory the rank that computes in it maps: its own device's on node 0;
        # the kernel's for a rank elsewhere (a mirror, kept equal: symphony.ranks).
        remote = tuple(r for r in range(world) if rdv.node_of(r) != 0)
        shapes = [pool_shard_shape(self.settings.page_shape, kv_pages, world, r)
                  for r in range(world)]
        tiers = [_device_tier(shapes[r], self.dtype,
                              torch.device("cpu") if r in remote else
                              self.device if world == 1 else
                              rank_device(self.device.type, rdv, r))
                 for r in range(world)]
        self._memfds = [fd for fd, _ in tiers if fd is not None]
        self._gpus = sorted({k.device for _, (k, _) in tiers if k.device.type == "cuda"},
                            key=str)
        self.pool = (MirroredPool if remote else KVPool)(
            self.settings.page_shape, kv_pages, host_pages, self.device, world,
            arrays=[arrays for _, arrays in tiers])
        self._rotary = Rotary(self.config.head_dim, self.config.rope_theta,
                              self.config.rope_scaling)
        # The loop's own torch work (page copies, sampling a kept row) is small: one thread,
        # so that it never forms an OpenMP team that competes with the engine's.
        torch.set_num_threads(1)
        # Each shard's device tier as its rank takes it: on the CPU the memfd's number
        # there (the same), on a GPU the tensors, which pickle as CUDA IPC handles. A
        # simulated accelerator writes no K/V: it gets none (nor sets up CUDA for them).
        shipped = [fd if fd is not None else arrays for fd, arrays in tiers]
        self._buf, self._procs, self._followers = bytearray(), {}, []
        # Steps sent (or held), oldest first, with their answers; steps held back.
        self._steps: list[tuple[asyncio.Future, StepWork]] = []
        self._held: list[bytes] = []
        self._out = bytearray()  # bytes written that the socket has not taken yet
        self._writing = False  # the loop calls _flush when the socket can take more
        self._loop: asyncio.AbstractEventLoop | None = None  # the one reading the answers
        try:
            # Node 0's ranks: rank 0 here, the others in symphony.ranks; each with its socket.
            for r in rdv.local_ranks():
                ours, theirs = socket.socketpair()
                fds = [theirs.fileno()] + [fd for fd in (tiers[r][0],) if fd is not None]
                if r == 0:
                    fds += [tiers[m][0] for m in remote]
                    command = ["symphony.engine_process", str(theirs.fileno())]
                else:
                    command = ["symphony.ranks", "--socket", str(theirs.fileno())]
                self._procs[r] = subprocess.Popen([sys.executable, "-m", *command],
                                                  pass_fds=fds, stdin=subprocess.DEVNULL)
                theirs.close()
                if r == 0:
                    self._sock = ours
                    self._sndbuf = ours.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
                    # Off node 0 a rank reads a checkpoint of its own: rank 0 compares
                    # theirs with this one's at the rendezvous (ranks.meet).
                    ranks = None if world == 1 else (
                        rdv, {m: shipped[m] for m in remote}, shapes,
                        self.fingerprint if remote else None)
                    message = (os.getpid(), self.model_dir, self.device, self.dtype,
                               shapes[0], None if simulated else shipped[0], simulated,
                               weights, ranks)
                else:
                    self._followers.append(ours)
                    message = FollowerLaunch(os.getpid(), r, rdv, self.device.type,
                                             self.model_dir, shipped[r], shapes[r], self.dtype)
                ours.sendall(_message(ForkingPickler.dumps(message)))
            # The attention kernels' name, and what each rank is.
            self.attention, self.ranks = self._reply(self._ready())
        except BaseException:
            self.close()
            raise

    def nice(self) -> int | None:
        """The engine process's nice value (its main thread's: Linux's is per thread); None
        once it has exited."""
        try:
            return os.getpriority(os.PRIO_PROCESS, self.pid)
        except ProcessLookupError:
            return None

    @property
    def pid(self) -> int:
        """Rank 0's: the process the kernel talks to."""
        return self._procs[0].pid

    def _ready(self) -> object:
        """Rank 0's first answer; EngineDied if a rank of this node exits first (a rank that
        never joins would leave rank 0 waiting for it)."""
        pidfds = {os.pidfd_open(p.pid): r for r, p in self._procs.items()}
        try:
            while True:
                ready, _, _ = select.select([self._sock, *pidfds], [], [])
                # A rank that failed to build told rank 0 why before it exited: its answer
                # names the error, where there is one.
                if self._sock in ready or select.select([self._sock], [], [], 5.0)[0]:
                    return receive(self._sock)
                self._procs[pidfds[ready[0]]].wait()
                raise self._died()
        finally:
            for fd in pidfds:
                os.close(fd)

    @torch.inference_mode()
    def rotate_keys(self, rows: torch.Tensor, delta: int) -> None:
        """Move the keys at device pool rows `rows` (page * page_size + offset) by `delta`
        positions, in every layer of every shard (kvfs's shift; docs/syscalls.md)."""
        for k_cache in self.pool.key_layers():
            rotate_keys(k_cache, rows, delta, self._rotary)
        if isinstance(self.pool, MirroredPool):
            self.pool.rows_changed(rows)

    async def step(self, work: StepWork) -> StepResult:
        """Run one step in the engine process; the event loop goes on meanwhile. The work's
        seeded generators come back advanced, as if sampled here."""
        return await self.send(work)

    def send(self, work: StepWork) -> asyncio.Future:
        """Send a step, behind those in flight (the engine process runs them in order); the
        future gets its StepResult. A step sent while another runs waits in the socket, or,
        too large to be sure it fits there, here until the answer before it is read: the
        loop never blocks on a socket the engine process is not reading."""
        if self.device.type == "cuda":  # the kernel's page copies done before the step reads
            for device in self._gpus:  # every rank's
                torch.cuda.synchronize(device)
        dirty = self.pool.take_dirty() if isinstance(self.pool, MirroredPool) else []
        data = _message(step_wire.dumps((work, dirty)))
        answer = self._reading_loop().create_future()
        first = not self._steps
        self._steps.append((answer, work))
        if first:
            self._write(data)
        elif len(data) <= self._sndbuf // 2 and not self._held:
            self._write(data)
        else:
            self._held.append(data)
        return answer

    def _write(self, data: bytes) -> None:
        """Send data behind what the socket has not taken yet. A step larger than the
        socket's buffer (many seeded generators' states) goes out as the engine process
        reads it, from the loop's writer callback: the loop never waits for it, and the
        stream stays whole."""
        self._out += data
        if len(self._out) == len(data):  # nothing was waiting to go: try now
            self._flush()

    def _flush(self) -> None:
        try:
            while self._out:
                del self._out[:self._sock.send(self._out, socket.MSG_DONTWAIT)]
        except BlockingIOError:
            pass
        except OSError:
            self._fail_all(self._died())
            return
        if bool(self._out) != self._writing:  # the writer callback wanted, or no longer
            self._writing = bool(self._out)
            loop = self._loop
            if self._writing:
                loop.add_writer(self._sock, self._flush)
            else:
                loop.remove_writer(self._sock)

    def _reading_loop(self) -> asyncio.AbstractEventLoop:
        """The loop that reads the engine's answers, the socket its reader from the first
        step on: adding the reader at each step sent with none in flight and removing it
        after took two epoll_ctl and two getpid system calls a step at batch 1."""
        loop = self._loop
        if loop is None or loop.is_closed():  # a test's engine may serve several loops
            loop = self._loop = asyncio.get_running_loop()
            loop.add_reader(self._sock, self._readable)
        return loop

    def _fail_all(self, e: Exception) -> None:
        steps, self._steps, self._held = self._steps, [], []
        self._out.clear()
        loop, self._loop = self._loop, None  # the next step sent adds the reader again
        if loop is not None:
            with contextlib.suppress(Exception):
                loop.remove_reader(self._sock)
            if self._writing:
                with contextlib.suppress(Exception):
                    loop.remove_writer(self._sock)
        self._writing = False
        for answer, _ in steps:
            if not answer.done():
                answer.set_exception(e)

    async def exited(self) -> None:
        """Wait until the engine process, or any rank of this node's, exits."""
        loop = asyncio.get_running_loop()
        gone = loop.create_future()
        pidfds = [os.pidfd_open(p.pid) for p in self._procs.values()]  # readable at exit
        for fd in pidfds:
            loop.add_reader(fd, lambda: gone.done() or gone.set_result(None))
        try:
            await gone
        finally:
            for fd in pidfds:
                loop.remove_reader(fd)
                os.close(fd)

    def deaths(self) -> str:
        """Which of the engine's processes exited, and how: for the log and EIO's message."""
        if len(self._procs) == 1 and self.rendezvous.world == 1:
            return (f"the engine process (pid {self.pid}) exited with status "
                    f"{self._procs[0].poll()}")
        gone = [f"rank {r} (pid {p.pid}) exited with status {p.poll()}"
                for r, p in self._procs.items() if p.poll() is not None]
        return "the engine's " + ("; ".join(gone) if gone else "rank 0 lost its group")

    def _readable(self) -> None:
        """The engine process answered: each whole answer goes to its step, in order (the
        generators of its work advanced as the engine's were), and a held step goes out."""
        try:
            data = self._sock.recv(1 << 20, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._fail_all(self._died())
            return
        self._buf += data
        while self._steps and len(self._buf) >= LENGTH.size:
            (size,) = LENGTH.unpack_from(self._buf)
            if len(self._buf) < LENGTH.size + size:
                return
            message = step_wire.loads(self._buf[LENGTH.size:LENGTH.size + size])
            del self._buf[:LENGTH.size + size]
            answer, work = self._steps.pop(0)
            if self._held:
                self._write(self._held.pop(0))
            if answer.done():  # the step's waiter was cancelled: the kernel is stopping
                continue
            try:
                result = self._reply(message)
            except Exception as e:
                answer.set_exception(e)
                continue
            for mine, theirs in zip(work.generators, result.generators, strict=True):
                if mine is not None:
                    mine.set_state(theirs.get_state())
            answer.set_result(result)

    @staticmethod
    def _reply(message: tuple[str, object]) -> object:
        kind, value = message
        if kind == "error":
            raise value
        return value

    def fail_steps(self) -> None:
        """A rank died while rank 0 may still wait in a collective: the steps in flight
        fail now, with EIO naming the ranks gone (EngineDied)."""
        self._fail_all(self._died())

    def _died(self) -> EngineDied:
        try:
            self._procs[0].wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        return EngineDied(errno.EIO, self.deaths())

    def close(self) -> None:
        """Stop the engine process: it exits when its socket closes, and ends the other
        ranks (which die with the kernel in any case)."""
        for sock in (getattr(self, "_sock", None), *self._followers):
            if sock is not None:
                sock.close()
        for proc in self._procs.values():
            try:
                proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for fd in self._memfds:
            os.close(fd)
        self._memfds = []


def _device_tier(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
                 ) -> tuple[int | None, tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed K and V of `shape` that the engine process can map: on the CPU in a memfd
    (returned, to pass on), on a GPU in device memory (CUDA IPC shares it)."""
    if device.type == "cuda":
        return None, (torch.zeros(shape, dtype=dtype, device=device),
                      torch.zeros(shape, dtype=dtype, device=device))
    fd = os.memfd_create("symphony-kv-pool")
    os.ftruncate(fd, 2 * math.prod(shape) * dtype.itemsize)
    return fd, mapped(fd, shape, dtype)


def mapped(fd: int, shape: tuple[int, ...], dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
    numel = math.prod(shape)
    both = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=2 * numel, dtype=dtype)
    return both[:numel].view(shape), both[numel:].view(shape)


def _message(data: bytes) -> bytes:
    return LENGTH.pack(len(data)) + data


def _send(sock: socket.socket, message: object) -> None:
    sock.sendall(_message(step_wire.dumps(message)))


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def receive(sock: socket.socket) -> object:
    """The next message; EOFError when the other end has closed."""
    head = _recv_exactly(sock, LENGTH.size)
    body = None if head is None else _recv_exactly(sock, LENGTH.unpack(head)[0])
    if body is None:
        raise EOFError("the other end of the engine's socket closed")
    return step_wire.loads(body)


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


# The nice value of a process that drives an accelerator (a GPU, or the simulated one).
DRIVER_NICE = -10


def drives_accelerator() -> None:
    """Run at DRIVER_NICE, where the OS allows it (root or CAP_SYS_NICE), every thread made
    from here on with it. Such a process spends a step waiting for its device and must run
    the moment the step ends, or the device idles: at nice 0 it waited behind the slices of
    the LIPs its last answers had woken (bench/RESULTS.md, issue 27, session 13). A CPU
    engine, whose steps are the CPU's own work, keeps the kernel's nice: above the LIPs it
    would starve them of the CPU they decode on."""
    with contextlib.suppress(PermissionError):
        os.setpriority(os.PRIO_PROCESS, 0, DRIVER_NICE)


def main(sock: socket.socket) -> None:
    """The engine process (rank 0): build the Engine over the kernel's pool (or take the
    simulated accelerator the kernel sent), with the other ranks where there are, then run
    steps until the kernel closes the socket."""
    try:
        setup = receive(sock)
    except EOFError:  # the kernel went away first (a Ctrl-C while it started): nothing to do
        return
    kernel, model_dir, device, dtype, shape, tier, simulated, weights, ranks = setup
    if not die_with_parent(kernel):  # the kernel died before prctl: nobody would stop us
        return
    if simulated is not None or device.type != "cpu":
        drives_accelerator()
    leader = None
    if simulated is not None:  # no weights to load
        step, attention = simulated.forward, "none"
        infos = [RankInfo(0, os.getpid(), socket.gethostname(), 0, "none")]
    else:
        try:
            engine, leader, infos = _build(model_dir, device, dtype, shape, tier, weights, ranks)
        except BaseException as e:  # handed to the kernel, which reports it
            with contextlib.suppress(OSError):  # unless it is gone (stopped while we built)
                _send(sock, ("error", _picklable(e)))
            return
        step, attention = (lambda work: forward(leader or engine, work)), engine.kernels.name
    # What is built by now lives as long as the process: out of the collector's sight, so
    # that the collections the steps' garbage sets off do not walk torch's and the model's
    # objects each time (in the kernel, collecting was 19% of the loop thread's CPU).
    gc.freeze()
    sampled: list[int] | None = None  # the last step's tokens, for the next one's placeholders
    try:
        try:
            _send(sock, ("ready", (attention, infos)))
        except OSError:  # the kernel closed its end while we started: it is stopping
            _stop_ranks(leader)
            return
        while True:
            try:
                work, dirty = receive(sock)
            except (EOFError, OSError):
                _stop_ranks(leader)
                return
            if leader is not None:
                leader.dirty = dirty
            try:
                fill_placeholders(work, sampled)
                sampled = None
                result = step(work)
                sampled = result.tokens
                answer = ("done", result)
                if device.type == "cuda" and simulated is None:
                    torch.cuda.synchronize()  # the step's K/V written before the kernel reads
            except ValueError as e:  # this step's batch, refused on every rank alike
                answer = ("error", _picklable(e))
            except Exception as e:
                if leader is not None and leader.broken:
                    raise  # the ranks are out of step, for good: this one ends (so the kernel)
                answer = ("error", _picklable(e))  # this step failed, as a whole; the next
            try:  # may not
                _send(sock, answer)
            except OSError:  # the kernel closed its end while the step ran: it is stopping
                return
    finally:
        gc.unfreeze()  # collected at exit as usual (else triton's bindings report leaks)


def _stop_ranks(leader: Leader | None) -> None:
    """The kernel is gone: the other ranks are told to end."""
    if leader is not None:
        with contextlib.suppress(Exception):  # a group a rank left has no one to tell:
            leader.stop()  # the others are ending, or gone


def _build(model_dir: Path, device: torch.device, dtype: torch.dtype, shape: tuple[int, ...],
           tier: object, weights: str, ranks: tuple | None
           ) -> tuple[Engine, Leader | None, list[RankInfo]]:
    """Rank 0's engine; with other ranks, joined to them, and what each of them is."""
    arrays = mapped(tier, shape, dtype) if isinstance(tier, int) else tier
    layers, pages, page_size, heads, head_dim = shape
    pool = KVPool(PageShape(layers, heads, head_dim, page_size, dtype), pages, device=device,
                  arrays=[arrays])
    if ranks is None:
        engine = Engine(model_dir, device=str(device), dtype=dtype, pool=pool, weights=weights)
        return engine, None, [RankInfo(0, os.getpid(), socket.gethostname(), 0, str(device))]
    rdv, mirror_tiers, shapes, model_print = ranks
    dev = rank_device(device.type, rdv, 0)
    cpu_group = join(rdv, claim(0, rdv, dev, model_dir, model_print), dev)
    group = Group(shard_of(ModelConfig.from_file(Path(model_dir) / "config.json"), 0, rdv.world),
                  cpu_group)
    remote = tuple(sorted(mirror_tiers))
    group.broadcast(RankSetup(dtype, pages, page_size, weights, remote))
    engine = Engine(model_dir, device=str(dev), dtype=dtype, pool=pool, weights=weights,
                    group=group)
    infos = gather_infos(cpu_group, info(0, rdv, dev))  # ModelError: a rank did not start
    mirrors = {r: mapped(t, shapes[r], dtype) for r, t in mirror_tiers.items()}
    return engine, Leader(engine, group, Mirror(group, remote, mirrors) if remote else None), \
        infos


if __name__ == "__main__":
    main(socket.socket(fileno=int(sys.argv[1])))
