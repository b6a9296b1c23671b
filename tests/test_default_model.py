"""The tiny model the project ships (models/tiny, the suite's): complete, small, and the same
under our engine and transformers; and which model is the default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "tiny"
sys.path.insert(0, str(ROOT / "models"))

SNIPPET = '''import os


def read_lines(path):
    """Return the lines of the file at path, without their newlines."""
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\\n") for line in f]
'''


def test_files_and_size():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (MODEL / name).is_file(), name
    assert sum(f.stat().st_size for f in MODEL.iterdir()) <= 25 * 2**20
    config = json.loads((MODEL / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["torch_dtype"] in ("bfloat16", "float16")
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # GQA


def test_tokenizer_round_trips_and_has_specials():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    text = SNIPPET + "\tTabs, trailing spaces   \nand unicode: héllo ✓ 東京\n"
    ids = tok.encode(text).ids
    assert ids[0] == tok.token_to_id("<|bos|>")
    assert tok.decode(ids) == text
    for special in ("<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"):
        assert len(tok.encode(special, add_special_tokens=False).ids) == 1


def test_chat_template_matches_corpus_format():
    from default_tokenizer import check_chat_template, render_chat

    from symphony.engine.tokenizer import Tokenizer

    check_chat_template(MODEL)  # transformers renders the shipped template as trained
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What does `len` do?"}]
    for gen in (False, True):  # and so does ours
        assert Tokenizer(MODEL).apply_chat_template(messages, gen) == render_chat(messages, gen)


def test_engine_matches_transformers_and_is_not_noise():
    """The same parity rule as the engine's: the paged forward within 1e-4 of transformers."""
    from transformers import AutoModelForCausalLM

    from symphony.engine.engine import Batch, Engine

    engine = Engine(MODEL, device="cpu", kv_pages=16)
    ids = engine.tokenizer.encode(SNIPPET)
    hf = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids])).logits[0]
    pages = engine.pool.allocate(-(-len(ids) // engine.page_size))
    got = engine.forward(Batch(ids, list(range(len(ids))), [len(ids)], [len(ids)], [pages],
                               list(range(len(ids)))))
    assert (got - want).abs().max().item() < 1e-4
    loss = F.cross_entropy(got[:-1], torch.tensor(ids[1:])).item()
    # Uniform guessing scores ln(4096) = 8.3 nats; the model knows Python.
    assert loss < 3.0, loss


def test_default_is_smollm2_where_installed(monkeypatch):
    from symphony.engine import engine

    monkeypatch.delenv("SYMPHONY_MODEL", raising=False)
    smollm2 = engine.smollm2_file()
    assert engine.default_model_dir() == (smollm2 or MODEL)
    if smollm2 is not None:
        assert smollm2.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smollm2.is_file()
    monkeypatch.setattr(engine.importlib.util, "find_spec", lambda name: None)
    assert engine.smollm2_file() is None and engine.default_model_dir() == MODEL
    monkeypatch.setenv("SYMPHONY_MODEL", "/some/model.gguf")
    assert engine.default_model_dir() == Path("/some/model.gguf")


@pytest.mark.slow  # the CLI as a process, on the default model
def test_generate_with_no_model_writes_text():
    from symphony.engine.engine import smollm2_file

    env = {k: v for k, v in os.environ.items() if k != "SYMPHONY_MODEL"}
    prompt = "The capital of France is" if smollm2_file() else "def fibonacci(n):"
    run = subprocess.run(
        [sys.executable, "-m", "symphony.cli", "generate", "--prompt", prompt,
         "--max-new-tokens", "8", "--json"],
        capture_output=True, text=True, timeout=300, env=env,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    assert 0 < len(result["output_ids"]) <= 8
    assert result["text"].strip()
    if smollm2_file():  # a real model: a real answer
        assert "Paris" in result["text"], result["text"]
