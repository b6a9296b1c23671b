"""The prompt flags that only the kernel's answers can check, the same in every program that
generates from a prompt and in `symphony generate`: a prompt with no tokens, and a prompt
that with --max-new-tokens passes the model's context, are usage errors (status 2, nothing on
stdout), refused before anything is generated. The test model's context is cut to CONTEXT
positions here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from daemon import ROOT, make_model

CONTEXT = 64
PROGRAMS = {  # each program's flags besides the prompt's
    "complete": ["--json"],
    "best_of_n": ["--n", "2", "--json"],
    "cacheback": ["--json"],
    "constrained": ["--regex", "[a-z ]*", "--json"],
    "beam": ["--width", "2", "--json"],
}
IDS = ",".join(str(10 + i % 200) for i in range(CONTEXT - 4))  # CONTEXT - 4 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The test model (tests/daemon.py's) with a context of CONTEXT positions, and no BOS
    added to a text prompt: an empty one has no tokens, as with models/tiny's tokenizer."""
    directory = make_model(tmp_path_factory.mktemp("short"))
    for name, key, value in (("config.json", "max_position_embeddings", CONTEXT),
                             ("tokenizer_config.json", "add_bos_token", False)):
        config = json.loads((directory / name).read_text())
        config[key] = value
        (directory / name).write_text(json.dumps(config))
    return directory


@pytest.fixture()
def lip(daemon, lip_main, monkeypatch):
    """lips.PROG's main run in this process against the daemon."""
    monkeypatch.setenv("SYMPHONY_SOCKET", str(daemon.socket))
    return lip_main


def generate(model, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "symphony.cli", "generate", "--model",
                           str(model), *argv], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


@pytest.mark.parametrize("prog", PROGRAMS)
def test_an_empty_prompt_is_a_usage_error(lip, prog):
    code, out, err = lip(prog, "--prompt", "", *PROGRAMS[prog])
    assert (code, out) == (2, "")
    assert err == f"{prog}: error: empty prompt: --prompt or --prompt-file gave no tokens\n"


def test_async_lms_empty_prompt_is_a_usage_error(lip):
    code, out, err = lip("async_lm", "--prompt", "")
    assert (code, out) == (2, "")
    assert "async_lm: error: empty prompt" in err


@pytest.mark.parametrize("prog", PROGRAMS)
def test_a_prompt_and_new_tokens_past_the_context_are_refused_up_front(lip, prog):
    code, out, err = lip(prog, "--prompt-ids", IDS, "--max-new-tokens", "5", *PROGRAMS[prog])
    assert (code, out) == (2, "")
    assert err == (f"{prog}: error: --max-new-tokens 5: the prompt's {CONTEXT - 4} tokens and "
                   f"5 new ones pass the model's context of {CONTEXT} positions\n")
    code, out, err = lip(prog, "--prompt-ids", IDS, "--max-new-tokens", "4", *PROGRAMS[prog])
    assert code in (0, 3) and out, err  # constrained's 3: its regex may be unfinished


def test_complete_and_generate_agree_at_the_context(lip, model):
    """`symphony generate` ran past the context where complete failed EOVERFLOW, its tokens
    lost: both refuse the same flags, and give the same tokens up to the context."""
    r = generate(model, "--prompt-ids", IDS, "--max-new-tokens", "5", "--json")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == (f"symphony: error: --max-new-tokens 5: the prompt's {CONTEXT - 4} "
                        f"tokens and 5 new ones pass the model's context of {CONTEXT} "
                        f"positions\n")
    r = generate(model, "--prompt-ids", IDS, "--max-new-tokens", "4", "--json")
    code, out, _ = lip("complete", "--prompt-ids", IDS, "--max-new-tokens", "4", "--json")
    assert r.returncode == code == 0
    assert json.loads(r.stdout)["output_ids"] == json.loads(out)["output_ids"]


def test_generates_empty_prompt_is_a_usage_error(model):
    r = generate(model, "--prompt", "")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == "symphony: error: empty prompt: --prompt or --prompt-file gave no tokens\n"
