"""Sizing real releases from config.json alone: `--check-config` plans, `admin capacity --gpu-memory`,
and the loader's name mapping on a meta-device model (tests/data/configs, sources in its README)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pdserve.checkpoints.random_checkpoint import tensor_specs
from pdserve.cli.main import app
from pdserve.decode_server.tp import apply_decode_tp
from pdserve.model.config import ModelConfig
from pdserve.model.quant import quantizable
from pdserve.model.weights import WeightError, check_tensor_names, load_model
from pdserve.prefill_server.moe_tp import shard_prefill_ffn
from pdserve.runtime.weight_plan import param_bytes

CONFIGS = Path(__file__).parent / "data" / "configs"
RELEASES = {"glm5": 744e9, "deepseek_v32": 671e9, "deepseek_v3": 671e9}  # parameters the model cards state
GIB = 2**30
GLM5_W8 = ("decode", "--model", str(CONFIGS / "glm5"), "--tp-size", "8", "--device", "cuda")  # fp8 kept


def cli(*args: str, env: dict | None = None):
    return CliRunner().invoke(app, list(args), env={"PDSERVE_ADMIN_TOKEN": "", **(env or {})})


@pytest.mark.parametrize("release", list(RELEASES))
def test_release_config_passes_check_config(release):
    d = str(CONFIGS / release)
    r = cli(
        "decode",
        "--model",
        d,
        "--tp-size",
        "16",
        "--dcp-size",
        "8",
        "--dtype",
        "bfloat16",
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--kv-memory",
        "40GiB",
        "--gpu-memory",
        "141GiB",
        "--check-config",
    )
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)["plan"]
    mcfg = ModelConfig.from_pretrained(d)
    pb = param_bytes(mcfg, "bfloat16")
    assert abs(pb.total / 2 - RELEASES[release]) < 0.005 * RELEASES[release]  # the card's size, within 0.5%
    assert plan["weight_bytes_per_rank"] == pb.decode_rank(16, 8)
    assert plan["kv_bytes_per_rank"] <= 40 * GIB and plan["kv_tokens"] == json.loads(r.stdout)["num_slots"]
    assert plan["gpu"]["fits"] and "16 rank(s): TP=16, DCP C_d=8" in plan["topology"]
    r = cli("prefill", "--model", d, "--cp-size", "4", "--dtype", "bfloat16", "--check-config")
    assert r.exit_code == 0 and json.loads(r.stdout)["plan"]["weight_bytes_per_rank"] == pb.total
    assert cli("up", "--model", d, "--decode-tp", "8", "--decode-dcp", "4", "--check-config").exit_code == 0


@pytest.mark.parametrize(
    "release,method", [("glm5_compressed_tensors", "compressed-tensors"), ("deepseek_v32_quark", "quark")]
)
def test_unsupported_release_quantization_is_one_line(release, method):
    r = cli("decode", "--model", str(CONFIGS / release), "--check-config")
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr.strip().splitlines() == [
        f"error: unsupported quantization method '{method}' in config.json "
        "(supported: fp8 with e4m3 block scales, or an unquantized checkpoint)"
    ]


def test_check_config_never_builds_the_builtin_model(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("--check-config built or loaded a model")

    # the built-in model's writer and the weight loader: a meta-device plan needs neither
    monkeypatch.setattr("pdserve.checkpoints.random_checkpoint.make_model", refuse)
    monkeypatch.setattr("pdserve.model.weights.load_model", refuse)
    monkeypatch.setattr("pdserve.cli.common.ensure_builtin_model", refuse)
    for role in ("prefill", "decode", "up", "router"):
        r = cli(role, "--check-config", env={"PDSERVE_CACHE": str(tmp_path)})
        assert r.exit_code == 0, r.output
        assert role == "router" or json.loads(r.stdout)["plan"]
    assert not any(tmp_path.iterdir())


def test_admin_capacity_sizes_glm5_on_h200():
    r = cli(
        "admin",
        "capacity",
        "--config",
        str(CONFIGS / "glm5"),
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--gpu-memory",
        "141GiB",
        "--json",
    )
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout)
    # the article's numbers (GLM-5.3, fp8 cache): E = 78 x 576, I = 21 x 132, factors 1.89 / 3.41 / 5.69
    assert (report["entry_bytes"], report["index_bytes"]) == (44_928, 2_772)
    assert [round(row["copy"]["factor"], 2) for row in report["rows"]] == [1.0, 1.89, 3.41, 5.69]
    pb = param_bytes(ModelConfig.from_pretrained(CONFIGS / "glm5"), "bfloat16")
    for row in report["gpu"]["rows"]:
        w, c = row["ranks"], row["dcp_size"]
        assert pb.decode_rank(w, c) <= 141 * GIB < pb.decode_rank(w // 2, c)  # the fewest that hold it
        assert row["kv_bytes_per_rank"] == 141 * GIB - pb.decode_rank(w, c)
    tokens = [row["tokens_copy"] for row in report["gpu"]["rows"]]
    assert [round(t / tokens[0], 2) for t in tokens] == [1.0, 1.89, 3.41, 5.69]
    table = cli("admin", "capacity", "--config", str(CONFIGS / "glm5"), "--gpu-memory", "141GiB").stdout
    assert "C_d=8: 16 ranks" in table


@pytest.mark.parametrize("moe_ep", [False, True])
@pytest.mark.parametrize("tp,dcp,replicate", [(2, 1, False), (2, 2, True), (4, 2, True)])
def test_decode_rank_bytes_are_what_tp_sharding_keeps(tiny_checkpoints, tp, dcp, replicate, moe_ep):
    """The planner against the real decode sharding (decode_server/tp.py) of a tiny model; with
    --moe-ep (E/W whole experts) a rank holds as many bytes as with the experts' intermediate slices."""
    path = tiny_checkpoints[("deepseek_v32", "make-model")]
    pb = param_bytes(ModelConfig.from_pretrained(path), "float32")
    for rank in (0, tp - 1):
        model = load_model(path)
        apply_decode_tp(model, rank, tp, dcp, replicate, comm=None, moe_ep=moe_ep)
        kept = sum(p.numel() * p.element_size() for p in model.parameters())
        assert kept == pb.decode_rank(tp, dcp, replicate), (rank, kept)
        assert (model.model.layers[-1].mlp.inner.experts.first_expert is not None) == moe_ep


@pytest.mark.parametrize("moe_tp", [False, True])
def test_prefill_rank_bytes_with_moe_ep(tiny_checkpoints, moe_tp):
    """--moe-ep on a prefill rank: 1/C_p of the routed experts; the shared experts and dense MLPs
    whole, or 1/C_p with --moe-tp too. The planner's bytes are the sharded rank's."""
    path = tiny_checkpoints[("glm_moe_dsa", "make-model")]
    pb = param_bytes(ModelConfig.from_pretrained(path), "float32")
    assert 0 < pb.routed < pb.ffn
    for rank in (0, 1):
        model = load_model(path)
        shard_prefill_ffn(model, rank, 2, moe_tp, moe_ep=True)
        kept = sum(p.numel() * p.element_size() for p in model.parameters())
        assert kept == pb.prefill_rank(2, moe_tp, moe_ep=True), (rank, kept)
    assert pb.prefill_rank(2, moe_ep=True) == pb.total - pb.routed // 2


def test_moe_ep_check_config(tiny_checkpoints, heads12_checkpoints):
    """--check-config with --moe-ep: GLM-5-FP8 at W = 8 holds 32 whole experts per rank, kept fp8, in
    the bytes TP's slices take; routed experts that do not split evenly over the ranks are refused
    before any rank starts, for decode and prefill alike."""
    args = [*GLM5_W8, "--check-config"]
    tp, ep = (json.loads(cli(*args, *extra).stdout)["plan"] for extra in ([], ["--moe-ep"]))
    assert "experts EP=8" in ep["topology"] and "EP" not in tp["topology"]
    assert ep["weight_bytes_by_dtype_per_rank"] == tp["weight_bytes_by_dtype_per_rank"]
    assert ep["weight_bytes_by_dtype_per_rank"][0]["float8_e4m3fn"] > 80 * GIB
    r = cli(
        "decode",
        "--model",
        str(heads12_checkpoints["glm_moe_dsa"]),
        "--tp-size",
        "3",
        "--moe-ep",
        "--check-config",
    )
    assert r.exit_code != 0 and "8 routed experts cannot be split evenly over 3 ranks" in r.output, r.output
    path = str(tiny_checkpoints[("glm_moe_dsa", "make-model")])
    r = cli("prefill", "--model", path, "--cp-size", "3", "--moe-ep", "--check-config")
    assert r.exit_code != 0 and "cannot be split evenly over 3 ranks" in r.output, r.output
    r = cli("prefill", "--model", path, "--cp-size", "2", "--moe-ep", "--check-config")
    assert r.exit_code == 0 and "experts EP=2" in json.loads(r.stdout)["plan"]["topology"], r.output


@pytest.mark.parametrize("release", list(RELEASES))
def test_every_release_tensor_name_is_mapped(release):
    """Every name a release holds in its layout (per-expert FP8 weights + scales, and the MTP layer) is
    one the loader maps or deliberately skips; built on the meta device."""
    raw = json.loads((CONFIGS / release / "config.json").read_text())
    cfg = ModelConfig.from_dict(raw)
    specs = tensor_specs(raw)
    names = list(specs) + [n + "_scale_inv" for n, s in specs.items() if quantizable(n, s.shape)]
    mtp = f"model.layers.{cfg.num_layers}"
    names += [
        f"{mtp}.{k}"
        for k in (
            "eh_proj.weight",
            "eh_proj.weight_scale_inv",
            "enorm.weight",
            "hnorm.weight",
            "shared_head.norm.weight",
            "shared_head.head.weight",
            "embed_tokens.weight",
            "self_attn.kv_b_proj.weight",
            "mlp.experts.255.down_proj.weight",
        )
    ]
    if release == "deepseek_v3":  # the public excerpt of the released index
        names += list(
            json.loads((CONFIGS / release / "model.safetensors.index.excerpt.json").read_text())["weight_map"]
        )
    counts = check_tensor_names(cfg, names)
    assert counts["mtp"] == 9 and counts["load"] == len(specs) + (5 if release == "deepseek_v3" else 0)
    with pytest.raises(WeightError, match=r"model\.layers\.0\.self_attn\.q_c_proj\.weight"):
        check_tensor_names(cfg, ["model.layers.0.self_attn.q_c_proj.weight"])


def test_glm5_fp8_at_w8_fits_an_h200_with_fp8_kept():
    """Issue 39: GLM-5-FP8 kept in fp8 on cuda, W = 8, 141 GB: each rank's weights (~91 GiB: fp8
    experts and projections, bf16 embeddings / LM head / kv_b, float32 scales) fit, with KV room
    beside them; dequantized to bf16 (--dequantize) they do not."""
    args = [*GLM5_W8, "--dcp-size", "8"]
    r = cli(*args, "--gpu-memory", "141GB", "--check-config")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)["plan"]
    by_rank = plan["weight_bytes_by_dtype_per_rank"]
    assert len(by_rank) == 8 and all(d == by_rank[0] for d in by_rank)
    assert set(by_rank[0]) == {"float8_e4m3fn", "bfloat16", "float32"}
    assert 85 * GIB < by_rank[0]["float8_e4m3fn"] < 90 * GIB and by_rank[0]["bfloat16"] < 5 * GIB
    assert plan["weight_bytes_per_rank"] == sum(by_rank[0].values()) < 141e9
    assert plan["gpu"]["weights_fit"] and plan["gpu"]["kv_tokens_fit"] > 800_000
    # no pool size on cuda: the ranks take what --gpu-memory-utilization (0.9) leaves, as planned here
    assert plan["kv_tokens"] == plan["gpu"]["kv_tokens_fit"] and plan["gpu"]["gpu_memory_utilization"] == 0.9
    assert plan["kv_tokens_from"] == "--gpu-memory-utilization 0.9 of --gpu-memory"
    page = plan["kv_bytes_per_rank"] // (plan["kv_tokens"] // 64)
    left = int(0.9 * 141e9) - plan["weight_bytes_per_rank"] - plan["gpu"]["workspace_bytes"]
    assert plan["kv_tokens"] == left // page * 64 and plan["gpu"]["fits"]
    half = json.loads(
        cli(*args, "--gpu-memory", "141GB", "--gpu-memory-utilization", "0.75", "--check-config").stdout
    )
    left = int(0.75 * 141e9) - plan["weight_bytes_per_rank"] - plan["gpu"]["workspace_bytes"]
    assert 0 < half["plan"]["kv_tokens"] == left // page * 64 < plan["kv_tokens"]
    unknown = json.loads(cli(*args, "--check-config").stdout)
    assert unknown["num_slots"] is None and unknown["plan"]["kv_tokens"] is None
    assert unknown["plan"]["kv_tokens_from"] == "--gpu-memory-utilization 0.9 of each GPU at startup"
    assert "kept fp8" in plan["checkpoint_quantization"]
    r = cli(*args, "--dequantize", "--gpu-memory", "141GB", "--check-config")
    plan = json.loads(r.stdout)["plan"]
    assert set(plan["weight_bytes_by_dtype_per_rank"][0]) == {"bfloat16", "float32"}
    assert not plan["gpu"]["weights_fit"] and plan["gpu"]["kv_tokens_fit"] == 0


def test_a_secret_on_the_command_line_is_warned_about():
    """Issue 40 item 7: a token given as a flag is readable by every user (ps); the CLI says so and
    names the safer forms; the same token from the environment says nothing."""
    token = "a-strong-internal-token-0123456789abcdef"
    args = ("decode", "--model", str(CONFIGS / "glm5"), "--tp-size", "8", "--check-config")
    flagged = cli(*args, "--internal-token", token)
    assert flagged.exit_code == 0, flagged.output
    assert "warning: --internal-token on the command line is visible" in flagged.stderr
    quiet = cli(*args, env={"PDSERVE_INTERNAL_TOKEN": token})
    assert quiet.exit_code == 0 and "warning" not in quiet.stderr
    admin = cli("admin", "--token", token, "capacity", "--config", str(CONFIGS / "glm5"))
    assert "warning: --token on the command line is visible" in admin.stderr
