"""`--engine sleep:MS`: a simulated accelerator whose steps sleep MS and answer tokens from a
rule (engine_process.py's SleepEngine), and a kernel daemon that runs on it."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from daemon import ROOT, meminfo, prompt, sched, start_daemon, wait_for

from symphony.cli import build_parser, parse_engine
from symphony.engine.config import ModelConfig
from symphony.engine.engine import Batch
from symphony.engine.sampler import RowControl, SamplingParams, sample
from symphony.engine.tokenizer import Tokenizer
from symphony.engine_process import SleepEngine, sleep_engine
from symphony.step import StepWork
from syscalls.convert import LogitControl

MS = 40.0
DAEMON_FLAGS = ("--kv-pages", "512", "--engine", f"sleep:{MS:g}")


def test_engine_values():
    assert parse_engine("model") is None
    assert parse_engine("sleep:5") == 5.0
    assert parse_engine("sleep:0.25") == 0.25
    for bad in ("", "sleep", "sleep:", "sleep:0", "sleep:-1", "sleep:nan", "sleep:inf",
                "sleep:x", "nap:5", "Model", "model:5"):
        with pytest.raises(ValueError):
            parse_engine(bad)


@pytest.mark.parametrize("command", ["kernel", "start"])
def test_a_bad_engine_is_refused(command, capsys):
    parser = build_parser()
    assert parser.parse_args([command]).engine == "model"
    assert parser.parse_args([command, "--engine", "sleep:5"]).engine == "sleep:5"
    with pytest.raises(SystemExit) as exit:
        parser.parse_args([command, "--engine", "sleep:0"])
    assert exit.value.code == 2
    assert "argument --engine: 'sleep:0' is neither model nor sleep:MS" in capsys.readouterr().err


def work(engine: SleepEngine, ids: list[int], params: SamplingParams,
         controls: list[RowControl | None] | None = None, kept: list[int] = ()) -> StepWork:
    """One sequence of `ids` with a logit row at every token."""
    n = len(ids)
    batch = Batch(ids, list(range(n)), [n], [n], [[0]], list(range(n)))
    return StepWork(batch, [params] * n, [None] * n, controls, list(kept))


SMALL = SleepEngine(0.01, vocab=64, tokens=60, special=frozenset({0, 1, 2}))


def test_a_step_sleeps_and_answers_the_rule():
    ids = [5, 9, 40, 1]
    started = time.monotonic()
    result = SMALL.forward(work(SMALL, ids, SamplingParams(temperature=1.0, top_logprobs=3)))
    assert time.monotonic() - started >= SMALL.seconds
    want = [36, 41, 43, 35]  # (31 t + p + 1) % 60: 156 % 60 = 36, 281 % 60 = 41, ...
    assert result.tokens == want
    assert SMALL.token(0, 59) == 3  # 60 % 60 = 0, moved up past the special 0, 1 and 2
    assert all(3 <= t < 60 for t in result.tokens)
    assert result.logprobs == [-math.log(2)] * 4
    assert result.top_ids == [[t, t + 1, t + 2] for t in want]
    assert result.top_logprobs[0] == pytest.approx([-math.log(2), -2 * math.log(2),
                                                    -3 * math.log(2)])
    assert result.model_logprobs is None and result.scores is None and result.kept == {}


def test_masks_scores_and_kept_rows():
    allowed = torch.frombuffer(bytearray(LogitControl.allowing([7, 50], 64).allowed),
                               dtype=torch.int32)
    mask = RowControl(allowed=allowed, score_ids=(7, 8, 9))
    score = RowControl(score_ids=(3,))
    ids = [5, 6, 1]  # the rule's tokens: 36, 8, 34
    result = SMALL.forward(work(SMALL, ids, SamplingParams(), [mask, score, None], kept=[2]))
    assert result.tokens == [50, 8, 34]  # the first allowed at or after 36 is 50
    assert result.model_logprobs == result.logprobs
    lp = [-(1 + (i - 50) % 64) * math.log(2) for i in (7, 8, 9)]
    assert result.scores[0] == pytest.approx(lp)
    assert result.scores[1][0] == pytest.approx(-60 * math.log(2))  # 3 is 59 ids after 8
    assert all(math.isnan(s) for s in result.scores[1][1:] + result.scores[2])
    # A kept row sampled again with a mask, as a masked pred that takes the guess does,
    # gives what the rule gives with that mask: 34 is not allowed, 50 is the next that is.
    again = sample(result.kept[2][None], [SamplingParams()], [None],
                   [RowControl(allowed=allowed)])
    assert again.tokens.tolist() == [50]


def test_the_rule_skips_every_special_id(model):
    sim = sleep_engine(ModelConfig.from_file(model / "config.json"), Tokenizer.from_dir(model),
                       0.001)
    tok = Tokenizer.from_dir(model)
    assert set(tok.eos_ids) <= sim.special and set(tok.special_ids()) <= sim.special
    assert {sim.token(t, p) for t in range(sim.vocab) for p in range(40)}.isdisjoint(
        sim.special)


def test_the_kernel_answers_the_rule_at_the_step_time(daemon, model, k):
    sim = sleep_engine(ModelConfig.from_file(model / "config.json"), Tokenizer.from_dir(model),
                       MS / 1e3)
    ids, n = prompt(20), 12
    with k.open("", os.O_RDWR) as f:
        started = time.monotonic()
        out = f.pred(ids, top_logprobs=2)[0]
        assert out.token == sim.token(ids[-1], len(ids) - 1)
        assert [t for t, _ in out.top] == [out.token, (out.token + 1) % sim.vocab]
        tokens = [out.token]
        for _ in range(n - 1):  # a decode loop: each pred a step of its own
            tokens.append(f.pred([tokens[-1]])[0].token)
        elapsed = time.monotonic() - started
    want, last = [], ids[-1]
    for p in range(len(ids) - 1, len(ids) - 1 + n):
        last = sim.token(last, p)
        want.append(last)
    assert tokens == want
    assert elapsed >= n * MS / 1e3  # a step takes at least MS
    stats = sched(k)
    assert stats["engine_mode"] == f"sleep:{MS:g}"
    # It drives an accelerator: it runs above the LIPs (engine_process.drives_accelerator),
    # where the tests' root may raise it.
    if os.geteuid() == 0:
        assert int(stats["engine_nice"]) == os.getpriority(
            os.PRIO_PROCESS, int(stats["engine_pid"])) == -10
    assert stats["engine"].endswith("attention none")
    assert int(stats["steps"]) >= n
    # The steps ran one after another, each its sleep and round trip: the engine was busy
    # for most of the window, and never above its share.
    assert 0.3 < float(stats["engine_busy"]) <= 1
    assert float(stats["steps_per_s"]) <= 1e3 / MS


def test_masked_preds_get_an_allowed_token(daemon, model, k):
    vocab = ModelConfig.from_file(model / "config.json").vocab_size
    with k.open("", os.O_RDWR) as f:
        out = f.pred(prompt(5), control=LogitControl.allowing([100, 200], vocab))[0]
    assert out.token in (100, 200)
    assert np.isfinite(out.model_logprob)



VICTIM = """
import os
from syscalls.client import Kernel
k = Kernel.connect(name="victim")
f = k.open("", os.O_RDWR)
print(k.pid, flush=True)
f.pred(list(range(5, 45)), no_outputs=True)
"""


def test_a_killed_lip_is_exiting_in_ps_until_its_pages_are_freed(model):
    """Its pred's step is in flight (1.5 s) when it is killed: its pages wait for the step,
    and meanwhile ps shows it `exiting` with them, not gone."""
    d = start_daemon(model, None, "--kv-pages", "64", "--engine", "sleep:1500")
    try:
        with d.connect() as k:
            baseline = int(meminfo(k)["device_used"])
            lip = subprocess.Popen([sys.executable, "-c", VICTIM], env=d.env(), cwd=ROOT,
                                   stdout=subprocess.PIPE, text=True)
            pid = int(lip.stdout.readline())
            wait_for(lambda: int(meminfo(k)["device_used"]) > baseline,
                     what="the pred's step to hold pages")
            lip.kill()
            assert lip.wait(30) == -signal.SIGKILL
            seen = []
            while True:
                procs = {p.pid: p for p in k.ps()}
                used = int(meminfo(k)["device_used"])
                if pid not in procs:
                    break
                seen.append((procs[pid].state, procs[pid].pages))
            assert used == baseline  # gone from ps: its pages are free
            while seen and seen[0][0] == "running":  # before the kernel saw its lifeline end
                seen.pop(0)
            assert seen and all(state == "exiting" and pages > 0 for state, pages in seen)
    finally:
        assert d.stop() == 0, d.log_text()
