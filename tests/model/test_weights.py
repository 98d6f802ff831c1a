"""Loading: sharded checkpoints with progress, and one-line errors that name what is wrong."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.checkpoints.random_checkpoint import make_model
from pdserve.model.config import ConfigError
from pdserve.model.weights import WeightError, load_model


@pytest.fixture()
def ckpt(tiny_checkpoints, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints[("glm_moe_dsa", "make-model")], dst)
    return dst


def rewrite_weights(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def cli_error(path) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "generate", "--model", str(path), "--token-ids", "5,6"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_missing_tensor_is_named(ckpt):
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    rewrite_weights(ckpt, lambda t: t.pop(name))
    with pytest.raises(WeightError, match=name.replace(".", r"\.")):
        load_model(ckpt)
    assert name in cli_error(ckpt)


def test_missing_expert_is_named(ckpt):
    rewrite_weights(ckpt, lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"))
    with pytest.raises(WeightError, match=r"model\.layers\.2\.mlp\.experts"):
        load_model(ckpt)


def test_wrong_shape_is_named(ckpt):
    name = "model.layers.0.self_attn.o_proj.weight"

    def edit(t):
        t[name] = torch.zeros(t[name].shape[0], t[name].shape[1] + 1)

    rewrite_weights(ckpt, edit)
    with pytest.raises(WeightError, match=name.replace(".", r"\.") + ".*shape"):
        load_model(ckpt)
    assert name in cli_error(ckpt)


def test_unsupported_model_type_is_named(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="llama"):
        load_model(ckpt)
    assert "llama" in cli_error(ckpt)


def test_sharded_checkpoint_loads_with_progress(tmp_path, tiny_checkpoints):
    sharded = make_model(tmp_path / "sharded", "deepseek_v32", "tiny", seed=0, max_shard_bytes=100_000)
    single = tiny_checkpoints[("deepseek_v32", "make-model")]
    messages = []
    a = load_model(sharded, progress=messages.append)
    b = load_model(single)
    n_shards = len(list(sharded.glob("model-*.safetensors")))
    assert n_shards > 1
    assert messages == [
        f"loading weights: shard {i}/{n_shards} ({p.name})"
        for i, p in enumerate(sorted(sharded.glob("model-*.safetensors")), 1)
    ]
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na


def test_fp32_modules_stay_fp32_in_bfloat16(tiny_checkpoints):
    model = load_model(tiny_checkpoints[("glm_moe_dsa", "make-model")], dtype=torch.bfloat16)
    layer = model.model.layers[2]  # a full indexer layer with a MoE block
    assert layer.self_attn.kv_b_proj.weight.dtype == torch.bfloat16
    assert layer.self_attn.indexer.weights_proj.weight.dtype == torch.float32
    assert layer.mlp.gate.e_score_correction_bias.dtype == torch.float32
