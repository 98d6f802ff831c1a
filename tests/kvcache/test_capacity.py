"""Invariant 6, capacity: E / C_d + I (copied index) or (E + I) / C_d (split), the GLM-5.3 numbers,
the per-rank pool that a budget buys, and `pdserve admin capacity`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from pdserve.checkpoints.presets import glm53_like_config as glm53_dict
from pdserve.checkpoints.presets import hf_config
from pdserve.kvcache import capacity as cap
from pdserve.kvcache import kv_cache
from pdserve.model.config import ModelConfig


@pytest.fixture(scope="module")
def glm53() -> ModelConfig:
    cfg = ModelConfig.from_dict(glm53_dict())
    assert len(cfg.indexer_layers) == 21 and cfg.indexer_types[0] == "full"
    return cfg


def test_glm53_bytes_per_token_match_the_article(glm53):
    assert cap.entry_bytes(glm53, "fp8_e4m3") == 78 * 576 == 44_928
    assert cap.index_bytes(glm53, "fp8_e4m3") == 21 * 132 == 2_772
    assert cap.entry_bytes(glm53, "auto", "bfloat16") == 78 * 576 * 2
    assert cap.index_bytes(glm53, "auto", torch.float32) == 21 * 128 * 4  # no scale outside fp8
    assert cap.bytes_per_token_per_rank(glm53, 4, "copy", "fp8_e4m3") == 44_928 / 4 + 2_772
    assert cap.bytes_per_token_per_rank(glm53, 4, "split", "fp8_e4m3") == (44_928 + 2_772) / 4


@pytest.mark.parametrize("dcp,copy,split", [(1, 1.0, 1.0), (2, 1.89, 2.0), (4, 3.41, 4.0), (8, 5.69, 8.0)])
def test_glm53_capacity_factors(glm53, dcp, copy, split):
    assert round(cap.capacity_factor(glm53, dcp, "copy", "fp8_e4m3"), 2) == copy
    assert round(cap.capacity_factor(glm53, dcp, "split", "fp8_e4m3"), 2) == split


def test_dense_model_has_no_index_so_copy_equals_split():
    cfg = ModelConfig.from_dict(hf_config("deepseek_v3", "tiny"))
    assert cap.index_bytes(cfg, "fp8_e4m3") == 0
    assert cap.capacity_factor(cfg, 4, "copy", "fp8_e4m3") == cap.capacity_factor(cfg, 4, "split") == 4.0


def test_bad_arguments_are_clear_errors(glm53):
    with pytest.raises(ValueError, match="index_mode 'shared'"):
        cap.capacity_factor(glm53, 2, "shared")
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8'"):
        cap.entry_bytes(glm53, "int8")
    with pytest.raises(ValueError, match="multiple of dcp_size"):
        cap.tokens_for_budget(glm53, 2**30, 3, "copy", 64)


@pytest.mark.parametrize("index_mode", ["copy", "split"])
@pytest.mark.parametrize("dcp", [1, 2, 4, 8])
def test_pool_for_budget_agrees_with_the_formula(glm53, index_mode, dcp):
    budget, page = 64 * 2**20, 16
    pool = kv_cache.pool_for_budget(glm53, budget, dcp, index_mode, page, torch.bfloat16, "fp8_e4m3")
    tokens = pool.num_slots * dcp  # latent rows per rank x ranks
    assert pool.nbytes <= budget
    assert (
        tokens == cap.tokens_for_budget(glm53, budget, dcp, index_mode, page, "fp8_e4m3")
        and tokens % page == 0
    )
    assert pool.index_slots == (tokens if index_mode == "copy" else tokens // dcp)
    ideal = budget / cap.bytes_per_token_per_rank(glm53, dcp, index_mode, "fp8_e4m3")
    assert 0.98 * ideal <= tokens <= ideal


def pdserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def glm53_config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm53") / "config.json"
    path.write_text(json.dumps(glm53_dict()))
    return path


def test_admin_capacity_json(glm53_config_file):
    proc = pdserve(
        "admin",
        "capacity",
        "--config",
        str(glm53_config_file),
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--kv-memory",
        "64MiB",
        "--page-size",
        "16",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["entry_bytes"], report["index_bytes"]) == (44_928, 2_772)
    rows = {r["dcp_size"]: r for r in report["rows"]}
    assert sorted(rows) == [1, 2, 4, 8]
    assert [round(rows[c]["copy"]["factor"], 2) for c in (2, 4, 8)] == [1.89, 3.41, 5.69]
    assert [round(rows[c]["split"]["factor"], 2) for c in (2, 4, 8)] == [2.0, 4.0, 8.0]
    assert rows[8]["split"]["tokens"] == cap.tokens_for_budget(
        ModelConfig.from_dict(glm53_dict()), 2**26, 8, "split", 16, "fp8_e4m3"
    )


def test_admin_capacity_table_accepts_a_checkpoint_directory(glm53_config_file):
    proc = pdserve(
        "admin",
        "capacity",
        "--config",
        str(glm53_config_file.parent),
        "--kv-cache-dtype",
        "fp8_e4m3",
        "--dcp-sizes",
        "2,4,8",
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "E = 44,928" in lines[0] and "I = 2,772" in lines[0]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert [rows[c][2] for c in ("2", "4", "8")] == ["1.89", "3.41", "5.69"]
    assert [rows[c][4] for c in ("2", "4", "8")] == ["2.00", "4.00", "8.00"]
    assert "tokens" not in proc.stdout  # only with --kv-memory


@pytest.mark.parametrize(
    "args,message",
    [
        (("--kv-memory", "12 parsecs"), "byte count"),
        (("--dcp-sizes", "2,x"), "--dcp-sizes"),
        (("--page-size", "12"), "not a multiple of C_d 8"),
    ],
)
def test_admin_capacity_bad_input_is_a_clear_error(glm53_config_file, args, message):
    proc = pdserve("admin", "capacity", "--config", str(glm53_config_file), *args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_parse_bytes_and_every_admin_flag_has_help():
    import typer

    from pdserve.cli.admin import admin_app, parse_bytes

    assert [parse_bytes(s) for s in ("80GiB", "512MiB", "1048576", "1.5k", "2GB")] == [
        80 * 2**30,
        512 * 2**20,
        2**20,
        1536,
        2 * 10**9,
    ]
    group = typer.main.get_command(admin_app)
    assert group.help
    for name, command in group.commands.items():
        assert command.help, name
        for param in command.params:
            assert param.help and len(param.help) > 10, (name, param.opts)
