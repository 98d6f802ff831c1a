"""Decode scheduling: lifecycle, admission by pages, continuous batching, stops, aborts; the
decode engine end to end on real ranks, rank 0 sampling exactly as the CPU sampler would from the
same logits; nothing leaks after hundreds of random aborts (pages, rank 0's generators)."""

from __future__ import annotations

import dataclasses
import random
import threading

import pytest

from pdserve.decode_server.instance import DecodeInstance
from pdserve.decode_server.scheduler import DecodeRequest, DecodeScheduler
from pdserve.decode_server.step_driver import DecodeStepDriver
from pdserve.decode_server.worker_config import DecodeWorkerConfig
from pdserve.engine.constraint import Grammars, grammar_for
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampler import Sampler
from pdserve.kvcache.page_allocator import PageAllocator
from pdserve.model.tokenizer import Tokenizer
from pdserve.request import SamplingParams
from pdserve.runtime.launcher import LaunchConfig
from tests.engine.test_grammar_cache import big_schema
from tests.reference import free_port


def test_lifecycle_admission_stop_and_abort_without_torch():
    alloc = PageAllocator(num_pages=4, page_size=4)
    s = DecodeScheduler(alloc, eos_ids=(0,))
    a = DecodeRequest(prompt_len=5, params=SamplingParams(max_tokens=4))  # 8 slots -> 2 pages
    b = DecodeRequest(prompt_len=9, params=SamplingParams(max_tokens=4))  # 12 slots -> 3 pages: waits for a
    one = DecodeRequest(prompt_len=2, params=SamplingParams(max_tokens=1))
    for r in (a, b, one):
        s.submit(r)
    # b does not fit yet; `one` would, but requests are admitted in arrival order
    assert s.admit() == [a] and b.state == one.state == "queued" and alloc.num_free == 2
    s.kv_ready(a.request_id, 7)
    assert s.running == [a] and a.output_ids == [7]
    assert s.postprocess([a], [8]) == [] and a.output_ids == [7, 8]
    assert s.postprocess([a], [0]) == [a] and a.finish_reason == "stop"  # EOS
    assert alloc.num_free == 4
    assert s.admit() == [b, one] and alloc.num_free == 0
    assert s.abort(b.request_id) is b and b.finish_reason == "abort" and alloc.num_free == 3
    s.kv_ready(one.request_id, 9)  # max_tokens = 1: done with the prefill's token
    assert one.finish_reason == "length" and s.is_idle() and alloc.num_free == 4
    alloc.check_integrity()
    with pytest.raises(ValueError, match="KV slots"):
        s.submit(DecodeRequest(prompt_len=20, params=SamplingParams(max_tokens=1)))


def test_a_choice_whose_first_token_ends_it_leaves_the_other_choices_running():
    """n = 2: choice 0's first token is EOS, choice 1's is not. Choice 1 started (it has its first
    token), so it keeps its pages and decodes on (seen by the HTTP fuzz: the parent's finish freed
    the child's pages as if it had never started, and the next step found a running choice with
    no pages)."""
    alloc = PageAllocator(num_pages=8, page_size=4)
    s = DecodeScheduler(alloc, eos_ids=(0,))
    req = DecodeRequest(prompt_len=5, params=SamplingParams(max_tokens=3, n=2))
    s.submit(req)
    assert s.admit() == [req]
    (child,) = req.children
    s.kv_ready(req.request_id, 0, [7])  # EOS for choice 0, 7 for choice 1
    assert req.finish_reason == "stop" and child.state == "running" and s.running == [child]
    assert len(child.pages) * 4 >= child.num_tokens  # its pages, all of them
    assert s.postprocess([child], [8]) == [] and s.postprocess([child], [9]) == [child]
    assert child.output_ids == [7, 8, 9] and child.finish_reason == "length"
    assert s.is_idle() and alloc.num_free == alloc.num_pages
    alloc.check_integrity()


@pytest.fixture(scope="module")
def engine(tiny_checkpoints):
    path = str(tiny_checkpoints[("glm_moe_dsa", "make-model")])
    worker = DecodeWorkerConfig(
        path, num_slots=512, dcp_size=2, index_mode="split", dtype="float64", float32_islands=False
    )
    with DecodeInstance(worker, LaunchConfig(2, free_port()), page_size=4) as inst:
        yield DecodeStepDriver(inst, max_batch=16)


@pytest.mark.slow
def test_continuous_batching_matches_single_rank_generate(tiny_checkpoints, engine):
    single = LLMEngine.from_pretrained(
        tiny_checkpoints[("glm_moe_dsa", "make-model")], "float64", float32_islands=False, max_kv_tokens=512
    )
    prompts = [[5 + i] * (3 + 7 * i) for i in range(5)]
    params = [SamplingParams(max_tokens=4 + 3 * i, ignore_eos=True) for i in range(5)]
    want = [single.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    reqs = [engine.submit(p, sp) for p, sp in zip(prompts[:2], params[:2])]
    engine.step()
    engine.step()
    reqs += [engine.submit(p, sp) for p, sp in zip(prompts[2:], params[2:])]  # join a running batch
    engine.run_until_idle()
    assert [r.output_ids for r in reqs] == want
    assert all(r.finish_reason == "length" for r in reqs)


@pytest.mark.slow
def test_rank0_samples_as_the_cpu_sampler(engine):
    """Every decode token rank 0 sampled (seeded temperature / top-k / top-p, penalties, logit_bias,
    min_tokens, a grammar's mask, logprobs) is the one Sampler.sample_row gives from the logits rank
    0 returned beside it (keep_logits), with the same logprobs; then rank 0 holds no generator."""
    mcfg = engine.instance.model_config
    eos = mcfg.eos_token_ids
    grammar = grammar_for("regex", "[a-z]{10,20}")
    sp = lambda **kw: SamplingParams(max_tokens=6, ignore_eos=True, **kw)  # noqa: E731
    prompts = [list(range(20, 31)), [9] * 5, list(range(40, 47)), [3, 4, 5]]
    params = [
        sp(temperature=0.9, seed=3, logprobs=2, presence_penalty=0.4, repetition_penalty=1.3,
           prompt_ids=tuple(prompts[0])),
        sp(logprobs=0, logit_bias=((17, 4.0),)),
        sp(temperature=1.0, seed=4, logprobs=1, grammar=grammar),
        sp(temperature=0.7, top_k=20, top_p=0.8, seed=5, min_tokens=4, stop_token_ids=(8,)),
    ]  # fmt: skip
    ref = Sampler(Grammars(engine.instance.worker.model_dir, mcfg.vocab_size, eos), eos)
    engine.keep_logits = True
    try:
        reqs = {r.request_id: r for r in (engine.submit(ids, p) for ids, p in zip(prompts, params))}
        checked = 0
        while not engine.scheduler.is_idle():
            engine.step()
            for rid, logits in engine.last_logits.items():
                req = reqs[rid]
                before = req.output_ids[:-1]  # this step's token is the last one
                token, lp = ref.sample_row(logits, req.params, rid, before)
                assert req.output_ids[-1] == token, (rid, len(before))
                assert lp is None or req.logprobs[len(before)] == lp, (rid, len(before))
                checked += 1
    finally:
        engine.keep_logits = False
    assert checked == 4 * 5 and all(r.finish_reason == "length" for r in reqs.values())
    assert engine.instance.sampling_streams() == []


@pytest.mark.slow
def test_n_choices_share_one_prompt_cache_and_equal_separate_requests(engine):
    """One prefill for n choices: choice i (its prompt rows copied into its own pages) samples exactly
    as a separate request with seed + i; every page and generator is released, after an abort too."""
    prompt = [7, 8, 9, 10, 11, 12, 13]  # 7 tokens: the last page is partly filled
    base = SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True, logprobs=2)
    alloc = engine.instance.allocator
    parent = engine.submit(prompt, dataclasses.replace(base, n=3))
    engine.run_until_idle()
    choices = [parent, *parent.children]
    singles = [engine.submit(prompt, base.choice_params(i)) for i in range(3)]
    engine.run_until_idle()
    assert [c.output_ids for c in choices] == [s.output_ids for s in singles]
    assert len({tuple(c.output_ids) for c in choices}) == 3  # three seed streams
    for c, s in zip(choices, singles):
        assert [lp.logprob for lp in c.logprobs] == pytest.approx(
            [lp.logprob for lp in s.logprobs], abs=1e-10
        )
    parent = engine.submit(prompt, dataclasses.replace(base, n=4, max_tokens=20))
    engine.step()
    engine.step()
    assert len(parent.children) == 3 and all(c.state == "running" for c in parent.children)
    assert engine.abort(parent.request_id) is parent
    assert all(c.state == "aborted" for c in [parent, *parent.children])
    engine.run_until_idle()
    alloc.check_integrity()
    assert alloc.num_free == alloc.num_pages and not engine.sampler._generators
    assert engine.instance.sampling_streams() == []  # rank 0 dropped every choice's generator


@pytest.mark.slow
def test_500_requests_with_random_aborts_leave_the_allocator_idle(engine):
    rng = random.Random(0)
    alloc = engine.instance.allocator
    live: list[DecodeRequest] = []
    for i in range(500):
        n = rng.randint(1, 40)
        params = SamplingParams(max_tokens=rng.randint(1, 8), temperature=rng.choice([0.0, 1.0]), seed=i)
        live.append(engine.submit([rng.randint(4, 500) for _ in range(n)], params))
        if rng.random() < 0.3:
            engine.step()
        if live and rng.random() < 0.25:
            engine.abort(rng.choice(live).request_id)  # any state: queued, waiting, running, finished
        live = [r for r in live if r.state not in ("finished", "aborted")]
    engine.run_until_idle()
    alloc.check_integrity()
    assert alloc.num_free == alloc.num_pages
    assert not engine._caches and not engine.sampler._generators
    assert engine.instance.sampling_streams() == []


@pytest.mark.slow
def test_fp8_cache_decodes_with_one_byte_entries(tiny_checkpoints):
    from pdserve.kvcache.capacity import bytes_per_token_per_rank

    path = str(tiny_checkpoints[("glm_moe_dsa", "make-model")])
    worker = DecodeWorkerConfig(
        path, num_slots=256, dcp_size=2, index_mode="split", kv_cache_dtype="fp8_e4m3"
    )
    with DecodeInstance(worker, LaunchConfig(2, free_port()), page_size=4) as inst:
        cfg = inst.model_config
        per_token = bytes_per_token_per_rank(cfg, 2, "split", "fp8_e4m3", "float32")
        assert inst.rank_infos[0].cache_bytes == pytest.approx(per_token * 256, rel=1e-9)
        engine = DecodeStepDriver(inst)
        ids = list(range(5, 45))
        req = engine.submit(ids, SamplingParams(max_tokens=6, ignore_eos=True))
        engine.step()  # admitted with the fp8 cache, then one decode step
        single = LLMEngine.from_pretrained(path, max_kv_tokens=256)
        first = single.generate([ids], SamplingParams(max_tokens=1, ignore_eos=True))[0]
        assert req.output_ids[0] == first[0]  # the first token comes from the (unquantized) prefill
        engine.run_until_idle()
        assert len(req.output_ids) == 6 and req.finish_reason == "length"


@pytest.mark.slow
def test_a_compiling_grammar_holds_only_its_own_request(engine, monkeypatch, request):
    """Issue 40 item 1: a request whose grammar compiles (in the background, engine/constraint.py)
    sits the steps out while the others decode; once compiled it decodes within its grammar.
    The compile is held until the other request has finished: how long a compile takes against
    four decode steps depends on the machine (an idle fast core compiled this schema first)."""
    grammar = grammar_for("json_schema", big_schema(3000))
    grammars, release = engine.sampler.grammars, threading.Event()
    compile_now = grammars._compile

    def held_compile(g):
        assert release.wait(60), "the test never released the compile"
        return compile_now(g)

    monkeypatch.setattr(grammars, "_compile", held_compile)
    request.addfinalizer(release.set)  # a failure below never leaves the compile thread waiting
    model_dir = engine.instance.worker.model_dir
    tok = Tokenizer.from_pretrained(model_dir)
    (brace,) = tok.encode('{"')  # the token the grammar allows first (an object with required keys)
    prompt = [5, 6, 7, 8]
    kv, index = engine._local_prefill().prefill_with_cache(prompt)[1:]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=2, grammar=grammar)
    slow = engine.submit(prompt, params, cache=(kv, index, brace))
    other = engine.submit([9, 10, 11], SamplingParams(max_tokens=4, ignore_eos=True))
    for _ in range(20):
        engine.step()
        if other.state == "finished":
            break
    assert other.state == "finished" and len(other.output_ids) == 4
    assert slow.output_ids == [brace], "the request with a compiling grammar was stepped"
    release.set()
    engine.run_until_idle()
    assert slow.state == "finished" and len(slow.output_ids) > 1, slow.error
    matcher = Grammars(model_dir, tok.vocab_size, tok.eos_token_ids).matcher(grammar)
    for t in slow.output_ids:
        if t not in tok.eos_token_ids:
            assert bool(matcher.allowed()[t]), (t, tok.decode(slow.output_ids))
            matcher.consume(t)
