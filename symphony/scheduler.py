"""Two-level scheduling of pred calls onto batched forward passes.

Level 1 (processes) decides whose work goes first and who must give up KV memory: fair
share by weighted tokens (CFS's virtual runtime with nice weights), admission when device
pages are short, and moving the pages of idle, low-priority processes to the host tier.

Level 2 (batches) packs the chosen work into one forward pass per step: decode tokens
first, then prefill chunks, up to a token budget, so a long prompt is chunked and decodes
keep flowing. A pred reserves its pages once, on admission, and commits once, when its
last chunk is done: a failed or cancelled pred leaves its file as it was.

Decoding ahead. A LIP in a decode loop sends, as its next pred, the token its last pred
sampled, at the next position, with the same sampler. So when a pred that continued its
file that way completes, the kernel reserves one entry and computes that pred at once, in
room the step has to spare, while the answer travels to the LIP and the LIP decides. If
the pred that arrives is that one, it takes the work (done, or in progress) and is
answered as soon as it is done; the round trip is hidden behind the forward pass. If it is
anything else, or any other call would change the file, the guess is rolled back first:
until a pred takes it, it is not in the file, and nobody sees it. This is the KV cache's
readahead. A seeded sampler draws from a fresh generator per pred, so the guess samples
exactly what the pred would; the process is charged for the work only when a pred uses it.

Everything here runs on the event loop's thread except the forward pass itself, which
runs on the engine thread; the loop keeps answering other syscalls meanwhile.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from kvfs.errors import FSError
from kvfs.fs import FileSystem, Handle, Reservation
from kvfs.inode import Inode
from kvfs.pages import DEVICE, DISK, HOST
from symphony.engine.engine import Batch, Engine
from symphony.engine.sampler import SamplingParams, sample
from symphony.engine_thread import EngineThread
from symphony.process import Process

log = logging.getLogger("symphony.scheduler")

STATS_WINDOW = 10.0  # seconds of steps /proc/sched summarises
HOLD_MAX, HOLD_SHARE = 0.010, 1.0  # the longest wait for just-served processes, absolute
SLEEP_GRACE = 0.1  # seconds between two preds that still count as running, not asleep
# and as a share of the last step


@dataclass
class Output:
    row: int
    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(eq=False)
class PredJob:
    proc: Process
    handle: Handle
    tokens: list[int]
    positions: list[int] | None  # None: contiguous after the file's last position
    rows: list[int]  # rows of `tokens` to sample at
    params: SamplingParams
    generator: torch.Generator | None
    future: asyncio.Future
    seq: int
    enqueued: float = field(default_factory=time.monotonic)
    res: Reservation | None = None
    done: int = 0  # tokens computed so far
    outputs: list[Output] = field(default_factory=list)
    cancelled: bool = False
    ahead: bool = False  # computed ahead of its pred (decoding ahead); no pred owns it yet
    follows: bool = False  # its tokens are the sample of its file's last pred, next in line
    seconds: float = 0.0  # accelerator time of work done ahead, charged when a pred takes it

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.done


@dataclass
class Step:
    end: float
    seconds: float
    seqs: int
    prefill: int
    decode: int


@dataclass
class SchedStats:
    steps: int = 0
    tokens: int = 0
    preemptions: int = 0  # idle processes whose pages were moved down
    pages_swapped_out: int = 0
    waits: int = 0  # admissions deferred for want of KV memory
    ahead: int = 0  # preds guessed (decoding ahead), one token each
    ahead_used: int = 0  # guesses a pred took
    max_seqs: int = 0  # the most sequences one step has packed
    recent: deque = field(default_factory=deque)  # Steps of the last STATS_WINDOW seconds
    delays: deque = field(default_factory=lambda: deque(maxlen=1024))  # queue delays, s

    def record(self, step: Step) -> None:
        self.steps += 1
        self.max_seqs = max(self.max_seqs, step.seqs)
        self.tokens += step.prefill + step.decode
        self.recent.append(step)
        while self.recent and self.recent[0].end < step.end - STATS_WINDOW:
            self.recent.popleft()


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        engine_thread: EngineThread,
        fs: FileSystem,
        procs: Callable[[], Iterable[Process]],
        token_budget: int,
        max_seqs: int,
        decode_ahead: bool,
    ):
        self.engine, self.engine_thread, self.fs, self.procs = engine, engine_thread, fs, procs
        self.token_budget, self.max_seqs = token_budget, max_seqs
        self.decode_ahead = decode_ahead
        self.context = engine.config.max_position_embeddings
        self.queue: list[PredJob] = []
        self.in_flight: list[tuple[PredJob, int]] = []
        self.min_vruntime = 0.0
        self.stats = SchedStats()
        self.next_seq = 0
        self.eos = set(engine.eos_ids())
        self.ahead: dict[Inode, PredJob] = {}  # work computed ahead, one per file at most
        # Per open file: (token, file length, sampler) of its last sampled pred.
        self.sampled: weakref.WeakKeyDictionary[Handle, tuple] = weakref.WeakKeyDictionary()
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    # -- level 1: submission, fair share, cancellation -----------------------------------

    def submit(self, proc: Process, handle: Handle, tokens: list[int],
               positions: list[int] | None, rows: list[int],
               params: SamplingParams) -> asyncio.Future:
        """Queue a checked pred; the future gets its Outputs, or the error that failed it."""
        guess = self.ahead.get(handle.inode)
        if guess is not None:
            if (guess.handle is handle and guess.tokens == tokens and rows == guess.rows
                    and positions in (None, guess.positions) and params == guess.params):
                return self._take(guess)
            self._unahead(handle.inode)
        self._arrive(proc)
        last = self.sampled.get(handle)
        inode = handle.inode
        job = PredJob(proc, handle, tokens, positions, rows, params,
                      params.generator(self.engine.device),
                      asyncio.get_running_loop().create_future(), self.next_seq)
        job.follows = (last == (tokens[0], inode.length, params) and rows == [0]
                       and len(tokens) == 1
                       and positions in (None, [inode.positions[-1] + 1]))
        self.next_seq += 1
        self.queue.append(job)
        self._wake.set()
        return job.future

    def _arrive(self, proc: Process) -> None:
        """A pred of proc arrives: the wake-up clamp, its think time, its pending count."""
        if proc.pending == 0:
            gap = time.monotonic() - proc.answered if proc.answered else None
            if gap is None or gap > SLEEP_GRACE:
                # Waking up: no credit for time asleep beyond one step's worth, as CFS
                # bounds a waker's lead.
                proc.vruntime = max(proc.vruntime, self.min_vruntime - self.token_budget)
            # A process only between two preds (its own syscalls, its Python) keeps its
            # lead: while it was away a niced process ran and raised min_vruntime, and the
            # clamp would hand that process the next steps too. When its round trip
            # outlasted the hold, nice 0 against nice 10 fell from 9.3x to 6x.
            if gap is not None:
                proc.think = gap if not proc.think else (proc.think + gap) / 2
        proc.pending += 1
        proc.swapped = False

    def _take(self, job: PredJob) -> asyncio.Future:
        """The pred computed ahead arrived: it owns the work from now on."""
        del self.ahead[job.handle.inode]
        self._arrive(job.proc)
        job.ahead, job.follows, job.enqueued = False, True, time.monotonic()
        self.stats.ahead_used += 1
        self.queue.append(job)
        if job.done:  # already computed: answer now
            self._charge(job, job.done, job.seconds)
            self._complete(job)
        else:  # queued or in the running step: it goes on as any admitted pred
            self._wake.set()
        return job.future

    def _unahead(self, inode: Inode) -> PredJob | None:
        """Forget the work computed ahead on inode; one in the running step is rolled back
        when the step is done (returned, so a caller can wait for that)."""
        job = self.ahead.pop(inode, None)
        if job is None:
            return None
        if any(j is job for j, _ in self.in_flight):
            job.cancelled = True
            return job
        self.fs.rollback(job.res)
        job.res = None
        return None

    async def settle(self, inode: Inode) -> None:
        """Before a call changes inode other than by pred: no work ahead is left on it."""
        if self._unahead(inode) is not None:
            await self.quiesce()

    def _go_ahead(self, job: PredJob) -> None:
        """After job completed: compute the pred its LIP will most likely send next."""
        handle, inode = job.handle, job.handle.inode
        if not (self.decode_ahead and job.follows and job.outputs
                and job.outputs[-1].row == len(job.tokens) - 1):
            return
        token, position = job.outputs[-1].token, job.positions[-1] + 1
        if (token in self.eos or position >= self.context or not job.proc.alive
                or handle.closed or inode.busy or inode in self.ahead
                or any(j.handle.inode is inode for j in self.queue)):
            return
        try:
            res = self.fs.reserve(handle, 1)
        except FSError:  # no room: guessing must never cost anyone a page
            return
        guess = PredJob(job.proc, handle, [token], [position], [0], job.params,
                        job.params.generator(self.engine.device),
                        asyncio.get_running_loop().create_future(), self.next_seq,
                        res=res, ahead=True, follows=True)
        self.next_seq += 1
        self.ahead[inode] = guess
        self.stats.ahead += 1
        self._wake.set()

    def _drop_all_ahead(self) -> bool:
        """Give back the pages of all work computed ahead (between steps). Any dropped?"""
        inodes = list(self.ahead)
        for inode in inodes:
            self._unahead(inode)
        return bool(inodes)

    async def give_way(self) -> bool:
        """A call is short of pages: every guess gives its pages back (after the step
        that may be writing one). Whether there were any."""
        dropped = self._drop_all_ahead()
        if dropped and self.in_flight:
            await self.quiesce()
        return dropped

    def cancel(self, future: asyncio.Future) -> None:
        """The caller gave up: the pred is dropped and its file left as it was."""
        for job in [j for j in self.queue if j.future is future]:
            self._cancel(job)

    def cancel_process(self, proc: Process) -> None:
        """Its preds fail with EINTR; a pred in the running step is rolled back after it."""
        for job in [j for j in self.queue if j.proc is proc]:
            self._cancel(job)
        for inode in [i for i, j in self.ahead.items() if j.proc is proc]:
            self._unahead(inode)

    def _cancel(self, job: PredJob) -> None:
        job.cancelled = True
        if any(j is job for j, _ in self.in_flight):
            return  # _finish rolls it back when the step is done
        self._fail(job, FSError(errno.EINTR, "pred: cancelled, the process is exiting"))

    def _drop(self, job: PredJob) -> None:
        self.queue.remove(job)
        job.proc.pending -= 1
        if job.res is not None:
            self.fs.rollback(job.res)
            job.res = None
        if not any(j.proc is job.proc and j.res is None for j in self.queue):
            job.proc.waiting = False

    def _fail(self, job: PredJob, err: Exception) -> None:
        self._drop(job)
        if not job.future.done():
            job.future.set_exception(err)

    def uses(self, handle: Handle) -> bool:
        return any(j.handle is handle for j in self.queue)

    async def quiesce(self) -> None:
        """Wait until no forward pass is running (before freeing what one may touch)."""
        await self._idle.wait()

    def poke(self) -> None:
        """Something that may make room happened (a close, an exit): try again."""
        self._wake.set()

    # -- the loop ---------------------------------------------------------------------------

    async def run(self) -> None:
        served: list[Process] = []
        last_step = 0.0
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._hold_for(served, last_step)
            plan = self._plan()
            if not plan:
                continue
            self._wake.set()  # more may be runnable after this step
            self.in_flight, self._idle = plan, asyncio.Event()
            start = time.monotonic()
            try:
                batch, params, gens = self._batch(plan)
                result = await self.engine_thread.run(self._forward, batch, params, gens)
            except Exception as e:  # the step failed as a whole: so does every pred in it
                log.exception("forward pass failed")
                for job, _ in plan:
                    self._fail(job, FSError(errno.EIO, f"pred: the forward pass failed: {e}"))
            else:
                last_step = time.monotonic() - start
                self._finish(plan, result, last_step)
            finally:
                self.in_flight = []
                self._idle.set()
            served = [job.proc for job, _ in plan if job.future.done()]

    async def _hold_for(self, served: list[Process], last_step: float) -> None:
        """Wait a little for the processes just served to send their next pred.

        A LIP with one pred in flight is not queued during its round trip. Planning at once
        would run a step of whoever happens to be back (a batch of 32 LIPs would run as
        steps of a few), and hand the turn of a process that would go first to whoever is
        queued, so nice would count for nothing. So the next step waits for the processes
        it would want: any of them while the step has room, and those that would go first
        when it is full. It waits only for processes that usually come back in time (their
        think time): to fill the step, at most HOLD_SHARE of a step; for a process whose
        turn it is, up to HOLD_MAX, however short the step, or a short step would hand its
        turn away whenever its round trip is longer (a truncate between two preds)."""
        now = time.monotonic()
        fill_by, turn_by = now + min(HOLD_MAX, HOLD_SHARE * last_step), now + HOLD_MAX
        while True:
            queued = self.queue
            full = (len({j.proc for j in queued}) >= self.max_seqs
                    or sum(j.remaining for j in queued) >= self.token_budget)
            first = min((j.proc.vruntime for j in queued), default=float("inf"))
            worth = 0.0  # the latest time a missing process is worth waiting until
            guessed = {j.proc for j in self.ahead.values()}
            for p in served:
                if p.alive and not p.pending:
                    if p in guessed:
                        # Its work ahead fills the step; wait only if it would go first.
                        by = turn_by if p.vruntime < first < float("inf") else 0.0
                    else:
                        by = turn_by if p.vruntime < first else 0.0 if full else fill_by
                    if p.answered + p.think < by:
                        worth = max(worth, by)
            left = worth - time.monotonic()
            if left <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                return

    def _forward(self, batch: Batch, params: list[SamplingParams], gens: list) -> tuple:
        """On the engine thread: one forward pass and the sampling of its logit rows."""
        logits = self.engine.forward(batch)
        if not params:
            return [], [], [], []
        s = sample(logits, params, gens)
        return (s.tokens.tolist(), s.logprobs.tolist(), s.top_ids.tolist(),
                s.top_logprobs.tolist())

    # -- level 2: packing a step ------------------------------------------------------------

    def _plan(self) -> list[tuple[PredJob, int]]:
        """Pick (job, tokens this step) pairs in virtual-runtime order (decodes first among
        equals). A prefill chunk leaves one token of the budget for each decode still
        queued, so that decodes keep flowing past long prompts. Ordering all decodes before
        all prefills would instead starve a prefill whenever decodes fill the step."""
        plan: list[tuple[PredJob, int]] = []
        budget = self.token_budget
        decodes = sum(j.remaining == 1 for j in self.queue)
        first: dict[int, int] = {}  # id(inode) -> seq of its earliest pred not yet started
        for j in self.queue:
            if j.res is None:
                key = id(j.handle.inode)
                first[key] = min(first.get(key, j.seq), j.seq)
        for job in sorted(self.queue, key=lambda j: (j.proc.vruntime, j.remaining > 1, j.seq)):
            if budget == 0 or len(plan) == self.max_seqs:
                break
            if job.remaining == 1:
                decodes -= 1
            if job.res is None:
                inode = job.handle.inode
                if inode.busy or first[id(inode)] != job.seq:
                    continue  # preds on one file are served in the order they came
                if not self._admit(job, others=bool(plan) or self._reserved()):
                    continue
            room = self.max_seqs - len(plan) - 1  # sequences left for the queued decodes
            chunk = min(job.remaining, max(1, budget - min(decodes, room)))
            plan.append((job, chunk))
            budget -= chunk
        # Work ahead only fills room no pred wants: a guess never delays a pred.
        for job in sorted((j for j in self.ahead.values() if not j.done),
                          key=lambda j: (j.proc.vruntime, j.seq)):
            if budget == 0 or len(plan) == self.max_seqs:
                break
            plan.append((job, 1))
            budget -= 1
        return plan

    def _reserved(self) -> bool:
        return any(j.res is not None for j in self.queue)

    def _admit(self, job: PredJob, others: bool) -> bool:
        """Reserve the job's pages, making room if need be. False: it waits (or failed)."""
        handle, proc = job.handle, job.proc
        try:
            if handle.closed:
                raise FSError(errno.EBADF, "pred: the file was closed")
            positions = job.positions
            if positions is None:  # read now: earlier preds on the file have committed
                last = handle.inode.positions[-1] if handle.inode.length else -1
                positions = list(range(last + 1, last + 1 + len(job.tokens)))
            if max(positions) >= self.context:
                raise FSError(errno.EOVERFLOW, f"pred: position {max(positions)} is past "
                              f"the model's context ({self.context})")
            try:
                job.res = self.fs.reserve(handle, len(job.tokens))
            except FSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT) and self._drop_all_ahead():
                    return self._admit(job, others)  # guesses give way to preds
                if e.errno != errno.ENOSPC:
                    raise
                self._relieve(self._device_need(handle.inode, len(job.tokens)))
                try:
                    job.res = self.fs.reserve(handle, len(job.tokens))
                except FSError as again:
                    if again.errno != errno.ENOSPC or not others:
                        raise
                    # Others are running: they may go idle and give up their pages.
                    proc.waiting = True
                    self.stats.waits += 1
                    return False
        except FSError as e:
            self._fail(job, e)
            return False
        job.positions = positions
        proc.waiting = False
        self.stats.delays.append(time.monotonic() - job.enqueued)
        return True

    def _device_need(self, inode: Inode, count: int) -> int:
        size = self.fs.page_size
        new = -(-(inode.length + count) // size) - len(inode.pages) + 1  # +1: a private tail
        down = sum(p is not None and p.tier != DEVICE for p in inode.pages)
        return max(0, new + down - self.fs.store.pool.free_in(DEVICE))

    def _relieve(self, need: int) -> None:
        """Move device pages down, taking first from files no process has open, then from
        idle processes, lowest priority and longest idle first. Pages that a process with
        queued work uses are never moved, and nothing moves unless enough can."""
        if need <= 0:
            return
        procs = list(self.procs())
        protected = {id(page) for p in procs if p.pending for h in p.fds.values()
                     for page in h.inode.pages if page is not None}
        idle = sorted((p for p in procs if not p.pending),
                      key=lambda p: (-p.nice, p.last_active))
        groups: list[tuple[Process | None, list[Inode]]] = [
            (None, [i for i in self.fs.files() if i.opens == 0])]
        groups += [(p, [h.inode for h in p.fds.values()]) for p in idle]
        plan: list[tuple[Process | None, list]] = []
        seen: set[int] = set(protected)
        for proc, inodes in groups:
            pages = []
            for page in (pg for inode in inodes for pg in inode.pages):
                if page is not None and page.tier == DEVICE and id(page) not in seen:
                    seen.add(id(page))
                    pages.append(page)
            if pages:
                plan.append((proc, pages))
        store = self.fs.store
        movable = sum(len(pages) for _, pages in plan)
        if min(movable, store.free_in(HOST) + store.free_in(DISK)) < need:
            return  # it cannot help: leave everyone where they are
        moved = 0
        for proc, pages in plan:
            n = store.move_down(pages[: need - moved])
            moved += n
            self.stats.pages_swapped_out += n
            if proc is not None and n:
                proc.swapped = True
                self.stats.preemptions += 1
            if moved >= need:
                return

    def _batch(self, plan: list[tuple[PredJob, int]]) -> tuple[Batch, list, list]:
        ids, pos, q_lens, kv_lens, tables, rows, excluded = [], [], [], [], [], [], []
        params, gens = [], []
        for job, chunk in plan:
            a, b = job.done, job.done + chunk
            base = len(ids)
            ids += job.tokens[a:b]
            pos += job.positions[a:b]
            q_lens.append(chunk)
            kv_lens.append(job.res.start + b)
            tables.append(job.res.page_table)
            excluded.append(job.handle.inode.excluded)
            for r in job.rows:
                if a <= r < b:
                    rows.append(base + r - a)
                    params.append(job.params)
                    gens.append(job.generator)
        return Batch(ids, pos, q_lens, kv_lens, tables, rows, excluded), params, gens

    def _finish(self, plan: list[tuple[PredJob, int]], result: tuple, seconds: float) -> None:
        tokens, logprobs, top_ids, top_lps = result
        total = sum(chunk for _, chunk in plan)
        k = 0
        prefill = decode = 0
        for job, chunk in plan:
            a, b = job.done, job.done + chunk
            for r in job.rows:
                if a <= r < b:
                    n = job.params.top_logprobs
                    job.outputs.append(Output(r, tokens[k], logprobs[k],
                                              list(zip(top_ids[k][:n], top_lps[k][:n],
                                                       strict=True))))
                    k += 1
            if chunk == 1 and len(job.tokens) == 1:
                decode += 1
            else:
                prefill += chunk
            if job.ahead:
                if job.cancelled:  # _unahead left it to us
                    self.fs.rollback(job.res)
                    job.res = None
                else:  # a pred may take it: done and charged then
                    job.done, job.seconds = b, seconds * chunk / total
                continue
            self._charge(job, chunk, seconds * chunk / total)
            if job.cancelled:
                self._fail(job, FSError(errno.EINTR, "pred: cancelled, the process is exiting"))
                continue
            job.done = b
            if job.remaining == 0:
                self._complete(job)
        self.stats.record(Step(time.monotonic(), seconds, len(plan), prefill, decode))
        # As CFS's: the least of the queued and of those that just ran ("current"), never
        # going back. Counting the queue alone would let a process that is only between
        # two preds be clamped to the other's vruntime on its next pred, losing its lead.
        runnable = [j.proc.vruntime for j in self.queue] + [j.proc.vruntime for j, _ in plan]
        self.min_vruntime = max(self.min_vruntime, min(runnable))

    def _charge(self, job: PredJob, tokens: int, seconds: float) -> None:
        proc = job.proc
        proc.tokens += tokens
        proc.vruntime += tokens * 1024 / proc.weight
        proc.accel_seconds += seconds

    def _complete(self, job: PredJob) -> None:
        """Its last chunk is done: the entries join the file and the pred is answered."""
        self.fs.commit(job.res, job.tokens, job.positions)
        job.res = None
        self._drop(job)
        job.proc.last_active = job.proc.answered = time.monotonic()
        if job.outputs and job.outputs[-1].row == len(job.tokens) - 1:
            self.sampled[job.handle] = (job.outputs[-1].token, job.handle.inode.length,
                                        job.params)
        if not job.future.done():
            job.future.set_result(job.outputs)
        self._go_ahead(job)
