"""Checkpoint loading: sharded files, and clear errors for every kind of broken checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from checkpoints import make_checkpoint
from safetensors.torch import load_file, save_file

from symphony.engine.errors import ModelError
from symphony.engine.loader import load_model, save_checkpoint


class Dense:
    """Plain causal attention over one sequence, to run a loaded model without a pool."""

    def attend(self, layer, q, k, v):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        )
        return out.transpose(0, 1)


def logits(model, ids):
    return model.logits(model(torch.tensor(ids), torch.arange(len(ids)), Dense()))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2")
    reference = make_checkpoint(directory, "qwen2")
    return directory, reference


def broken_copy(checkpoint, tmp_path):
    directory, _ = checkpoint
    target = tmp_path / "ckpt"
    shutil.copytree(directory, target)
    return target


def test_sharded_checkpoint_loads_like_a_single_file(checkpoint, tmp_path):
    directory, reference = checkpoint
    reference.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    torch.testing.assert_close(
        logits(load_model(tmp_path), ids), logits(load_model(directory), ids), rtol=0, atol=0
    )


def test_save_checkpoint_round_trips(checkpoint, tmp_path):
    directory, _ = checkpoint
    model = load_model(directory)
    save_checkpoint(
        model, json.loads((directory / "config.json").read_text()), tmp_path, dtype=torch.float32
    )
    ids = [7, 7, 8, 100, 3]
    torch.testing.assert_close(
        logits(load_model(tmp_path), ids), logits(model, ids), rtol=0, atol=0
    )


def test_missing_config(checkpoint, tmp_path):
    target = broken_copy(checkpoint, tmp_path)
    (target / "config.json").unlink()
    with pytest.raises(ModelError, match="config.json: no such file"):
        load_model(target)


def test_unsupported_architecture(checkpoint, tmp_path):
    target = broken_copy(checkpoint, tmp_path)
    cfg = json.loads((target / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (target / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_model(target)


def test_truncated_weights(checkpoint, tmp_path):
    target = broken_copy(checkpoint, tmp_path)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelError, match="model.safetensors"):
        load_model(target)


def test_missing_tensor_is_named(checkpoint, tmp_path):
    target = broken_copy(checkpoint, tmp_path)
    tensors = load_file(target / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, target / "model.safetensors")
    with pytest.raises(ModelError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_model(target)


def test_mismatched_shape_is_named(checkpoint, tmp_path):
    target = broken_copy(checkpoint, tmp_path)
    cfg = json.loads((target / "config.json").read_text())
    cfg["intermediate_size"] += 16
    (target / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelError, match=r"mlp\.(gate|up|down)_proj\.weight' is .*expected"):
        load_model(target)


def test_unexpected_tensor_is_named(checkpoint, tmp_path):
    target = broken_copy(checkpoint, tmp_path)
    tensors = load_file(target / "model.safetensors")
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, target / "model.safetensors")
    with pytest.raises(ModelError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.extra"):
        load_model(target)


def test_missing_shard_is_named(checkpoint, tmp_path):
    directory, reference = checkpoint
    reference.save_pretrained(tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelError, match=shard.name):
        load_model(tmp_path)
