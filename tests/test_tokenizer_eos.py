"""The ids generation stops at, from a checkpoint directory, are those transformers' generate
stops at: generation_config.json's where there is one, else config.json's."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import add_tokenizer, make_checkpoint

from symphony.engine.engine import Engine
from symphony.engine.generate import generate
from symphony.engine.sampler import GREEDY

PROMPT = [1, 17, 250, 3, 99]


@pytest.mark.parametrize("where", ["config.json", "generation_config.json"])
def test_generation_stops_where_transformers_does(tmp_path, where):
    from transformers import AutoModelForCausalLM

    model = make_checkpoint(tmp_path, "llama", weight_scale=4.0)
    add_tokenizer(tmp_path)
    (tmp_path / "generation_config.json").unlink(missing_ok=True)
    with torch.no_grad():
        free = model.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False,
                              min_new_tokens=6, pad_token_id=0)[0, len(PROMPT):].tolist()
    # The first token after the first that is new, and not the tokenizer's EOS, ends it.
    end = next(i for i in range(1, 6) if free[i] not in (*free[:i], 2))
    stop = free[end]
    if where == "config.json":
        config = json.loads((tmp_path / "config.json").read_text())
        (tmp_path / "config.json").write_text(json.dumps({**config, "eos_token_id": [2, stop]}))
    else:  # config.json keeps its own eos_token_id, 2, which transformers then ignores
        (tmp_path / where).write_text(json.dumps({"eos_token_id": [2, stop]}))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        theirs = reference.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False,
                                    pad_token_id=0)[0, len(PROMPT):].tolist()
    assert theirs == free[: end + 1]
    engine = Engine(tmp_path, device="cpu", kv_pages=8)
    assert set(engine.eos_ids()) == {2, stop}
    assert generate(engine, [PROMPT], GREEDY, 6)[0] == theirs
