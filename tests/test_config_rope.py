"""config.json's RoPE scaling: the types computed match transformers; any other is named."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import SMALL

from symphony.engine.config import ModelConfig
from symphony.engine.errors import ModelError
from symphony.engine.loader import load_model


class Dense:
    """Plain causal attention over one sequence, to run a loaded model without a pool."""

    def attend(self, layer, q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        )
        return out.transpose(0, 1)


def test_linear_rope_scaling_matches_transformers(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SMALL, rope_scaling={"rope_type": "linear", "factor": 4.0})
    torch.manual_seed(0)
    reference = LlamaForCausalLM(config).eval()
    reference.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    ids = list(range(3, 300, 7))  # 43 positions: past where linear scaling changes the angles
    with torch.no_grad():
        ours = model.logits(model(torch.tensor(ids), torch.arange(len(ids)), Dense()))
        theirs = reference(torch.tensor([ids])).logits[0]
        unscaled = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
        unscaled.load_state_dict(reference.state_dict())
        assert (unscaled(torch.tensor([ids])).logits[0] - theirs).abs().max() > 1e-3
    assert (ours - theirs).abs().max() <= 1e-5 * max(1.0, theirs.abs().max().item())


@pytest.mark.parametrize("spelling", ["rope_scaling", "rope_parameters"])
def test_an_unsupported_rope_type_is_named_once(tmp_path, spelling):
    raw = {"architectures": ["LlamaForCausalLM"], **SMALL,
           spelling: {"rope_type": "yarn", "factor": 2.0}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ModelError) as e:
        ModelConfig.from_file(path)
    assert str(e.value) == (f"{path}: rope_scaling: rope_type 'yarn' is not supported "
                            "(supported: default, linear, llama3)")
