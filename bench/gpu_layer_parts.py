"""bench/gpu_layer.py's parts: per-rank layer configs, random weights made on the device (bf16 or fp8
with 128x128 block scales), a CUDA-graph-safe dense decode backend, and the byte and FLOP counts
that the bounds divide by. No checkpoint is read: every weight is drawn on the device."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.model.config import ModelConfig
from pdserve.model.kernels import attend
from pdserve.model.layers import Experts, Linear
from pdserve.model.quant import FP8_BLOCK, quantizable, quantize_fp8
from pdserve.model.shard import cut_expert_ids
from pdserve.model.transformer import DecoderLayer

ROOT = Path(__file__).resolve().parents[1]
GLM5 = ROOT / "tests" / "data" / "configs" / "glm5" / "config.json"
RANKS = 8  # tp8 / ep8: one of 8 ranks
SHAPES = ("tp1", "tp8", "ep8")
TINY = dict(  # the CPU smoke run's dims (CI): every code path, seconds on 2 cores
    hidden_size=256, num_attention_heads=8, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32,
    qk_rope_head_dim=32, v_head_dim=32, n_routed_experts=16, moe_intermediate_size=128,
    num_experts_per_tok=4, index_n_heads=4, index_head_dim=64, index_topk=16, vocab_size=512,
)  # fmt: skip


@dataclass(frozen=True)
class RankShape:
    """What one rank of a shape holds and reads, beside its layer config."""

    name: str  # tp1 | tp8 | ep8
    cfg: ModelConfig
    ranks: int  # ranks the full layer is split over
    first_expert: int | None  # ep8: this rank's first expert id (rank 0)

    def context_share(self, context: int) -> int:
        """Tokens of a request's cache on this rank: the decode instance splits them over its ranks
        (DCP, C_d = ranks) while TP splits the heads."""
        return max(1, context // self.ranks)

    def topk_share(self) -> int:
        """Selected keys a query reads on this rank: the indexer's top-k falls on each rank's shard
        in proportion (the expected share; the exact global top-k needs the ranks' candidates)."""
        return max(1, self.cfg.index_topk // self.ranks)


def base_dict(tiny: bool) -> dict:
    d = json.loads(GLM5.read_text())
    d.update(num_hidden_layers=1, mlp_layer_types=["sparse"], indexer_types=["full"], first_k_dense_replace=0)
    if tiny:
        d.update(TINY)
    return d


def rank_shape(name: str, tiny: bool = False) -> RankShape:
    """GLM-5's real dims (tests/data/configs/glm5) as one rank of `name` holds them: tp8 narrows the
    attention heads and each expert's intermediate size by 8; ep8 narrows the heads by 8 and keeps
    256/8 whole experts. The indexer (32 heads) and the router stay whole on every rank."""
    d = base_dict(tiny)
    ranks = 1 if name == "tp1" else RANKS
    first = None
    if name != "tp1":
        d["num_attention_heads"] //= RANKS
    if name == "tp8":
        d["moe_intermediate_size"] //= RANKS
    if name == "ep8":
        first = 0
    return RankShape(name, ModelConfig.from_dict(d), ranks, first)


def _fp8_param(t: torch.Tensor, chunk: int = 8) -> tuple[torch.nn.Parameter, torch.Tensor]:
    if t.dim() == 2:
        q, s = quantize_fp8(t, FP8_BLOCK)
    else:  # experts a few at a time: the float32 padding of all 256 would take tens of GB
        parts = [quantize_fp8(t[i : i + chunk], FP8_BLOCK) for i in range(0, t.shape[0], chunk)]
        q, s = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    return torch.nn.Parameter(q, requires_grad=False), s


@torch.no_grad()
def build_layer(shape: RankShape, device: torch.device, weight_dtype: str, seed: int = 0) -> DecoderLayer:
    """One MoE decoder layer of `shape` with random weights on `device`, in bf16 (float32 on the CPU
    smoke run) with fp8 projections and experts where `weight_dtype` is fp8 and the release
    quantizes them (model/quant.quantizable; kv_b_proj stays in the run dtype: decode absorbs it)."""
    cfg = shape.cfg
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device("meta"):
        layer = DecoderLayer(cfg, 0)
    if shape.first_expert is not None:
        n = cfg.n_routed_experts // RANKS  # this rank's whole experts, as --moe-ep cuts them
        cut_expert_ids(layer.mlp.experts, slice(shape.first_expert, shape.first_expert + n))
    layer = layer.to(dtype).to_empty(device=device)  # run-dtype storage (meta modules start float32)
    g = torch.Generator(device=device).manual_seed(seed)
    fp8 = weight_dtype == "fp8"
    for name, p in list(layer.named_parameters()):
        if "norm" in name:
            p.data = torch.ones(p.shape, device=device, dtype=dtype)
            continue
        keep32 = name.endswith(("mlp.gate.weight", "e_score_correction_bias", "weights_proj.weight"))
        w = torch.randn(p.shape, generator=g, device=device, dtype=torch.float32 if keep32 else dtype)
        w.mul_(p.shape[-1] ** -0.5)
        if name.endswith("e_score_correction_bias"):
            w.zero_()
        owner_name, _, attr = name.rpartition(".")
        owner = layer.get_submodule(owner_name)
        as_fp8 = fp8 and "kv_b_proj" not in name and not keep32
        if as_fp8 and isinstance(owner, Experts):
            q, s = _fp8_param(w)
            setattr(owner, attr, q)
            setattr(owner, "gate_up_scale_inv" if attr == "gate_up_proj" else "down_scale_inv", s)
        elif as_fp8 and isinstance(owner, Linear) and quantizable("model.layers.0." + name, tuple(p.shape)):
            owner.weight, owner.weight_scale_inv = _fp8_param(w)
        else:
            p.data = w
        del w
    return layer


def weight_bytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def linear_bytes(m: Linear) -> int:
    return weight_bytes(m.weight) + weight_bytes(m.weight_scale_inv) + weight_bytes(m.bias)


def expert_bytes(experts: Experts, n_used: int) -> int:
    """Bytes of n_used of this rank's routed experts and of a shared expert folded among them
    (MoE.fold_shared_expert), weights and scales."""
    total = sum(
        weight_bytes(t)
        for t in (experts.gate_up_proj, experts.down_proj, experts.gate_up_scale_inv, experts.down_scale_inv)
    )
    folded = experts.shared_slot is not None
    return total * (n_used + folded) // experts.gate_up_proj.shape[0]


def dense_bytes(layer: DecoderLayer, moe_only: bool) -> int:
    """Bytes of every weight the layer reads whatever the tokens chose: all but the routed experts."""
    mods = layer.mlp.modules() if moe_only else layer.modules()
    total = 0
    for m in mods:
        if isinstance(m, Experts):
            continue
        if isinstance(m, Linear):
            total += linear_bytes(m)
        else:
            total += sum(weight_bytes(p) for p in m.parameters(recurse=False))
    return total


def used_experts(layer: DecoderLayer, x: torch.Tensor) -> int:
    """How many of this rank's experts the tokens x choose (outside any timing)."""
    _, ids = layer.mlp.gate(x)
    ids = layer.mlp.experts.local_ids(ids)
    return int(torch.unique(ids[ids >= 0]).numel())


def active_params(layer: DecoderLayer, moe_only: bool, per_token_experts: int) -> int:
    """Multiply-adds per token: every weight element except the routed experts, plus the experts
    one token runs."""
    n = 0
    mods = layer.mlp.modules() if moe_only else layer.modules()
    for m in mods:
        if isinstance(m, Experts):  # a folded shared expert is one more per token
            per_token = per_token_experts + (m.shared_slot is not None)
            n += per_token * (m.gate_up_proj[0].numel() + m.down_proj[0].numel())
        elif isinstance(m, Linear):
            n += m.weight.numel()
    return n


class DenseDecodeBackend:
    """A decode step's attention with static shapes and no host sync (so it can be captured in a CUDA
    graph): each request's cache is a dense [S, entry] block, the new token's slot a device tensor;
    the indexer scores every cached key in the run dtype (no float32 copy of the keys), torch.topk
    picks `topk` of them, attention reads those rows (model/kernels.attend). Ties in top-k follow
    torch.topk, not the engine's earlier-key rule: this backend models a step's work for timing."""

    def __init__(self, cfg: ModelConfig, batch: int, context: int, topk: int, device, dtype):
        g = torch.Generator(device=device).manual_seed(1)
        S = context + 1  # the cached tokens and the step's new one
        self.kv = torch.randn(batch, S, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=g, device=device)
        self.kv = self.kv.to(dtype)
        self.ik = torch.randn(batch, S, cfg.index_head_dim, generator=g, device=device).to(dtype)
        self.slot = torch.full((batch,), context, device=device)
        self.rows = torch.arange(batch, device=device)
        self.topk = min(topk, S)
        self.dv = cfg.kv_lora_rank

    def read_bytes(self) -> int:
        """What a step must read of the cache: every index key, and the selected latent rows."""
        b, s, d = self.kv.shape
        return b * s * self.ik.shape[2] * self.ik.element_size() + b * self.topk * d * self.kv.element_size()

    def attention(self, layer, q, kv, index, scale):
        self.kv[self.rows, self.slot] = kv.to(self.kv.dtype)
        self.ik[self.rows, self.slot] = index.k.to(self.ik.dtype)
        s = torch.matmul(index.q.to(self.ik.dtype), self.ik.transpose(1, 2)).relu_()  # [B, Hi, S]
        scores = torch.matmul(index.weights.unsqueeze(1).float(), s.float()).squeeze(1)  # [B, S]
        picked = scores.topk(self.topk, dim=-1).indices  # [B, k]
        keys = self.kv[self.rows[:, None], picked]  # [B, k, entry]
        valid = torch.ones(picked.shape, dtype=torch.bool, device=picked.device)
        return attend(q, keys, valid, scale, self.dv)[0]


class PrefillBackend:
    """A prompt's first chunk of T tokens: each query attends over the indexer's top-k of the
    tokens up to itself (all of them while there are fewer than k), in query blocks so the
    [block, H, T] scores stay small. Scores and probabilities are computed for the whole causal
    prefix and masked to the selection; the FLOP bound counts only the selected keys."""

    def __init__(self, cfg: ModelConfig, block: int = 512):
        self.topk, self.block, self.dv = cfg.index_topk, block, cfg.kv_lora_rank

    def attention(self, layer, q, kv, index, scale):
        T, dv = q.shape[0], self.dv
        pos = torch.arange(T, device=q.device)
        out = torch.empty(T, q.shape[1], dv, dtype=q.dtype, device=q.device)
        for a in range(0, T, self.block):
            b = min(T, a + self.block)
            s = torch.einsum("qhd,kd->qhk", index.q[a:b].to(kv.dtype), index.k[:b].to(kv.dtype)).relu_()
            scores = torch.einsum("qh,qhk->qk", index.weights[a:b].float(), s.float())
            causal = pos[None, :b] <= pos[a:b, None]
            scores = scores.masked_fill(~causal, float("-inf"))
            k = min(self.topk, b)
            chosen = torch.zeros_like(causal).scatter_(1, scores.topk(k, dim=-1).indices, True) & causal
            att = torch.einsum("qhd,kd->qhk", q[a:b], kv[:b]).float() * scale
            att = att.masked_fill(~chosen[:, None, :], float("-inf")).softmax(dim=-1)
            out[a:b] = torch.einsum("qhk,kd->qhd", att.to(kv.dtype), kv[:b, :dv])
        return out
