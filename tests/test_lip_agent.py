"""lips/agent.py end to end on a real daemon, in scripted mode: the test model is random and
the small default model is not tuned for ReAct, so the script teacher-forces the actions
(the model writes only the thoughts). What is checked is the system: the tools run, their
observations are in the KV file, the conversation is computed once (against the kernel's
own count, and against --resend, which prefills it all every turn), and forked tries leave
nothing behind."""

import json
import math
import subprocess

import pytest
from daemon import ROOT, SYMPHONY, meminfo

from lips import agent

SECRET = "secret text outside the root"


@pytest.fixture()
def task(tmp_path):
    """A --root with a note, a file outside it, and a script touching both."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "notes.txt").write_text("the capital of France is Paris\n")
    (tmp_path / "secret.txt").write_text(SECRET)
    (root / "escape").symlink_to(tmp_path / "secret.txt")
    actions = [
        ("python", "print(6 * 7)"),
        ("lookup", "notes.txt"),
        ("lookup", "../secret.txt"),
        ("lookup", "escape"),
        ("python", "import time\nwhile True: time.sleep(0.01)"),
        ("python", "raise SystemExit(3)"),
        ("finish", "42"),
    ]
    script = tmp_path / "task.jsonl"
    script.write_text("".join(json.dumps({"action": a, "input": i}) + "\n"
                              for a, i in actions))
    return root, script


def run_agent(daemon, monkeypatch, capsys, *argv: str) -> dict:
    monkeypatch.setenv("SYMPHONY_SOCKET", str(daemon.socket))
    assert agent.main([*argv, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_scripted_run_keeps_observations_in_one_kv_file(daemon, k, task, monkeypatch, capsys):
    root, script = task
    args = ("--question", "What is 6 * 7?", "--script", str(script), "--root", str(root),
            "--tool-timeout", "1", "--max-new-tokens", "4")
    lip = subprocess.run([*SYMPHONY, "run", "lips/agent.py", *args, "--save", "agent.kv",
                          "--json"],
                         env=daemon.env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert lip.returncode == 0, lip.stderr
    kept = json.loads(lip.stdout)
    observations = [t["observation"] for t in kept["turns"]]
    assert observations[:2] == ["42", "the capital of France is Paris"]
    assert observations[2] == "refused: ../secret.txt is outside the root"
    assert observations[3] == "refused: escape is outside the root"  # a symlink out
    assert observations[4] == "timed out after 1 s"  # an observation, not a crash
    assert observations[5] == "(exit status 3)"
    assert kept["answer"] == "42" and kept["turns"][-1]["tool"] == "finish"

    with k.open(k.home + "/agent.kv") as f:
        tokens, positions = f.read()
    text = k.detokenize(tokens)
    for obs in observations[:-1]:  # the last turn finishes
        assert f"Observation: {obs}\nThought:" in text
    assert SECRET not in text
    assert text.endswith("Action: finish[42]\n")
    # Computed once: the kernel's count of the run's tokens is the conversation's length.
    assert kept["computed_tokens"] == kept["conversation_tokens"] == len(tokens)
    assert positions == list(range(len(tokens)))

    # A prompt-based server's client prefills the whole conversation every turn: the same
    # conversation, and the kernel counts every turn's prefix again.
    resent = run_agent(daemon, monkeypatch, capsys, *args, "--resend")
    assert [t["thought"] for t in resent["turns"]] == [t["thought"] for t in kept["turns"]]
    assert resent["conversation_tokens"] == len(tokens)
    assert resent["prefill_tokens"] == sum(t["context_tokens"] for t in resent["turns"])
    assert kept["prefill_tokens"] < resent["prefill_tokens"]
    assert resent["computed_tokens"] - kept["computed_tokens"] == (
        resent["prefill_tokens"] - kept["prefill_tokens"])


def test_tries_fork_and_leave_no_pages_behind(daemon, k, task, monkeypatch, capsys):
    root, script = task
    used = int(meminfo(k)["device_used"])
    got = run_agent(daemon, monkeypatch, capsys, "--question", "6 * 7?", "--script",
                    str(script), "--root", str(root), "--tool-timeout", "1",
                    "--max-new-tokens", "4", "--tries", "3", "--seed", "1")
    assert all(len(t["tries"]) == 3 for t in got["turns"])
    # Each turn's losing forks computed their own tokens, and only those, beside the file.
    assert got["computed_tokens"] == got["conversation_tokens"] + got["discarded_tokens"]
    assert got["discarded_tokens"] > 0
    # At the end the process holds the conversation's file and its pages only ...
    assert got["open_files"] == 1
    assert got["pages"] == math.ceil(got["conversation_tokens"] / k.model_info().page_size)
    assert int(meminfo(k)["device_used"]) == used  # ... and nothing after it exits


def test_free_mode_reports_a_missing_action(daemon, tmp_path, monkeypatch, capsys):
    got = run_agent(daemon, monkeypatch, capsys, "--question", "hi", "--root", str(tmp_path),
                    "--max-turns", "2", "--max-new-tokens", "3")
    assert got["mode"] == "free" and got["answer"] is None
    assert [t["observation"] for t in got["turns"]] == [
        "no action: write Action: python[code], lookup[path] or finish[answer]"] * 2


def test_lookup_stays_under_the_root(tmp_path):
    (tmp_path / "a.txt").write_text("A")
    tools = agent.Tools(tmp_path.resolve(), 1.0, 40)
    assert tools.run(agent.Action("lookup", "a.txt")) == "A"
    assert tools.run(agent.Action("lookup", "/etc/passwd")).startswith("refused")
    assert tools.run(agent.Action("lookup", "nope.txt")) == "nope.txt: No such file or directory"
    assert tools.run(agent.Action("python", "print('x' * 50)")) == "x" * 40 + " ..."


@pytest.mark.parametrize("argv, what", [
    (["--tries", "0"], "--tries"),
    (["--max-turns", "0"], "--max-turns"),
    (["--tool-timeout", "0"], "--tool-timeout: must be a finite number in (0, 86400], got 0"),
    # inf was taken, and the first python action died in subprocess's wait (OverflowError)
    (["--tool-timeout", "inf"], "--tool-timeout: must be a finite number in (0, 86400], got"),
    (["--tool-timeout", "nan"], "--tool-timeout: must be a finite number in (0, 86400], got"),
    (["--tool-timeout", "1e7"], "--tool-timeout: must be a finite number in (0, 86400], got"),
    (["--root", "/no/such/dir"], "--root"),
    (["--script", "/no/such/script"], "--script"),
    (["--script", "BAD"], "not JSON"),
    (["--script", "WRONG"], "want"),
    (["--tries", "2", "--greedy"], "--greedy"),
    (["--tries", "2", "--resend"], "--resend"),
    (["--resend", "--save", "x.kv"], "--save"),
    ([], "--question"),
])
def test_bad_flags_exit_2_with_a_message(argv, what, tmp_path, capsys):
    (tmp_path / "BAD").write_text("{not json\n")
    (tmp_path / "WRONG").write_text('{"action": "shell", "input": "ls"}\n')
    argv = [str(tmp_path / a) if a in ("BAD", "WRONG") else a for a in argv]
    with pytest.raises(SystemExit) as e:
        agent.main(["--question", "q", *argv] if argv else argv)
    assert e.value.code == 2
    assert what in capsys.readouterr().err


@pytest.mark.parametrize("resend", [False, True])
def test_an_observation_past_the_context_stops_the_run_keeping_its_turns(
        daemon, k, tmp_path, monkeypatch, capsys, resend):
    """A lookup whose observation would pass the model's context ended the run with
    EOVERFLOW and nothing on stdout: now the run stops there, says so, and prints its turns."""
    context = k.model_info().context_length
    (tmp_path / "big.txt").write_text("the quick brown fox " * (context // 2))
    script = tmp_path / "task.jsonl"
    script.write_text('{"action": "python", "input": "print(6 * 7)"}\n'
                      '{"action": "lookup", "input": "big.txt"}\n'
                      '{"action": "finish", "input": "42"}\n')
    monkeypatch.setenv("SYMPHONY_SOCKET", str(daemon.socket))
    argv = ["--question", "q", "--script", str(script), "--root", str(tmp_path),
            "--max-observation", str(20 * context), "--max-new-tokens", "4", "--json"]
    assert agent.main(argv + (["--resend"] if resend else [])) == 0
    out, err = capsys.readouterr()
    got = json.loads(out)
    assert [t["tool"] for t in got["turns"]] == ["python", "lookup"]
    assert got["turns"][1]["observation"].startswith("the quick brown fox")
    assert got["answer"] is None and got["conversation_tokens"] < context
    assert err.startswith("agent: stopped after 2 turns: the conversation's ")
    assert err.endswith(f"would pass the model's context of {context} positions\n")


def test_a_question_past_the_context_is_a_usage_error(daemon, k, tmp_path, monkeypatch, capsys):
    context = k.model_info().context_length
    (tmp_path / "q.txt").write_text("the quick brown fox " * context)
    monkeypatch.setenv("SYMPHONY_SOCKET", str(daemon.socket))
    assert agent.main(["--question-file", str(tmp_path / "q.txt"), "--root", str(tmp_path),
                       "--max-new-tokens", "4"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("agent: error: --max-new-tokens 4: the prompt's ")
    assert err.endswith(f"pass the model's context of {context} positions\n")


def test_a_run_without_an_answer_leaves_no_empty_thought(daemon, tmp_path, monkeypatch, capsys):
    """The transcript showed a last "Thought:" cue with nothing after it before "(no answer)"."""
    monkeypatch.setenv("SYMPHONY_SOCKET", str(daemon.socket))
    assert agent.main(["--question", "What is 6 * 7?", "--root", str(tmp_path),
                       "--max-turns", "2", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Question: What is 6 * 7?\nThought:")
    assert out.count("Thought:") == 2 and out.count("Observation: ") == 2
    assert out.endswith("\n\n(no answer)\n")
