"""lips/async_lm.py: asynchronous function calling (AsyncLM) on a real daemon.

The test model is random and knows nothing of the call protocol, so every run here is
scripted: the call text is teacher-forced at given points (--script), and what is tested
is the system: markers parsed, tools run as concurrent subprocesses while decoding goes
on, results injected into the KV file, errors as values, bad arguments refused.
"""

import asyncio
import json
import subprocess
import sys
import time

import pytest
from daemon import ROOT, SYMPHONY

from lips.async_lm import CallParser, Tools, interrupt_text, main

SLOW = "python: import time; time.sleep(1); print(6*7)"
SCRIPT = [
    {"after": 1, "text": f" [CALL] slow1 [HEAD] {SLOW} [END]"},
    {"after": 2, "text": " [CALL] slow2 [HEAD] sh: sleep 1 [END]"},
    {"after": 3, "text": " [CALL] fast [HEAD] sh: echo hello [END]"},
    {"after": 4, "text": " [CALL] bad [HEAD] python: 1/0 [END]"},
    {"after": 5, "text": " [CALL] stuck [HEAD] python: import time; time.sleep(60) [END]"},
]
PROMPT = "def fibonacci(n):"


def lip(daemon, tmp_path, script, *args: str, via=(sys.executable,)) -> dict:
    path = tmp_path / "script.json"
    path.write_text(json.dumps(script))
    out = subprocess.run([*via, "lips/async_lm.py", "--prompt", PROMPT, "--script", str(path),
                          "--json", *args], env=daemon.env(), cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_parser_finds_calls_split_across_tokens():
    parser = CallParser([bytes([b]) for b in range(256)])  # one token per byte
    found = []
    for b in b"x [CALL] a [HEAD] python: print(1) [END] y [CA":
        found += parser.feed([b])
    assert found == [("a", "python: print(1)")] and not parser.open
    assert parser.feed(list(b"LL] 7 [HEAD] sh: echo hi [E")) == [] and parser.open
    assert parser.feed(list(b"ND] [INTR] no call here [END]")) == [("7", "sh: echo hi")]
    assert not parser.open
    # No [HEAD]: the id is what there is, and no code (the tool gives an error value).
    assert parser.feed(list(b"[CALL] 9 [END][CALL][HEAD] sh: x[END]")) == [
        ("9", ""), ("4", "sh: x")]  # no id: numbered by its place


def test_tools_give_errors_as_values():
    tools = Tools(timeout=0.5, allow=frozenset({"echo"}), enabled=frozenset({"python", "sh"}),
                  max_chars=40)

    async def all_of(*codes: str):
        return await asyncio.gather(*(tools.run(c) for c in codes))

    start = time.monotonic()
    got = asyncio.run(all_of(
        "sh: echo 'a b'", "python: print('[END]' * 3)", "python: raise KeyError('k')",
        "python: import time; time.sleep(30)", "sh: rm -rf /", "sh: echo 'unbalanced",
        "perl: 1", "python: print('x' * 100)"))
    assert time.monotonic() - start < 10  # the sleeper was killed at its timeout
    assert got[0] == ("a b", True)
    assert got[1] == ("(END)(END)(END)", True)  # a value cannot close the interrupt
    assert got[2] == ("error: exit 1: KeyError: 'k'", False)
    assert got[3] == ("error: timed out after 0.5 s", False)
    assert got[4][0].startswith("error: command 'rm' is not allowed") and not got[4][1]
    assert got[5][0].startswith("error: ") and not got[5][1]
    assert got[6][0].startswith("error: no tool in 'perl: 1'") and not got[6][1]
    assert got[7] == ("x" * 37 + "...", True)


def test_async_calls_overlap_decoding_and_their_results_are_injected(daemon, tmp_path):
    r = lip(daemon, tmp_path, SCRIPT, "--max-new-tokens", "120", "--answer-tokens", "4",
            "--timeout", "1.5", "--save", "async_lm.kv")
    assert r["mode"] == "async" and r["scripted"]
    calls = {c["id"]: c for c in r["calls"]}
    assert list(calls) == ["slow1", "slow2", "fast", "bad", "stuck"]
    assert [calls[i]["dispatched_after"] for i in calls] == [1, 2, 3, 4, 5]
    assert calls["slow1"]["value"] == "42" and calls["slow2"]["value"] == ""
    assert calls["fast"]["value"] == "hello"
    assert calls["bad"]["value"].startswith("error: exit 1:") and not calls["bad"]["ok"]
    assert "ZeroDivisionError" in calls["bad"]["value"]
    assert calls["stuck"]["value"] == "error: timed out after 1.5 s"
    # The slow calls ran at the same time.
    slow = [calls[i] for i in ("slow1", "slow2", "stuck")]
    assert max(c["dispatched"] for c in slow) < min(c["returned"] for c in slow)
    # Decoding went on while slow1 ran, and a result came in mid-generation.
    gen = [s for s in r["segments"] if s["kind"] == "generated"]
    assert any(calls["slow1"]["dispatched"] < s["at"] < calls["slow1"]["returned"] for s in gen)
    assert calls["fast"]["injected_after"] < 120
    for c in calls.values():
        assert c["dispatched"] <= c["returned"] <= c["injected"]
    check_file(daemon, r, "async_lm.kv")


def test_sync_calls_wait_for_each_result(daemon, tmp_path):
    script = [{"after": 2, "text": f" [CALL] {i} [HEAD] python: import time; "
                                   f"time.sleep(0.5); print({i}) [END]"} for i in (1, 2)]
    script[1]["after"] = 5
    r = lip(daemon, tmp_path, script, "--sync", "--max-new-tokens", "8", "--answer-tokens",
            "2", "--save", "sync_lm.kv", via=(*SYMPHONY, "run"))
    assert r["mode"] == "sync"
    one, two = r["calls"]
    assert one["returned"] <= two["dispatched"]  # one after the other
    assert [c["value"] for c in r["calls"]] == ["1", "2"]
    # Nothing was sampled while a call ran: each result follows its call in the file.
    kinds = [s["kind"] for s in r["segments"]]
    assert kinds == ["prompt", "generated", "forced", "interrupt", "generated", "forced",
                     "interrupt", "generated"]
    assert [c["injected_after"] for c in r["calls"]] == [2, 5]
    assert r["seconds"] >= 1.0 and r["sampled"] == 10
    check_file(daemon, r, "sync_lm.kv")


def check_file(daemon, r: dict, name: str) -> None:
    """The KV file holds prompt, sampled, forced and injected tokens in the order they
    happened; each sampled token is the model's greedy choice after all that came before,
    as one pred over the whole sequence computes it."""
    segments = r["segments"]
    with daemon.connect() as k, k.open(f"{k.home}/{name}") as f:
        tokens = f.read()[0]
        assert tokens == [t for s in segments for t in s["tokens"]]
        assert segments[0] == {**segments[0], "kind": "prompt",
                               "tokens": k.tokenize(PROMPT, add_special=True)}
        assert [s["at"] for s in segments] == sorted(s["at"] for s in segments)
        calls = {c["id"]: c for c in r["calls"]}
        injected = [s for s in segments if s["kind"] == "interrupt"]
        assert [s["call"] for s in injected] == sorted(
            calls, key=lambda i: calls[i]["returned"])
        text = k.detokenize(tokens)
        for s in injected:
            c = calls[s["call"]]
            assert s["tokens"] == k.tokenize(interrupt_text(c["id"], c["value"]))
            assert f"[INTR] {c['id']} [HEAD] {c['value']} [END]" in text
        rows, at = [], 0
        for s in segments:
            if s["kind"] == "generated":
                rows += range(at - 1, at - 1 + len(s["tokens"]))
            at += len(s["tokens"])
        with k.open() as fresh:
            outs = fresh.pred(tokens, outputs=rows)
        assert [o.token for o in outs] == [tokens[i + 1] for i in rows]


def ids(n: int) -> str:
    """--prompt-ids of n tokens."""
    return ",".join(str(10 + i % 200) for i in range(n))


def test_new_tokens_past_the_context_are_refused_up_front(daemon, k, lip_main, monkeypatch,
                                                          tmp_path):
    """`--max-new-tokens 4 --answer-tokens 99999999999` decoded for 100 s, then failed at the
    context's end (EOVERFLOW, status 1) with nothing printed. The prompt, the script's text
    and both counts of new tokens must fit the context together, as the other programs'
    prompt and --max-new-tokens must."""
    monkeypatch.setenv("SYMPHONY_SOCKET", str(daemon.socket))
    context = k.model_info().context_length
    start = time.monotonic()
    code, out, err = lip_main("async_lm", "--prompt", "x", "--max-new-tokens", "4",
                              "--answer-tokens", "99999999999", "--json")
    assert (code, out) == (2, "") and time.monotonic() - start < 10
    prompt = len(k.tokenize("x", add_special=True))
    assert err == (f"async_lm: error: --max-new-tokens 4 and --answer-tokens 99999999999: the "
                   f"prompt's {prompt} tokens, the script's 0 and 100000000003 new ones pass "
                   f"the model's context of {context} positions\n")
    text = " and so on"  # forced, and no call: nothing else goes in
    (tmp_path / "s.json").write_text(json.dumps([{"after": 2, "text": text}]))
    forced = len(k.tokenize(text))
    flags = ["--script", str(tmp_path / "s.json"), "--max-new-tokens", "4",
             "--answer-tokens", "2", "--json", "--prompt-ids"]
    code, out, err = lip_main("async_lm", *flags, ids(context - forced - 6 + 1))
    assert (code, out) == (2, "")
    assert f"the prompt's {context - forced - 5} tokens, the script's {forced} and 6 new" in err
    code, out, err = lip_main("async_lm", *flags, ids(context - forced - 6))
    assert (code, err) == (0, "")
    r = json.loads(out)
    assert not r["context_full"] and 2 <= r["sampled"] <= 6


@pytest.mark.parametrize("over", [0, 1])
def test_results_that_fill_the_context_stop_the_task_with_what_it_has(
        daemon, k, lip_main, monkeypatch, tmp_path, over):
    """A result's length is known only once its tool returns: where the result (over=1) or
    then a sampled token (over=0, the result filling the context to its last position) would
    pass the context, the task stops before it, prints its record, says so on stderr, and
    exits 0; the KV file holds what went in. It failed EOVERFLOW, status 1, nothing printed."""
    monkeypatch.setenv("SYMPHONY_SOCKET", str(daemon.socket))
    context = k.model_info().context_length
    call = " [CALL] big [HEAD] sh: echo hello [END]"
    (tmp_path / "s.json").write_text(json.dumps([{"after": 1, "text": call}]))
    forced, result = len(k.tokenize(call)), len(k.tokenize(interrupt_text("big", "hello")))
    prompt = context - forced - 1 - result + over  # then 1 sampled, the call, its result
    code, out, err = lip_main(
        "async_lm", "--prompt-ids", ids(prompt), "--script", str(tmp_path / "s.json"), "--sync",
        "--max-new-tokens", "1", "--answer-tokens", "1", "--save", f"full{over}.kv", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["context_full"] and r["sampled"] == 1
    (c,) = r["calls"]
    assert c["value"] == "hello" and c["returned"] is not None
    kinds = [s["kind"] for s in r["segments"]]
    written = [t for s in r["segments"] for t in s["tokens"]]
    if over:
        assert kinds == ["prompt", "generated", "forced"] and c["injected"] is None
        what = f"call big's result ({result} tokens)"
    else:
        assert kinds == ["prompt", "generated", "forced", "interrupt"]
        assert c["injected_after"] == 1 and len(written) == context
        what = "a sampled token"
    assert err == (f"async_lm: stopped after 1 tokens sampled: the KV file's {len(written)} "
                   f"tokens and {what} would pass the model's context of {context} positions\n")
    with k.open(f"{k.home}/full{over}.kv") as f:
        assert f.read()[0] == written


@pytest.mark.parametrize("args, message", [
    (["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1"),
    (["--answer-tokens", "-1"], "--answer-tokens must be >= 0"),
    (["--timeout", "0"], "argument --timeout: must be a finite number > 0, got 0"),
    (["--timeout", "nan"], "argument --timeout: must be a finite number > 0, got nan"),
    (["--timeout", "inf"], "argument --timeout: must be a finite number > 0, got inf"),
    (["--tools", "perl"], "--tools must name some of python, sh"),
    (["--max-result-chars", "2"], "--max-result-chars must be >= 8"),
    (["--script", "/nonexistent.json"], "/nonexistent.json: No such file"),
    (["--script", "{bad}"], "not JSON"),
    (["--script", '{"after": 1}'], "want a JSON list"),
    (["--script", '[{"after": -1, "text": "x"}]'], 'entry 0 wants an integer "after"'),
    (["--script", '[{"after": 65, "text": "x"}]'], "text after 65 tokens is never reached"),
])
def test_bad_arguments_exit_2_with_a_message(args, message, tmp_path, capsys):
    if args[0] == "--script" and not args[1].startswith("/"):
        (tmp_path / "s.json").write_text(args[1])
        args = ["--script", str(tmp_path / "s.json")]
    with pytest.raises(SystemExit) as e:
        main(["--prompt", "x", *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "async_lm: error: " in err and message in err, err
    assert "Traceback" not in err


def test_a_missing_kernel_is_reported(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SYMPHONY_SOCKET", str(tmp_path / "k.sock"))
    assert main(["--prompt", "x"]) == 1
    assert capsys.readouterr().err.startswith(f"async_lm: no Symphony kernel at {tmp_path}")


def test_help_explains_the_protocol(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "[CALL] ID [HEAD] TOOL: ARGS [END]" in out and "teacher-force" in out
