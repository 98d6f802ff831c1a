"""Rank 0's sampler (engine/batch_sampler.py) on CUDA logits: greedy and processed rows and their
logprobs as on the CPU, seeded streams reproducible on the device's generators, a step run again
redraws the same tokens, and a step synchronizes with the host once (the results' one copy)."""

from __future__ import annotations

import warnings

import torch

from pdserve.engine.batch_sampler import BatchSampler, SampleRow
from pdserve.request import SamplingParams

V = 1000
PARAMS = [
    SamplingParams(logprobs=3),
    SamplingParams(repetition_penalty=1.5, prompt_ids=(1, 2, 3), logit_bias=((7, 2.0),), logprobs=0),
    SamplingParams(temperature=0.8, seed=1, logprobs=5),
    SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=2, presence_penalty=0.5, min_tokens=3),
]


def rows(outs: list[list[int]]) -> list[SampleRow]:
    return [SampleRow.of(f"r{i}", p, outs[i], [0]) for i, p in enumerate(PARAMS)]


def test_cuda_rows_match_the_cpu_where_they_must_and_streams_reproduce():
    gen = torch.Generator().manual_seed(0)
    cpu, gpu, again = BatchSampler(), BatchSampler(), BatchSampler()
    outs: list[list[int]] = [[] for _ in PARAMS]
    for _ in range(6):
        logits = torch.randn(len(PARAMS), V, generator=gen) * 3
        rs = rows(outs)
        want, got = cpu.sample(logits, rs), gpu.sample(logits.cuda(), rs)
        assert got == gpu.sample(logits.cuda(), rs)  # the same step again: the same draws
        assert got == again.sample(logits.cuda(), rs)  # the same seeds: the same device streams
        for w, g, p in zip(want, got, PARAMS):
            assert g.error is None
            if p.greedy:
                assert g.token == w.token
            if p.logprobs is not None and p.greedy:
                assert abs(g.logprob.logprob - w.logprob.logprob) <= 1e-9
                assert [t for t, _ in g.logprob.top] == [t for t, _ in w.logprob.top]
        top5 = set(logits[3].topk(5).indices.tolist())
        assert got[3].token in top5  # top-k held on the device too
        for i, g in enumerate(got):
            outs[i].append(g.token)


def test_one_host_synchronization_per_step():
    logits = torch.randn(len(PARAMS), V, device="cuda")
    sampler = BatchSampler()
    sampler.sample(logits, rows([[] for _ in PARAMS]))  # warm-up: generators, kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sampler.sample(logits, rows([[5] for _ in PARAMS]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchronizing" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
