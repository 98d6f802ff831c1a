"""Shared fixtures: tiny checkpoints written by `make-model` and by transformers' save_pretrained."""

from __future__ import annotations

import importlib
import math
import os
import sys
import time
from pathlib import Path

import pytest
import torch

from pdserve.runtime.faults import FAULTS_ENV
from pdserve.serving.auth import INTERNAL_TOKEN_ENV
from tests.servers import TEST_TOKEN

os.environ[INTERNAL_TOKEN_ENV] = TEST_TOKEN  # every server, router and `pdserve up` a test starts shares it
os.environ[FAULTS_ENV] = "1"  # rank processes the tests start accept ArmFaultCmd (runtime/faults.py)

ARCHS = ("glm_moe_dsa", "deepseek_v32", "deepseek_v3")
BENCH = str(Path(__file__).resolve().parents[1] / "bench")


FUZZ_SEED_ENV = "PDSERVE_FUZZ_SEED"
SWEEP_SEED_ENV = "PDSERVE_SWEEP_SEED"


def pytest_configure(config):
    """The run's seeds (the fuzzers', the shape sweep's), new per run unless the environment gives
    them, chosen once by the process that runs the session and put in its environment: pytest-xdist
    workers (make test runs two) inherit it, so every worker draws from the same seeds."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller chose them
        return
    now = time.time_ns() // 1000
    os.environ.setdefault(FUZZ_SEED_ENV, str(now % 1_000_000))
    os.environ.setdefault(SWEEP_SEED_ENV, str(now // 7 % 1_000_000))


def _seed_lines(config) -> list[str]:
    sweep = config.getoption("--seed")
    sweep = os.environ[SWEEP_SEED_ENV] if sweep is None else sweep
    return [
        f"fuzz seed {os.environ[FUZZ_SEED_ENV]} (rerun: {FUZZ_SEED_ENV}={os.environ[FUZZ_SEED_ENV]})",
        f"sweep seed {sweep} (rerun: {SWEEP_SEED_ENV}={sweep} or --seed {sweep})",
    ]


def pytest_sessionstart(session):
    """The seeds, first thing in the output (with -q too, and once with xdist: the controller's)."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and not hasattr(session.config, "workerinput"):
        for line in _seed_lines(session.config):
            reporter.write_line(line)


def pytest_terminal_summary(terminalreporter, config):
    """And again at the end, beside the failures they reproduce."""
    for line in _seed_lines(config):
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def fuzz_seed() -> int:
    """The seed of this session's fuzzers (tests/router/test_http_fuzz.py, the schemathesis fuzz in
    test_hardening.py): $PDSERVE_FUZZ_SEED, which pytest_configure sets to a new one per run unless
    given, so run after run they draw other cases. Printed first and last in the run's output
    (pytest_sessionstart, pytest_terminal_summary) and named in every failure."""
    return int(os.environ[FUZZ_SEED_ENV])


@pytest.fixture
def bench_module():
    """import_module for bench scripts, with bench/ on sys.path as when a script runs (their own
    imports, and the processes they spawn, find their modules there)."""
    sys.path.insert(0, BENCH)
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(BENCH)


def pytest_addoption(parser):
    """The randomized equality sweep (tests/sweep/test_sweep.py)."""
    group = parser.getgroup("sweep", "randomized equality sweep")
    group.addoption(
        "--deep",
        action="store_true",
        help="the long local runs: the sweep's 1008 drawn cases, the whole CP and DCP equality grids",
    )
    group.addoption(
        "--seed",
        type=int,
        default=None,
        help="the sweep's seed (default: $PDSERVE_SWEEP_SEED, else a new one per run, printed)",
    )
    group.addoption("--pairs", type=int, default=None, help="how many drawn instance pairs to run")
    group.addoption("--case", type=int, default=None, help="run only this drawn case (with its pair)")
    group.addoption("--requests", default=None, help="only these requests of --case, e.g. 0,2")


def randomize_hf_model(model, seed: int) -> None:
    """Give every weight a non-default random value: norms around 1, biases and the routing
    correction bias non-zero, matrices N(0, 1/fan_in) so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    with torch.no_grad():
        for name, t in tensors:
            if not t.is_floating_point() or "inv_freq" in name:
                continue
            if name.endswith("e_score_correction_bias") or name.endswith(".bias"):
                t.copy_(0.1 * torch.randn(t.shape, generator=g))
            elif "norm" in name:
                t.copy_(1 + 0.1 * torch.randn(t.shape, generator=g))
            elif t.dim() == 1:
                t.copy_(0.1 * torch.randn(t.shape, generator=g))
            else:
                fan_in = t.shape[-1]
                std = 1.0 if "embed_tokens" in name else 1 / math.sqrt(fan_in)
                t.copy_(std * torch.randn(t.shape, generator=g))


def save_pretrained_checkpoint(arch: str, out_dir, seed: int = 1):
    """A tiny checkpoint written by transformers itself from a randomly initialised model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pdserve.checkpoints.bpe_builder import write_tokenizer_files
    from pdserve.checkpoints.presets import hf_config

    d = {k: v for k, v in hf_config(arch, "tiny").items() if k not in ("architectures", "model_type")}
    config = AutoConfig.for_model(arch, **d)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    randomize_hf_model(model, seed)
    model.save_pretrained(out_dir)
    write_tokenizer_files(out_dir, hf_config(arch, "tiny")["vocab_size"])
    return out_dir


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """{(arch, source): path} for source in ("make-model", "save_pretrained")."""
    from pdserve.checkpoints.random_checkpoint import make_model

    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for arch in ARCHS:
        out[(arch, "make-model")] = make_model(root / f"mm-{arch}", arch, "tiny", seed=0)
        out[(arch, "save_pretrained")] = save_pretrained_checkpoint(arch, root / f"hf-{arch}")
    return out


@pytest.fixture(scope="session")
def heads12_checkpoints(tmp_path_factory):
    """{arch: path}: the tiny presets with 12 attention heads, so TP (= W) can be 1, 2, 3 or 4.
    glm_moe_dsa's has one index head: a score is then w * relu(q . k), exactly 0 for about half the
    keys and the largest score whenever w < 0, so ties at 0 decide top-k places all the time (the
    tie rule of docs/design.md invariant 3 is exercised); deepseek_v32 keeps the preset's 8 index heads."""
    from pdserve.checkpoints.random_checkpoint import make_model

    root = tmp_path_factory.mktemp("ckpt12")
    heads = {"num_attention_heads": 12, "num_key_value_heads": 12}
    extra = {"glm_moe_dsa": {"index_n_heads": 1}}
    return {
        arch: make_model(root / arch, arch, "tiny", seed=3, config_overrides={**heads, **extra.get(arch, {})})
        for arch in ARCHS
    }
