"""The scheduler as plain data: schedule() plans a step, finish() takes synthetic samples.

A real kvfs FileSystem on a small CPU pool (kvfs_helpers), processes made here, and no
engine, daemon or sleep: each test drives steps by hand and checks what was planned,
admitted, answered, committed and charged."""

from __future__ import annotations

import asyncio
import errno
import functools
import gc
import os
import time
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kvfs_helpers import make_fs

from kvfs.fs import Handle
from kvfs.pages import DEVICE, HOST
from kvfs.perm import Cred
from symphony import scheduler, syscall_table
from symphony.engine.engine import Batch
from symphony.engine.sampler import GREEDY, SamplingParams
from symphony.engine.tree import ancestor_bits
from symphony.pred_job import JobState, Output, PredSpec
from symphony.process import Process
from symphony.scheduler import PREFILL_PATIENCE, SLEEP_GRACE, Scheduler
from symphony.step import Chunk, StepPlan, StepResult, StepWork, fill_placeholders
from symphony.syscall_table import submit_pred
from syscalls import symphony_pb2 as pb

CONTEXT, EOS, SAMPLE, VOCAB = 1024, 99, 7, 320
ENGINE = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=CONTEXT,
                                                vocab_size=VOCAB),
                         device=torch.device("cpu"), eos_ids=lambda: (EOS,))


def in_loop(test):
    """Run an async test body in a fresh event loop (futures need a running one); an error
    raised in one of the loop's callbacks fails the test too (an exception a test leaves
    in a future it does not read is no error)."""
    @functools.wraps(test)
    def run(*args, **kwargs) -> None:
        errors = []

        def handler(_, context: dict) -> None:
            if "handle" in context:  # "Exception in callback ..."
                errors.append(context)

        async def body() -> None:
            asyncio.get_running_loop().set_exception_handler(handler)
            await test(*args, **kwargs)
        asyncio.run(body())
        assert not errors, errors
    return run


def result(plan: StepPlan, tokens: list[int] | None = None, seconds: float = 0.01,
           **controlled) -> StepResult:
    """What the forward pass and the sampler would give back: `tokens`, else SAMPLE for
    every logit row; `controlled`: model_logprobs, scores."""
    n = plan.rows
    # Kept rows' logits rise with the id: unmasked, the last id is the most likely.
    kept = {i: torch.arange(VOCAB, dtype=torch.float32) for i in plan.kept}
    return StepResult(tokens or [SAMPLE] * n, [-1.0] * n, [[]] * n, [[]] * n, seconds,
                      **controlled, kept=kept)


class World:
    def __init__(self, *, budget: int = 8, max_seqs: int = 8, ahead: bool = False,
                 pages: int = 64, host: int = 16, pipeline: bool = False):
        self.fs = make_fs(pages=pages, host=host)
        self.procs: list[Process] = []
        self.sched = Scheduler(ENGINE, self.fs, lambda: self.procs, budget, max_seqs,
                               ahead, pipeline=pipeline)

    def process(self, nice: int = 0) -> tuple[Process, Handle]:
        """A new process with one anonymous file open."""
        pid = len(self.procs) + 1
        p = Process(pid, 0, Cred(1000 + pid, 1000 + pid), f"token{pid}", nice=nice)
        self.procs.append(p)
        handle = self.fs.open(p.cred, "", os.O_RDWR)
        p.add_fd(handle)
        return p, handle

    def pred(self, p: Process, f: Handle, tokens: list[int],
             params: SamplingParams = GREEDY) -> asyncio.Future:
        return self.sched.submit(p, f, PredSpec(tokens, None, [len(tokens) - 1], params))

    def submit(self, p: Process, f: Handle, tokens: list[int], **fields) -> asyncio.Future:
        """A pred through the syscall's checks (submit_pred): `fields` of PredRequest."""
        fd = next(fd for fd, h in p.fds.items() if h is f)
        kernel = SimpleNamespace(engine=ENGINE, sched=self.sched)
        return submit_pred(kernel, p, p.cred, pb.PredRequest(fd=fd, tokens=tokens, **fields))

    def step(self, tokens: list[int] | None = None, **controlled) -> StepPlan:
        plan = self.sched.schedule()
        assert plan is not None, "nothing was planned"
        self.sched.finish(plan, result(plan, tokens, **controlled))
        return plan

    @property
    def free(self) -> int:
        return self.fs.store.free_in(DEVICE)


def sizes(plan: StepPlan) -> list[tuple[Process, int]]:
    return [(c.job.proc, c.size) for c in plan.chunks]


# -- budget and chunking -------------------------------------------------------------------


@in_loop
async def test_a_long_prefill_is_chunked_to_the_token_budget_and_commits_once():
    w = World(budget=8)
    p, f = w.process()
    answer = w.pred(p, f, list(range(1, 21)))
    plans = []
    for _ in range(3):
        assert f.inode.length == 0 and not answer.done()  # in the file only when all done
        plans.append(w.step())
    assert [pl.batch.q_lens for pl in plans] == [[8], [8], [4]]
    assert [pl.batch.kv_lens for pl in plans] == [[8], [16], [20]]
    assert plans[1].batch.positions == list(range(8, 16))
    # only the last chunk holds the row to sample
    assert [pl.batch.logit_rows for pl in plans] == [[], [], [3]]
    assert answer.result() == [Output(19, SAMPLE, -1.0, (), ())]
    assert f.inode.tokens == list(range(1, 21)) and f.inode.positions == list(range(20))
    assert not f.inode.busy and p.tokens == 20 and p.pending == 0
    assert w.sched.schedule() is None


@in_loop
async def test_a_prefill_chunk_leaves_room_for_each_decode_and_decodes_go_first_among_equals():
    w = World(budget=8)
    a, fa = w.process()
    b, fb = w.process()
    w.pred(a, fa, list(range(1, 21)))
    w.pred(b, fb, [5])  # came second, equal virtual runtime: a decode goes first
    plan = w.step()
    assert sizes(plan) == [(b, 1), (a, 7)]
    # b behind a now (nice 0: one token, one vruntime), yet its decodes flow each step
    a.vruntime = 0.0
    decode = w.pred(b, fb, [6])
    plan = w.step()
    assert sizes(plan) == [(a, 7), (b, 1)] and decode.done()
    w.pred(b, fb, [7])
    assert sizes(w.step()) == [(b, 1), (a, 6)]


@in_loop
async def test_a_prompt_waits_for_decodes_that_tie_with_it_a_while_not_for_ever():
    """One process, two files, one sequence a step: its decode goes before its prompt, which
    it ties with, until the prompt has waited PREFILL_PATIENCE; then arrival order."""
    w = World(budget=8, max_seqs=1)
    p, f = w.process()
    g = w.fs.open(p.cred, "", os.O_RDWR)
    p.add_fd(g)
    prompt = w.pred(p, g, [1, 2, 3])
    w.pred(p, f, [5])
    assert [c.job.handle for c in w.step().chunks] == [f]  # decodes first among equals
    w.pred(p, f, [6])
    (job,) = [j for j in w.sched.queue if j.future is prompt]
    job.enqueued -= PREFILL_PATIENCE  # it has waited long enough
    assert [c.job.handle for c in w.step().chunks] == [g] and prompt.done()


@in_loop
async def test_max_seqs_caps_the_sequences_of_a_step():
    w = World(budget=8, max_seqs=2)
    procs = [w.process() for _ in range(3)]
    for p, f in procs:
        w.pred(p, f, [5])
    assert [c.job.proc for c in w.step().chunks] == [procs[0][0], procs[1][0]]
    assert [c.job.proc for c in w.step().chunks] == [procs[2][0]]


# -- virtual runtime and nice -----------------------------------------------------------


@in_loop
async def test_the_lowest_virtual_runtime_goes_first():
    w = World(max_seqs=1)
    (late, fl), (early, fe) = w.process(), w.process()
    late.vruntime, early.vruntime = 50.0, 10.0
    w.pred(late, fl, [5])
    w.pred(early, fe, [5])
    assert sizes(w.step()) == [(early, 1)]
    assert early.vruntime == 11.0
    assert sizes(w.step()) == [(late, 1)]


@in_loop
async def test_contending_processes_get_steps_by_nice_weight():
    """One token a step, two processes always queued: their shares are the CFS weights."""
    w = World(budget=1, max_seqs=1)
    (a, fa), (b, fb) = w.process(nice=0), w.process(nice=5)
    for p, f in ((a, fa), (b, fb)):
        w.pred(p, f, [5])
    steps = {a: 0, b: 0}
    for _ in range(200):
        (chunk,) = w.step().chunks
        steps[chunk.job.proc] += 1
        w.pred(chunk.job.proc, chunk.job.handle, [5])
    assert steps[a] / steps[b] == pytest.approx(1.25**5, rel=0.05)
    assert a.tokens == steps[a] and b.vruntime == pytest.approx(steps[b] * 1.25**5)


@in_loop
async def test_only_a_real_sleep_costs_a_process_its_lead():
    w = World(budget=8)
    w.sched.min_vruntime = 1000.0
    (between, fb), (sleeper, fs), (new, fn) = w.process(), w.process(), w.process()
    between.answered = time.monotonic() - SLEEP_GRACE / 10
    sleeper.answered = time.monotonic() - SLEEP_GRACE * 10
    for p, f in ((between, fb), (sleeper, fs), (new, fn)):
        w.pred(p, f, [5])
    assert between.vruntime == 0.0
    assert sleeper.vruntime == new.vruntime == 1000.0 - 8


# -- admission and relief -----------------------------------------------------------------


@in_loop
async def test_an_idle_process_s_pages_move_down_to_admit_a_pred():
    w = World(budget=16, pages=4, host=8)
    (idle, fi), (busy, fb) = w.process(), w.process()
    w.pred(idle, fi, list(range(1, 13)))
    w.step()
    assert w.free == 1  # idle holds three pages
    w.pred(busy, fb, list(range(1, 9)))  # two pages
    assert sizes(w.step()) == [(busy, 8)]
    assert idle.swapped and w.sched.stats.preemptions == 1
    assert w.sched.stats.pages_swapped_out == 2
    assert sum(page.tier == HOST for page in fi.inode.pages) == 2
    assert fb.inode.length == 8


@in_loop
async def test_a_pred_short_of_pages_waits_while_others_run_then_takes_an_idle_one_s():
    """The pages of a process with work queued never move; the pred waits instead, and is
    admitted once that process is idle and its pages can move."""
    w = World(budget=16, pages=4, host=8)
    (a, fa), (b, fb) = w.process(), w.process()
    w.pred(a, fa, list(range(1, 9)))
    w.step()
    w.pred(a, fa, [9])  # a third page: one left
    waiting = w.pred(b, fb, list(range(1, 13)))  # three pages
    b.vruntime = 100.0  # after a
    assert sizes(w.step()) == [(a, 1)]
    assert b.waiting and b.state == "waiting" and w.sched.stats.waits == 1
    assert all(page.tier == DEVICE for page in fa.inode.pages) and not a.swapped
    assert sizes(w.step()) == [(b, 12)]
    assert waiting.done() and not b.waiting and a.swapped


@in_loop
async def test_pages_a_process_with_queued_work_uses_never_move():
    """b is idle, but shares a's pages through a fork: only b's own pages move."""
    w = World(budget=16, pages=4, host=8)
    (a, fa), (b, _) = w.process(), w.process()
    w.pred(a, fa, list(range(1, 9)))
    w.step()
    b.add_fd(w.fs.fork(fa, b.cred))  # looked at before b's own file
    fb = w.fs.open(b.cred, "", os.O_RDWR)
    b.add_fd(fb)
    w.pred(b, fb, list(range(1, 9)))
    w.step()
    assert w.free == 0
    w.pred(a, fa, [9, 10, 11, 12])
    assert sizes(w.step()) == [(a, 4)]
    assert [page.tier for page in fa.inode.pages] == [DEVICE] * 3
    assert [page.tier for page in fb.inode.pages] == [HOST] * 2 and b.swapped


@in_loop
async def test_two_decoders_on_a_full_pool_take_turns_through_the_host_tier():
    """Both files fill the device and both preds need a page: the one whose pred is only
    queued is preempted (its pages move down) and comes back when its turn comes; nobody
    gets ENOSPC while the host tier has room."""
    w = World(budget=16, pages=4, host=8)
    (a, fa), (b, fb) = w.process(), w.process()
    w.pred(a, fa, list(range(1, 9)))
    w.pred(b, fb, list(range(1, 9)))
    w.step()
    assert w.free == 0
    b.vruntime = a.vruntime + 1  # a goes first
    first, second = w.pred(a, fa, [9]), w.pred(b, fb, [9])
    assert sizes(w.step()) == [(a, 1)] and b.swapped and b.waiting
    assert sizes(w.step()) == [(b, 1)] and a.swapped
    assert first.result() and second.result()
    assert fa.inode.length == fb.inode.length == 9
    assert all(page.tier == DEVICE for page in fb.inode.pages)


@in_loop
async def test_pages_of_a_file_a_step_in_flight_writes_never_move():
    """An idle process's guess the running step computes was dropped to make room, but
    its rollback waits for the step: its file's pages stay where the step writes them."""
    w = World(ahead=True, budget=16, pages=4, host=8)
    (p, f), (q, g) = w.process(), w.process()
    await decoding(w, p, f)  # p's file: 4 entries, and a page for its guess's 5th
    plan = w.sched.schedule()  # computes the guess: p is idle, its file busy
    assert p.pending == 0 and f.inode.busy and w.free == 2
    answer = w.pred(q, g, list(range(1, 13)))  # three pages: two are free
    w.sched.schedule()
    assert all(page.tier == DEVICE for page in f.inode.pages)
    w.sched.finish(plan, result(plan))
    assert not f.inode.busy
    assert sizes(w.step()) == [(q, 12)] and answer.done()


@in_loop
async def test_enospc_only_when_nothing_can_help():
    """No host tier: the idle process's pages cannot move, and nothing else runs."""
    w = World(budget=16, pages=4, host=0)
    (idle, fi), (p, f) = w.process(), w.process()
    w.pred(idle, fi, list(range(1, 9)))
    w.step()
    failed = w.pred(p, f, list(range(1, 13)))
    assert w.sched.schedule() is None
    assert failed.exception().errno == errno.ENOSPC
    assert f.inode.length == 0 and f.inode.pages == [] and not f.inode.busy
    assert p.pending == 0 and not p.waiting
    assert not idle.swapped and all(page.tier == DEVICE for page in fi.inode.pages)
    assert w.free == 2


@in_loop
async def test_nothing_moves_unless_enough_can():
    w = World(budget=32, pages=4, host=8)
    (idle, fi), (p, f) = w.process(), w.process()
    w.pred(idle, fi, [1, 2, 3, 4])
    w.step()
    failed = w.pred(p, f, list(range(1, 21)))  # five pages: more than the pool
    assert w.sched.schedule() is None and failed.exception().errno == errno.ENOSPC
    assert not idle.swapped and fi.inode.pages[0].tier == DEVICE
    assert w.sched.stats.pages_swapped_out == 0


# -- preds on one file, cancellation ------------------------------------------------------


@in_loop
async def test_preds_on_one_file_are_served_in_the_order_they_came():
    w = World(budget=4)
    p, f = w.process()
    prompt = w.pred(p, f, list(range(1, 11)))
    decode = w.pred(p, f, [50])  # one token: among equals it would go first
    for size in (4, 4, 2):
        assert sizes(w.step()) == [(p, size)]
    assert prompt.done() and not decode.done()
    plan = w.step()
    assert plan.batch.positions == [10] and decode.done()
    assert f.inode.tokens == [*range(1, 11), 50]


@in_loop
async def test_default_positions_follow_the_last_entry_not_the_largest_position():
    """docs/syscalls.md, pred: a module placed at 100.. and then one at 0..: the next pred
    without positions goes on from the last entry's position."""
    w = World(budget=16)
    p, f = w.process()
    w.submit(p, f, [1, 2, 3], positions=[100, 101, 102], no_outputs=True)
    w.submit(p, f, [4, 5], positions=[0, 1], no_outputs=True)
    w.submit(p, f, [6, 7], no_outputs=True)
    while w.sched.queue:
        w.step()
    assert f.inode.positions == [100, 101, 102, 0, 1, 2, 3]


@in_loop
@pytest.mark.parametrize("running", [False, True])
async def test_settle_takes_back_a_pred_whose_caller_cancelled_it_before_its_task_ran(running):
    """A gRPC client cancels its rpc (or sends CANCEL) and truncates at once: the rpc's
    handler, which takes the pred back, may not have run when the truncate settles."""
    w = World()
    p, f = w.process()
    w.pred(p, f, [1, 2, 3])
    w.step()
    answer = w.pred(p, f, [4, 5, 6])
    plan = w.sched.schedule() if running else None
    answer.cancel()  # what cancelling sys_pred's task does first
    settling = asyncio.create_task(w.sched.settle(f.inode))
    await asyncio.sleep(0)
    if running:
        assert not settling.done()  # the step still writes it
        w.sched.finish(plan, result(plan))
    await settling
    w.fs.truncate(f, 1)  # not EBUSY
    assert f.inode.tokens == [1] and w.sched.queue == [] and p.pending == 0
    await w.sched.cancel(answer)  # the handler's turn: nothing left to do


@in_loop
async def test_a_queued_pred_cancelled_fails_and_changes_nothing():
    w = World()
    p, f = w.process()
    answer = w.pred(p, f, [1, 2, 3])
    await w.sched.cancel(answer)
    assert answer.exception().errno == errno.ECANCELED
    assert w.sched.queue == [] and p.pending == 0 and not w.sched.uses(f)
    assert w.sched.schedule() is None and f.inode.length == 0


@in_loop
async def test_a_pred_cancelled_in_the_running_step_is_rolled_back_after_it():
    w = World()
    p, f = w.process()
    w.pred(p, f, [1, 2, 3])
    w.step()
    pages, free = list(f.inode.pages), w.free
    answer = w.pred(p, f, [4, 5, 6])
    plan = w.sched.schedule()
    assert f.inode.busy and w.free == free - 1  # its reservation: a second page
    cancelling = asyncio.create_task(w.sched.cancel(answer))
    await asyncio.sleep(0)
    (job,) = [c.job for c in plan.chunks]
    assert job.state is JobState.CANCELLED and not answer.done()
    assert not cancelling.done()  # it returns once the file is as it was
    w.sched.finish(plan, result(plan))
    await cancelling
    assert answer.exception().errno == errno.ECANCELED and job.state is JobState.FAILED
    assert f.inode.tokens == [1, 2, 3] and f.inode.pages == pages and not f.inode.busy
    assert w.free == free and p.pending == 0 and w.sched.queue == []
    assert p.tokens == 6  # the step did compute it


@in_loop
async def test_a_cancel_waits_for_the_step_computing_the_pred_not_the_one_behind_it():
    w = World(pipeline=True, budget=16)
    (p, f), (q, g) = w.process(), w.process()
    answer = w.pred(p, f, [1, 2, 3, 4, 5, 6])
    computing = w.sched.schedule()
    w.pred(q, g, [1, 2, 3])
    behind = w.sched.schedule()
    assert sizes(computing) == [(p, 6)] and sizes(behind) == [(q, 3)]
    cancelling = asyncio.create_task(w.sched.cancel(answer))
    await asyncio.sleep(0)
    assert not cancelling.done()
    w.sched.finish(computing, result(computing))
    await asyncio.wait_for(cancelling, 1)  # the step behind is still in flight
    assert w.sched.running == [behind] and answer.exception().errno == errno.ECANCELED
    assert f.inode.length == 0 and not f.inode.busy


@in_loop
async def test_a_pred_whose_call_was_cancelled_during_its_step_is_rolled_back_not_committed():
    """Cancelling sys_pred's task cancels the future at once; the step may end before
    sys_pred runs again to cancel the pred."""
    w = World()
    p, f = w.process()
    free = w.free
    answer = w.pred(p, f, [1, 2, 3])
    plan = w.sched.schedule()
    answer.cancel()
    w.sched.finish(plan, result(plan))
    assert f.inode.length == 0 and not f.inode.busy and w.free == free
    assert w.sched.queue == [] and p.pending == 0 and not w.sched.ahead.guesses
    await w.sched.cancel(answer)  # sys_pred's turn: nothing left to do


@in_loop
async def test_settle_waits_for_a_cancelled_pred_in_the_running_step():
    """A truncate right after a gRPC client cancelled its pred: not EBUSY, after the step."""
    w = World()
    p, f = w.process()
    w.pred(p, f, [1, 2, 3])
    w.step()
    answer = w.pred(p, f, [4, 5, 6])
    plan = w.sched.schedule()
    cancelling = asyncio.create_task(w.sched.cancel(answer))
    await asyncio.sleep(0)
    settling = asyncio.create_task(w.sched.settle(f.inode))
    await asyncio.sleep(0)
    assert not settling.done() and f.inode.busy
    w.sched.finish(plan, result(plan))
    await settling
    w.fs.truncate(f, 1)
    assert f.inode.tokens == [1]
    await cancelling


@in_loop
async def test_a_pred_that_took_its_guess_and_is_cancelled_leaves_no_guess_behind():
    w = World(ahead=True)
    p, f = w.process()
    free = w.free
    guess = await decoding(w, p, f)
    plan = w.sched.schedule()  # computes the guess
    answer = w.pred(p, f, [9])  # takes it
    cancelling = asyncio.create_task(w.sched.cancel(answer))
    await asyncio.sleep(0)
    assert guess.state is JobState.CANCELLED
    w.sched.finish(plan, result(plan, [11]))
    await cancelling
    assert answer.exception().errno == errno.ECANCELED
    assert not w.sched.ahead.guesses and not f.inode.busy and guess.res is None
    assert f.inode.tokens == [1, 2, 3, SAMPLE] and w.free == free - 1
    assert w.sched.schedule() is None


@in_loop
async def test_a_decoding_pred_cancelled_in_its_step_makes_no_guess():
    """Answered, it would have guessed the next pred (decoding())."""
    w = World(ahead=True)
    p, f = w.process()
    w.pred(p, f, [1, 2, 3])
    w.step()
    free = w.free
    answer = w.pred(p, f, [SAMPLE])
    plan = w.sched.schedule()
    cancelling = asyncio.create_task(w.sched.cancel(answer))
    await asyncio.sleep(0)
    w.sched.finish(plan, result(plan, [9]))
    await cancelling
    assert not w.sched.ahead.guesses and w.free == free and f.inode.length == 3


@in_loop
async def test_a_failed_step_fails_its_preds_and_drops_its_guesses():
    w = World(ahead=True)
    p, f = w.process()
    q, g = w.process()
    w.pred(p, f, [1, 2, 3])
    w.step()
    w.pred(p, f, [SAMPLE])
    w.step()  # p guesses
    free = w.free
    answer = w.pred(q, g, [1, 2])
    plan = w.sched.schedule()
    assert len(plan.chunks) == 2
    w.sched.fail_step(plan, OSError(errno.EIO, "the forward pass failed"))
    assert answer.exception().errno == errno.EIO
    assert not w.sched.ahead.guesses and not f.inode.busy and not g.inode.busy
    assert w.free == free + 1 and f.inode.length == 4 and g.inode.length == 0


# -- decoding ahead ---------------------------------------------------------------------


async def decoding(w: World, p: Process, f: Handle, params: SamplingParams = GREEDY):
    """p's file holds a prompt and one fed-back sample; the guess of the next pred is
    made (not yet computed). Returns it."""
    prompt = w.pred(p, f, [1, 2, 3], params)
    while not prompt.done():
        w.step()
    assert not w.sched.ahead.guesses  # a prompt does not continue a sample
    w.pred(p, f, [SAMPLE], params)
    w.step([9])
    return w.sched.ahead.guesses[f.inode]


@in_loop
async def test_a_guess_is_computed_unseen_and_a_matching_pred_takes_it_without_a_step():
    w = World(ahead=True)
    p, f = w.process()
    guess = await decoding(w, p, f)
    assert guess.state is JobState.AHEAD and guess.spec.tokens == [9] and guess.positions == [4]
    assert w.sched.stats.ahead == 1
    plan = w.step([11])
    assert plan.chunks == [Chunk(guess, 0, 1)] and plan.batch.kv_lens == [5]
    # not in the file, not charged
    assert f.inode.tokens == [1, 2, 3, SAMPLE] and p.tokens == 4 and guess.done == 1
    answer = w.pred(p, f, [9])
    assert answer.done() and answer.result()[0].token == 11
    assert f.inode.tokens == [1, 2, 3, SAMPLE, 9] and p.tokens == 5
    assert w.sched.stats.ahead_used == 1 and p.pending == 0
    nxt = w.sched.ahead.guesses[f.inode]  # and the next one is guessed
    assert nxt.spec.tokens == [11] and nxt.positions == [5]


@in_loop
async def test_a_known_decode_pred_takes_its_guess_as_submit_would_with_no_request_built():
    """syscall_table.submit_known's steady state: a plain decode pred that is the file's
    guess takes it (Scheduler.take_guess) keeping the guess's spec; any other token, a
    sampler not equal, or another open file of the same inode takes nothing and leaves
    the guess as it was, for submit to drop."""
    w = World(ahead=True)
    p, f = w.process()
    guess = await decoding(w, p, f)
    spec = guess.spec
    other = w.fs.open(p.cred, "", os.O_RDWR)  # not the guess's handle
    for handle, token, params in ((f, 10, GREEDY), (f, 9, SamplingParams(temperature=0.5)),
                                  (other, 9, GREEDY)):
        assert w.sched.take_guess(handle, token, params, None) is None
        assert w.sched.ahead.guesses[f.inode] is guess and guess.state is JobState.AHEAD
    replied = []
    answer = w.sched.take_guess(f, 9, SamplingParams(),  # equal, not the same
                                lambda outputs, error: replied.append((outputs, error)))
    assert answer is guess.future and guess.state is JobState.ADMITTED and guess.spec is spec
    w.step([11])
    assert answer.result()[0].token == 11 and replied == [(answer.result(), None)]
    assert f.inode.tokens == [1, 2, 3, SAMPLE, 9] and p.tokens == 5 and p.pending == 0
    # Answered through a reply, unseeded and plain: its file decodes ahead as a stream.
    (slot,) = w.sched.ahead.streams[f.inode].slots
    assert w.sched.stats.ahead_used == 1 and slot.token == 11
    assert f.inode not in w.sched.ahead.guesses


@in_loop
async def test_a_failed_pred_answered_through_its_reply_leaves_asyncio_nothing_to_log():
    """The lifeline's and the rings' preds are answered through their reply, which gets
    the error: when the pred's future goes, asyncio must not log that error as one never
    retrieved (a user whose preds fail at its exit wrote three lines to the kernel's log a
    pred)."""
    w = World()
    logged = []
    asyncio.get_running_loop().set_exception_handler(lambda _, context: logged.append(context))
    p, f = w.process()
    errors = []
    for tokens in ([1, 2, 3], [4]):
        w.sched.submit(p, f, PredSpec(tokens, None, [len(tokens) - 1], GREEDY),
                       lambda outputs, error: errors.append((outputs, error)))
    w.sched.cancel_process(p)  # both fail with EINTR, the first admitted or not
    gc.collect()
    assert [(outputs, e.errno) for outputs, e in errors] == [(None, errno.EINTR)] * 2
    assert logged == []


@in_loop
async def test_a_pred_takes_its_guess_in_the_running_step():
    w = World(ahead=True)
    p, f = w.process()
    guess = await decoding(w, p, f)
    plan = w.sched.schedule()
    answer = w.pred(p, f, [9])
    assert not answer.done() and guess.state is JobState.ADMITTED
    w.sched.finish(plan, result(plan, [11]))
    assert answer.result()[0].token == 11 and f.inode.length == 5 and p.tokens == 5


@in_loop
async def test_a_guess_never_delays_a_pred():
    w = World(ahead=True, budget=2)
    p, f = w.process()
    q, g = w.process()
    guess = await decoding(w, p, f)
    q.vruntime = p.vruntime + 100  # last in line, and still first to be served
    w.pred(q, g, [1, 2])
    assert sizes(w.step()) == [(q, 2)] and guess.done == 0
    assert w.step().chunks == [Chunk(guess, 0, 1)]


@in_loop
async def test_no_guess_after_an_end_of_sequence():
    w = World(ahead=True)
    p, f = w.process()
    w.pred(p, f, [1, 2, 3])
    w.step()
    w.pred(p, f, [SAMPLE])
    w.step([EOS])
    assert not w.sched.ahead.guesses


@in_loop
async def test_another_pred_drops_the_guess_first():
    w = World(ahead=True)
    p, f = w.process()
    free = w.free
    guess = await decoding(w, p, f)
    w.step([11])
    assert w.free == free - 2  # the file's page, and the guess's
    other = w.pred(p, f, [5])
    assert guess.state is JobState.DROPPED and not w.sched.ahead.guesses
    assert not f.inode.busy and w.free == free - 1
    plan = w.step([12])
    assert plan.batch.token_ids == [5] and plan.batch.positions == [4]
    assert other.result()[0].token == 12 and f.inode.tokens == [1, 2, 3, SAMPLE, 5]
    assert w.sched.stats.ahead_used == 0 and p.tokens == 5


@in_loop
async def test_settle_drops_the_guess_before_a_truncate_and_a_close():
    w = World(ahead=True)
    p, f = w.process()
    free = w.free
    await decoding(w, p, f)
    await w.sched.settle(f.inode)
    assert not w.sched.ahead.guesses and not f.inode.busy
    w.fs.truncate(f, 2)  # no EBUSY
    w.pred(p, f, [3])
    w.step([SAMPLE])
    w.pred(p, f, [SAMPLE])
    w.step([9])
    assert w.sched.ahead.guesses
    await w.sched.settle(f.inode)
    w.fs.close(f)
    assert w.free == free


@in_loop
async def test_settle_waits_for_the_step_computing_the_guess_and_rolls_it_back():
    w = World(ahead=True)
    p, f = w.process()
    free = w.free
    guess = await decoding(w, p, f)
    plan = w.sched.schedule()
    settling = asyncio.create_task(w.sched.settle(f.inode))
    await asyncio.sleep(0)  # let it run up to its wait
    assert not settling.done() and f.inode.busy and guess.state is JobState.DROPPED
    w.sched.finish(plan, result(plan, [11]))
    await settling
    assert not f.inode.busy and w.free == free - 1 and f.inode.length == 4
    assert p.tokens == 4  # a dropped guess is never charged


@in_loop
async def test_a_guess_gives_its_page_to_a_pred_short_of_pages():
    w = World(ahead=True, pages=2, host=0)
    p, f = w.process()
    q, g = w.process()
    guess = await decoding(w, p, f)
    assert w.free == 0  # p's file and its guess
    answer = w.pred(q, g, [1])
    assert sizes(w.step()) == [(q, 1)] and answer.done()
    assert guess.state is JobState.DROPPED and not f.inode.busy


@in_loop
async def test_give_way_frees_every_guess_once_no_step_writes_it():
    w = World(ahead=True)
    p, f = w.process()
    free = w.free
    await decoding(w, p, f)
    assert await w.sched.give_way()
    assert w.free == free - 1 and not w.sched.ahead.guesses
    assert not await w.sched.give_way()
    w.pred(p, f, [9])
    w.step()
    guess = w.sched.ahead.guesses[f.inode]
    plan = w.sched.schedule()  # computes it
    giving = asyncio.create_task(w.sched.give_way())
    await asyncio.sleep(0)
    assert not giving.done() and f.inode.busy
    w.sched.finish(plan, result(plan))
    assert await giving and guess.res is None and not f.inode.busy


@in_loop
async def test_cancel_process_fails_its_preds_and_drops_its_guesses():
    w = World(ahead=True)
    p, f = w.process()
    free = w.free
    await decoding(w, p, f)
    other = w.fs.open(p.cred, "", os.O_RDWR)
    p.add_fd(other)
    queued = w.pred(p, other, [1, 2])
    w.sched.cancel_process(p)
    assert queued.exception().errno == errno.EINTR
    assert not w.sched.ahead.guesses and w.sched.queue == [] and p.pending == 0
    assert w.free == free - 1 and w.sched.schedule() is None


@in_loop
async def test_a_computed_guess_not_yet_taken_is_guessed_on_up_to_the_depth():
    w = World(ahead=True)
    p, f = w.process()
    guess = await decoding(w, p, f)
    w.step([11])  # computed; its pred has not come
    nxt = guess.following
    assert nxt.state is JobState.AHEAD and nxt.spec.tokens == [11] and nxt.positions == [5]
    plan = w.step([13])  # the LIP is a step late: the engine goes on without it
    assert plan.chunks == [Chunk(nxt, 0, 1)] and plan.batch.kv_lens == [6]
    assert nxt.done == 1 and nxt.following is None  # DEPTH guesses: no third
    assert w.sched.schedule() is None
    assert f.inode.tokens == [1, 2, 3, SAMPLE] and p.tokens == 4  # nothing in the file yet
    first = w.pred(p, f, [9])
    assert first.result()[0].token == 11 and w.sched.ahead.guesses[f.inode] is nxt
    last = nxt.following  # taking the first made room for a guess after nxt
    assert last.spec.tokens == [13] and last.positions == [6] and last.done == 0
    second = w.pred(p, f, [11])
    assert second.result()[0].token == 13  # both answered without a step
    assert f.inode.tokens == [1, 2, 3, SAMPLE, 9, 11] and p.tokens == 6
    assert w.sched.stats.ahead_used == 2 and w.sched.ahead.guesses[f.inode] is last
    assert w.step([17]).chunks == [Chunk(last, 0, 1)]


@in_loop
async def test_a_dropped_chain_is_rolled_back_last_first_after_the_step_writing_it():
    w = World(ahead=True)
    p, f = w.process()
    free = w.free
    guess = await decoding(w, p, f)
    w.step([11])
    plan = w.sched.schedule()  # computes the chain's second guess
    other = w.pred(p, f, [5])  # not the guess: the whole chain goes
    assert guess.state is JobState.DROPPED and guess.following.state is JobState.DROPPED
    assert f.inode.busy and not other.done()
    w.sched.finish(plan, result(plan, [13]))
    assert guess.res is None and not f.inode.busy and w.free == free - 1
    w.step([12])
    assert other.result()[0].token == 12 and f.inode.tokens == [1, 2, 3, SAMPLE, 5]
    assert p.tokens == 5  # dropped guesses are never charged


@in_loop
async def test_a_failed_step_rolls_back_the_chain_it_was_extending():
    w = World(ahead=True)
    p, f = w.process()
    free = w.free
    await decoding(w, p, f)
    w.step([11])
    plan = w.sched.schedule()
    w.sched.fail_step(plan, OSError(errno.EIO, "the forward pass failed"))
    assert not w.sched.ahead.guesses and not f.inode.busy and w.free == free - 1
    assert f.inode.tokens == [1, 2, 3, SAMPLE]


@in_loop
async def test_no_guess_on_after_an_end_of_sequence_or_a_masked_pred():
    w = World(ahead=True)
    p, f = w.process()
    guess = await decoding(w, p, f)
    w.step([EOS])
    assert guess.done == 1 and guess.following is None
    q, g = w.process()
    masked = await masked_decoding(w, q, g)
    w.step([319])
    assert masked.done == 1 and masked.following is None


@in_loop
async def test_cancel_process_drops_its_chains():
    w = World(ahead=True)
    p, f = w.process()
    free = w.free
    await decoding(w, p, f)
    w.step([11])
    w.sched.cancel_process(p)
    assert not w.sched.ahead.guesses and not f.inode.busy and w.free == free - 1


@in_loop
async def test_a_seeded_guess_draws_from_a_fresh_generator_as_its_pred_would():
    w = World(ahead=True)
    p, f = w.process()
    seeded = SamplingParams(temperature=1.0, seed=1234)
    w.pred(p, f, [1, 2, 3], seeded)
    w.step()
    w.pred(p, f, [SAMPLE], seeded)
    plan = w.sched.schedule()
    (job, _), = plan.samples
    torch.rand(1, generator=job.generator)  # the pred's own sampling draws from its stream
    w.sched.finish(plan, result(plan, [9]))
    guess = w.sched.ahead.guesses[f.inode]
    fresh = seeded.generator(torch.device("cpu"))
    assert torch.equal(torch.rand(4, generator=guess.generator), torch.rand(4, generator=fresh))


# -- issue 15: truncating preds, logit controls, scores, trees -----------------------------


@in_loop
async def test_a_truncating_pred_attends_to_the_kept_entries_and_commits_in_their_place():
    w = World(budget=16)
    p, f = w.process()
    w.sched.submit(p, f, PredSpec(list(range(1, 11)), list(range(100, 110)), [9], GREEDY))
    w.step()
    w.fs.punch(f, 6, 10)
    answer = w.submit(p, f, [20, 21], truncate=7)
    plan = w.step()
    # Positions follow the entry before the cut; the punch counts only up to it.
    assert plan.batch.positions == [107, 108] and plan.batch.kv_lens == [9]
    assert plan.batch.excluded == [[(6, 7)]]
    assert answer.result()[0].row == 1
    assert f.inode.tokens == [*range(1, 8), 20, 21]
    assert f.inode.positions == [*range(100, 107), 107, 108]
    assert f.inode.excluded == [(6, 7)]


@in_loop
async def test_a_truncating_pred_cancelled_in_its_step_leaves_the_file_as_it_was():
    w = World(budget=32)
    p, f = w.process()
    w.pred(p, f, list(range(1, 21)))
    w.step()
    tokens, positions, pages, free = (list(f.inode.tokens), list(f.inode.positions),
                                      list(f.inode.pages), w.free)
    answer = w.submit(p, f, [30, 31, 32], truncate=3)
    plan = w.sched.schedule()
    assert plan.batch.positions == [3, 4, 5] and f.inode.length == 20  # not cut yet
    cancelling = asyncio.create_task(w.sched.cancel(answer))
    await asyncio.sleep(0)
    w.sched.finish(plan, result(plan))
    await cancelling
    assert answer.exception().errno == errno.ECANCELED
    assert (f.inode.tokens, f.inode.positions, f.inode.pages) == (tokens, positions, pages)
    assert w.free == free and not f.inode.busy and all(pg.refs == 1 for pg in pages)


@in_loop
async def test_a_truncate_past_the_file_at_admission_fails_with_einval_and_changes_nothing():
    w = World()
    p, f = w.process()
    w.pred(p, f, [1, 2, 3])
    failed = w.submit(p, f, [4], truncate=4)  # checked against the length at admission:
    w.step()  # the prompt is admitted first, and commits
    assert not failed.done()
    assert w.sched.schedule() is None
    assert failed.exception().errno == errno.EINVAL and "truncate 4" in str(failed.exception())
    assert f.inode.tokens == [1, 2, 3] and not f.inode.busy and p.pending == 0


@in_loop
async def test_a_pred_past_the_context_fails_and_is_freed_without_a_collection():
    """Its error goes without the traceback whose frames held the job (and its tokens): a
    cycle with the future that only the collector freed (refused preds of millions of
    tokens kept gigabytes)."""
    w = World()
    p, f = w.process()
    failed = w.pred(p, f, [5] * (CONTEXT + 1))
    (job,) = w.sched.queue
    gone = weakref.ref(job)
    del job
    gc.disable()
    try:
        assert w.sched.schedule() is None
        assert gone() is None
    finally:
        gc.enable()
    err = failed.exception()
    assert err.errno == errno.EOVERFLOW and f"position {CONTEXT}" in str(err)
    assert f.inode.length == 0 and p.pending == 0


@in_loop
async def test_score_next_scores_each_row_s_next_token_and_splits_it_out():
    w = World()
    p, f = w.process()
    answer = w.submit(p, f, [1, 2, 3, 4], outputs=[2, 0, 3], score_next=True,
                      controls=[pb.LogitControl(score_ids=[7]), pb.LogitControl(),
                                pb.LogitControl(score_ids=[8, 9])])
    plan = w.sched.schedule()
    assert [r for _, r in plan.samples] == [0, 2, 3]
    # the next token is the last score id of a row; the last token's row has none
    assert [c.score_ids for c in plan.controls] == [(2,), (7, 4), (8, 9)]
    nan = float("nan")
    w.sched.finish(plan, result(plan, scores=[[-0.5, nan], [-0.7, -0.4], [-0.8, -0.9]]))
    outputs = {o.row: o for o in answer.result()}
    assert (outputs[0].scores, outputs[0].next_logprob) == ([], -0.5)
    assert (outputs[2].scores, outputs[2].next_logprob) == ([-0.7], -0.4)
    assert (outputs[3].scores, outputs[3].next_logprob) == ([-0.8, -0.9], None)
    assert all(o.model_logprob is None for o in outputs.values())  # no mask, no bias


@in_loop
async def test_controls_stay_with_their_rows_when_the_rows_are_sorted():
    w = World()
    p, f = w.process()
    mask = np.zeros(VOCAB // 32, "<i4")
    mask[0] = 1 << 5  # token 5 only
    answer = w.submit(p, f, [1, 2, 3, 4], outputs=[3, 1],
                      controls=[pb.LogitControl(bias_ids=[4], bias_values=[2.0], score_ids=[11]),
                                pb.LogitControl(allowed=mask.tobytes(), score_ids=[22])])
    plan = w.sched.schedule()
    assert [r for _, r in plan.samples] == [1, 3]
    assert [c.score_ids for c in plan.controls] == [(22,), (11,)]
    assert plan.controls[0].allowed.tolist() == mask.tolist()
    assert plan.controls[1].bias_ids == (4,) and plan.controls[1].bias_values == (2.0,)
    w.sched.finish(plan, result(plan, model_logprobs=[-3.0, -4.0], scores=[[-1.0], [-2.0]]))
    assert [(o.row, o.model_logprob, o.scores) for o in answer.result()] == [
        (1, -3.0, [-1.0]), (3, -4.0, [-2.0])]


@in_loop
async def test_one_control_is_every_row_s_and_a_plain_step_builds_no_controls():
    w = World()
    p, f = w.process()
    q, g = w.process()
    w.submit(p, f, [1, 2, 3], outputs=[2, 0, 1], controls=[pb.LogitControl(score_ids=[9])])
    w.pred(q, g, [4, 5])
    plan = w.sched.schedule()
    assert [c and c.score_ids for c in plan.controls] == [(9,)] * 3 + [None]
    w.sched.finish(plan, result(plan, scores=[[-1.0]] * 3 + [[float("nan")]]))
    w.pred(q, g, [6])
    plan = w.step()
    assert plan.controls is None and plan.batch.trees is None


@in_loop
async def test_a_tree_pred_chunked_over_two_steps_gives_each_chunk_its_rows_of_bits():
    w = World(budget=4)
    p, f = w.process()
    q, g = w.process()
    w.pred(p, f, [1, 2, 3])
    w.step()
    parents = [-1, 0, 0, 1, 1, 2]
    bits = ancestor_bits(parents)
    answer = w.submit(p, f, [10, 11, 12, 13, 14, 15], parents=parents, outputs=[3, 5])
    q.vruntime = p.vruntime + 100  # after p
    w.pred(q, g, [7])
    first = w.step()
    assert sizes(first) == [(p, 3), (q, 1)] and first.batch.kv_lens == [6, 1]
    tree, plain = first.batch.trees
    assert plain is None and tree.start == 3 and np.array_equal(tree.bits, bits[0:3])
    assert first.batch.positions == [3, 4, 4, 0]
    second = w.step()
    (tree,) = second.batch.trees
    assert tree.start == 3 and np.array_equal(tree.bits, bits[3:6])
    assert second.batch.positions == [5, 5, 5] and second.batch.kv_lens == [9]
    assert [o.row for o in answer.result()] == [3, 5]
    assert f.inode.positions == [0, 1, 2, 3, 4, 4, 5, 5, 5]


@in_loop
async def test_a_chain_of_parents_is_causal_and_explicit_positions_stand():
    w = World()
    p, f = w.process()
    w.submit(p, f, [1, 2, 3], parents=[-1, 0, 1])
    assert w.step().batch.trees is None
    w.submit(p, f, [4, 5], parents=[-1, -1], positions=[10, 10])
    plan = w.step()
    assert plan.batch.positions == [10, 10] and plan.batch.trees[0].bits.tolist() == [[1], [2]]


@pytest.mark.parametrize("extra", [{"score_next": True}, {"parents": [-1]}, {"truncate": 4}])
@in_loop
async def test_a_pred_with_scores_next_a_tree_or_a_cut_neither_takes_a_guess_nor_makes_one(
        extra):
    """{"parents": [-1]} of one token is a chain, plain: it is the one that takes it."""
    w = World(ahead=True)
    p, f = w.process()
    guess = await decoding(w, p, f)
    w.step([11])  # the guess of [9] is computed
    answer = w.submit(p, f, [9], **extra)
    plain = extra == {"parents": [-1]}
    if plain:
        assert guess.state is JobState.ANSWERED and answer.result()[0].token == 11
        return
    assert guess.state is JobState.DROPPED and not answer.done()
    plan = w.step([12])
    assert plan.chunks[0].job is not guess and answer.result()[0].token == 12
    assert not w.sched.ahead.guesses  # the next pred will carry its own


def only(token: int) -> pb.LogitControl:
    """A control whose mask allows `token` alone."""
    mask = np.zeros(VOCAB // 32, "<i4")
    mask[token // 32] = 1 << (token % 32)
    return pb.LogitControl(allowed=mask.tobytes())


@in_loop
async def test_a_masked_pred_takes_no_computed_guess_made_after_a_plain_one():
    """Its logits were not kept; the masked pred's own guess keeps them."""
    w = World(ahead=True)
    p, f = w.process()
    guess = await decoding(w, p, f)
    w.step([11])
    answer = w.submit(p, f, [9], controls=[only(5)])
    assert guess.state is JobState.DROPPED and not answer.done()
    w.step([5], model_logprobs=[-2.0])
    assert answer.result()[0].token == 5
    assert w.sched.ahead.guesses[f.inode].keep_logits


async def masked_decoding(w: World, p: Process, f: Handle):
    """As decoding(), with masked preds: the guess keeps its logits."""
    w.submit(p, f, [1, 2, 3], controls=[only(SAMPLE)])
    w.step(model_logprobs=[-1.5])
    w.submit(p, f, [SAMPLE], controls=[only(9)])
    w.step([9], model_logprobs=[-1.5])
    guess = w.sched.ahead.guesses[f.inode]
    assert guess.keep_logits and guess.spec.controls is None
    return guess


@in_loop
async def test_a_masked_pred_takes_its_computed_guess_and_samples_its_kept_logits_with_its_mask():
    w = World(ahead=True)
    p, f = w.process()
    guess = await masked_decoding(w, p, f)
    plan = w.step([319])  # computed unmasked: the last id
    assert plan.kept == [0] and guess.logits is not None and guess.done == 1
    answer = w.submit(p, f, [9], controls=[only(5)])
    assert not answer.done() and w.sched.schedule() is None  # nothing left to compute
    await asyncio.sleep(0)  # answered when the loop turns, without another step
    (out,) = answer.result()
    assert out.token == 5 and out.logprob == 0.0  # the only allowed token
    # the model's own logprob of 5, from the kept logits
    assert out.model_logprob == pytest.approx(torch.log_softmax(
        torch.arange(VOCAB, dtype=torch.float32), 0)[5].item())
    assert f.inode.tokens[-1] == 9 and w.sched.stats.ahead_used == 1 and guess.logits is None
    assert w.sched.ahead.guesses[f.inode].spec.tokens == [5]  # the loop goes on ahead


@in_loop
async def test_masked_preds_taking_computed_guesses_together_are_sampled_in_one_batch(
        monkeypatch):
    w = World(ahead=True)
    files = [w.process() for _ in range(3)]
    for p, f in files:
        await masked_decoding(w, p, f)
    w.step([319, 319, 319])  # the three guesses, computed unmasked
    batches = []
    real = scheduler.resample
    monkeypatch.setattr(scheduler, "resample",
                        lambda jobs, logits: batches.append(len(jobs)) or real(jobs, logits))
    answers = [w.submit(p, f, [9], controls=[only(t)])
               for (p, f), t in zip(files, (5, 6, 7), strict=True)]
    await asyncio.sleep(0)
    assert batches == [3] and [a.result()[0].token for a in answers] == [5, 6, 7]
    assert all(f.inode.tokens[-1] == 9 for _, f in files)
    assert [w.sched.ahead.guesses[f.inode].spec.tokens for _, f in files] == [[5], [6], [7]]


@in_loop
async def test_a_masked_pred_cancelled_before_its_guess_is_sampled_leaves_its_file():
    w = World(ahead=True)
    p, f = w.process()
    free = w.free
    await masked_decoding(w, p, f)
    w.step([319])
    answer = w.submit(p, f, [9], controls=[only(5)])
    await w.sched.cancel(answer)
    await asyncio.sleep(0)
    assert answer.exception().errno == errno.ECANCELED
    assert f.inode.tokens == [1, 2, 3, SAMPLE] and not f.inode.busy and w.free == free - 1
    assert p.pending == 0 and w.sched.queue == []


@in_loop
async def test_a_masked_pred_takes_its_guess_in_the_running_step_and_is_sampled_after_it():
    w = World(ahead=True)
    p, f = w.process()
    await masked_decoding(w, p, f)
    plan = w.sched.schedule()
    answer = w.submit(p, f, [9], controls=[only(7)])
    assert not answer.done()
    w.sched.finish(plan, result(plan, [319]))
    assert answer.result()[0].token == 7 and f.inode.length == 5


@in_loop
async def test_masked_preds_taking_guesses_in_one_step_are_sampled_together_each_with_its_mask():
    w = World(ahead=True)
    (p, f), (q, g) = w.process(), w.process()
    for tokens, sampled in (([1, 2, 3], SAMPLE), ([SAMPLE], 9)):  # both decode masked
        for proc, file in ((p, f), (q, g)):
            w.submit(proc, file, tokens, controls=[only(sampled)])
        w.step([sampled] * 2, model_logprobs=[-1.5, -1.5])
    plan = w.sched.schedule()
    assert plan.kept == [0, 1]
    answers = [w.submit(p, f, [9], controls=[only(7)]), w.submit(q, g, [9], controls=[only(40)])]
    w.sched.finish(plan, result(plan, [319, 319]))
    assert [a.result()[0].token for a in answers] == [7, 40]


@in_loop
async def test_a_masked_pred_takes_a_guess_not_yet_computed_with_its_mask_in_the_step():
    w = World(ahead=True)
    p, f = w.process()
    guess = await decoding(w, p, f)  # made after a plain pred: no kept logits
    answer = w.submit(p, f, [9], controls=[only(5)])
    assert guess.state is JobState.ADMITTED and guess.spec.controls is not None
    plan = w.step([5], model_logprobs=[-2.0])
    assert plan.controls[0].allowed is not None and plan.kept == []
    assert answer.result()[0].token == 5 and answer.result()[0].model_logprob == -2.0


@in_loop
async def test_a_pred_s_spec_is_what_submit_pred_built_frozen_and_its_progress_is_the_job_s():
    w = World()
    p, f = w.process()
    w.submit(p, f, [4, 5, 6], outputs=[2, 0], truncate=0,
             sampler=pb.Sampler(temperature=0.5, seed=3))
    (job,) = w.sched.queue
    spec = job.spec
    assert spec == PredSpec([4, 5, 6], None, [0, 2], SamplingParams(temperature=0.5, seed=3),
                            cut=0)  # the rows sorted
    with pytest.raises(AttributeError):  # a named tuple's fields are read-only
        spec.tokens = [7]
    assert not hasattr(spec, "__dict__")  # no attributes of its own either
    assert job.positions is None  # read on admission
    w.step()
    assert job.state is JobState.ANSWERED and job.spec is spec and spec.positions is None
    assert job.positions == [0, 1, 2] and f.inode.tokens == [4, 5, 6]


@pytest.mark.parametrize(("fields", "words"), [
    ({"controls": [pb.LogitControl(bias_ids=[1, 2], bias_values=[1.0])]},
     "controls[0]: bias_ids has 2 ids but bias_values 1 values"),
    ({"controls": [pb.LogitControl(score_ids=[1])] * 2}, "2 controls for 1 output rows"),
    ({"outputs": [0, 1], "controls": [pb.LogitControl(), pb.LogitControl(score_ids=[VOCAB])]},
     "controls[1]: score_ids: token 320"),
    ({"outputs": [1, 2]}, "pred: output row 2 is not a row of 2 tokens"),
    ({"outputs": [1, 0, 1]}, "pred: output row 1 is given more than once"),
])
@in_loop
async def test_a_bad_control_only_a_raw_request_can_send_is_einval_and_queues_nothing(fields,
                                                                                      words):
    w = World()
    p, f = w.process()
    with pytest.raises(OSError) as e:
        w.submit(p, f, [1, 2], **fields)
    assert e.value.errno == errno.EINVAL and words in str(e.value)
    assert w.sched.queue == [] and p.pending == 0 and w.sched.schedule() is None


@in_loop
async def test_an_error_about_a_million_output_rows_names_one():
    """The message named every row given: with millions, the reply passed 64 MiB and the
    caller's session died without its EINVAL."""
    w = World()
    p, f = w.process()
    with pytest.raises(OSError) as e:
        w.submit(p, f, [1, 2], outputs=[0, *range(2, 1_000_000)])
    assert e.value.errno == errno.EINVAL and len(str(e.value)) < 100
    assert "output row 2 is not a row of 2 tokens" in str(e.value)


# -- pipelined steps: the next planned while one is in flight -----------------------------


async def two_in_flight(w: World, p: Process, f: Handle) -> tuple[StepPlan, StepPlan]:
    """p decodes (decoding()); the step computing its guess is in flight, and the next one,
    planned meanwhile, computes the guess on that guess, whose token it does not know yet."""
    first = await decoding(w, p, f)
    computing = w.sched.schedule()
    assert computing.chunks == [Chunk(first, 0, 1)]
    second = w.sched.ahead.guesses[f.inode].following  # made as soon as first was planned
    assert second.spec.tokens == [-1] and second.after is first and second.positions == [5]
    behind = w.sched.schedule()
    assert behind.chunks == [Chunk(second, 0, 1)] and w.sched.running == [computing, behind]
    # its token is the sample of logit row 0 of the step in flight, filled in by the engine
    assert behind.placeholders == [(0, 0)] and behind.batch.token_ids == [0]
    assert behind.batch.positions == [5] and behind.batch.kv_lens == [6]
    return computing, behind


@in_loop
async def test_a_pipelined_step_computes_the_guess_on_a_guess_in_flight():
    w = World(ahead=True, pipeline=True)
    p, f = w.process()
    computing, behind = await two_in_flight(w, p, f)
    first, second = computing.chunks[0].job, behind.chunks[0].job
    w.sched.finish(computing, result(computing, [11]))
    assert second.spec.tokens == [11] and second.after is None  # learned from the step
    assert w.sched.schedule() is None  # nothing left to plan: the chain is DEPTH long
    w.sched.finish(behind, result(behind, [12]))
    assert w.sched.running == [] and p.tokens == 4  # guesses are charged when taken
    assert w.pred(p, f, [9]).result()[0].token == 11
    assert w.pred(p, f, [11]).result()[0].token == 12
    assert f.inode.tokens == [1, 2, 3, SAMPLE, 9, 11] and f.inode.positions == list(range(6))
    assert first.state is second.state is JobState.ANSWERED and p.tokens == 6
    assert w.sched.stats.ahead_used == 2


@in_loop
async def test_a_pred_takes_a_guess_whose_token_a_step_in_flight_learns():
    """The first guess taken while computed: the second, planned on its sample, follows."""
    w = World(ahead=True, pipeline=True)
    p, f = w.process()
    computing, behind = await two_in_flight(w, p, f)
    answer = w.pred(p, f, [9])  # takes the first, in flight
    assert not answer.done()
    w.sched.finish(computing, result(computing, [11]))
    assert answer.result()[0].token == 11
    nxt = w.pred(p, f, [11])  # takes the second, in flight behind
    w.sched.finish(behind, result(behind, [12]))
    assert nxt.result()[0].token == 12 and f.inode.tokens == [1, 2, 3, SAMPLE, 9, 11]


@in_loop
async def test_another_pred_drops_a_chain_in_two_steps_when_the_last_ends():
    w = World(ahead=True, pipeline=True)
    p, f = w.process()
    free = w.free
    computing, behind = await two_in_flight(w, p, f)
    other = w.pred(p, f, [5])
    assert not w.sched.ahead.guesses and f.inode.busy
    w.sched.finish(computing, result(computing, [11]))
    assert f.inode.busy  # the step behind still writes the chain's last guess
    assert w.sched.schedule() is None
    w.sched.finish(behind, result(behind, [12]))
    assert not f.inode.busy and w.free == free - 1
    plan = w.step([13])
    assert plan.batch.token_ids == [5] and plan.batch.positions == [4]
    assert other.result()[0].token == 13 and f.inode.tokens == [1, 2, 3, SAMPLE, 5]
    assert p.tokens == 5


@in_loop
async def test_settle_waits_for_both_steps_in_flight():
    w = World(ahead=True, pipeline=True)
    p, f = w.process()
    computing, behind = await two_in_flight(w, p, f)
    settling = asyncio.create_task(w.sched.settle(f.inode))
    await asyncio.sleep(0)
    w.sched.finish(computing, result(computing, [11]))
    await asyncio.sleep(0)
    assert not settling.done() and f.inode.busy
    w.sched.finish(behind, result(behind, [12]))
    await settling
    assert not f.inode.busy and f.inode.length == 4


@in_loop
async def test_a_failed_step_fails_the_chain_once_the_step_behind_it_ends():
    """The step behind takes its token from the failed one: the engine fails it too."""
    w = World(ahead=True, pipeline=True)
    p, f = w.process()
    free = w.free
    computing, behind = await two_in_flight(w, p, f)
    w.sched.fail_step(computing, OSError(errno.EIO, "the forward pass failed"))
    assert f.inode.busy and not w.sched.ahead.guesses
    w.sched.fail_step(behind, OSError(errno.EIO, "the forward pass failed"))
    assert not f.inode.busy and w.free == free - 1 and f.inode.length == 4
    assert w.sched.running == []


@in_loop
async def test_a_prefill_in_two_steps_in_flight_is_rolled_back_after_the_second():
    w = World(budget=4, pipeline=True)
    p, f = w.process()
    free = w.free
    answer = w.pred(p, f, list(range(1, 11)))
    first, second = w.sched.schedule(), w.sched.schedule()
    assert [c.start for c in first.chunks + second.chunks] == [0, 4]
    cancelling = asyncio.create_task(w.sched.cancel(answer))
    await asyncio.sleep(0)
    w.sched.finish(first, result(first))
    await asyncio.sleep(0)
    assert not cancelling.done() and f.inode.busy  # the second step still writes it
    third = w.sched.schedule()
    assert third is None  # a cancelled pred is planned no further
    w.sched.finish(second, result(second))
    await cancelling
    assert answer.exception().errno == errno.ECANCELED
    assert not f.inode.busy and f.inode.length == 0 and w.free == free


@in_loop
async def test_a_prefill_planned_in_two_steps_in_flight_commits_after_the_second():
    w = World(budget=4, pipeline=True)
    p, f = w.process()
    answer = w.pred(p, f, list(range(1, 9)))
    first, second = w.sched.schedule(), w.sched.schedule()
    assert second.batch.kv_lens == [8] and second.batch.logit_rows == [3]
    w.sched.finish(first, result(first))
    assert not answer.done() and f.inode.length == 0
    w.sched.finish(second, result(second, [42]))
    assert answer.result()[0].token == 42 and f.inode.tokens == list(range(1, 9))


def test_placeholders_take_the_samples_of_the_step_before():
    work = StepWork(Batch([5, 0, 7, 0], [0, 1, 2, 3], [1, 1, 1, 1], [1, 2, 3, 4],
                          [[0]] * 4, [0, 1, 2, 3]), [], [], None, [],
                    [(1, 2), (3, 0)])
    fill_placeholders(work, [30, 31, 32])
    assert work.batch.token_ids == [5, 32, 7, 30]
    with pytest.raises(ValueError, match="failed"):
        fill_placeholders(work, None)


@in_loop
async def test_a_pred_that_took_a_guess_in_flight_and_is_cancelled_goes_after_its_chain():
    """The guess behind is stacked on the taken guess's reservation: both are rolled back,
    that one first, when the step behind ends; a truncate waits for that."""
    w = World(ahead=True, pipeline=True)
    p, f = w.process()
    free = w.free
    computing, behind = await two_in_flight(w, p, f)
    answer = w.pred(p, f, [9])  # takes the first guess, in flight
    cancelling = asyncio.create_task(w.sched.cancel(answer))
    await asyncio.sleep(0)
    w.sched.finish(computing, result(computing, [11]))
    await asyncio.sleep(0)
    assert answer.exception().errno == errno.ECANCELED and f.inode.busy
    settling = asyncio.create_task(w.sched.settle(f.inode))
    await asyncio.sleep(0)
    assert not settling.done()
    w.sched.finish(behind, result(behind, [12]))
    await cancelling
    await settling
    assert not f.inode.busy and f.inode.tokens == [1, 2, 3, SAMPLE] and w.free == free - 1
    assert not w.sched.ahead.guesses and w.sched.schedule() is None


@in_loop
async def test_behind_a_step_a_pred_goes_only_before_the_processes_that_step_answers():
    """a's pred is in flight; b (ahead of a in virtual runtime, a counted with the two
    tokens that step charges it, only when a has run more) is planned behind it only then:
    otherwise a, back with its next pred, goes first."""
    w = World(pipeline=True)
    a, fa = w.process()
    b, fb = w.process(nice=10)
    w.pred(a, fa, [1, 2])
    computing = w.sched.schedule()
    w.pred(b, fb, [3, 4])
    b.vruntime = a.vruntime + 2 + 1
    assert w.sched.schedule() is None
    b.vruntime = a.vruntime + 2
    behind = w.sched.schedule()
    assert sizes(behind) == [(b, 2)]
    w.sched.finish(computing, result(computing))
    w.sched.finish(behind, result(behind))


@in_loop
async def test_behind_a_step_its_processes_count_with_what_it_charges_them():
    """Two processes at nice 0, each with two budget-sized preds queued: the step behind
    the one in flight goes to the other process, as it would once that step is charged.
    Ordered on the virtual runtimes before the step in flight's charge, the process whose
    turn it was got the step behind too: each turn two steps or more, whatever the nice
    (with nice 19 against nice 0, 1,024 tokens a turn instead of 512)."""
    w = World(budget=8, pipeline=True)
    (a, _), (b, _) = w.process(), w.process()
    for p in (a, a, b, b):
        f = w.fs.open(p.cred, "", os.O_RDWR)
        p.add_fd(f)
        w.pred(p, f, list(range(1, 9)))
    first = w.sched.schedule()
    behind = w.sched.schedule()
    assert sizes(first) == [(a, 8)] and sizes(behind) == [(b, 8)]
    w.sched.finish(first, result(first))
    w.sched.finish(behind, result(behind))
    assert a.vruntime == b.vruntime == 8.0


@in_loop
async def test_behind_a_step_a_seeded_pred_waits_for_its_generator():
    w = World(budget=4, pipeline=True)
    p, f = w.process()
    seeded = SamplingParams(temperature=1.0, seed=7)
    answer = w.sched.submit(p, f, PredSpec(list(range(1, 9)), None, [3, 7], seeded))
    first = w.sched.schedule()
    assert w.sched.schedule() is None  # its second chunk samples with the generator in flight
    w.sched.finish(first, result(first))
    w.step()
    assert len(answer.result()) == 2


@in_loop
async def test_a_sampler_padded_with_fields_protobuf_skips_is_checked_but_not_kept():
    """A sampler's bytes key the cache of checked samplers: a long one (an unknown field,
    which protobuf skips) is checked each time and never kept, or 1024 of them could hold
    gigabytes; a short one is kept once."""
    w = World()
    p, f = w.process()
    unknown = b"\xfa\x0f" + bytes([0x80 | 1000 & 0x7F, 1000 >> 7]) + b"x" * 1000  # field 255
    padded = pb.Sampler.FromString(pb.Sampler(temperature=0.5).SerializeToString() + unknown)
    syscall_table._checked_sampler.cache_clear()
    answer = w.submit(p, f, [1, 2, 3], sampler=padded)
    w.step()
    assert len(await answer) == 1
    assert syscall_table._checked_sampler.cache_info().currsize == 0
    answer = w.submit(p, f, [4], sampler=pb.Sampler(temperature=0.5))
    w.step()
    assert len(await answer) == 1
    assert syscall_table._checked_sampler.cache_info().currsize == 1
    bad = pb.Sampler.FromString(pb.Sampler(top_p=2.0).SerializeToString() + unknown)
    with pytest.raises(OSError) as e:
        w.submit(p, f, [5], sampler=bad)
    assert e.value.errno == errno.EINVAL and "top_p" in str(e.value)
    assert f.inode.length == 4


# -- decode streams (decode_stream.py) --------------------------------------------------


def known(w: World, p: Process, f: Handle, token: int, replies: list | None) -> asyncio.Future:
    """A known plain decode pred as the rings send one (syscall_table.submit_known): it
    takes the file's stream slot or guess, else it is submitted. With `replies` it is
    answered through a reply, which the list records, as a ring's pred is (its file then
    decodes ahead as a stream); with None, as a gRPC pred (guess jobs)."""
    reply = None if replies is None else lambda out, err: replies.append((out, err))
    taken = w.sched.take_guess(f, token, GREEDY, reply)
    if taken is not None:
        return taken
    return w.sched.submit(p, f, PredSpec([token], None, [0], GREEDY), reply)


def by_position(plan: StepPlan) -> StepResult:
    """A step's samples as a function of each row's position alone, whatever the order of
    the rows (a stream's come after the chunks')."""
    positions = plan.batch.positions
    return result(plan, [(positions[r] * 7 + 3) % (VOCAB - 1) for r in plan.batch.logit_rows])


async def decode_loops(w: World, streams: bool, late: bool, preds: int = 12) -> list:
    """Three processes (one at nice 5) decode `preds` preds each after prompts of different
    lengths, each coming back with its next pred at once or, `late`, 0, 1 or 2 steps after
    its answer (in turn, each process from its own start: a late LIP finds its guesses
    computed, chained up to DEPTH); steps pipelined when the world is. What each process
    and file ends with, and the scheduler's counts."""
    lips = [(*w.process(nice), [], []) for nice in (0, 0, 5)]  # p, f, replies, answers
    pending, due = {}, {}
    for i, (p, f, replies, _) in enumerate(lips):
        prompt = list(range(1, 4 + 3 * i))
        reply = (lambda out, err, r=replies: r.append((out, err))) if streams else None
        pending[p] = w.sched.submit(p, f, PredSpec(prompt, None, [len(prompt) - 1], GREEDY),
                                    reply)
    in_flight = 2 if w.sched.pipeline else 1
    for tick in range(10 * preds):
        while len(w.sched.running) < in_flight and w.sched.schedule() is not None:
            pass
        if w.sched.running:
            done = w.sched.running[0]
            w.sched.finish(done, by_position(done))
        for i, (p, f, replies, answers) in enumerate(lips):
            if pending[p] is not None and pending[p].done():
                (out,) = pending[p].result()
                answers.append(out.token)
                pending[p] = None
                if len(answers) <= preds:
                    due[p] = tick + (i + len(answers)) % 3 if late else tick
            if due.get(p) == tick:
                pending[p] = known(w, p, f, answers[-1], replies if streams else None)
    assert not w.sched.queue and not w.sched.running
    assert [len(answers) for *_, answers in lips] == [preds + 1] * 3
    assert len(w.sched.ahead.streams if streams else w.sched.ahead.guesses) == 3
    await w.sched.give_way()  # the guesses never taken give their pages back
    for _, _, replies, answers in lips:
        assert not streams or [o[0].token for o, _ in replies] == answers
    s = w.sched.stats
    return [[(answers, f.inode.tokens, f.inode.positions, p.tokens, p.vruntime, p.pending)
             for p, f, _, answers in lips], s.preds, s.ahead, s.ahead_used, s.steps]


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("pipeline", [False, True])
@in_loop
async def test_a_stream_decodes_ahead_exactly_as_guess_jobs_do(pipeline, late):
    """The same decode loops, their preds answered through replies (the rings': streams)
    and not (gRPC's: guess jobs): the same answers, files, charges, guesses and steps."""
    worlds = [World(ahead=True, pipeline=pipeline, budget=16) for _ in range(2)]
    as_jobs = await decode_loops(worlds[0], streams=False, late=late)
    on_streams = await decode_loops(worlds[1], streams=True, late=late)
    assert as_jobs == on_streams
    assert as_jobs[2] > 30 and as_jobs[3] > 30  # guesses made and used, most of them
    assert worlds[1].free == worlds[0].free


async def streaming(w: World, p: Process, f: Handle, replies: list):
    """p's file holds a prompt and one fed-back sample, both answered through replies; its
    stream's first slot (the next pred's) is made, not yet computed. Returns the stream."""
    prompt = known(w, p, f, 1, replies)
    while not prompt.done():
        w.step()
    assert f.inode not in w.sched.ahead.streams  # a prompt does not continue a sample
    known(w, p, f, SAMPLE, replies)
    plan = w.sched.schedule()
    w.sched.finish(plan, result(plan, [9] * plan.rows))  # other files' slots too
    return w.sched.ahead.streams[f.inode]


async def one_stream(**world) -> tuple:
    """A world decoding ahead (`world`: World's other options) with one process whose file
    streams (streaming()): the world, the process, its file, its replies, the stream."""
    w = World(ahead=True, **world)
    p, f = w.process()
    replies = []
    return w, p, f, replies, await streaming(w, p, f, replies)


@in_loop
async def test_a_computed_slot_is_answered_on_its_pred_with_no_step():
    w, p, f, replies, stream = await one_stream()
    (slot,) = stream.slots
    assert slot.token == 9 and slot.position == 2 and not w.sched.ahead.guesses
    plan = w.step([11])
    assert plan.chunks == [] and plan.streamed == [slot] and plan.batch.kv_lens == [3]
    assert f.inode.tokens == [1, SAMPLE] and p.tokens == 2  # unseen, not charged
    (slot2,) = stream.slots[1:]  # guessed on from the computed slot, up to DEPTH
    assert slot2.token == 11 and slot2.position == 3
    answer = known(w, p, f, 9, replies)
    assert answer.result() == [Output(0, 11, -1.0, (), ())]
    assert replies[-1] == (answer.result(), None)
    assert f.inode.tokens == [1, SAMPLE, 9] and p.tokens == 3 and p.pending == 0
    assert stream.slots == [slot2] and w.sched.stats.ahead_used == 1
    assert w.sched.run_queue() == 0 and not w.sched.uses(f)


@in_loop
async def test_a_pred_takes_a_slot_in_the_running_step_and_is_answered_when_it_ends():
    w, p, f, replies, stream = await one_stream()
    plan = w.sched.schedule()
    answer = known(w, p, f, 9, replies)
    assert not answer.done() and stream.taken and w.sched.run_queue() == 1 and w.sched.uses(f)
    assert not w.sched.queue and p.state == "running"
    w.sched.finish(plan, result(plan, [11]))
    assert answer.result()[0].token == 11 and len(replies) == 3 and plan.served == [p]
    assert f.inode.tokens == [1, SAMPLE, 9] and p.pending == 0 and w.sched.run_queue() == 0
    assert [s.token for s in stream.slots] == [11]  # the next pred's, made at the answer


@in_loop
async def test_a_pipelined_slot_on_a_slot_in_flight_takes_its_token_from_the_engine():
    w, p, f, replies, stream = await one_stream(pipeline=True)
    computing = w.sched.schedule()
    first, second = stream.slots  # the second made as soon as the first was planned
    assert second.token == -1 and second.after is first and second.position == 3
    behind = w.sched.schedule()
    assert behind.streamed == [second] and behind.placeholders == [(0, 0)]
    assert behind.batch.token_ids == [0] and behind.batch.kv_lens == [4]
    answer = known(w, p, f, 9, replies)  # takes the first, in flight
    w.sched.finish(computing, result(computing, [11]))
    assert answer.result()[0].token == 11 and second.token == 11 and second.after is None
    w.sched.finish(behind, result(behind, [12]))
    assert known(w, p, f, 11, replies).result()[0].token == 12  # computed: no step
    assert f.inode.tokens == [1, SAMPLE, 9, 11] and p.tokens == 4


@in_loop
async def test_another_pred_turns_the_stream_into_guess_jobs_and_drops_them():
    w = World(ahead=True)
    p, f = w.process()
    replies = []
    free = w.free
    stream = await streaming(w, p, f, replies)
    assert w.free == free - 1 and f.inode.busy  # the file's page, and the slot in it
    answer = known(w, p, f, 10, replies)  # not the guessed token: not a decode loop's
    assert not w.sched.ahead.streams and not w.sched.ahead.guesses and stream.slots == []
    w.step([12])
    assert answer.result()[0].token == 12 and f.inode.tokens == [1, SAMPLE, 10]
    assert not w.sched.ahead.streams and not f.inode.busy
    known(w, p, f, 12, replies)  # the loop goes on, and so does decoding ahead
    w.step([13])
    assert w.sched.ahead.streams[f.inode].slots[0].token == 13


@in_loop
async def test_a_taken_slot_cancelled_in_its_step_is_rolled_back_after_it_with_no_reply():
    w, p, f, replies, stream = await one_stream(pipeline=True)
    free = w.free
    computing = w.sched.schedule()
    behind = w.sched.schedule()  # the slot on the slot in flight
    answer = known(w, p, f, 9, replies)
    answer.cancel()  # as a CANCEL frame does (server.Hello.cancel), then its task
    cancelling = asyncio.create_task(w.sched.cancel(answer))
    await asyncio.sleep(0)
    assert not w.sched.ahead.streams and stream.slots == []  # jobs now, in the queue
    (job,) = w.sched.queue
    assert job.future is answer and job.state is JobState.CANCELLED
    assert behind.computes(w.sched.ahead.guesses[f.inode])  # the slot behind, as a chunk
    w.sched.finish(computing, result(computing, [11]))
    w.sched.finish(behind, result(behind, [12]))
    await cancelling
    assert answer.cancelled() and len(replies) == 2  # the two before: cancel() replies
    assert f.inode.tokens == [1, SAMPLE] and not f.inode.busy and w.free == free
    assert p.pending == 0 and not w.sched.queue and not w.sched.ahead.guesses


@in_loop
async def test_a_taken_slot_whose_future_is_cancelled_before_cancel_runs_is_rolled_back():
    """A CANCEL frame cancels the pred's future and leaves cancel() to a task: the step
    computing the slot ends first. The pred is not answered and its file is as before."""
    w, p, f, replies, _ = await one_stream()
    plan = w.sched.schedule()
    answer = known(w, p, f, 9, replies)
    answer.cancel()
    w.sched.finish(plan, result(plan, [11]))
    assert len(replies) == 2 and f.inode.tokens == [1, SAMPLE] and not f.inode.busy
    assert p.pending == 0 and not w.sched.queue and not w.sched.ahead.streams
    await w.sched.cancel(answer)  # the task, later: nothing left to do
    assert w.sched.schedule() is None


@in_loop
async def test_a_failed_step_fails_the_pred_on_its_slot_and_drops_the_stream():
    w, p, f, replies, _ = await one_stream(pipeline=True)
    free = w.free
    computing = w.sched.schedule()
    behind = w.sched.schedule()
    answer = known(w, p, f, 9, replies)
    w.sched.fail_step(computing, OSError(errno.EIO, "pred: the forward pass failed"))
    assert answer.exception().errno == errno.EIO and replies[-1][1] is answer.exception()
    w.sched.fail_step(behind, OSError(errno.EIO, "pred: the forward pass failed"))
    assert f.inode.tokens == [1, SAMPLE] and not f.inode.busy and w.free == free
    assert p.pending == 0 and not w.sched.queue and not w.sched.ahead.streams
    assert not w.sched.ahead.guesses and w.sched.schedule() is None


@in_loop
async def test_an_exit_settle_or_give_way_turns_streams_into_jobs_and_frees_their_slots():
    w = World(ahead=True)
    procs = [w.process() for _ in range(3)]
    for p, f in procs:
        await streaming(w, p, f, [])
    free = w.free
    assert len(w.sched.ahead.streams) == 3 and all(f.inode.busy for _, f in procs)
    (a, fa), (b, fb), (c, fc) = procs
    a.alive = False
    w.sched.cancel_process(a)
    assert fa.inode not in w.sched.ahead.streams and not fa.inode.busy
    await w.sched.settle(fb.inode)
    assert fb.inode not in w.sched.ahead.streams and not fb.inode.busy
    assert await w.sched.give_way() and not w.sched.ahead.streams and not fc.inode.busy
    assert w.free == free and not w.sched.ahead.guesses and w.sched.schedule() is None


@in_loop
async def test_a_settle_waits_for_the_step_computing_a_taken_slot_and_its_pred():
    """A truncate on a file whose pred took a slot in flight: the pred is the file's (it
    is answered), so the call finds the file in use, after the step."""
    w, p, f, replies, _ = await one_stream()
    plan = w.sched.schedule()
    answer = known(w, p, f, 9, replies)
    await w.sched.settle(f.inode)
    assert w.sched.uses(f) and [j.future for j in w.sched.queue] == [answer]
    w.sched.finish(plan, result(plan, [11]))
    assert answer.result()[0].token == 11 and f.inode.tokens == [1, SAMPLE, 9]
    assert not w.sched.uses(f) and not w.sched.queue


@pytest.mark.parametrize("p_first", [True, False])
@in_loop
async def test_a_taken_slot_planned_beside_a_pred_short_of_pages_goes_as_its_job(p_first):
    """p's pred took its slot, not computed yet; q's prompt finds no page when planned, and
    the guesses give way: p's stream becomes jobs, and its slot goes in the step as its
    job's chunk, whether planning took it before q (p first) or had it still to take."""
    w = World(ahead=True, pages=2, host=0)
    p, f = w.process()
    q, g = w.process()
    replies = []
    w.sched.submit(p, f, PredSpec([1, 2, 3], None, [2], GREEDY),
                   lambda out, err: replies.append((out, err)))
    w.step()
    known(w, p, f, SAMPLE, replies)
    w.step([9])
    assert w.free == 0 and f.inode in w.sched.ahead.streams  # p's file, and its slot's page
    answer = known(w, p, f, 9, replies)
    (q if p_first else p).vruntime = 100.0
    waiting = w.pred(q, g, [1])
    plan = w.sched.schedule()
    (job,) = [j for j in w.sched.queue if j.proc is p]
    assert plan.streamed == [] and plan.chunks == [Chunk(job, 0, 1)] and q.waiting
    w.sched.finish(plan, result(plan, [11]))
    assert answer.result()[0].token == 11 and f.inode.tokens == [1, 2, 3, SAMPLE, 9]
    assert not waiting.done() and w.sched.run_queue() == 1


@in_loop
async def test_a_pred_that_takes_a_slot_in_flight_ends_the_hold_that_waits_for_it():
    """run() holds the next step a little for the processes just served; a pred that
    comes and takes its slot in the running step wakes that hold, which then waits no
    longer for its process, as a pred that takes a guess job does."""
    w = World(ahead=True, pipeline=True)
    p, f = w.process()
    q, g = w.process()
    replies = []
    await streaming(w, p, f, replies)
    w.sched.schedule()  # the slot, in flight
    assert p.pending == 0 and p.think < 0.01  # it comes back at once
    q.vruntime = 100.0
    w.pred(q, g, [1])  # queued, behind p
    hold = asyncio.create_task(w.sched._hold_for([p], 1.0))
    await asyncio.sleep(0)
    assert not hold.done()  # waits for p, whose turn it is
    known(w, p, f, 9, replies)
    for _ in range(3):
        await asyncio.sleep(0)
    assert hold.done()


async def last_page(streams: bool) -> tuple[bool, bool]:
    """p and q decode, p through replies when `streams`; one free page is left when both
    take guesses in one step, q first: whose answer makes the next guess, with that page."""
    w = World(ahead=True, pages=5, host=0, budget=16)
    p, f = w.process()
    q, g = w.process()
    replies = [] if streams else None
    reply = (lambda out, err: replies.append((out, err))) if streams else None
    w.sched.submit(p, f, PredSpec([1, 2, 3, 4, 5, 6], None, [5], GREEDY), reply)
    w.sched.submit(q, g, PredSpec([1, 2, 3, 4, 5, 6], None, [5], GREEDY))
    w.step([9, 9])
    known(w, p, f, 9, replies)
    known(w, q, g, 9, None)
    plan = w.sched.schedule()
    w.sched.finish(plan, result(plan, [9] * plan.rows))
    assert w.free == 1 and (f.inode in w.sched.ahead.streams) == streams
    known(w, p, f, 9, replies)
    known(w, q, g, 9, None)
    q.vruntime -= 0.5
    plan = w.sched.schedule()
    w.sched.finish(plan, result(plan, [11] * plan.rows))
    ahead = w.sched.ahead
    return f.inode in ahead.guesses or f.inode in ahead.streams, g.inode in ahead.guesses


@in_loop
async def test_a_step_answers_its_preds_in_the_order_picked_streams_or_not():
    """The answers of a step make their files' next guesses in the order its work was
    picked, streams or not: with pages for one more guess, it goes to q, first."""
    assert await last_page(streams=False) == await last_page(streams=True) == (False, True)


@in_loop
async def test_a_pred_with_no_reply_takes_no_slot():
    """A slot's pred is answered through its reply alone: one without turns the stream
    into guess jobs and takes its guess as a job."""
    w = World(ahead=True)
    p, f = w.process()
    await streaming(w, p, f, [])
    answer = w.sched.take_guess(f, 9, GREEDY, None)
    assert not w.sched.ahead.streams and [j.future for j in w.sched.queue] == [answer]
    w.step([11])
    assert answer.result()[0].token == 11


@in_loop
async def test_a_reply_that_sends_the_next_pred_at_once_finds_the_stream_whole():
    """The stream's next slot is made before its pred's reply runs: a reply that sends the
    next pred at once takes it (as the next pred would take a guess job)."""
    w, p, f, replies, stream = await one_stream()
    sent = []

    def reply(out, err):
        replies.append((out, err))
        if not sent:
            sent.append(known(w, p, f, out[0].token, replies))

    plan = w.sched.schedule()
    answer = w.sched.take_guess(f, 9, GREEDY, reply)  # the slot in flight
    w.sched.finish(plan, result(plan, [11]))
    assert answer.result()[0].token == 11
    assert stream.taken and [s.token for s in stream.slots] == [11]  # taken by the reply's pred
    w.step([12])
    assert sent[0].result()[0].token == 12 and f.inode.tokens == [1, SAMPLE, 9, 11]
