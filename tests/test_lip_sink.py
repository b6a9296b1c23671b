"""lips/sink.py on a real daemon: generating and streaming ten times the model's context.

The module serves the test model with its context cut to CONTEXT positions, so ten contexts
take seconds, and a device pool too small to hold them (POOL pages, no host tier to swap
to): a sink whose pages grew would fail with ENOSPC, one whose positions grew with
EOVERFLOW. Before the first slide the sink is plain decoding and plain scoring, which a
fresh file computes here the ordinary way.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
from daemon import ROOT, make_model, meminfo, run_reader_gone

from lips.sink import Sink, main
from syscalls.context import Context
from syscalls.convert import LogitControl

CONTEXT = 64
PAGE = 16
POOL = 24  # pages: ten contexts would need 40
DAEMON_FLAGS = ("--kv-pages", str(POOL), "--host-pages", "0")
SINKS, WINDOW, SLIDE = 4, CONTEXT - 4, 16
# Entries [0, sinks), punched ones (fewer than a window), the window and one slide's pred.
MAX_ENTRIES = SINKS + 2 * WINDOW + SLIDE
MAX_PAGES = -(-(SINKS + WINDOW + SLIDE) // PAGE) + 2  # the sinks' and a partial page


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The test model (tests/daemon.py's) with a context of CONTEXT positions."""
    directory = make_model(tmp_path_factory.mktemp("short"))
    config = json.loads((directory / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def text_ids(n: int) -> list[int]:
    """n varied ids of the test vocabulary (a fixed pseudo-random walk, BOS first)."""
    ids, x = [1], 12345
    while len(ids) < n:
        x = (1103515245 * x + 12345) % 2**31
        ids.append(6 + x % 290)
    return ids


def check_file(sink: Sink, used_before: int, k) -> None:
    """Positions cache-relative and inside the context; pages and entries bounded."""
    positions = sink.file.read()[1]
    assert len(positions) == sink.length <= MAX_ENTRIES
    assert positions[:SINKS] == list(range(SINKS))
    assert positions[sink.first:] == list(range(SINKS, SINKS + sink.live))
    assert all(0 <= p < CONTEXT for p in positions)
    assert sink.file.stat().pages <= MAX_PAGES
    assert int(meminfo(k)["device_used"]) - used_before <= MAX_PAGES


class CheckedSink(Sink):
    def __init__(self, k, used_before: int):
        super().__init__(k.open(), SINKS, WINDOW, SLIDE, CONTEXT)
        self.k, self.used_before, self.checks = k, used_before, 0

    def note(self) -> None:
        super().note()
        check_file(self, self.used_before, self.k)
        self.checks += 1


def test_the_context_is_cut(k):
    assert k.model_info().context_length == CONTEXT


def test_generation_runs_ten_contexts_in_bounded_pages(k):
    prompt, n = text_ids(20), 10 * CONTEXT
    used = int(meminfo(k)["device_used"])
    with Context(k) as plain:  # the reference: ordinary greedy decoding in one file
        plain.fill(prompt)
        first_window = list(plain.generate(CONTEXT - len(prompt), stop=()))
    sink = CheckedSink(k, used)  # checks the file before every slide, when it is fullest
    with sink.file:
        out = list(sink.generate(prompt, n))
        figures = sink.figures()
    assert len(out) == n and sink.checks > figures["slides"]
    assert out[:len(first_window)] == first_window
    assert figures["max_pages"] <= MAX_PAGES and figures["max_entries"] <= MAX_ENTRIES
    assert figures["slides"] >= (n + len(prompt) - CONTEXT) // SLIDE
    assert figures["compactions"] >= figures["slides"] * SLIDE // WINDOW - 1
    assert int(meminfo(k)["device_used"]) == used  # all given back on close


def plain_logprobs(k, ids: list[int]) -> list[float]:
    """log p(ids[i + 1] | ids[:i + 1]) in one fresh file: one token per pred, each scored by
    id (another path than the sink's chunked score_next)."""
    with k.open() as f:
        return [f.pred([t], control=LogitControl(score=[ids[i + 1]]))[0].scores[0]
                for i, t in enumerate(ids[:-1])]


def test_streaming_ten_contexts_scores_the_first_window_as_plain_scoring(k):
    ids = text_ids(10 * CONTEXT)
    used = int(meminfo(k)["device_used"])
    sink = CheckedSink(k, used)  # checks the file after every pred and before every slide
    with sink.file:
        logprobs, starts = sink.score(ids)
        figures = sink.figures()
    assert len(logprobs) == len(ids) - 1 and all(math.isfinite(x) and x <= 0 for x in logprobs)
    assert figures["max_pages"] <= MAX_PAGES and figures["max_entries"] <= MAX_ENTRIES
    window = SINKS + WINDOW
    want = plain_logprobs(k, ids[:window])
    assert max(abs(a - b) for a, b in zip(logprobs[:window - 1], want, strict=True)) < 1e-4
    assert starts[:window - 1] == [SINKS] * (window - 1)
    # After it, each token saw the sinks and a window of at least WINDOW - SLIDE tokens.
    assert all(t + 1 - s >= min(t + 1 - SINKS, WINDOW - SLIDE) for t, s in enumerate(starts))
    assert all(t + 1 - s <= WINDOW for t, s in enumerate(starts))
    assert int(meminfo(k)["device_used"]) == used


def test_the_lip_streams_a_file_through_symphony_run(daemon, k, tmp_path):
    text = "The quick brown fox jumps over the lazy dog. def fibonacci(n): return n\n" * 10
    (tmp_path / "long.txt").write_text(text)
    n = len(k.tokenize(text, add_special=True))
    assert n > 3 * CONTEXT  # ten contexts are streamed above; this is the command line
    run = subprocess.run(
        [sys.executable, "-m", "symphony.cli", "run", "lips/sink.py", "--stream",
         str(tmp_path / "long.txt"), "--slide", "32", "--json"],
        env=daemon.env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["tokens"] == n and result["scored"] == n - 1
    assert result["window"] == CONTEXT - SINKS and result["sinks"] == SINKS
    assert result["max_pages"] <= MAX_PAGES and result["max_entries"] <= MAX_ENTRIES
    # The same text through the class, in this process: the same perplexity.
    sink = Sink(k.open(), SINKS, WINDOW, 32, CONTEXT)
    with sink.file:
        logprobs, _ = sink.score(k.tokenize(text, add_special=True))
    assert result["perplexity"] == pytest.approx(math.exp(-sum(logprobs) / (n - 1)), rel=1e-5)


def test_the_lip_takes_a_prompt_longer_than_the_context(daemon, monkeypatch, capsys):
    """A prompt that plain decoding would refuse (EOVERFLOW) goes through the sink too."""
    monkeypatch.setenv("SYMPHONY_SOCKET", str(daemon.socket))
    prompt = ",".join(map(str, text_ids(3 * CONTEXT)))
    assert main(["--prompt-ids", prompt, "--max-new-tokens", str(CONTEXT),
                 "--ignore-eos", "--slide", "32", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["output_ids"]) == CONTEXT and result["tokens"] == 4 * CONTEXT - 1
    assert result["max_pages"] <= -(-(CONTEXT + 32) // PAGE) + 2
    assert result["max_entries"] <= SINKS + 2 * WINDOW + 32


def test_the_lip_streams_text(daemon, monkeypatch, capsys):
    monkeypatch.setenv("SYMPHONY_SOCKET", str(daemon.socket))
    assert main(["--prompt", "def fibonacci(n):", "--max-new-tokens", str(CONTEXT + 32),
                 "--ignore-eos", "--temperature", "1", "--seed", "3"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def fibonacci(n):")
    assert err.startswith(f"sink: {CONTEXT + 32} tokens; pages max ") and "slides" in err


@pytest.mark.parametrize("flags, message", [
    (["--sinks", "-1"], "--sinks"),
    (["--window", "0"], "--window"),
    (["--slide", "0"], "--slide"),
    (["--limit", "1"], "--limit"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--window", str(CONTEXT)], "context"),  # 4 sinks + the whole context: too long
    (["--window", "8", "--slide", "9"], "--slide"),
])
def test_bad_flags_exit_2_with_a_message(daemon, monkeypatch, capsys, flags, message):
    """argparse's exit for what it checks; the status, as lip_main's, for what only the model's
    context shows."""
    monkeypatch.setenv("SYMPHONY_SOCKET", str(daemon.socket))
    try:
        code = main(["--prompt-ids", "1,2", *flags])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and "sink: error: " in err and message in err and "Traceback" not in err


def test_a_text_prompt_is_not_printed_before_a_flag_is_refused(daemon, monkeypatch, capsys):
    """The prompt was echoed, then the flags refused against the model's context."""
    monkeypatch.setenv("SYMPHONY_SOCKET", str(daemon.socket))
    assert main(["--prompt", "hello there", "--window", str(CONTEXT)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "context" in err


def test_a_missing_stream_file_and_a_missing_kernel(tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--stream", str(tmp_path / "nope.txt")])
    assert e.value.code == 2 and "nope.txt" in capsys.readouterr().err
    monkeypatch.setenv("SYMPHONY_SOCKET", str(tmp_path / "no.sock"))
    assert main(["--prompt-ids", "1,2"]) == 1
    assert "no Symphony kernel" in capsys.readouterr().err


@pytest.mark.parametrize("args", [
    ["--help"],
    ["--prompt-ids", "1,2", "--max-new-tokens", "4", "--json"],
    ["--stream", "docs/programs.md", "--limit", "40"],
])
def test_a_reader_gone_from_stdout_stops_it_quietly(daemon, args):
    """`sink ... | head -1`: --help's write was a traceback, and output still waiting at
    exit Python's "Exception ignored ... BrokenPipeError", status 120; now nothing, 141
    (128 + SIGPIPE), as every lip_main LIP."""
    # stdout buffered, as a user's is (PYTHONUNBUFFERED would write each print at once)
    env = {k: v for k, v in daemon.env().items() if k != "PYTHONUNBUFFERED"}
    out = run_reader_gone([sys.executable, "lips/sink.py", *args], env)
    assert (out.returncode, out.stderr) == (141, "")
