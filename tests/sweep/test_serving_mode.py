"""Issue 14, item 3: the serving mode (float32 with the float32 islands, the servers' default).

On a few shapes of the sweep's space (one per architecture: prefill CP -> hand-off -> decode DCP,
copy and split index, both merges), a batch of prompts of lengths 1, 2, C_d, index_topk + 1 and 33
decodes 32 greedy tokens. They equal the single-rank engine's (same dtype, same islands), or the
first divergence is a near-tie: the single-rank engine's logit of its own token exceeds its logit of
the token the instances chose by less than NEAR_TIE. A near-tie is reported (printed and recorded
as a user property); a larger gap fails.
"""

from __future__ import annotations

import pytest
import torch

from tests.sweep.draw import Case, Pair
from tests.sweep.runner import PairRunner
from tests.sweep.single_rank import SingleRank

pytestmark = pytest.mark.slow
NEAR_TIE = 1e-5
TOKENS = 32
SHAPES = [  # (pair, index mode, merge)
    (
        Pair("glm_moe_dsa", "tcp", 2, "interleave", "full", False, 4, 4, False, "auto", 4, "float32", True),
        "split",
        "a2a",
    ),
    (
        Pair(
            "deepseek_v32",
            "nixl",
            3,
            "interleave",
            "layer-split",
            True,
            3,
            3,
            True,
            "auto",
            6,
            "float32",
            True,
        ),
        "copy",
        "ag_rs",
    ),
    (
        Pair("deepseek_v3", "tcp", 2, "zigzag", "full", False, 2, 2, True, "auto", 2, "float32", True),
        "copy",
        "a2a",
    ),
]


def first_divergence(got: list[int], want: list[int]) -> int | None:
    return next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)


@pytest.mark.parametrize("pair,index_mode,comm", SHAPES, ids=lambda v: v.arch if isinstance(v, Pair) else v)
def test_float32_islands_tokens_match_or_near_tie(
    heads12_checkpoints, request, capsys, pair, index_mode, comm
):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the single-rank engine: tiny tensors, a loaded machine
    path = str(heads12_checkpoints[pair.arch])
    oracle = SingleRank(path, "float32", islands=True)
    lengths = (1, 2, pair.c, 9, 33)
    case = Case(0, index_mode, comm, 16, lengths, (TOKENS,) * len(lengths))
    prompts = [case.prompt(14, i) for i in range(len(lengths))]
    runner = PairRunner(pair, path)
    try:
        got = runner.run(case, prompts, "f32")
    finally:
        runner.close()
        torch.set_num_threads(threads)
    for ids, g in zip(prompts, got):
        want = oracle.expect(ids, TOKENS - 1)
        i = first_divergence(g.tokens, want.tokens)
        if i is None:
            continue
        ref = oracle.prefiller.prefill_with_cache(ids)[0] if i == 0 else want.logits[i - 1]
        gap = float(ref[want.tokens[i]] - ref[g.tokens[i]])
        what = f"{pair.arch} prompt {len(ids)}: token {i} is {g.tokens[i]}, single-rank {want.tokens[i]} (gap {gap:.2e})"
        assert gap < NEAR_TIE, f"{what}: not a near-tie"
        request.node.user_properties.append(("near_tie", what))
        with capsys.disabled():
            print(f"\nnear-tie divergence (accepted): {what}")
