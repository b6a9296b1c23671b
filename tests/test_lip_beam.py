"""lips/beam.py end to end on a real daemon: width 1 is a plain greedy loop, wider beams
match a beam search written here over full distributions each computed from scratch (no
forks, no top-n), files and pages stay bounded by the width, and bad flags exit 2."""

import json
import math
import subprocess
from functools import cache

import pytest
from daemon import ROOT, SYMPHONY, meminfo, prompt

from lips import beam


def greedy(k, ids: list[int], n: int, eos: tuple[int, ...]) -> list[int]:
    """One pred per token, argmax, stopping after EOS."""
    out = []
    with k.open() as f:
        f.pred(ids[:-1], no_outputs=True)
        token = ids[-1]
        for _ in range(n):
            (o,) = f.pred([token])
            token = o.token
            out.append(token)
            if token in eos:
                break
    return out


def reference_beam(dist, ids: list[int], width: int, steps: int, eos: tuple[int, ...]):
    """Beam search as beam.py's docstring states it, over full next-token distributions."""
    beams, finished = [([], 0.0)], []
    for _ in range(steps):
        cands = [(lp + next_lp, i, t) for i, (out, lp) in enumerate(beams)
                 for t, next_lp in dist(tuple(ids + out))[: 2 * width]]
        cands.sort(key=lambda c: -c[0])
        live = []
        for rank, (lp, i, t) in enumerate(cands):
            if len(live) == width:
                break
            if t not in eos:
                live.append((beams[i][0] + [t], lp))
            elif rank < width:
                finished.append((beams[i][0] + [t], lp))
        beams = live
        if len(finished) >= width or not beams:
            break
    return finished + beams


def run_beam(daemon, monkeypatch, capsys, *argv: str) -> dict:
    monkeypatch.setenv("SYMPHONY_SOCKET", str(daemon.socket))
    assert beam.main([*argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_width_one_is_greedy(daemon, k):
    eos = k.model_info().eos_ids
    for salt in range(3):
        ids = prompt(5 + 7 * salt, salt)
        lip = subprocess.run(
            [*SYMPHONY, "run", "lips/beam.py", "--prompt-ids", ",".join(map(str, ids)),
             "--width", "1", "--max-new-tokens", "12", "--json"],
            env=daemon.env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert lip.returncode == 0, lip.stderr
        best = json.loads(lip.stdout)["hypotheses"][0]
        assert best["output_ids"] == greedy(k, ids, 12, eos)


def near_eos(k, eos: tuple[int, ...]) -> list[int]:
    """A prompt after which EOS is among the two likeliest tokens: every last token tried
    at once, as roots of one tree pred."""
    vocab = k.model_info().vocab_size
    for salt in range(10):
        base = prompt(6, salt)
        with k.open() as f:
            f.pred(base, no_outputs=True)
            outs = f.pred(list(range(vocab)), parents=[-1] * vocab, outputs=range(vocab),
                          top_logprobs=2)
        for out in outs:
            if {t for t, _ in out.top} & set(eos):
                return base + [out.row]
    raise AssertionError("no prompt puts EOS near the top")


@pytest.mark.parametrize("width, alpha, ending", [
    (2, 0.0, False), (3, 0.0, False), (3, 1.0, False), (3, 0.0, True), (3, 1.0, True)])
def test_matches_a_reference_beam_search(daemon, k, monkeypatch, capsys, width, alpha, ending):
    info = k.model_info()

    @cache
    def dist(ids: tuple[int, ...]) -> list[tuple[int, float]]:
        with k.open() as f:
            (out,) = f.pred(list(ids), top_logprobs=info.vocab_size)
        return out.top

    ids, steps = near_eos(k, info.eos_ids) if ending else prompt(9, salt=width), 6
    used = int(meminfo(k)["device_used"])
    got = run_beam(daemon, monkeypatch, capsys, "--prompt-ids", ",".join(map(str, ids)),
                   "--width", str(width), "--max-new-tokens", str(steps),
                   "--length-penalty", str(alpha))
    want = reference_beam(dist, ids, width, steps, info.eos_ids)
    want.sort(key=lambda h: -beam.gnmt_score(h[1], len(h[0]), alpha))
    finished = [h["finished"] for h in got["hypotheses"]]
    assert finished == [out[-1] in info.eos_ids for out, _ in want]
    assert any(finished) == ending
    assert [h["output_ids"] for h in got["hypotheses"]] == [out for out, _ in want]
    for h, (out, lp) in zip(got["hypotheses"], want, strict=True):
        assert h["logprob"] == pytest.approx(lp, abs=1e-3)
        assert h["score"] == pytest.approx(lp / ((5 + len(out)) / 6) ** alpha, abs=1e-3)
    # At most `width` files at once, each at most ceil(length / page) pages; none leak.
    assert got["peak_files"] <= width
    assert 0 < got["peak_pages"] <= width * math.ceil((len(ids) + steps) / info.page_size)
    assert int(meminfo(k)["device_used"]) == used


def test_eos_among_the_best_finishes_a_hypothesis():
    # (total logprob, beam, token); token 2 is EOS.
    cands = [(-1.0, 0, 2), (-1.5, 0, 7), (-2.0, 1, 2), (-2.5, 1, 8), (-3.0, 0, 9)]
    live, ended = beam.select(cands, 2, (2,))
    assert ended == [(-1.0, 0, 2)]  # the second EOS ranks past the width: dropped
    assert live == [(-1.5, 0, 7), (-2.5, 1, 8)]
    assert beam.gnmt_score(-6.0, 1, 0.0) == -6.0
    assert beam.gnmt_score(-6.0, 7, 1.0) == pytest.approx(-3.0)


@pytest.mark.parametrize("argv, what", [
    (["--width", "0"], "--width"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--length-penalty", "nan"], "--length-penalty: must be a finite number >= 0, got nan"),
    (["--length-penalty", "inf"], "--length-penalty: must be a finite number >= 0, got inf"),
    (["--length-penalty", "-1"], "--length-penalty: must be a finite number >= 0, got -1"),
    (["--width", "two"], "--width"),
    ([], "--prompt"),
])
def test_bad_flags_exit_2_with_a_message(argv, what, capsys):
    with pytest.raises(SystemExit) as e:
        beam.main(["--prompt-ids", "1,2", *argv] if argv else argv)
    assert e.value.code == 2
    assert what in capsys.readouterr().err
