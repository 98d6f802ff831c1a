"""--device / --gpu-ids / --attention-ops on generate, prefill, decode and up: a configuration that
cannot run is a startup error naming the problem (never a silent fallback to the CPU or to torch);
bfloat16 is the default dtype on cuda; `up` hands each instance its own GPUs."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from pdserve.checkpoints.random_checkpoint import make_model
from pdserve.cli.main import app
from pdserve.decode_server.config import DecodeServerConfig
from pdserve.prefill_server.config import PrefillServerConfig
from pdserve.router.launch import Stack, StackConfig

NO_CUDA = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_model(tmp_path_factory.mktemp("dev") / "m", "glm_moe_dsa", "tiny", seed=0))


def _run(*args):
    return CliRunner().invoke(app, list(args))


@pytest.mark.skipif(not NO_CUDA, reason="checks the error of a machine without CUDA")
@pytest.mark.parametrize(
    "cmd",
    [
        ("generate", "--token-ids", "1,2"),
        ("prefill", "--cp-size", "2"),
        ("decode", "--tp-size", "2", "--max-kv-tokens", "256"),
    ],
)
def test_cuda_without_a_gpu_is_a_startup_error(ckpt, cmd):
    res = _run(*cmd, "--model", ckpt, "--device", "cuda")
    assert res.exit_code == 2, res.output
    assert "--device cuda: this torch build has no CUDA" in res.output


@pytest.mark.parametrize(
    "args,message",
    [
        (("generate", "--token-ids", "1", "--attention-ops", "flashinfer"), "flashinfer needs --device cuda"),
        (("generate", "--token-ids", "1", "--gpu-ids", "0"), "--gpu-ids needs --device cuda"),
        (("prefill", "--attention-ops", "flashinfer"), "flashinfer needs --device cuda"),
        (
            ("prefill", "--moe-ops", "triton"),
            "--moe-ops triton cannot run: the triton kernels need --device cuda",
        ),
        (
            ("decode", "--linear-ops", "triton", "--max-kv-tokens", "64"),
            "--linear-ops triton multiplies fp8 weights",
        ),
        (
            ("decode", "--attention-ops", "flashinfer", "--max-kv-tokens", "64"),
            "flashinfer needs --device cuda",
        ),
        (
            ("decode", "--cuda-graphs", "on", "--max-kv-tokens", "64"),
            "--cuda-graphs on needs --device cuda (device is cpu)",
        ),
        (
            ("prefill", "--gpu-ids", "0,1", "--device", "cuda", "--check-config"),
            "lists 2 GPU(s) for 1 rank(s)",
        ),
        (
            ("prefill", "--gpu-ids", "0,x", "--device", "cuda", "--check-config"),
            "comma-separated GPU ordinals",
        ),
    ],
)
def test_device_flag_errors(ckpt, args, message):
    res = _run(*args, "--model", ckpt)
    assert res.exit_code == 2, res.output
    assert message in res.output


def test_check_config_shows_device_fields_and_cuda_dtype(ckpt):
    """--check-config works on a machine without the GPUs (it only prints the plan)."""
    res = _run(
        "decode", "--model", ckpt, "--device", "cuda", "--gpu-ids", "0,0", "--tp-size", "2", "--check-config"
    )
    assert res.exit_code == 0, res.output
    cfg = json.loads(res.output.strip().splitlines()[-1])
    assert (cfg["device"], cfg["gpu_ids"], cfg["dtype"], cfg["attention_ops"], cfg["cuda_graphs"]) == (
        "cuda",
        [0, 0],
        "bfloat16",
        "auto",
        "auto",  # on where the ranks can capture; two ranks on GPU 0 cannot (each rank says so)
    )


def test_server_configs_resolve_dtype_per_device(ckpt):
    assert PrefillServerConfig.create(model=ckpt).dtype == "float32"
    assert PrefillServerConfig.create(model=ckpt, device="cuda").dtype == "bfloat16"
    assert PrefillServerConfig.create(model=ckpt, device="cuda", dtype="float64").dtype == "float64"
    assert DecodeServerConfig.create(model=ckpt, device="cuda", max_kv_tokens=64).dtype == "bfloat16"
    assert (
        DecodeServerConfig.create(model=ckpt, max_kv_tokens=64).cuda_graphs == "off"
    )  # --cuda-graphs per device
    assert DecodeServerConfig.create(model=ckpt, device="cuda", max_kv_tokens=64).cuda_graphs == "auto"
    assert (
        DecodeServerConfig.create(model=ckpt, device="cuda", max_kv_tokens=64, cuda_graphs="off").cuda_graphs
        == "off"
    )
    with pytest.raises(ValueError, match="--attention-ops must be one of"):
        PrefillServerConfig.create(model=ckpt, attention_ops="fast")
    # a config is never changed once built: only create() fills the defaults that follow the device
    with pytest.raises(ValueError, match="dtype is empty"):
        PrefillServerConfig(ckpt)
    with pytest.raises(ValueError, match="cuda_graphs is empty"):
        DecodeServerConfig(ckpt, dtype="float32", max_kv_tokens=64)
    with pytest.raises(ValueError, match="gpu_ids must be a tuple"):
        PrefillServerConfig.create(model=ckpt, device="cuda", gpu_ids="0")


def test_up_gives_each_instance_its_gpus(tmp_path):
    cfg = StackConfig(
        model="m", prefill_instances=2, prefill_cp=2, decode_tp=2, device="cuda", log_dir=str(tmp_path)
    )
    assert cfg.total_ranks == 6
    assert [cfg.instance_gpus("prefill", i) for i in range(2)] == [(0, 1), (2, 3)]
    assert cfg.instance_gpus("decode", 0) == (4, 5)
    shared = StackConfig(model="m", decode_tp=2, device="cuda", gpu_ids=(0, 0, 0), log_dir=str(tmp_path))
    decode = Stack(shared).instance_args("decode", 0, 8200)
    assert decode[decode.index("--device") + 1] == "cuda" and decode[decode.index("--gpu-ids") + 1] == "0,0"
    prefill = Stack(StackConfig(model="m", log_dir=str(tmp_path))).instance_args("prefill", 0, 8100)
    assert prefill[prefill.index("--device") + 1] == "cpu" and "--gpu-ids" not in prefill
    with pytest.raises(ValueError, match="one GPU per rank of the stack"):
        StackConfig(model="m", device="cuda", gpu_ids=(0,))
