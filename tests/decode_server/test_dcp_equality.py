"""docs/design.md invariant 2 for decode: a decode instance of W real rank processes (TP = W, DCP = C_d)
decodes exactly like the single-rank engine (float64 logits within 1e-8, identical greedy tokens).

For (W, C_d) in {(1,1), (2,1), (2,2), (4,2), (4,4)} x index {copy, split} x merge {a2a, ag_rs} x
replicated query projection {on, off} (in CI one of the two per layout: CI_CASES; `--deep` both):
a batch of requests of different lengths (one shorter than C_d, one long enough that some rank
selects no token in some layer) decodes 16 greedy tokens.
The prompt caches come from the single-rank engine and are loaded directly. The short prompts run
batched with the 70-token one here, so no rank is ever empty: a short request alone in the batch is
test_failure_isolation.py's regression test and a drawn case of tests/sweep/test_sweep.py.
With --moe-ep (experts by id across the ranks) the same, and equal to TP over the same W.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.decode_server.instance import DecodeInstance
from pdserve.decode_server.worker_config import DecodeWorkerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.request import SamplingParams
from pdserve.runtime.launcher import LaunchConfig
from tests.reference import assert_close, free_port, reference_prefill

TOKENS = 16
LAYOUTS = [(1, 1), (2, 1), (2, 2), (4, 2), (4, 4)]
CASES = [(w, c, rq) for w, c in LAYOUTS for rq in ((False, True) if c > 1 else (False,))]
# in CI one replicated-q value per layout, alternating, so both values run with C_d = 2 and with
# C_d = 4 (tests/sweep draws the rest end to end); `pytest --deep` runs every case
CI_CASES = [(w, c, i % 2 == 0 and c > 1) for i, (w, c) in enumerate(LAYOUTS)]


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(4, 500, (n,), generator=g).tolist() for n in (1, 11, 70)]


@pytest.fixture(scope="module")
def expected(tiny_checkpoints):
    """Per architecture: for each prompt, its 16 greedy tokens, the logits of every decode step and
    its prompt cache, all from the single-rank engine in true float64."""
    out = {}
    for arch in ("glm_moe_dsa", "deepseek_v3"):
        engine = LLMEngine.from_pretrained(
            tiny_checkpoints[(arch, "make-model")], "float64", float32_islands=False, max_kv_tokens=1024
        )
        per = []
        for ids in prompts():
            tokens = engine.generate([ids], SamplingParams(max_tokens=TOKENS, ignore_eos=True))[0]
            logits = engine.prefill_logits(ids + tokens[:-1])[len(ids) :]  # decode step i sees token i
            per.append((ids, tokens, logits, reference_prefill(engine, ids)[1]))
        out[arch] = per
    return out


def decode_all(inst: DecodeInstance, cases) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Loads every prompt's cache, then decodes all requests together, greedily."""
    pages, seqs = [], []
    for ids, tokens, _, entries in cases:
        p = inst.allocator.allocate(len(ids) + TOKENS)
        kv = torch.stack([entries[layer][0] for layer in sorted(entries)])
        index = {layer: e[1] for layer, e in entries.items() if e[1] is not None}
        inst.load(p, kv, index)
        pages.append(p)
        seqs.append(list(ids) + [tokens[0]])  # the first token comes from the prefill
    all_logits = [[] for _ in cases]
    for _ in range(TOKENS - 1):
        logits = inst.step([s[-1] for s in seqs], pages, [len(s) for s in seqs])
        for i, row in enumerate(logits):
            all_logits[i].append(row)
            seqs[i].append(int(row.argmax()))
    for p in pages:
        inst.allocator.free(p)
    return [s[len(c[0]) :] for s, c in zip(seqs, cases)], [torch.stack(x) for x in all_logits]


def pytest_generate_tests(metafunc):
    if "replicate_q" in metafunc.fixturenames:
        metafunc.parametrize("tp,dcp,replicate_q", CASES if metafunc.config.getoption("--deep") else CI_CASES)


@pytest.mark.slow
def test_decode_instance_matches_single_rank(tiny_checkpoints, expected, tp, dcp, replicate_q):
    arch = "glm_moe_dsa"
    worker = DecodeWorkerConfig(
        str(tiny_checkpoints[(arch, "make-model")]),
        num_slots=1024,
        dcp_size=dcp,
        replicate_q=replicate_q,
        dtype="float64",
        float32_islands=False,
    )
    with DecodeInstance(worker, LaunchConfig(tp, free_port()), page_size=4) as inst:
        for index_mode in ("copy", "split"):
            for comm in ("a2a", "ag_rs"):
                inst.reconfigure(index_mode, comm)
                tokens, logits = decode_all(inst, expected[arch])
                for (ids, want_tokens, want_logits, _), got_t, got_l in zip(expected[arch], tokens, logits):
                    tag = f"W={tp} C_d={dcp} rq={replicate_q} {index_mode}/{comm} prompt {len(ids)}"
                    assert got_t == want_tokens, tag
                    assert_close(got_l, want_logits, tag)
                assert inst.allocator.num_free == inst.allocator.num_pages
        empty = sum(r.empty_selections for r in inst.rank_info())
        if dcp == 4:
            assert empty > 0, "the long prompt should leave some rank with no selected token in some layer"


@pytest.mark.slow
@pytest.mark.parametrize("tp,dcp,cpu_comm", [(2, 2, "gloo"), (4, 2, "shm")])
def test_dense_model_decode_matches_single_rank(tiny_checkpoints, expected, tp, dcp, cpu_comm):
    """Also covers both collective backends (the sparse sweep above uses the default, shared memory)."""
    worker = DecodeWorkerConfig(
        str(tiny_checkpoints[("deepseek_v3", "make-model")]),
        num_slots=1024,
        dcp_size=dcp,
        dtype="float64",
        float32_islands=False,
        cpu_comm=cpu_comm,
    )
    with DecodeInstance(worker, LaunchConfig(tp, free_port()), page_size=4) as inst:
        tokens, logits = decode_all(inst, expected["deepseek_v3"])
        for (ids, want_tokens, want_logits, _), got_t, got_l in zip(expected["deepseek_v3"], tokens, logits):
            assert got_t == want_tokens
            assert_close(got_l, want_logits, f"deepseek_v3 W={tp} C_d={dcp} prompt {len(ids)}")


@pytest.mark.parametrize(
    "arch,tp,dcp",
    [("glm_moe_dsa", 2, 1), pytest.param("deepseek_v3", 4, 2, marks=pytest.mark.slow)],
    ids=["glm-w2", "dsv3-w4-dcp2"],
)
def test_moe_ep_decode_matches_tp_and_single_rank(tiny_checkpoints, expected, arch, tp, dcp):
    """--moe-ep: each rank holds E/W whole experts (tokens are replicated in decode, so nothing is
    exchanged; the all-reduce after the block sums the ranks' experts). The same greedy tokens as the
    single-rank engine and as TP over the same W (experts cut by intermediate dim), and logits within
    1e-8 of the single rank's (this file's bound) and 1e-12 of TP's in float64 (measured: about
    8e-15 and 3e-15 at W = 2, logits of size 4): the three sum a token's expert outputs in different
    orders (all experts ascending; per rank, then over ranks; per intermediate slice), so they agree
    to rounding, not bitwise."""
    runs, weight_bytes = {}, {}
    for moe_ep in (True, False):
        worker = DecodeWorkerConfig(
            str(tiny_checkpoints[(arch, "make-model")]),
            num_slots=1024,
            dcp_size=dcp,
            dtype="float64",
            float32_islands=False,
            moe_ep=moe_ep,
        )
        with DecodeInstance(worker, LaunchConfig(tp, free_port()), page_size=4) as inst:
            runs[moe_ep] = decode_all(inst, expected[arch])
            weight_bytes[moe_ep] = sum(r.weight_bytes for r in inst.rank_info())
    (ep_tokens, ep_logits), (tp_tokens, tp_logits) = runs[True], runs[False]
    for (ids, want_tokens, want_logits, _), et, el, tt, tl in zip(
        expected[arch], ep_tokens, ep_logits, tp_tokens, tp_logits
    ):
        tag = f"{arch} W={tp} C_d={dcp} --moe-ep prompt {len(ids)}"
        assert et == want_tokens == tt, tag
        assert_close(el, want_logits, tag)
        assert_close(el, tl, tag + " vs TP", tol=1e-12)
    # EP really ran (its sums are not TP's bit for bit), and holds the same bytes over the ranks
    assert any(not torch.equal(el, tl) for el, tl in zip(ep_logits, tp_logits))
    assert weight_bytes[True] == weight_bytes[False]
