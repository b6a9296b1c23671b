"""`symphony generate` and the tokenizer, end to end from the shell."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from checkpoints import add_tokenizer, make_checkpoint

from symphony.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # each test runs the CLI as a process

SYMPHONY = [sys.executable, "-m", "symphony.cli"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llama")
    reference = make_checkpoint(directory, "llama", weight_scale=4.0, seed=5)
    return directory, reference


def symphony(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SYMPHONY, *args], capture_output=True, text=True, timeout=120)


def test_prompt_ids_json_is_transformers_greedy(checkpoint):
    directory, reference = checkpoint
    prompt = [9, 8, 7, 200, 3]
    run = symphony(
        "generate",
        "--model",
        str(directory),
        "--prompt-ids",
        "9,8,7,200,3",
        "--max-new-tokens",
        "24",
        "--json",
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]),
            max_new_tokens=24,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=2,
        )[0, len(prompt) :].tolist()
    if 2 in out:  # transformers stops at eos (and keeps it) as we do
        out = out[: out.index(2) + 1]
    assert result == {"prompt_ids": prompt, "output_ids": out}


def test_seeded_sampling_is_reproducible(checkpoint):
    directory, _ = checkpoint
    args = [
        "generate",
        "--model",
        str(directory),
        "--prompt-ids",
        "1 2 3",
        "--json",
        "--temperature",
        "1.0",
        "--top-k",
        "50",
        "--max-new-tokens",
        "16",
    ]
    a, b = symphony(*args, "--seed", "1"), symphony(*args, "--seed", "1")
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout) == json.loads(b.stdout)


def test_text_prompt_without_tokenizer_is_refused(checkpoint):
    directory, _ = checkpoint
    run = symphony("generate", "--model", str(directory), "--prompt", "hello")
    assert run.returncode == 1
    assert "tokenizer.json" in run.stderr and "--prompt-ids" in run.stderr


def test_bad_flags_are_refused(checkpoint, tmp_path):
    directory, _ = checkpoint
    run = symphony("generate", "--model", str(directory), "--prompt-ids", "1,x")
    assert run.returncode == 2 and "--prompt-ids" in run.stderr
    run = symphony("generate", "--model", str(directory), "--prompt-ids", "1", "--top-p", "0")
    assert run.returncode == 1 and "top_p" in run.stderr
    run = symphony("generate", "--model", str(tmp_path), "--prompt-ids", "1")
    assert run.returncode == 1 and "config.json: no such file" in run.stderr
    run = symphony("generate", "--model", str(directory), "--prompt-ids", "1,4000")
    assert run.returncode == 2 and "--prompt-ids: token 4000 is outside" in run.stderr


@pytest.mark.parametrize("n", ["2000000", "9999999999", "99999999999999999999999"])
def test_max_new_tokens_past_the_context_is_refused_before_the_pool_is_made(checkpoint, n):
    """The pool was sized by --max-new-tokens before the context was checked: 2000000 took
    12 GB and 50 s before the refusal, more an allocator's traceback (an outside tester's
    finding)."""
    directory, _ = checkpoint
    run = symphony("generate", "--model", str(directory), "--prompt-ids", "1,2",
                   "--max-new-tokens", n)
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines()[-1] == (
        f"symphony: error: --max-new-tokens {n}: the prompt's 2 tokens and {n} new ones pass "
        "the model's context of 4096 positions")


def test_text_prompt_with_tokenizer(checkpoint, tmp_path):
    directory, _ = checkpoint
    for f in directory.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    add_tokenizer(tmp_path)
    tok = Tokenizer(tmp_path)
    run = symphony(
        "generate",
        "--model",
        str(tmp_path),
        "--prompt",
        "def fibonacci(n):",
        "--max-new-tokens",
        "12",
        "--json",
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert result["prompt_ids"] == tok.encode("def fibonacci(n):")
    assert result["prompt_ids"][0] == tok.bos_id
    assert result["text"] == tok.decode(result["output_ids"])
    plain = symphony(
        "generate",
        "--model",
        str(tmp_path),
        "--prompt",
        "def fibonacci(n):",
        "--max-new-tokens",
        "12",
    )
    assert plain.stdout == "def fibonacci(n):" + result["text"] + "\n"


def test_tokenizer_round_trip_specials_and_chat(tmp_path):
    add_tokenizer(tmp_path)
    tok = Tokenizer(tmp_path)
    text = "def fibonacci(n):\n    return n  # ünïcode"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and tok.decode(ids) == text
    assert tok.eos_ids == (tok._tok.token_to_id("<|eos|>"),)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|user|>hi<|end|><|assistant|>"
    assert tok.encode(chat, add_bos=False)[0] == tok._tok.token_to_id("<|user|>")
