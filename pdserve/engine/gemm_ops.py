"""Which implementation runs the linear products and the routed experts (`--linear-ops`, `--moe-ops`).

Like `attn_ops.select_attention_ops`, each choice is a pure function of facts (device, compute
capability, installed packages, weight dtype, dims), so its table is tested on CPU, and asking for
an implementation that cannot run is a startup error, never a silent fallback.

--linear-ops (products with a weight of the checkpoint: the attention projections, dense MLPs,
shared experts):
  torch      F.linear; fp8 weights are dequantized on the fly, 128 output rows at a time
             (model/moe_ops.dequant_linear), so no whole bf16 copy of a weight ever exists
  triton     fp8 weights: a block-scaled w8a8 triton GEMM with split-K (model/triton_gemm.py) for
             every product
  scaled_mm  fp8 weights: torch's block-scaled `scaled_mm` (1x128 activation and 128x128 weight
             scales) for products of model/fp8_matmul.SCALED_MM_MIN_ROWS rows or more (prefill), the triton GEMM
             below that (a decode step: scaled_mm at 32 rows is slower than bf16, the issue's
             measurement on an H200)
  auto       scaled_mm where it can run, else triton, else torch
--moe-ops (the routed experts):
  torch      the grouped reference (model/layers.Experts, model/moe_ops.moe_torch for fp8)
  triton     the fused MoE kernel (model/triton_moe.py): tokens grouped by expert on the device,
             no host sync, bf16 or fp8 w8a8 with 128x128 block scales
  auto       triton where it can run, else torch
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from ..model.quant import FP8_BLOCK  # torch-free

LINEAR_OPS = ("auto", "torch", "triton", "scaled_mm")
MOE_OPS = ("auto", "torch", "triton")
TRITON_DTYPES = ("bfloat16", "float8_e4m3fn")  # weight dtypes the triton kernels are written for


@dataclass(frozen=True)
class GemmFacts:
    """Everything the choices depend on."""

    device: str  # "cpu" | "cuda"
    capability: tuple[int, int] | None  # CUDA compute capability of this rank's GPU
    triton: bool  # triton importable
    scaled_mm_blockwise: bool  # torch.nn.functional.scaled_mm with ScalingType.BlockWise1x128
    weight_dtype: str  # "bfloat16", "float8_e4m3fn", "float32", ...
    block: tuple[int, int] | None = None  # fp8 block-scale shape; None for unquantized weights


@dataclass(frozen=True)
class GemmChoice:
    name: str  # "torch" | "triton" | "scaled_mm"
    reason: str  # why (logged at startup)


def _one_of(flag: str, allowed: tuple[str, ...], name: str) -> str:
    if name not in allowed:
        raise ValueError(f"{flag} must be one of {', '.join(allowed)}, not {name!r}")
    return name


def triton_blocker(f: GemmFacts) -> str | None:
    """Why the triton kernels cannot run with these facts, or None when they can."""
    if f.device != "cuda":
        return f"the triton kernels need --device cuda (device is {f.device})"
    if not f.triton:
        return "triton is not installed"
    if f.weight_dtype not in TRITON_DTYPES:
        return f"the triton kernels take {' or '.join(TRITON_DTYPES)} weights, not {f.weight_dtype}"
    if f.weight_dtype == "float8_e4m3fn":
        if f.capability is None or f.capability < (8, 9):
            return f"fp8 products need compute capability 8.9 or newer, this GPU has {f.capability}"
        if f.block != FP8_BLOCK:
            return f"the fp8 kernels take {FP8_BLOCK[0]}x{FP8_BLOCK[1]} block scales, not {f.block}"
    return None


def scaled_mm_blocker(f: GemmFacts) -> str | None:
    """Why torch's block-scaled scaled_mm cannot run with these facts, or None when it can."""
    if f.device != "cuda":
        return f"scaled_mm needs --device cuda (device is {f.device})"
    if f.weight_dtype != "float8_e4m3fn":
        return f"scaled_mm multiplies fp8 weights, these are {f.weight_dtype}"
    if not f.scaled_mm_blockwise:
        return "this torch has no block-scaled scaled_mm (ScalingType.BlockWise1x128)"
    if f.capability is None or f.capability[0] != 9:
        return f"block-scaled scaled_mm runs on compute capability 9.x, this GPU has {f.capability}"
    if f.block != FP8_BLOCK:
        return f"scaled_mm takes {FP8_BLOCK[0]}x{FP8_BLOCK[1]} block scales, not {f.block}"
    return triton_blocker(f)  # its few-row products go to the triton GEMM


def select_linear_ops(requested: str, f: GemmFacts) -> GemmChoice:
    _one_of("--linear-ops", LINEAR_OPS, requested)
    if requested == "torch":
        return GemmChoice("torch", "--linear-ops torch")
    if f.weight_dtype != "float8_e4m3fn":  # only fp8 weights have a kernel of ours; F.linear is cuBLAS
        if requested != "auto":
            raise ValueError(f"--linear-ops {requested} multiplies fp8 weights; these are {f.weight_dtype}")
        return GemmChoice("torch", f"auto: {f.weight_dtype} weights go to F.linear")
    blockers = {"scaled_mm": scaled_mm_blocker(f), "triton": triton_blocker(f)}
    if requested != "auto":
        if blockers[requested]:
            raise ValueError(f"--linear-ops {requested} cannot run: {blockers[requested]}")
        return GemmChoice(requested, f"--linear-ops {requested}")
    for name in ("scaled_mm", "triton"):
        if blockers[name] is None:
            return GemmChoice(name, f"auto: {name} can run")
    return GemmChoice("torch", f"auto: {blockers['triton']}")


def select_moe_ops(requested: str, f: GemmFacts) -> GemmChoice:
    _one_of("--moe-ops", MOE_OPS, requested)
    if requested == "torch":
        return GemmChoice("torch", "--moe-ops torch")
    blocker = triton_blocker(f)
    if blocker is None:
        return GemmChoice("triton", f"{requested}: the fused triton MoE")
    if requested == "triton":
        raise ValueError(f"--moe-ops triton cannot run: {blocker}")
    return GemmChoice("torch", f"auto: {blocker}")


def has_scaled_mm_blockwise() -> bool:
    import torch.nn.functional as F

    scaling = getattr(F, "ScalingType", None)
    return hasattr(F, "scaled_mm") and scaling is not None and hasattr(scaling, "BlockWise1x128")


def gather_facts(device, weight_dtype, block: tuple[int, int] | None = None) -> GemmFacts:
    """The facts of this process for weights of `weight_dtype` (a torch.dtype) on `device`."""
    import torch

    cap = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    return GemmFacts(
        device.type,
        tuple(cap) if cap else None,
        importlib.util.find_spec("triton") is not None,
        has_scaled_mm_blockwise(),
        str(weight_dtype).removeprefix("torch."),
        tuple(block) if block else None,
    )


def apply_gemm_ops(
    model, linear_ops: str, moe_ops: str, device, who: str = ""
) -> tuple[GemmChoice, GemmChoice]:
    """Choose (select_*) and set a loaded model's ops; with `who` the choices are printed to stderr
    (the startup lines of the server's log). A ValueError when a requested one cannot run."""
    import sys

    import torch

    from ..model.layers import Experts, Linear

    fp8 = torch.float8_e4m3fn
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    quantized = [m for m in linears if m.weight.dtype == fp8]
    lin_facts = (
        gather_facts(device, fp8, quantized[0].block)
        if quantized
        else gather_facts(device, linears[0].weight.dtype)
    )
    ex = experts[0] if experts else None
    moe_facts = (
        gather_facts(device, ex.gate_up_proj.dtype, ex.block if ex.gate_up_proj.dtype == fp8 else None)
        if ex
        else lin_facts
    )
    lin, moe = select_linear_ops(linear_ops, lin_facts), select_moe_ops(moe_ops, moe_facts)
    set_gemm_ops(model, lin.name, moe.name)
    if who:
        print(
            f"{who}: linear ops {lin.name} ({lin.reason}); moe ops {moe.name} ({moe.reason})", file=sys.stderr
        )
    return lin, moe


def set_gemm_ops(model, linear_ops: str, moe_ops: str) -> None:
    """Every fp8 Linear of `model` multiplies with `linear_ops`, every Experts with `moe_ops` (names
    the select_* functions chose); with the triton MoE each shared expert is folded into its
    layer's experts (MoE.fold_shared_expert: one fused call reads both)."""
    import torch

    from ..model.layers import Experts, Linear, MoE

    for module in list(model.modules()):
        if isinstance(module, Linear) and module.weight.dtype == torch.float8_e4m3fn:
            module.ops = linear_ops
        elif isinstance(module, Experts):
            module.ops = moe_ops
        elif isinstance(module, MoE) and moe_ops == "triton":
            module.fold_shared_expert()
