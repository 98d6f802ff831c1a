"""No leak with prefix caches (docs/design.md invariant 7): 500 requests with random shared prefixes
(a few system prompts, conversations that come back with their history), failed prefills, aborts
in every decode state (some with the quarantine hold), failed and finished requests, several at a
time on small pools so that the caches evict. The bookkeeping is the production one -- a
`PrefillInstance` and a `DecodeStepDriver` with their page allocators and radix trees -- with the rank
processes replaced by an in-process stand-in (no tensors: the equality tests cover the values), so
it can afford 500 requests in a second; tests/transfer/test_prefix_handoff.py runs the mixed-fault
loop with prefix caches through the production ranks (both models, NIXL and TCP).

Checked throughout: every cached prefix a request is given holds exactly the tokens it stands for
(pages are tracked by what was written into them). At the end: every page is free or cached and
unreferenced on both sides, and flushing the caches returns them all.
"""

from __future__ import annotations

import random
import time

import pytest

from pdserve.decode_server.instance import DecodeInstance
from pdserve.decode_server.step_driver import DecodeStepDriver
from pdserve.decode_server.worker_config import DecodeWorkerConfig
from pdserve.kvcache.page_allocator import OutOfPages
from pdserve.prefill_server.instance import PrefillInstance
from pdserve.prefill_server.rank_worker import PrefillCmd, PrefillRankReply
from pdserve.prefill_server.worker_config import PrefillWorkerConfig
from pdserve.request import SamplingParams
from pdserve.runtime.launcher import CommandFailed, LaunchConfig

PS = 4  # ranks never start: the launch configs name an unused port


class StandInRanks:
    """Answers PrefillCmd like a one-rank group, recording what each slot holds; fails on request."""

    def __init__(self, content: dict[int, int]):
        self.content, self.fail_next = content, False

    def call(self, cmd):
        assert isinstance(cmd, PrefillCmd)
        for p in range(cmd.cached_len):  # the cached prefix holds exactly these tokens
            assert self.content.get(cmd.slots[p]) == cmd.token_ids[p], f"{cmd.request_id}: stale page"
        if self.fail_next:
            self.fail_next = False
            raise CommandFailed("rank 0: injected failure", "")
        for p in range(cmd.cached_len, len(cmd.token_ids)):
            self.content[cmd.slots[p]] = cmd.token_ids[p]
        return [PrefillRankReply(0, token=7)]


def make_sides(model_path: str):
    pw = PrefillWorkerConfig(model_path, num_slots=40 * PS, dtype="float64")
    prefill = PrefillInstance(pw, LaunchConfig(1, 1), page_size=PS, prefix_cache=True)
    prefill.ranks = StandInRanks({})
    dw = DecodeWorkerConfig(model_path, num_slots=60 * PS, dcp_size=2, index_mode="split", dtype="float64")
    decode = DecodeStepDriver(DecodeInstance(dw, LaunchConfig(2, 1), page_size=PS, prefix_cache=True))
    return prefill, decode


class Live:
    """One request on the decode side, with the slots it wrote (for the content check)."""

    def __init__(self, rid: str, ids: list[int], max_tokens: int):
        self.rid, self.ids, self.max_tokens = rid, ids, max_tokens


def test_500_requests_leave_only_cached_pages(model_path):
    rng = random.Random(0)
    prefill, decode = make_sides(model_path)
    sched, dalloc, dcache = decode.scheduler, decode.instance.allocator, decode.instance.cache
    content: dict[int, int] = {}  # decode slot -> the token whose rows it holds
    systems = [[rng.randrange(4, 500) for _ in range(n)] for n in (6, 13, 24, 37)]
    history: list[list[int]] = []  # finished conversations (prompt + output) that may come back
    live: list[Live] = []
    outcomes = dict.fromkeys(("prefill failed", "abort queued", "abort waiting", "failed", "finished"), 0)

    def slots(req, n):
        return dalloc.slots(req.pages, 0, n)

    def step_decode(finish: bool = False):
        """Admit, then move one random live request forward to its end (`finish`: no abort, no failure)."""
        for req in sched.admit():
            for p, s in enumerate(slots(req, req.cached_len)):
                assert content.get(s) == req.prompt_ids[p], f"{req.request_id}: stale decode page"
        if not live:
            return
        lv = live.pop(rng.randrange(len(live)))
        req = next(
            (r for r in [*sched.queued, *sched.waiting_for_kv.values()] if r.request_id == lv.rid), None
        )
        if req.state == "queued" and not finish:
            assert decode.abort(lv.rid) is req
            outcomes["abort queued"] += 1
            return
        draw = 1.0 if finish else rng.random()
        if draw < 0.15:  # a failed hand-off: the pages are held for the quarantine
            decode.abort(lv.rid, hold_s=rng.choice([0.0, 0.02]))
            outcomes["abort waiting"] += 1
            return
        for p, s in enumerate(slots(req, req.prompt_len)):  # the hand-off writes past the cached prefix
            if p >= req.cached_len:
                content[s] = req.prompt_ids[p]
        decode.kv_ready(lv.rid, rng.randrange(4, 500))
        while req.state == "running":
            if draw < 0.25:
                sched.fail(req, "injected")
                outcomes["failed"] += 1
                return
            content[slots(req, req.num_tokens)[-1]] = req.output_ids[-1]  # the step writes the fed token
            sched.postprocess([req], [rng.randrange(4, 500)])
        outcomes["finished"] += 1
        history.append(req.prompt_ids + req.output_ids)

    def submit(i: int, may_fail: bool = True) -> None:
        if history and rng.random() < 0.4:  # a conversation comes back with its history
            ids = rng.choice(history) + [rng.randrange(4, 500) for _ in range(rng.randint(1, 9))]
        else:
            ids = rng.choice(systems) + [rng.randrange(4, 500) for _ in range(rng.randint(0, 12))]
        ids = ids[:100]  # keep within both pools
        rid = f"r{i}"
        prefill.ranks.fail_next = rng.random() < 0.05 and may_fail
        try:
            prefill.prefill(rid, ids)
        except CommandFailed:
            outcomes["prefill failed"] += 1
            return
        except OutOfPages:
            pytest.fail("the prefill pool ran out with one request at a time")
        prefill.release(rid)
        prefill.check_idle()
        max_tokens = rng.randint(1, 6)
        decode.submit_remote(len(ids), SamplingParams(max_tokens=max_tokens, ignore_eos=True), rid, ids)
        live.append(Live(rid, ids, max_tokens))

    for i in range(500):
        submit(i)
        while len(live) > rng.randint(0, 4):
            step_decode()
    while live:
        step_decode()
    assert all(outcomes.values()), outcomes
    assert prefill.cache.hit_tokens > 0 and dcache.hit_tokens > 0 and dcache.evicted_pages > 0
    assert sched.is_idle() and dcache.protected_pages == 0
    dcache.check_integrity()
    deadline = time.monotonic() + 5
    while dalloc.num_held:  # the quarantine holds expire
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # How much the decode cache still holds depends on when the holds expired (they decide what was
    # evicted); one last conversation run to its end makes sure both caches hold pages to flush.
    submit(500, may_fail=False)
    finished = outcomes["finished"]
    step_decode(finish=True)
    assert outcomes["finished"] == finished + 1 and not live
    dalloc.check_integrity()
    assert dalloc.num_free + dcache.cached_pages == dalloc.num_pages
    assert prefill.flush_cache() > 0 and decode.instance.flush_cache() > 0
    cap = prefill.capacity()
    assert cap["free_tokens"] == cap["total_tokens"] and dalloc.num_free == dalloc.num_pages
