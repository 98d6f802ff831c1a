"""make_model / presets: determinism, file layout, and loadability by transformers 5.23."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pdserve.checkpoints import bpe_builder
from pdserve.checkpoints.presets import ARCHS, SIZES, hf_config
from pdserve.checkpoints.random_checkpoint import make_model, num_parameters, tensor_specs

transformers = pytest.importorskip("transformers")

EXPECTED_FILES = {
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: make_model(root / arch, arch, "tiny", seed=0) for arch in ARCHS}


def _read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            out.update({k: sf.get_tensor(k) for k in sf.keys()})
    return out


def _load_hf(model_dir: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    return model.eval(), info


def _assert_clean_load(info: dict) -> None:
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"], info["unexpected_keys"]
    assert not info["mismatched_keys"], info["mismatched_keys"]
    assert not info["error_msgs"], info["error_msgs"]


# ----------------------------------------------------------------------------- presets


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("size", SIZES)
def test_preset_is_exactly_what_transformers_saves(arch, size):
    cfg = hf_config(arch, size)
    hf = transformers.AutoConfig.for_model(**cfg)
    saved = hf.to_diff_dict()  # what save_pretrained writes to config.json
    saved.pop("transformers_version", None)
    assert saved == cfg
    assert cfg["bos_token_id"] == bpe_builder.BOS_TOKEN_ID
    assert cfg["eos_token_id"] == bpe_builder.EOS_TOKEN_ID


def test_preset_rejects_unknown_values():
    with pytest.raises(ValueError, match="llama.*glm_moe_dsa"):
        hf_config("llama", "tiny")
    with pytest.raises(ValueError, match="huge.*tiny, small"):
        hf_config("deepseek_v3", "huge")


def test_presets_cover_both_rope_types_and_q_paths():
    assert hf_config("glm_moe_dsa", "tiny")["rope_parameters"]["rope_type"] == "default"
    assert hf_config("deepseek_v32", "tiny")["rope_parameters"]["rope_type"] == "yarn"
    assert hf_config("deepseek_v3", "tiny")["q_lora_rank"] is None
    assert hf_config("deepseek_v3", "small")["q_lora_rank"] == 256
    assert hf_config("glm_moe_dsa", "small")["indexer_types"][:3] == ["full", "shared", "full"]
    assert "indexer_types" not in hf_config("deepseek_v32", "tiny")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("size, low, high", [("small", 20e6, 99e6), ("medium", 380e6, 450e6)])
def test_parameter_count_matches_transformers(arch, size, low, high):
    cfg = hf_config(arch, size)
    ours = num_parameters(cfg)
    assert low < ours < high  # medium: ~1.65 GB of float32, weight-bound decode (bench/engine.py)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    # e_score_correction_bias is a buffer in transformers but a checkpoint tensor all the same.
    hf = sum(p.numel() for p in model.parameters())
    hf += sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert ours == hf


# ----------------------------------------------------------------------------- files


def test_same_seed_gives_identical_bytes(tmp_path, tiny_dirs):
    again = make_model(tmp_path / "again", "glm_moe_dsa", "tiny", seed=0)
    first = tiny_dirs["glm_moe_dsa"]
    assert {p.name for p in again.iterdir()} == EXPECTED_FILES
    for name in EXPECTED_FILES:
        assert (again / name).read_bytes() == (first / name).read_bytes(), name


def test_different_seed_gives_different_weights(tmp_path, tiny_dirs):
    other = make_model(tmp_path / "other", "glm_moe_dsa", "tiny", seed=1)
    a, b = _read_tensors(tiny_dirs["glm_moe_dsa"]), _read_tensors(other)
    assert a.keys() == b.keys()
    for name in a:
        assert not torch.equal(a[name], b[name]), name


def test_weights_are_never_left_at_defaults(tiny_dirs):
    for arch, model_dir in tiny_dirs.items():
        tensors = _read_tensors(model_dir)
        assert all(t.dtype == torch.float32 for t in tensors.values())
        norms = [n for n in tensors if "norm" in n and n.endswith(".weight")]
        assert len(norms) > 10
        for name in norms:
            assert not torch.allclose(tensors[name], torch.ones_like(tensors[name])), name
        for name in tensors:
            if name.endswith((".bias", "e_score_correction_bias")):
                assert tensors[name].abs().min() > 0, name
        if arch != "deepseek_v3":
            assert any(n.endswith("indexer.k_norm.bias") for n in tensors)


def test_generation_config(tiny_dirs):
    gen = json.loads((tiny_dirs["deepseek_v3"] / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "do_sample": False}


def test_refuses_to_overwrite_and_overwrites_on_request(tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    (target / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        make_model(target, "deepseek_v3", "tiny")
    assert (target / "keep.txt").exists()
    make_model(target, "deepseek_v3", "tiny", overwrite=True)
    assert {p.name for p in target.iterdir()} == EXPECTED_FILES
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temp dirs left behind


def test_crash_midway_leaves_no_checkpoint(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(bpe_builder, "write_tokenizer_files", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        make_model(tmp_path / "m", "deepseek_v3", "tiny")
    assert list(tmp_path.iterdir()) == []


def test_sharded_checkpoint(tmp_path, tiny_dirs):
    sharded = make_model(tmp_path / "sharded", "deepseek_v32", "tiny", max_shard_bytes=200_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (sharded / "model.safetensors").exists()
    assert shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    tensors = _read_tensors(sharded)
    assert set(index["weight_map"]) == set(tensors) == set(tensor_specs(hf_config("deepseek_v32", "tiny")))
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in tensors.values())
    for shard in shards:
        with safe_open(str(shard), "pt") as sf:
            assert all(index["weight_map"][k] == shard.name for k in sf.keys())
    # Values do not depend on sharding.
    unsharded = _read_tensors(tiny_dirs["deepseek_v32"])
    assert all(torch.equal(tensors[k], unsharded[k]) for k in tensors)
    _, info = _load_hf(sharded)
    _assert_clean_load(info)


# ----------------------------------------------------------------------------- transformers


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_and_runs(arch, tiny_dirs):
    model_dir = tiny_dirs[arch]
    model, info = _load_hf(model_dir)
    _assert_clean_load(info)
    ids = torch.tensor([[5, 17, 300, 42, 7, 99, 260, 11, 400, 3]])
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 512)
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.1  # not flat: a random model should still prefer some tokens

    # The loaded (fused-expert) weights are exactly the ones we wrote.
    written = _read_tensors(model_dir)
    state = model.state_dict()
    for name, value in written.items():
        if name in state:
            assert torch.equal(state[name], value), name
    gate_up = state["model.layers.1.mlp.experts.gate_up_proj"]
    for e in range(8):
        pre = f"model.layers.1.mlp.experts.{e}"
        expected = torch.cat([written[f"{pre}.gate_proj.weight"], written[f"{pre}.up_proj.weight"]])
        assert torch.equal(gate_up[e], expected)
