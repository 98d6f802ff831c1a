"""Issue 14: a short request alone in a batch, and a failure in one request, stay their own size
(docs/design.md invariants 2 and 9), over real rank processes.

- Regression: a 1-token prompt alone in the batch at C_d = 3 and 4 (copy and split index) used to
  raise on the ranks that own no position yet (`arange(me, smax, C)`, then `gather` on a zero-size
  dimension) and take the whole instance down. It now decodes the single-rank engine's tokens
  (float64, logits within 1e-8) and the instance stays healthy.
- An injected exception in one request's decode step (runtime/faults.py, a test-only hook that the
  last rank raises after its forward) fails only that request, with its message, through the
  server's DecodeLoop; the other requests finish with exact tokens and the instance keeps serving.
- The prefill side: a job whose prefill raises on the ranks (CommandFailed) fails alone; the next
  job on the same instance succeeds.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import torch

from pdserve.decode_server.instance import DecodeInstance
from pdserve.decode_server.loop import DecodeLoop
from pdserve.decode_server.step_driver import DecodeStepDriver
from pdserve.decode_server.worker_config import DecodeWorkerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.prefill_server.instance import PrefillInstance
from pdserve.prefill_server.scheduler import PrefillJob, PrefillScheduler
from pdserve.prefill_server.worker_config import PrefillWorkerConfig
from pdserve.request import SamplingParams
from pdserve.runtime.faults import FAULT_ENV
from pdserve.runtime.launcher import LaunchConfig
from pdserve.serving.instance_loop import Failed, Finished, Token
from tests.reference import assert_close, free_port

pytestmark = pytest.mark.slow
TOKENS = 12
FAULTY = "fault-me"


@pytest.fixture(scope="module")
def path(heads12_checkpoints):
    return str(heads12_checkpoints["glm_moe_dsa"])


@pytest.fixture(scope="module")
def single(path):
    return LLMEngine.from_pretrained(path, "float64", float32_islands=False, max_kv_tokens=256)


def start_decode(path: str, w: int, c: int, monkeypatch) -> DecodeStepDriver:
    monkeypatch.setenv(FAULT_ENV, FAULTY)  # the ranks inherit it; only this request id is hit
    cfg = DecodeWorkerConfig(path, num_slots=240, dcp_size=c, dtype="float64", float32_islands=False)
    return DecodeStepDriver(DecodeInstance(cfg, LaunchConfig(w, free_port()), page_size=c).start())


@pytest.mark.parametrize("c", [3, 4])
def test_one_token_prompt_alone_decodes_exactly(path, single, monkeypatch, c):
    engine = start_decode(path, c, c, monkeypatch)
    inst = engine.instance
    try:
        ids = [77]
        want = single.generate([ids], SamplingParams(max_tokens=TOKENS, ignore_eos=True))[0]
        want_logits = single.prefill_logits(ids + want[:-1])[len(ids) :]
        for index_mode in ("copy", "split"):
            inst.reconfigure(index_mode, "a2a" if index_mode == "copy" else "ag_rs")
            logits, kv, index = single.prefill_with_cache(ids)
            pages = inst.allocator.allocate(len(ids) + TOKENS)
            inst.load(pages, kv, index)
            seq = ids + [int(logits.argmax())]
            got = []
            for _ in range(TOKENS - 1):  # alone in the batch from its first decode step (context 2)
                row = inst.step([seq[-1]], [pages], [len(seq)])[0]
                got.append(row)
                seq.append(int(row.argmax()))
            inst.allocator.free(pages)
            assert seq[len(ids) :] == want, f"C_d={c} {index_mode}"
            assert_close(torch.stack(got), want_logits, f"C_d={c} {index_mode} logits")
            assert inst.ranks.unhealthy() is None
        # and through the engine, still alone: the request finishes, the instance stays healthy
        req = engine.submit(ids, SamplingParams(max_tokens=TOKENS, ignore_eos=True))
        engine.run_until_idle()
        assert req.output_ids == want and inst.ranks.unhealthy() is None
        assert sum(r.empty_selections for r in inst.rank_info()) > 0  # some rank really was empty
    finally:
        inst.shutdown()


def run_loop(
    engine: DecodeStepDriver, requests: dict[str, list[int]], params: dict[str, SamplingParams] | None = None
) -> dict[str, list]:
    """Submits every request to a running DecodeLoop (greedy unless `params` names it); returns each
    request's events once it ended."""
    loop = DecodeLoop(engine, on_fatal=lambda msg: pytest.fail(f"the instance stopped: {msg}"))
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    events: dict[str, list] = {rid: [] for rid in requests}
    ended = {rid: Future() for rid in requests}

    def listener(rid):
        def on(ev):
            events[rid].append(ev)
            if isinstance(ev, (Finished, Failed)):
                ended[rid].set_result(None)

        return on

    try:
        for rid, ids in requests.items():
            p = (params or {}).get(rid, SamplingParams(max_tokens=TOKENS, ignore_eos=True))
            loop.submit(ids, p, rid, listener(rid)).result(60)
        for f in ended.values():
            f.result(120)
    finally:
        loop.stop()
        thread.join(30)
    return events


def test_injected_fault_fails_only_its_request(path, single, monkeypatch):
    engine = start_decode(path, 4, 2, monkeypatch)
    try:
        prompts = {
            "short": [5],
            "mid": list(range(10, 19)),
            "seeded": list(range(100, 110)),  # running when FAULTY's first step fails the batch
            FAULTY: list(range(30, 50)),
            "long": list(range(60, 90)),
        }
        seeded = {"seeded": SamplingParams(max_tokens=TOKENS, ignore_eos=True, temperature=1.0, seed=7)}
        events = run_loop(engine, prompts, seeded)
        last = events[FAULTY][-1]
        assert isinstance(last, Failed) and "injected fault" in last.message, events[FAULTY]
        for rid, ids in prompts.items():
            if rid in (FAULTY, "seeded"):
                continue
            want = single.generate([ids], SamplingParams(max_tokens=TOKENS, ignore_eos=True))[0]
            assert events[rid][-1] == Finished("length"), (rid, events[rid][-3:])
            assert [e.token for e in events[rid] if isinstance(e, Token)] == want, rid
        alloc = engine.instance.allocator
        assert engine.scheduler.is_idle() and alloc.num_free == alloc.num_pages
        assert engine.instance.ranks.unhealthy() is None
        again = run_loop(engine, {"after": [5]})  # the instance keeps serving
        assert again["after"][-1] == Finished("length")
        # the seeded request's batch failed and was re-run request by request: rank 0 redrew the
        # tokens it had drawn (its generator rewinds), so it samples as it does alone
        alone = run_loop(engine, {"seeded": prompts["seeded"]}, seeded)
        tokens = lambda evs: [e.token for e in evs if isinstance(e, Token)]  # noqa: E731
        assert tokens(events["seeded"]) == tokens(alone["seeded"]) and len(tokens(alone["seeded"])) == TOKENS
        assert engine.instance.sampling_streams() == []
    finally:
        engine.instance.shutdown()


def test_prefill_job_failure_stays_its_own(path, single, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, FAULTY)
    worker = PrefillWorkerConfig(path, num_slots=256, dtype="float64", float32_islands=False)
    with PrefillInstance(worker, LaunchConfig(2, free_port()), page_size=4) as inst:
        sched = PrefillScheduler(inst)
        bad = sched.submit(PrefillJob([1, 2, 3], request_id=FAULTY))
        good = sched.submit(PrefillJob([7, 8, 9, 10], request_id="fine"))
        deadline = time.monotonic() + 60
        while good.state not in ("done", "failed"):
            sched.run_once()
            assert time.monotonic() < deadline
        assert bad.state == "failed" and "CommandFailed" in bad.error and "injected fault" in bad.error, (
            bad.error
        )
        assert good.state == "done" and good.first_token == int(
            single.prefill_logits([7, 8, 9, 10])[-1].argmax()
        )
        assert inst.ranks.unhealthy() is None and not inst.held
        assert inst.allocator.num_free == inst.allocator.num_pages
