"""Expert parallelism (`--moe-ep`): routed experts split by id across the ranks, applied from outside
the model.

Rank r of W holds experts [r E/W, (r+1) E/W) whole (full intermediate dim; fp8 with its block
scales unchanged, a whole expert being block-aligned) and only those are read from the checkpoint
(model/shard.py `cut_expert_ids`). The router is replicated: every rank routes a token alike. A
rank's Experts module adds exactly nothing for a choice of another rank's expert
(model/layers.py `Experts.local_ids`), so its output is its own experts' part of the sum.

Two ways to bring tokens and experts together, by where the tokens are:
  - tokens replicated (decode: after attention's o_proj all-reduce every rank holds every token of
    the step; prefill with --moe-tp: the block sees the all-gathered chunk): no exchange. Each
    rank applies its experts to every token and the collective the tensor-parallel MLP already
    makes (all-reduce; reduce-scatter) sums the ranks' parts. `shard_moe_ep(shared_tp=True)`: the
    shared expert and the dense MLPs stay cut by intermediate dim, summed by the same collective.
  - tokens split (prefill: each rank its own positions): `ExpertParallelMoE` dispatches each token
    once to every rank that owns one of its chosen experts (torch's uneven all_to_all_single: gloo
    on CPU, NCCL on CUDA; one exchange of counts, one of rows, one of routing), the owners compute
    their experts' part for the rows they received, a second exchange sends the parts back, and
    the token's rank sums them in rank order. The shared expert and dense MLPs stay replicated
    (`shared_tp=False`) and run on the token's own rank.
In both, a token's output is the sum over the ranks of each rank's part (its chosen experts, in
ascending id, weighted): a different order of the same sum than one rank's (all experts ascending)
or TP's (per intermediate slice), so equal to rounding (float64: ~1e-15), not bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from ..model.config import experts_per_rank
from ..model.layers import MLP, MoE
from ..model.shard import cut_expert_ids
from ..model.transformer import CausalLM
from .collectives import all_to_all_rows, exchange_counts
from .tp_shard import shard_mlp


def expert_span(n_experts: int, rank: int, world: int) -> slice:
    """Rank `rank`'s routed experts (ids); the count must divide evenly (model/config.py)."""
    per = experts_per_rank(n_experts, world)
    return slice(rank * per, (rank + 1) * per)


def shard_moe_ep(model: CausalLM, rank: int, world: int, shared_tp: bool) -> None:
    """Every MoE layer's routed experts by id; shared experts and dense MLPs cut by intermediate dim
    (shared_tp: a later sum over the ranks completes them) or kept whole. One rank: nothing to cut."""
    if world == 1:
        return
    for layer in model.model.layers:
        ffn = layer.mlp
        if isinstance(ffn, MoE):
            cut_expert_ids(ffn.experts, expert_span(ffn.experts.n_routed, rank, world))
            if ffn.shared_experts is not None and shared_tp:
                shard_mlp(ffn.shared_experts, rank, world)
        elif shared_tp:
            shard_mlp(ffn, rank, world)


class ExpertParallelMoE(nn.Module):
    """A MoE block whose routed experts live across the ranks of `group` (torch.distributed; None:
    the world), for ranks that hold different tokens: dispatch, local experts, combine (module
    docstring). The shared expert moves here, so it is never folded into the routed ones
    (engine/gemm_ops.py): it runs once per token, on the token's rank. The counts are read on the
    host (one sync per block, before the row exchange): a prefill-sized step's cost, and why decode
    takes the exchange-free path."""

    def __init__(self, moe: MoE, world: int, group=None):
        super().__init__()
        self.gate, self.experts = moe.gate, moe.experts
        self.shared_experts: MLP | None = moe.shared_experts
        self.world, self.group = world, group
        self.per_rank = moe.experts.n_routed  # every rank holds as many

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)  # [T, k]
        out = self.combine(self.dispatch(x, weights, ids), x)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def dispatch(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        """Sends each token to the ranks that own one of its experts; computes the parts of the rows
        this rank received; returns what combine needs."""
        owner = torch.zeros(x.shape[0], self.world, dtype=torch.bool, device=x.device)
        owner.scatter_(1, ids // self.per_rank, True)  # [T, W]: token t has an expert on rank r
        _, token = owner.t().nonzero(as_tuple=True)  # (destination, token) pairs, by destination then token
        send = owner.sum(0)  # [W]
        send_counts = send.tolist()
        recv_counts = exchange_counts(send, self.group)
        rows = all_to_all_rows(x[token], send_counts, recv_counts, self.group)
        # weights and ids in one tensor of the weights' dtype (float32 or float64: ids < 2^24 are exact)
        routing = torch.cat([weights, ids.to(weights.dtype)], 1)[token]
        got = all_to_all_rows(routing, send_counts, recv_counts, self.group)
        k = ids.shape[1]
        if rows.shape[0]:
            part = self.experts(rows, got[:, :k], got[:, k:].long())  # other ranks' experts add nothing
        else:
            part = rows.new_zeros(rows.shape)
        back = all_to_all_rows(part, recv_counts, send_counts, self.group)  # in the order sent
        return back, token, send_counts

    def combine(self, dispatched, x: torch.Tensor) -> torch.Tensor:
        """Each token's parts summed in rank order (a token's row at most once per rank)."""
        back, token, send_counts = dispatched
        out = torch.zeros_like(x)
        start = 0
        for n in send_counts:
            if n:
                out.index_add_(0, token[start : start + n], back[start : start + n].to(out.dtype))
            start += n
        return out


def wrap_moe_ep(model: CausalLM, world: int, group=None) -> None:
    """Every MoE block of a loaded, EP-sharded (shared_tp=False) model exchanges its tokens."""
    if world == 1:
        return
    for layer in model.model.layers:
        if isinstance(layer.mlp, MoE):
            layer.mlp = ExpertParallelMoE(layer.mlp, world, group)
