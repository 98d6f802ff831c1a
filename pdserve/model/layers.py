"""Norms, the dense MLP and the routed MoE block with shared experts.

Parameters are allocated with torch.empty: the weight loader fills them in place, so a model is
never initialised and then overwritten, and the weights exist once in memory.
Tokens are flattened: every activation here is [T, hidden] for T tokens of any number of requests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..native import ops as native
from .config import ModelConfig
from .fp8_matmul import fp8_matmul
from .kernels import FEW_ROWS, onednn_linear, uses_onednn, uses_onednn_gemv
from .moe_ops import moe_dense, moe_torch
from .quant import FP8_BLOCK


def island_dtype(dtype: torch.dtype, islands: bool) -> torch.dtype:
    """Compute dtype of a float32 island (see ModelConfig.float32_islands)."""
    return torch.float64 if dtype == torch.float64 and not islands else torch.float32


def empty_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


SMALL_OUT = 64  # few-row products with a W of at most this many rows go to F.linear (see `linear`)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) for W [out, in]. On the CPU in float32, a product of at most native.MAX_ROWS rows
    (a decode step's) goes to the native few-row kernel where it is built (native/ops.py: it reads
    W at about the rate of a sum, the BLAS kernels below at half that); without it, and otherwise:
    with PDSERVE_ONEDNN=1, oneDNN takes every
    product of more than FEW_ROWS rows (prefill; model/kernels.py `uses_onednn`), and by default
    one row times a W of GEMV_MIN_BYTES or more (`uses_onednn_gemv`). Another product of a few
    rows (decode: one row per request) is taken as (W x^T)^T: this torch's CPU BLAS runs x W^T for 1-8 rows through
    a matrix-vector path at about half the memory bandwidth its matrix-matrix path reaches on W x^T
    (one row is given a copy of itself as a second row, so that it is a matrix-matrix product too).
    A W of at most SMALL_OUT rows is read in a few microseconds either way, and there F.linear's
    single call is the faster one. Same values up to the order of the sums
    (tests/model/test_linear_rows.py). float64 (the exactness checks) never goes to oneDNN; other
    devices take F.linear."""
    if native.usable(x, weight, bias):
        return native.rows_linear(x, weight, bias)
    if uses_onednn(x, weight) or uses_onednn_gemv(x, weight):
        return onednn_linear(x, weight, bias)
    rows = x.shape[0] if x.dim() == 2 else 0
    if (
        not 0 < rows <= FEW_ROWS
        or weight.shape[0] <= SMALL_OUT
        or x.device.type != "cpu"
        or x.dtype != weight.dtype
    ):
        return F.linear(x, weight, bias)
    xt = x.t() if rows > 1 else torch.cat([x, x]).t()
    y = torch.mm(weight, xt)[:, :rows].t().contiguous()
    return y if bias is None else y + bias


class Linear(nn.Module):
    """y = x W^T (+ b); W is [out, in] as in checkpoints.

    A weight kept in fp8 (float8_e4m3fn, with its float32 block scales in `weight_scale_inv`, the
    checkpoint's layout) is multiplied by model/fp8_matmul.py with the implementation named by
    `ops` (engine/gemm_ops.py: torch | triton | scaled_mm)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = empty_param(out_features, in_features)
        self.bias = empty_param(out_features) if bias else None
        self.weight_scale_inv: torch.Tensor | None = None  # fp8 weights only: [ceil(out/b0), ceil(in/b1)]
        self.block = FP8_BLOCK
        self.ops = "torch"
        self.cut = None  # model/shard.Cut: the slice of the checkpoint's weight held (None: all of it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.float8_e4m3fn:
            return fp8_matmul(x, self.weight, self.weight_scale_inv, self.bias, self.ops, self.block)
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """The reference normalises in float32 and casts back before the weight multiply; so do we."""

    def __init__(self, dim: int, eps: float = 1e-6, islands: bool = True):
        super().__init__()
        self.weight = empty_param(dim)
        self.eps, self.islands = eps, islands

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype, dim = x.dtype, (x.shape[-1],)
        compute = island_dtype(dtype, self.islands)
        if compute == dtype == self.weight.dtype:  # one fused op: x * rsqrt(mean(x^2) + eps) * weight
            if native.rms_norm_usable(x, self.weight):  # a decode step's float32 rows on the CPU
                return native.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, dim, self.weight, self.eps)
        return self.weight * F.rms_norm(x.to(compute), dim, eps=self.eps).to(dtype)


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = empty_param(dim)
        self.bias = empty_param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate and up as one product once stacked (model/fusion.py)."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)
        self.gate_up = None  # a fusion.RowStack of gate_proj and up_proj, set after loading

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stack = self.gate_up
        if stack is not None and stack.live():
            gate, up = stack(x)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class TopkRouter(nn.Module):
    """Grouped sigmoid routing with a score-correction bias that steers selection but not weights."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = empty_param(cfg.n_routed_experts, cfg.hidden_size)
        self.e_score_correction_bias = empty_param(cfg.n_routed_experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, k] in the island dtype, expert ids [T, k])."""
        cfg = self.cfg
        ct = island_dtype(x.dtype, cfg.float32_islands)
        if ct == x.dtype and native.route_usable(  # a decode step's float32 rows on the CPU: one native call
            x, self.weight, self.e_score_correction_bias, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok
        ):
            return native.route_rows(
                x,
                self.weight,
                self.e_score_correction_bias,
                cfg.n_group,
                cfg.topk_group,
                cfg.num_experts_per_tok,
                cfg.norm_topk_prob,
                cfg.routed_scaling_factor,
            )
        # [T, E] in float32 like the reference, with its op: a float32 island keeps the reference's sums
        scores = F.linear(x.to(ct), self.weight.to(ct)).sigmoid()
        choice = scores + self.e_score_correction_bias.to(ct)
        if cfg.n_group == 1:  # one group (GLM-5): the group mask keeps every expert; 6 kernels fewer
            return self._weights(scores, choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False)[1])
        per_group = cfg.n_routed_experts // cfg.n_group
        group_scores = choice.view(-1, cfg.n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        group_idx = group_scores.topk(cfg.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        expert_mask = (
            group_mask.unsqueeze(-1).expand(-1, cfg.n_group, per_group).reshape(-1, cfg.n_routed_experts)
        )
        choice = choice.masked_fill(~expert_mask.bool(), float("-inf"))
        return self._weights(scores, choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False)[1])

    def _weights(self, scores: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights = scores.gather(1, ids)
        if self.cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.cfg.routed_scaling_factor, ids


class Experts(nn.Module):
    """Routed experts stored stacked: gate and up fused per expert, as [E, 2I, H] and [E, H, I].

    fp8 experts keep their block scales beside them ([E, ceil(2I/b0), ceil(H/b1)] and
    [E, ceil(H/b0), ceil(I/b1)]). `ops` (engine/gemm_ops.py) is "torch" (the grouped loop below; fp8
    through model/moe_ops.moe_torch) or "triton" (model/triton_moe.fused_moe: no host sync).
    With expert parallelism a rank holds experts first_expert .. first_expert + E - 1; a token's
    choice of another rank's expert adds nothing here (the all-to-all brings it to that rank).
    `static_shapes` (a decode rank's step, which must not sync with the host): the torch paths
    become moe_ops.moe_dense, whose shapes do not depend on the routing."""

    def __init__(self, n_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = empty_param(n_experts, 2 * intermediate, hidden)
        self.down_proj = empty_param(n_experts, hidden, intermediate)
        self.gate_up_scale_inv: torch.Tensor | None = None
        self.down_scale_inv: torch.Tensor | None = None
        self.block = FP8_BLOCK
        self.ops = "torch"
        self.first_expert: int | None = None  # expert parallelism: the id of this rank's expert 0
        self.n_routed = n_experts  # this rank's routed experts (the stacks may hold a shared one after)
        self.shared_slot: int | None = None  # MoE.fold_shared_expert: the shared expert's index
        self.cut = None  # model/shard.Cut (dim -1): the intermediate rows / columns held (TP)
        self.static_shapes = False

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Router ids -> this rank's expert ids, -1 for another rank's expert (device ops, no sync)."""
        if self.first_expert is None:
            return ids
        local = ids - self.first_expert
        return torch.where((local >= 0) & (local < self.n_routed), local, -1)

    def with_shared(self, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing plus the folded shared expert: one more slot per token, weight 1."""
        if self.shared_slot is None:
            return weights, ids
        col = torch.full_like(ids[:, :1], self.shared_slot)
        return torch.cat([weights, torch.ones_like(weights[:, :1])], 1), torch.cat([ids, col], 1)

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj[e])

    def _one_token(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [1, H]: the k chosen experts one after another, with no grouping by expert (a decode
        step at batch 1 off the native path). Sums in ascending expert order, as the grouped path does."""
        out = None
        for e, w in sorted(zip(ids[0].tolist(), weights[0].tolist())):
            h = (self._expert(e, x) * w).to(x.dtype)
            out = h if out is None else out.add_(h)
        return out if out is not None else torch.zeros_like(x)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        fp8 = self.gate_up_proj.dtype == torch.float8_e4m3fn
        general = fp8 or self.first_expert is not None or self.shared_slot is not None
        native_rows = not general and native.moe_usable(x, self.gate_up_proj, self.down_proj)
        if self.ops == "triton" or general or (self.static_shapes and not native_rows):
            scales = (self.gate_up_scale_inv, self.down_scale_inv)
            weights, ids = self.with_shared(weights, self.local_ids(ids))
            args = (x, self.gate_up_proj, self.down_proj, weights, ids, *scales)
            if self.ops == "triton":
                from .triton_moe import fused_moe  # triton is imported only where it runs

                return fused_moe(*args)
            return (moe_dense if self.static_shapes else moe_torch)(*args, block=self.block)
        if native_rows:
            # a decode step's few float32 rows on the CPU: one native call reads each chosen expert once
            return native.moe_rows(x, self.gate_up_proj, self.down_proj, ids, weights)
        if x.shape[0] == 1:
            return self._one_token(x, weights, ids)
        out = torch.zeros_like(x)
        flat_ids = ids.flatten()
        order = flat_ids.argsort(stable=True)  # group (token, slot) pairs by expert
        counts = torch.bincount(flat_ids, minlength=self.gate_up_proj.shape[0]).tolist()
        token_of = order // ids.shape[1]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[start : start + n]
            tok = token_of[start : start + n]
            start += n
            h = self._expert(e, x[tok]) * weights.flatten()[sel, None]
            out.index_add_(0, tok, h.to(out.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = TopkRouter(cfg)
        self.experts = Experts(cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
            if cfg.n_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    @torch.no_grad()
    def fold_shared_expert(self) -> bool:
        """Stack the shared expert onto the routed ones as one more expert that every token takes
        with weight 1 (SGLang's shared-experts fusion): the fused MoE then reads it in the same two
        launches, instead of three products and their small kernels of its own. Only where it has
        the experts' shape, dtype and block scales (one shared expert). True when folded."""
        mlp, ex = self.shared_experts, self.experts
        if mlp is None or ex.shared_slot is not None:
            return False
        gate, up, down = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        inter = ex.down_proj.shape[2]
        fp8 = ex.gate_up_proj.dtype == torch.float8_e4m3fn
        if (
            tuple(down.weight.shape) != tuple(ex.down_proj.shape[1:])
            or gate.weight.dtype != ex.gate_up_proj.dtype
            or (fp8 and (inter % ex.block[0] or gate.weight_scale_inv is None))
        ):
            return False

        def append(stack: torch.Tensor, one: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(torch.cat([stack, one.unsqueeze(0)]), requires_grad=False)

        ex.gate_up_proj = append(ex.gate_up_proj, torch.cat([gate.weight, up.weight]))
        ex.down_proj = append(ex.down_proj, down.weight)
        if fp8:
            ex.gate_up_scale_inv = append(
                ex.gate_up_scale_inv, torch.cat([gate.weight_scale_inv, up.weight_scale_inv])
            ).data
            ex.down_scale_inv = append(ex.down_scale_inv, down.weight_scale_inv).data
        ex.shared_slot, self.shared_experts = ex.n_routed, None
        return True
