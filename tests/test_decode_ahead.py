"""Decoding ahead (symphony/scheduler.py), end to end on a real daemon: the kernel computes
a decoding LIP's next pred before it comes; the pred that comes gets exactly what it would
have got, anything else drops the guess first, and a guess never holds memory or a file
against anyone."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys

import pytest
from daemon import ROOT, meminfo, prompt, sched, start_daemon, wait_for

from symphony.decode_ahead import DEPTH
from syscalls.convert import LogitControl

DAEMON_FLAGS = ("--kv-pages", "64", "--host-pages", "0")


def guesses(k) -> tuple[int, int]:
    s = sched(k)
    return int(s["ahead_guesses"]), int(s["ahead_used"])


def decode(f, first: int, n: int, between=lambda: None, **sampling) -> list[tuple[int, float]]:
    """n preds, each of the token the last one sampled: (token, logprob) of each."""
    out, token = [], first
    for _ in range(n):
        between()
        (o,) = f.pred([token], **sampling)
        out.append((o.token, o.logprob))
        token = o.token
    return out


@pytest.mark.parametrize("masked", [False, True])
def test_a_decoding_lip_gets_its_preds_computed_ahead_and_the_same_samples(daemon, masked):
    """Seeded sampling: every pred draws from a fresh generator of its seed, so a guess
    samples what the pred itself would. A no-op truncate between preds drops each guess,
    and the same loop then computes every pred on arrival: the tokens must agree. Masked:
    the guesses keep their logits and each pred samples them with its mask."""
    ids, n, sampling = prompt(21), 24, {"temperature": 1.0, "top_k": 40, "seed": 1234}
    with daemon.connect() as k:
        info = k.model_info()
        eos = set(info.eos_ids)
        if masked:
            allowed = [t for t in range(info.vocab_size) if t % 3 or t in eos]
            sampling["control"] = LogitControl.allowing(allowed, info.vocab_size)
        runs = []
        for drop in (False, True):
            with k.open("", os.O_RDWR) as f:
                (first,) = f.pred(ids, **sampling)
                before = guesses(k)
                between = (lambda f=f: f.truncate(f.stat().tokens)) if drop else (lambda: None)
                out = decode(f, first.token, n, between, **sampling)
                made, used = (a - b for a, b in zip(guesses(k), before, strict=True))
                tokens = [t for t, _ in out]
                # Pred i (i >= 1) continues pred i-1; a guess follows every such pred unless
                # it sampled an end of sequence, and one computed before its pred came is
                # guessed on (DEPTH guesses a file at most).
                expect = sum(t not in eos for t in tokens[:-1])
                least = expect + (tokens[-1] not in eos)
                assert least <= made <= least * DEPTH
                assert used == (0 if drop else expect)
                # the file holds what was fed, not the guess of the last sample
                assert f.read()[0] == ids + [first.token] + tokens[:-1]
                assert f.stat().tokens == len(ids) + n
                runs.append(out)
        assert expect > n // 2, "the loop sampled end of sequence too often to test anything"
        assert runs[0] == runs[1]
        if masked:
            assert all(t % 3 or t in eos for t, _ in runs[0])


def test_any_other_call_on_the_file_drops_the_guess_first(daemon):
    """With a guess pending, a pred of another token, truncate, punch, splice into the file
    and close each find it gone (no EBUSY), and the file holds exactly what preds put
    there: after the other token, the next greedy token is what a fresh prefill of the
    same entries predicts."""
    ids = prompt(30, salt=1)
    with daemon.connect() as k:
        eos = set(k.model_info().eos_ids)
        baseline = int(meminfo(k)["device_used"])
        with k.open("", os.O_RDWR) as f, k.open("", os.O_RDWR) as src, \
                k.open("", os.O_RDWR) as ref:
            src.pred(ids[:16], no_outputs=True)
            (o,) = f.pred(ids)
            entries, last = list(ids), o.token

            def decode_with_a_guess_pending() -> int:
                nonlocal last
                made, used = guesses(k)
                out = decode(f, last, 3)
                entries.extend([last] + [t for t, _ in out[:-1]])
                last = out[-1][0]
                pending = (guesses(k)[0] - made) - (guesses(k)[1] - used)
                # a guess of the next pred, and one after it if that was computed in time
                assert 1 <= pending <= DEPTH if last not in eos else pending == 0
                return last

            guessed = decode_with_a_guess_pending()
            assert guessed not in eos  # else this prompt tests nothing: pick another
            other = 6 if guessed != 6 else 7
            (o,) = f.pred([other])
            entries.append(other)
            assert f.read()[0] == entries
            (r,) = ref.pred(entries)
            assert o.token == r.token
            last = o.token

            decode_with_a_guess_pending()
            f.truncate(len(entries) - 1)
            del entries[-1]
            assert f.read()[0] == entries
            last = entries.pop()  # carry on from the entry before the cut
            f.truncate(len(entries))
            decode_with_a_guess_pending()
            f.punch(0, 2)
            decode_with_a_guess_pending()
            f.splice_from(src, 0, 16)
            entries.extend(ids[:16])
            assert f.read()[0] == entries and f.stat().tokens == len(entries)
            decode_with_a_guess_pending()
        # closed with a guess pending: all the files held is back in the pool
        assert int(meminfo(k)["device_used"]) == baseline


def test_a_guess_gives_its_page_to_whatever_call_needs_it(model):
    """No host tier, eight device pages. a's guess took a fresh page, and b's export, fork
    and pred each fit only if the guess gives it back. Then a's own pred fails with
    ENOSPC, leaving a's file as it was, and goes through once b's file is closed."""
    d = start_daemon(model, None, "--kv-pages", "8", "--host-pages", "0")
    try:
        with d.connect("a") as a, d.connect("b") as b:
            eos = set(a.model_info().eos_ids)
            fa = a.open("", os.O_RDWR)

            def guess_a_page() -> int:
                """Decode a to 16 entries: its guess then needs page 2."""
                fa.truncate(14)
                (o,) = fa.pred([6])
                out = decode(fa, o.token, 1)
                assert out[-1][0] not in eos and fa.stat().tokens == 16
                return out[-1][0]

            fa.pred(prompt(14, salt=2), no_outputs=True)
            guess_a_page()
            assert int(meminfo(a)["device_used"]) == 2  # one full page and the guess's
            with b.open("", os.O_RDWR) as fb:
                fb.pred(prompt(5 * 16 + 1, salt=3), no_outputs=True)  # 6 pages: none free
                # export's snapshot, then a fork: each copies b's partial last page
                assert len(b.export(fb)) == fb.stat().size
                guess_a_page()
                with fb.fork() as clone:
                    assert clone.stat().tokens == 5 * 16 + 1
                token = guess_a_page()
                fb.pred(prompt(16, salt=4), no_outputs=True)  # 7 pages: all but a's
                assert fb.stat().tokens == 6 * 16 + 1
                with pytest.raises(OSError) as e:
                    fa.pred([token])
                assert e.value.errno == errno.ENOSPC
                assert fa.stat().tokens == 16 and int(meminfo(a)["device_used"]) == 8
            fa.pred([token])
            assert fa.read()[0][-1] == token and fa.stat().tokens == 17
    finally:
        assert d.stop() == 0, d.log_text()


def test_open_with_o_trunc_drops_another_process_s_guess(daemon):
    """A named file another process decodes in: open(O_TRUNC) finds no guess in the way."""
    with daemon.connect("writer") as a, daemon.connect("truncater") as b:
        path = f"{a.home}/shared.kv"
        with a.open(path, os.O_RDWR | os.O_CREAT, 0o666) as fa:
            (o,) = fa.pred(prompt(10, salt=5))
            made = guesses(a)[0]
            decode(fa, o.token, 2)
            assert guesses(a)[0] > made
            with b.open(path, os.O_RDWR | os.O_TRUNC) as fb:
                assert fb.stat().tokens == 0 and fa.stat().tokens == 0
        a.unlink(path)


DECODER = """
import os
from syscalls.client import Kernel
k = Kernel.connect(name="decoder")
f = k.open("", os.O_RDWR)
(o,) = f.pred([(5 * i) % 290 + 6 for i in range(20)])
eos = k.model_info().eos_ids
print(k.pid, flush=True)
while True:
    (o,) = f.pred([o.token])
    if o.token in eos:
        f.truncate(20)
"""


def test_a_killed_decoder_leaves_no_guess_behind(daemon):
    with daemon.connect() as k:
        baseline = int(meminfo(k)["device_used"])
        used = guesses(k)[1]
        lip = subprocess.Popen([sys.executable, "-c", DECODER], env=daemon.env(), cwd=ROOT,
                               stdout=subprocess.PIPE, text=True)
        pid = int(lip.stdout.readline())
        wait_for(lambda: guesses(k)[1] > used + 20, what="the LIP to decode ahead")
        lip.send_signal(signal.SIGKILL)
        assert lip.wait(30) == -signal.SIGKILL
        wait_for(lambda: all(p.pid != pid for p in k.ps()), what="the process to be reaped")
        wait_for(lambda: int(meminfo(k)["device_used"]) == baseline,
                 what="its pages, the guess's too, to be freed")


def test_decode_ahead_off_computes_each_pred_when_it_comes(model, daemon):
    ids = prompt(17, salt=4)
    d = start_daemon(model, None, "--kv-pages", "64", "--decode-ahead", "off")
    try:
        outs = []
        for kernel in (d, daemon):
            with kernel.connect() as k, k.open("", os.O_RDWR) as f:
                (o,) = f.pred(ids)
                outs.append([t for t, _ in decode(f, o.token, 8)])
        with d.connect() as k:
            s = sched(k)
        assert s["decode_ahead"] == "off" and s["ahead_guesses"] == "0"
        assert outs[0] == outs[1]
    finally:
        assert d.stop() == 0, d.log_text()
