"""Engine pieces: page allocator, scheduler lifecycle, sampler, and the engine's request handling."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampler import Sampler, filtered_probs
from pdserve.engine.scheduler import Scheduler
from pdserve.kvcache.page_allocator import OutOfPages, PageAllocator
from pdserve.request import Request, SamplingParams, Status


def test_allocator_allocate_free_integrity():
    a = PageAllocator(num_pages=4, page_size=16)
    p1 = a.allocate(17)  # two pages
    p2 = a.allocate(32)
    assert len(p1) == 2 and len(p2) == 2 and a.num_free == 0
    with pytest.raises(OutOfPages):
        a.allocate(1)
    a.free(p1)
    with pytest.raises(ValueError, match="double free"):
        a.free(p1)
    a.check_integrity()
    assert a.slots([3, 1], 14, 18) == [62, 63, 16, 17]


def test_held_pages_come_back_only_after_their_hold():
    """free(pages, hold_s): pages a failed hand-off's senders may still WRITE into are not handed out
    again until hold_s passed; a double free of them is still caught."""
    now = [100.0]
    a = PageAllocator(num_pages=4, page_size=16, clock=lambda: now[0])
    held, kept = a.allocate(32), a.allocate(16)
    a.free(held, hold_s=0.3)
    assert a.num_free == 1 and a.num_held == 2 and not a.can_allocate(17)
    a.check_integrity()
    with pytest.raises(ValueError, match="double free"):
        a.free(held)
    with pytest.raises(OutOfPages):
        a.allocate(17)
    now[0] += 0.29
    assert a.num_held == 2 and a.num_free == 1  # not yet
    now[0] += 0.02
    assert (
        a.num_held == 0
        and a.num_free == 3
        and set(a.allocate(48)) == set(held) | ({0, 1, 2, 3} - set(held) - set(kept))
    )
    a.check_integrity()


def test_scheduler_lifecycle_without_torch():
    alloc = PageAllocator(num_pages=4, page_size=4)
    s = Scheduler(alloc, eos_ids=(0,), prefill_chunk=3)
    a = Request([5, 6, 7, 8], SamplingParams(max_tokens=3))  # needs 6 slots -> 2 pages
    b = Request([9], SamplingParams(max_tokens=13))  # needs 13 slots -> 4 pages: waits for a
    s.add(a)
    s.add(b)
    chunks = s.schedule()
    assert [(c.request, c.start, c.n) for c in chunks] == [(a, 0, 3)]
    assert list(s.waiting) == [b] and a.status == Status.PREFILLING
    s.postprocess(chunks, [None])  # an intermediate chunk samples nothing
    chunks = s.schedule()
    assert [(c.start, c.n) for c in chunks] == [(3, 1)]
    s.postprocess(chunks, [11])
    assert s.running == [a] and a.output_ids == [11]
    chunks = s.schedule()
    assert [(c.request, c.start, c.n) for c in chunks] == [(a, 4, 1)]
    s.postprocess(chunks, [0])  # EOS
    assert a.finish_reason == "stop" and alloc.num_free == 4
    chunks = s.schedule()  # b is admitted now that a's pages are back
    assert chunks[0].request is b
    assert s.abort(b.request_id) is b and b.finish_reason == "abort"
    assert alloc.num_free == 4 and not s.has_work()
    alloc.check_integrity()


def test_scheduler_rejects_a_request_larger_than_the_cache():
    s = Scheduler(PageAllocator(2, 4), eos_ids=())
    with pytest.raises(ValueError, match="KV slots"):
        s.add(Request([1] * 6, SamplingParams(max_tokens=4)))


def test_sampling_params_are_validated():
    for bad in (
        dict(max_tokens=0),
        dict(max_tokens=2**40),
        dict(temperature=-1),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(top_p=0),
        dict(top_p=float("nan")),
        dict(top_k=-2),
        dict(top_k=2**70),
        dict(seed=2**64),
        dict(seed=2**63),
        dict(seed=-1),
        dict(seed=-(2**70)),
        dict(stop_token_ids=tuple(range(65))),
    ):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    # the extremes that are allowed are ones the sampler can use (manual_seed takes [0, 2**63))
    p = SamplingParams(temperature=1.0, seed=2**63 - 1)
    assert Sampler().sample(torch.zeros(1, 8), [p], ["edge"])[0] in range(8)


def test_extreme_temperatures_sample_from_valid_distributions():
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0, 50.0, 49.999]], dtype=torch.float64)
    for t in (5e-324, 1e-300, 1e-6):  # the hottest logit (index 4) wins: its distribution is one-hot
        p = filtered_probs(logits[0], SamplingParams(temperature=t, top_p=0.9))
        assert torch.isfinite(p).all() and p[4] == 1.0, (t, p)
        assert Sampler().sample(logits, [SamplingParams(temperature=t, seed=1)], ["x"]) == [4]
    for top_p in (5e-324, 1e-45):  # below float32's resolution: the most likely token still stays
        assert Sampler().sample(logits, [SamplingParams(temperature=1.0, top_p=top_p, seed=2)], ["y"]) == [4]
    p = filtered_probs(logits[0], SamplingParams(temperature=100.0))
    assert torch.isfinite(p).all() and abs(float(p.sum()) - 1) < 1e-12 and float(p.min()) > 0


def test_sampler_seeded_and_filters():
    logits = torch.log_softmax(torch.tensor([[1.0, 3.0, 2.0, 0.5]]), -1)
    p = SamplingParams(temperature=1.0, seed=123)
    runs = [[Sampler().sample(logits, [p], ["r"])[0] for _ in range(1)] for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    s = Sampler()
    many = [s.sample(logits, [p], ["r"])[0] for _ in range(200)]
    assert len(set(many)) > 1  # really samples
    assert set(Sampler().sample(logits, [SamplingParams(temperature=1.0, top_k=1)], ["x"])) == {1}
    probs = filtered_probs(logits[0], SamplingParams(temperature=1.0, top_k=2))
    assert probs[0] == 0 and probs[3] == 0 and abs(probs.sum().item() - 1) < 1e-6
    probs = filtered_probs(logits[0], SamplingParams(temperature=1.0, top_p=0.5))
    assert probs.tolist().count(0.0) == 3 and probs[1] == 1.0  # token 1 alone has >= 0.5 of the mass


def test_engine_abort_and_bad_input(tiny_checkpoints):
    engine = LLMEngine.from_pretrained(
        tiny_checkpoints[("glm_moe_dsa", "make-model")], max_kv_tokens=128, page_size=8
    )
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 10**6])
    r1 = engine.add_request([5] * 30, SamplingParams(max_tokens=40, ignore_eos=True))
    r2 = engine.add_request([6] * 10, SamplingParams(max_tokens=40, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.allocator.num_free < engine.allocator.num_pages
    engine.abort(r1.request_id)
    engine.abort(r2.request_id)
    assert r1.finish_reason == r2.finish_reason == "abort"
    assert engine.allocator.num_free == engine.allocator.num_pages
    engine.allocator.check_integrity()


def test_chunked_prefill_equals_one_shot(tiny_checkpoints):
    path = tiny_checkpoints[("deepseek_v32", "make-model")]
    ids = torch.randint(4, 500, (45,), generator=torch.Generator().manual_seed(3)).tolist()
    p = SamplingParams(max_tokens=8, ignore_eos=True)
    one = LLMEngine.from_pretrained(path, "float64", max_kv_tokens=128).generate([ids], p)
    chunked = LLMEngine.from_pretrained(
        path, "float64", max_kv_tokens=128, prefill_chunk=7, query_block=4
    ).generate([ids], p)
    assert one == chunked


def test_bfloat16_engine_runs_with_a_bfloat16_cache(tiny_checkpoints):
    engine = LLMEngine.from_pretrained(
        tiny_checkpoints[("glm_moe_dsa", "make-model")], "bfloat16", max_kv_tokens=128
    )
    assert engine.pool.kv.dtype == torch.bfloat16
    logits = engine.prefill_logits(list(range(5, 40)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    out = engine.generate([list(range(5, 40))], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(out) == 6
