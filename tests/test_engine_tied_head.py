"""A config that ties the embedding and the LM head, and a checkpoint that holds both, or
only one of them: the model is what transformers loads (tied where they are equal or one is
missing, the file's head where they differ)."""

from __future__ import annotations

import pytest
import torch
from checkpoints import make_checkpoint
from safetensors.torch import load_file, save_file

from symphony.engine.engine import Engine
from symphony.engine.generate import generate
from symphony.engine.loader import load_model
from symphony.engine.sampler import GREEDY

IDS = [1, 17, 250, 3, 99, 42, 7]


class Dense:
    """Plain causal attention over one sequence, to run a loaded model without a pool."""

    def attend(self, layer, q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        )
        return out.transpose(0, 1)


@pytest.mark.parametrize("head", ["different", "equal", "only the head", "only the embedding"])
def test_the_lm_head_in_the_file_is_used_as_transformers_uses_it(tmp_path, head):
    from transformers import AutoModelForCausalLM

    make_checkpoint(tmp_path, "llama-tied-mha")
    weights = load_file(tmp_path / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    torch.manual_seed(1)
    different = torch.randn_like(embed)
    if head == "only the head":  # the one tied tensor saved under the head's name
        weights["lm_head.weight"] = weights.pop("model.embed_tokens.weight")
    elif head != "only the embedding":
        weights["lm_head.weight"] = different if head == "different" else embed.clone()
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    reference = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tied = reference.lm_head.weight.data_ptr() == reference.model.embed_tokens.weight.data_ptr()
    assert tied == (head != "different")
    assert torch.equal(reference.model.embed_tokens.weight, embed)
    model = load_model(tmp_path)
    assert model.config.tie_word_embeddings == tied
    with torch.no_grad():
        ours = model.logits(model(torch.tensor(IDS), torch.arange(len(IDS)), Dense()))
        theirs = reference(torch.tensor([IDS])).logits[0]
    assert (ours - theirs).abs().max() <= 1e-5 * max(1.0, theirs.abs().max().item())
    engine = Engine(tmp_path, device="cpu", kv_pages=4)  # the packed C matmuls' LM head
    with torch.no_grad():
        want = reference.generate(torch.tensor([IDS]), max_new_tokens=4, min_new_tokens=4,
                                  do_sample=False, pad_token_id=0)[0, len(IDS):].tolist()
    assert generate(engine, [IDS], GREEDY, 4, stop_ids=())[0] == want
