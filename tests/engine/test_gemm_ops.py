"""--linear-ops / --moe-ops: the choice table (engine/gemm_ops.py), a pure function of the facts."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.gemm_ops import GemmFacts, gather_facts, select_linear_ops, select_moe_ops

FP8 = "float8_e4m3fn"
H200 = dict(device="cuda", capability=(9, 0), triton=True, scaled_mm_blockwise=True)
CPU = dict(device="cpu", capability=None, triton=True, scaled_mm_blockwise=True)


def facts(base: dict, dtype: str = FP8, block=(128, 128), **over) -> GemmFacts:
    return GemmFacts(**{**base, **over}, weight_dtype=dtype, block=block if dtype == FP8 else None)


@pytest.mark.parametrize(
    "requested, f, want",
    [
        ("auto", facts(H200), "scaled_mm"),
        ("auto", facts(H200, scaled_mm_blockwise=False), "triton"),
        ("auto", facts(H200, capability=(8, 9)), "triton"),  # Ada: fp8 dots, no block-scaled scaled_mm
        ("auto", facts(H200, capability=(8, 0)), "torch"),  # Ampere: no fp8 dots
        ("auto", facts(H200, triton=False), "torch"),  # scaled_mm's few rows need the triton GEMM
        ("auto", facts(H200, block=(64, 64)), "torch"),
        ("auto", facts(H200, "bfloat16"), "torch"),  # bf16 weights: cuBLAS through F.linear
        ("auto", facts(CPU), "torch"),
        ("torch", facts(H200), "torch"),
        ("triton", facts(H200), "triton"),
        ("scaled_mm", facts(H200), "scaled_mm"),
    ],
)
def test_linear_ops_table(requested, f, want):
    choice = select_linear_ops(requested, f)
    assert choice.name == want and choice.reason


@pytest.mark.parametrize(
    "requested, f, want",
    [
        ("auto", facts(H200), "triton"),
        ("auto", facts(H200, "bfloat16"), "triton"),
        ("auto", facts(H200, "float32"), "torch"),
        ("auto", facts(H200, capability=(8, 0)), "torch"),  # fp8 experts on Ampere
        ("auto", facts(H200, "bfloat16", capability=(8, 0)), "triton"),
        ("auto", facts(CPU), "torch"),
        ("auto", facts(H200, triton=False), "torch"),
        ("torch", facts(H200), "torch"),
        ("triton", facts(H200), "triton"),
    ],
)
def test_moe_ops_table(requested, f, want):
    choice = select_moe_ops(requested, f)
    assert choice.name == want and choice.reason


@pytest.mark.parametrize(
    "select, requested, f, words",
    [
        (select_linear_ops, "triton", facts(CPU), "need --device cuda"),
        (select_linear_ops, "scaled_mm", facts(H200, capability=(8, 9)), "capability 9.x"),
        (select_linear_ops, "triton", facts(H200, "bfloat16"), "multiplies fp8 weights"),
        (select_linear_ops, "cublas", facts(H200), "must be one of"),
        (select_moe_ops, "triton", facts(H200, triton=False), "triton is not installed"),
        (select_moe_ops, "triton", facts(H200, block=(1, 128)), "block scales"),
        (select_moe_ops, "fast", facts(H200), "must be one of"),
    ],
)
def test_impossible_requests_are_errors(select, requested, f, words):
    with pytest.raises(ValueError, match=words):
        select(requested, f)


def test_facts_of_this_process():
    f = gather_facts(torch.device("cpu"), torch.float8_e4m3fn, (128, 128))
    assert (f.device, f.capability, f.weight_dtype, f.block) == ("cpu", None, FP8, (128, 128))
    assert select_linear_ops("auto", f).name == select_moe_ops("auto", f).name == "torch"


def test_apply_gemm_ops_on_a_loaded_model(tiny_checkpoints, capsys):
    """What a rank does after loading: the choice printed, set on the model; a request that cannot
    run is the startup error."""
    from pdserve.engine.gemm_ops import apply_gemm_ops
    from pdserve.model.weights import load_model

    model = load_model(tiny_checkpoints[("glm_moe_dsa", "make-model")], torch.float32)
    lin, moe = apply_gemm_ops(model, "auto", "auto", torch.device("cpu"), "decode rank 0")
    assert (lin.name, moe.name) == ("torch", "torch")
    assert "decode rank 0: linear ops torch" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--moe-ops triton cannot run"):
        apply_gemm_ops(model, "auto", "triton", torch.device("cpu"))
