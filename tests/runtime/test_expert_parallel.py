"""runtime/expert_parallel.py: the all-to-all dispatch / combine of --moe-ep, in real gloo rank processes.

Each rank holds E/W whole experts (cut by id from the same MoE block) and its own tokens; the
EP block's output for a rank's tokens equals the whole block's output for them, in float64 (to
1e-12: a token's parts are summed per rank, then over ranks in rank order, where the whole block
adds all its experts in ascending order; float addition is not associative, so not bitwise).
W = 2 with uneven token counts (7 and 2); W = 3 where rank 1 holds no token (it sends nothing,
but still joins every exchange and computes for the tokens it receives) and rank 2's experts are
never chosen (it receives nothing), so every zero-sized split is crossed. `exchange_counts` and
`all_to_all_rows` carry the rows in the order the docstrings promise.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pdserve.checkpoints.presets import hf_config
from pdserve.model.config import ModelConfig
from pdserve.model.layers import MoE
from pdserve.model.shard import cut_expert_ids
from pdserve.runtime.collectives import all_to_all_rows, exchange_counts
from pdserve.runtime.expert_parallel import ExpertParallelMoE, expert_span
from tests.reference import free_port

E = 12


def block(unused: range | None) -> tuple[MoE, ModelConfig]:
    """The same float64 MoE block on every rank (12 experts, 2 of them per token, one shared expert);
    experts `unused` are never chosen (their correction bias is very negative)."""
    d = hf_config("glm_moe_dsa", "tiny")
    d.update(n_routed_experts=E, n_group=1, topk_group=1)
    cfg = replace(ModelConfig.from_dict(d), float32_islands=False)  # the router in float64 too
    torch.manual_seed(4)
    m = MoE(cfg)
    for p in m.parameters():
        p.data = torch.randn(p.shape, dtype=torch.float64) * p.shape[-1] ** -0.5
    if unused is not None:
        m.gate.e_score_correction_bias.data[list(unused)] = -100.0
    return m.eval(), cfg


def tokens(counts: list[int], hidden: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(9)
    return [torch.randn(n, hidden, dtype=torch.float64, generator=g) for n in counts]


def _worker(rank: int, world: int, port: int, counts: list[int], unused, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        # the raw exchange: rank r sends (r + j) % 3 rows to rank j, each row naming its sender and target
        send = torch.tensor([(rank + j) % 3 for j in range(world)])
        got_counts = exchange_counts(send)
        assert got_counts == [(j + rank) % 3 for j in range(world)]
        rows = torch.cat([torch.full((int(n), 2), 10.0 * rank + j) for j, n in enumerate(send)])
        got = all_to_all_rows(rows, send.tolist(), got_counts)
        assert got[:, 0].tolist() == [10.0 * j + rank for j, n in enumerate(got_counts) for _ in range(n)]

        whole, cfg = block(unused)
        xs = tokens(counts, cfg.hidden_size)
        with torch.no_grad():
            want = whole(torch.cat(xs)).split(counts)[rank]
            part, _ = block(unused)
            cut_expert_ids(part.experts, expert_span(E, rank, world))
            ep = ExpertParallelMoE(part, world)
            out = ep(xs[rank])
            _, ids = whole.gate(torch.cat(xs))
        err = (out - want).abs().max().item() if out.numel() else 0.0
        results.put(
            (rank, out.shape == want.shape and err <= 1e-12, err, sorted(set(ids.flatten().tolist())))
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "counts, unused",
    [([7, 2], None), ([5, 0, 6], range(8, 12))],
    ids=["w2-uneven", "w3-empty-sender-and-receiver"],
)
def test_dispatch_combine_equals_the_whole_block(counts, unused):
    world = len(counts)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, counts, unused, results)) for r in range(world)
    ]
    for p in procs:
        p.start()
    out = sorted(results.get(timeout=120) for _ in range(world))
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for rank, ok, err, _ in out:
        assert ok, (rank, err)
    if unused is not None:  # rank 2 owns experts 8..11: no token chose one, so it received nothing
        assert not set(out[0][3]) & set(unused)


def test_moe_ep_reaches_the_rank_workers(tiny_checkpoints):
    """`--moe-ep` on each server's config reaches its rank workers' config; an uneven split is refused
    by validate_model (before any rank starts) and by the instance itself."""
    from pdserve.decode_server.config import DecodeServerConfig
    from pdserve.decode_server.serve import build_instance as build_decode
    from pdserve.prefill_server.config import PrefillServerConfig
    from pdserve.prefill_server.serve import build_instance as build_prefill

    path = str(tiny_checkpoints[("glm_moe_dsa", "make-model")])  # 8 routed experts, 4 heads
    decode = DecodeServerConfig.create(model=path, tp_size=2, moe_ep=True, max_kv_tokens=256)
    decode.validate_model()
    assert build_decode(decode).worker.moe_ep
    prefill = PrefillServerConfig.create(model=path, cp_size=2, moe_ep=True)
    prefill.validate_model()
    assert build_prefill(prefill).worker.moe_ep
    with pytest.raises(ValueError, match="8 routed experts cannot be split evenly over 3 ranks"):
        PrefillServerConfig.create(model=path, cp_size=3, moe_ep=True).validate_model()
    with pytest.raises(ValueError, match="cannot be split evenly over 3 ranks"):
        build_prefill(PrefillServerConfig.create(model=path, cp_size=3, moe_ep=True))
