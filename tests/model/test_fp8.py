"""FP8 block-quantized checkpoints (the released layout): load, dequantize exactly, fail by name.

The checkpoints come from `make-model --quantize fp8` with intermediate_size 200, so the dense MLP
weights span one full 128-block and one partial 72-row (or 72-column) block; most other projections
are smaller than one block (partial blocks only). The oracle dequantizes independently in float64
with index arithmetic and writes a plain checkpoint; float64 logits must agree to 1e-8.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pdserve.checkpoints.random_checkpoint import make_model
from pdserve.engine.llm_engine import LLMEngine
from pdserve.model.config import ModelConfig
from pdserve.model.quant import QuantizationError
from pdserve.model.weights import WeightError, load_model
from tests.conftest import ARCHS
from tests.model.test_weights import cli_error

WIDE = {"intermediate_size": 200}  # > 128 and not a multiple of it: a full block plus a partial one
DENSE_GATE = "model.layers.0.mlp.gate_proj.weight"


@pytest.fixture(scope="module")
def fp8_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return {a: make_model(root / a, a, "tiny", seed=3, quantize="fp8", config_overrides=WIDE) for a in ARCHS}


def dequantized_copy(src, dst):
    """The oracle: every fp8 weight times scale_inv[i // 128, j // 128] in float64, as a plain checkpoint."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        if scale is None:
            out[name] = t.double()
            continue
        rows, cols = torch.arange(t.shape[0]) // 128, torch.arange(t.shape[1]) // 128
        out[name] = t.double() * scale.double()[rows][:, cols]
    save_file(out, dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_layout_is_the_released_one(fp8_checkpoints):
    with safe_open(str(fp8_checkpoints["deepseek_v32"] / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        gate = f.get_tensor(DENSE_GATE)
        assert gate.dtype == torch.float8_e4m3fn and tuple(gate.shape) == (200, 64)
        assert tuple(f.get_tensor(DENSE_GATE + "_scale_inv").shape) == (2, 1)
        assert f.get_tensor(DENSE_GATE + "_scale_inv").dtype == torch.float32
        assert f.get_tensor("model.layers.1.mlp.experts.3.down_proj.weight").dtype == torch.float8_e4m3fn
        for plain in (
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.norm.weight",
            "model.layers.1.mlp.gate.weight",
            "model.layers.1.self_attn.indexer.weights_proj.weight",
            "model.layers.1.input_layernorm.weight",
        ):
            assert f.get_tensor(plain).dtype == torch.float32, plain
            assert plain + "_scale_inv" not in names
    qc = json.loads((fp8_checkpoints["deepseek_v32"] / "config.json").read_text())["quantization_config"]
    assert qc == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    }


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_logits_equal_independently_dequantized(fp8_checkpoints, tmp_path, arch):
    src = fp8_checkpoints[arch]
    oracle = dequantized_copy(src, tmp_path / "plain")
    ids = torch.randint(4, 500, (21,), generator=torch.Generator().manual_seed(1)).tolist()
    got = LLMEngine.from_pretrained(src, "float64", max_kv_tokens=128).prefill_logits(ids)
    want = LLMEngine.from_pretrained(oracle, "float64", max_kv_tokens=128).prefill_logits(ids)
    assert (got - want).abs().max().item() <= 1e-8
    # and quantization really happened: the weights differ from the unquantized random ones
    plain = load_model(
        make_model(tmp_path / "f32", arch, "tiny", seed=3, config_overrides=WIDE), torch.float64
    )
    fp8 = load_model(src, torch.float64)
    w32, w8 = (m.model.layers[0].mlp.gate_proj.weight for m in (plain, fp8))
    assert 0 < (w32 - w8).abs().max().item() < 0.1 * w32.abs().max().item()


def test_scale_in_another_shard_than_its_weight(fp8_checkpoints, tmp_path):
    """A weight and its scale may sit in different shards: either order loads the same model."""
    src = fp8_checkpoints["glm_moe_dsa"]
    dst = shutil.copytree(src, tmp_path / "split")
    tensors = load_file(dst / "model.safetensors")
    (dst / "model.safetensors").unlink()
    scales = {k: v for k, v in tensors.items() if k.endswith("_scale_inv")}
    weights = {k: v for k, v in tensors.items() if k not in scales}
    first, second = dict(list(scales.items())[::2]), dict(list(scales.items())[1::2])
    save_file({**weights, **first}, dst / "model-00001-of-00002.safetensors")
    save_file(second, dst / "model-00002-of-00002.safetensors")
    weight_map = {
        **dict.fromkeys([*weights, *first], "model-00001-of-00002.safetensors"),
        **dict.fromkeys(second, "model-00002-of-00002.safetensors"),
    }
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    a, b = load_model(src, torch.float64), load_model(dst, torch.float64, progress=lambda m: None)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na


def _edit(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


def test_missing_scale_is_named(fp8_checkpoints, tmp_path):
    path = shutil.copytree(fp8_checkpoints["deepseek_v3"], tmp_path / "c")
    name = "model.layers.2.self_attn.kv_b_proj.weight_scale_inv"
    _edit(path, lambda t: t.pop(name))
    with pytest.raises(WeightError, match=name.replace(".", r"\.")):
        load_model(path)
    assert name in cli_error(path)


def test_scale_of_wrong_shape_is_named(fp8_checkpoints, tmp_path):
    path = shutil.copytree(fp8_checkpoints["deepseek_v3"], tmp_path / "c")
    name = DENSE_GATE + "_scale_inv"
    _edit(path, lambda t: t.__setitem__(name, torch.ones(1, 1)))
    with pytest.raises(
        WeightError, match=name.replace(".", r"\.") + r" has shape \[1, 1\], expected \[2, 1\]"
    ):
        load_model(path)


def test_fp8_tensor_without_quantization_config_is_named(fp8_checkpoints, tmp_path):
    path = shutil.copytree(fp8_checkpoints["deepseek_v3"], tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightError, match="float8.*no quantization_config"):
        load_model(path)


UNSUPPORTED = {
    "int4 (gptq)": {"quant_method": "gptq", "bits": 4, "group_size": 128},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True},
    "compressed-tensors": {"quant_method": "compressed-tensors", "format": "pack-quantized"},
    "nvfp4 (modelopt)": {"quant_algo": "NVFP4"},
}


@pytest.mark.parametrize("what", list(UNSUPPORTED))
def test_unsupported_quantization_method_is_named(fp8_checkpoints, what):
    cfg = json.loads((fp8_checkpoints["deepseek_v3"] / "config.json").read_text())
    cfg["quantization_config"] = UNSUPPORTED[what]
    method = UNSUPPORTED[what].get("quant_method") or UNSUPPORTED[what]["quant_algo"]
    with pytest.raises(QuantizationError, match=f"unsupported quantization method '{method}'"):
        ModelConfig.from_dict(cfg)


def test_unsupported_method_is_one_line_at_load(fp8_checkpoints, tmp_path):
    path = shutil.copytree(fp8_checkpoints["deepseek_v3"], tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = UNSUPPORTED["awq"]
    (path / "config.json").write_text(json.dumps(cfg))
    assert "unsupported quantization method 'awq'" in cli_error(path)


def _with_mtp(src, dst, n_mtp: int, layers: list[int]):
    """A copy of src whose file also holds MTP-style tensors for `layers` (eh_proj, enorm, a full block)."""
    path = shutil.copytree(src, dst)
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = n_mtp
    (path / "config.json").write_text(json.dumps(cfg))

    def add(t):
        for layer in layers:
            for k in [k for k in t if k.startswith("model.layers.3.")]:
                t[k.replace("model.layers.3.", f"model.layers.{layer}.")] = t[k].clone()
            t[f"model.layers.{layer}.eh_proj.weight"] = torch.zeros(64, 128)
            t[f"model.layers.{layer}.enorm.weight"] = torch.ones(64)

    _edit(path, add)
    return path


def test_mtp_layers_are_skipped_with_one_line(fp8_checkpoints, tmp_path):
    src = fp8_checkpoints["glm_moe_dsa"]  # 4 decoder layers: MTP is layer 4
    path = _with_mtp(src, tmp_path / "mtp", 1, [4])
    messages = []
    a, b = load_model(src, torch.float64), load_model(path, torch.float64, progress=messages.append)
    mtp = [m for m in messages if "multi-token-prediction" in m]
    assert mtp == ["skipped 72 tensors of 1 multi-token-prediction layer(s) (layers 4+; not served)"], (
        messages
    )
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na
    # a layer past the declared MTP layers is not recognised, and a missing required tensor still fails
    beyond = _with_mtp(src, tmp_path / "beyond", 1, [4, 5])
    with pytest.raises(WeightError, match=r"unexpected tensor model\.layers\.5\."):
        load_model(beyond)
    _edit(path, lambda t: t.pop("model.layers.3.self_attn.o_proj.weight"))
    with pytest.raises(WeightError, match=r"missing tensor model\.layers\.3\.self_attn\.o_proj\.weight"):
        load_model(path)


def test_make_model_cli_quantize_fp8(tmp_path, fp8_checkpoints):
    from typer.testing import CliRunner

    from pdserve.cli.main import app

    out = tmp_path / "cli"
    r = CliRunner().invoke(
        app, ["make-model", str(out), "--arch", "deepseek_v3", "--quantize", "fp8", "--seed", "3"]
    )
    assert r.exit_code == 0, r.output
    assert json.loads((out / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.self_attn.o_proj.weight").dtype == torch.float8_e4m3fn
    load_model(out)
    assert CliRunner().invoke(app, ["make-model", str(tmp_path / "x"), "--quantize", "int4"]).exit_code == 2
