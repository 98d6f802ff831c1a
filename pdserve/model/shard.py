"""A rank's part of the model: which slice of each checkpoint tensor it holds, and in which dtype.

Parallelism (runtime/tp_shard.py, runtime/expert_parallel.py, decode_server/tp.py,
prefill_server/moe_tp.py) is applied to a model built on the meta device, before any storage
exists: `cut_linear`, `cut_experts` (intermediate dim) and `cut_expert_ids` (whole experts by id,
--moe-ep) give a module the shape of its slice and record which slice of the checkpoint's tensor
that is (`Cut`, or the experts' `first_expert`), so the loader (weights.py) allocates only the
rank's shapes and reads only its slices (safetensors `get_slice`). Applied to a loaded model, the
same functions slice the real tensors.

FP8 kept (`keep_fp8`): a Linear or Experts whose checkpoint weight is float8_e4m3fn with block scales
stays fp8 in memory (weight + float32 `weight_scale_inv`, the checkpoint's layout) when its slice
starts and ends on block boundaries; kv_b_proj is always dequantized (its W_UK / W_UV are read as
matrices by the absorbed attention, as SGLang does). Everything else is dequantized to the run
dtype as it is read.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from .config import ModelConfig
from .layers import Experts, Linear
from .quant import SCALE_SUFFIX, quantizable
from .transformer import CausalLM, Embedding

FP8 = torch.float8_e4m3fn
# Parameters the reference keeps in float32 whatever the model dtype.
FP32_PARAM_PATTERNS = (re.compile(r"\.indexer\.weights_proj\."), re.compile(r"\.e_score_correction_bias$"))
EXPERT_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
NEVER_FP8 = re.compile(r"\.kv_b_proj$")  # read as matrices by the absorbed attention: dequantized


@dataclass(frozen=True)
class Cut:
    """The part [start, stop) along `dim` of a checkpoint tensor that a module holds."""

    dim: int
    start: int
    stop: int
    full: int  # the checkpoint tensor's size along dim

    def index(self, ndim: int, offset: int = 0) -> tuple[slice, ...]:
        """The basic index of this cut in a tensor of `ndim` dims (the cut dim counted from the end
        when negative), shifted by `offset` (a tensor that begins `offset` rows into the full one)."""
        dim = self.dim % ndim
        return (slice(None),) * dim + (slice(self.start - offset, self.stop - offset),)

    def aligned(self, block: int) -> bool:
        """Whether the cut starts and ends on a block boundary (or at the tensor's end)."""
        return self.start % block == 0 and (self.stop % block == 0 or self.stop == self.full)

    def cover(self, block: int) -> "Cut":
        """The smallest cut on block boundaries that contains this one."""
        return Cut(
            self.dim, self.start // block * block, min(-(-self.stop // block) * block, self.full), self.full
        )

    def blocks(self, block: int) -> "Cut":
        """The rows (or columns) of the block-scale grid this cut touches."""
        return Cut(self.dim, self.start // block, -(-self.stop // block), -(-self.full // block))


def _narrow(t: torch.Tensor, dim: int, span: slice) -> torch.Tensor:
    return t.narrow(dim, span.start, span.stop - span.start)


def _keep(param: nn.Parameter, value: torch.Tensor) -> None:
    param.data = value.contiguous().clone()  # a fresh copy: the full weight is freed


def cut_linear(lin: Linear, dim: int, span: slice) -> None:
    """lin keeps rows (dim 0) or columns (dim 1) `span` of its weight (rows: its bias too)."""
    full = lin.weight.shape[dim]
    _keep(lin.weight, _narrow(lin.weight, dim, span))
    if dim == 0 and lin.bias is not None:
        _keep(lin.bias, lin.bias[span])
    if lin.weight_scale_inv is not None:  # a loaded fp8 weight: its scales follow (aligned cuts only)
        block = lin.block[dim]
        lin.weight_scale_inv = _narrow(
            lin.weight_scale_inv, dim, slice(span.start // block, -(-span.stop // block))
        ).contiguous()
    lin.cut = _compose(lin.cut, dim, span, full)


def cut_rows(emb: Embedding, span: slice) -> None:
    """emb keeps rows `span` of its [vocab, hidden] weight (a vocab-parallel embedding or LM head)."""
    full = emb.weight.shape[0]
    _keep(emb.weight, emb.weight[span])
    emb.cut = _compose(emb.cut, 0, span, full)


def _compose(prev: Cut | None, dim: int, span: slice, full: int) -> Cut:
    """A cut of a tensor that may already be a cut of the checkpoint's."""
    if prev is None:
        return Cut(dim, span.start, span.stop, full)
    if prev.dim != dim:
        raise ValueError("a module is cut along one dimension only")
    return Cut(dim, prev.start + span.start, prev.start + span.stop, prev.full)


def _halves(t: torch.Tensor, half: int, span: slice) -> torch.Tensor:
    """Rows `span` of each of the two stacked halves (dim 1) of t, stacked again. A model built on
    the meta device only needs the shape: torch.cat of meta tensors runs a Python meta kernel whose
    first call imports torch._dynamo (about 0.55 s of CPU in every TP decode rank's start)."""
    a, b = t[:, :half][:, span], t[:, half:][:, span]
    if t.is_meta:
        return t.new_empty(a.shape[0], a.shape[1] + b.shape[1], *a.shape[2:])
    return torch.cat([a, b], dim=1)


def cut_experts(ex: Experts, span: slice) -> None:
    """Every routed expert keeps intermediate rows `span` of gate and up and columns `span` of down."""
    inter = ex.down_proj.shape[2]
    _keep(ex.gate_up_proj, _halves(ex.gate_up_proj, inter, span))
    _keep(ex.down_proj, ex.down_proj[:, :, span])
    if ex.gate_up_scale_inv is not None:
        b0, b1 = ex.block
        rows, half = slice(span.start // b0, -(-span.stop // b0)), -(-inter // b0)
        ex.gate_up_scale_inv = _halves(ex.gate_up_scale_inv, half, rows)
        ex.down_scale_inv = ex.down_scale_inv[:, :, span.start // b1 : -(-span.stop // b1)].contiguous()
    ex.cut = _compose(ex.cut, -1, span, inter)


def cut_expert_ids(ex: Experts, span: slice) -> None:
    """Expert parallelism: ex keeps routed experts `span` (by id) whole, with their block scales (a
    whole expert is block-aligned, so fp8 stays fp8); the other experts are other ranks'. The loader
    reads only these experts (weights.py `_expert_target`)."""
    if ex.first_expert is not None or ex.cut is not None or ex.shared_slot is not None:
        raise ValueError("experts are cut by id once, before any other cut or fold")
    if not 0 <= span.start < span.stop <= ex.n_routed:
        raise ValueError(
            f"experts {span.start}..{span.stop - 1} are not among the {ex.n_routed} routed experts"
        )
    _keep(ex.gate_up_proj, ex.gate_up_proj[span])
    _keep(ex.down_proj, ex.down_proj[span])
    if ex.gate_up_scale_inv is not None:
        ex.gate_up_scale_inv = ex.gate_up_scale_inv[span].contiguous()
        ex.down_scale_inv = ex.down_scale_inv[span].contiguous()
    ex.first_expert, ex.n_routed = span.start, span.stop - span.start


def quantized_modules(cfg: ModelConfig, checkpoint_keys: Iterable[str] | None) -> set[str]:
    """Module paths whose checkpoint weights are fp8 with block scales: read from the checkpoint's
    tensor names (a `.weight_scale_inv` beside a weight; an Experts module when its experts are),
    or, for a config.json without weights, the tensors the releases quantize (quant.quantizable)."""
    if cfg.quantization is None:
        return set()
    out = set()
    if checkpoint_keys is not None:
        for key in checkpoint_keys:
            if key.endswith(".weight" + SCALE_SUFFIX):
                weight = key[: -len(SCALE_SUFFIX)]
                m = EXPERT_KEY.match(weight)
                out.add(m.group(1) if m else weight.removesuffix(".weight"))
        return out
    with torch.device("meta"):
        model = CausalLM(cfg)
    skip = cfg.quantization.modules_to_not_convert
    for name, module in model.named_modules():
        if any(s and s in name for s in skip):
            continue
        if isinstance(module, Experts) or (
            isinstance(module, Linear) and quantizable(name + ".weight", tuple(module.weight.shape))
        ):
            out.add(name)
    return out


def _keeps_fp8(name: str, module: Linear | Experts) -> bool:
    """Whether a quantized module can stay fp8: its cut must fall on block boundaries."""
    if NEVER_FP8.search(name):
        return False
    cut, (b0, b1) = module.cut, module.block
    if isinstance(module, Experts):  # gate and up are stacked: each must end on a block boundary
        inter = module.down_proj.shape[2]
        return inter % b0 == 0 and (cut is None or (cut.start % b0 == 0 and cut.aligned(b1)))
    return cut is None or cut.aligned(module.block[cut.dim])


def build_rank_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    shard: Callable[[CausalLM], None] | None = None,
    fp8_modules: set[str] = frozenset(),
) -> CausalLM:
    """The rank's model on the meta device: the run dtype, float32 islands, the rank's slices
    (`shard`, applied to the meta model) and fp8 weights with meta scales where kept."""
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.to(dtype)
    for name, p in model.named_parameters():
        if cfg.float32_islands and any(pat.search(name) for pat in FP32_PARAM_PATTERNS):
            p.data = p.data.float()
    if shard is not None:
        shard(model)
    for name, module in model.named_modules():
        if name in fp8_modules and isinstance(module, (Linear, Experts)) and _keeps_fp8(name, module):
            make_fp8(module)
    return model


def make_fp8(module: Linear | Experts) -> None:
    """Gives a (meta) module fp8 weights and float32 scales of their block grid, in place."""

    def grid(t: torch.Tensor, block) -> torch.Tensor:
        *lead, n, k = t.shape
        return torch.empty(*lead, -(-n // block[0]), -(-k // block[1]), dtype=torch.float32, device=t.device)

    if isinstance(module, Linear):
        module.weight.data = module.weight.data.to(FP8)
        module.weight_scale_inv = grid(module.weight, module.block)
        return
    inter = module.down_proj.shape[2]
    module.gate_up_proj.data = module.gate_up_proj.data.to(FP8)
    module.down_proj.data = module.down_proj.data.to(FP8)
    half = grid(module.gate_up_proj[:, :inter], module.block)  # gate and up each on their own blocks
    module.gate_up_scale_inv = torch.cat([half, half], dim=1)
    module.down_scale_inv = grid(module.down_proj, module.block)


def _empty(t: torch.Tensor, device) -> torch.Tensor:
    """Uninitialised storage for a meta tensor's shape and dtype. torch.empty, not Module.to_empty:
    the latter's empty_like of a meta tensor runs torch's Python reference, whose first call
    imports torch.fx's symbolic shapes and sympy (~0.3 s of CPU in every process that loads)."""
    return torch.empty(t.shape, dtype=t.dtype, device=device)


def materialize(model: CausalLM, device: str | torch.device) -> CausalLM:
    """Storage on `device` for every parameter, buffer and fp8 scale of a meta model (uninitialised)."""
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:
                setattr(module, name, nn.Parameter(_empty(p, device), requires_grad=p.requires_grad))
        for name, b in list(module.named_buffers(recurse=False)):
            if b.is_meta:
                module._buffers[name] = _empty(b, device)
        for attr in ("weight_scale_inv", "gate_up_scale_inv", "down_scale_inv"):
            t = getattr(module, attr, None)
            if t is not None and t.is_meta:
                setattr(module, attr, _empty(t, device))
    if model.config.tie_word_embeddings:  # every parameter got its own storage above; re-tie
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def weight_bytes_by_dtype(model: nn.Module) -> dict[str, int]:
    """Bytes of the parameters and fp8 scales of `model` by dtype name (meta or real)."""
    out: dict[str, int] = {}

    def add(t: torch.Tensor) -> None:
        name = str(t.dtype).removeprefix("torch.")
        out[name] = out.get(name, 0) + t.numel() * t.element_size()

    for p in model.parameters():
        add(p)
    for module in model.modules():
        for attr in ("weight_scale_inv", "gate_up_scale_inv", "down_scale_inv"):
            t = getattr(module, attr, None)
            if t is not None:
                add(t)
    return out
