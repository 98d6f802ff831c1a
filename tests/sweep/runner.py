"""Runs drawn sweep cases through the whole path: prefill instance -> KV hand-off (TCP or NIXL)
-> decode instance (real rank processes), driving both in-process as the hand-off tests do.

`PairRunner(pair, path).run(case)` hands off every request of the case, decodes them together
with `DecodeStepDriver.step` until all finished, and returns per request its output tokens, the logits
of every decode step and every step's selected positions (rank 0's; every rank must agree).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.decode_server.instance import DecodeInstance
from pdserve.decode_server.step_driver import DecodeStepDriver
from pdserve.decode_server.worker_config import DecodeWorkerConfig
from pdserve.prefill_server.instance import PrefillInstance
from pdserve.prefill_server.worker_config import PrefillWorkerConfig
from pdserve.request import SamplingParams
from pdserve.runtime.launcher import LaunchConfig
from tests.reference import free_port
from tests.sweep.draw import Case, Pair
from tests.transfer.handoff_driver import Driver

SLOTS = 480  # decode slots: five requests of <= 70 + 40 tokens, a multiple of every page size drawn


@dataclass
class Got:
    tokens: list[int]
    logits: list[torch.Tensor] = field(default_factory=list)  # one [vocab] per decode step
    selections: list[dict[int, torch.Tensor]] = field(default_factory=list)  # per step: layer -> [k]


class PairRunner:
    def __init__(self, pair: Pair, path: str):
        self.pair, self.path = pair, path
        pw = PrefillWorkerConfig(
            path,
            num_slots=512,
            dtype=pair.dtype,
            layout=pair.layout,
            cache=pair.cache,
            moe_tp=pair.moe_tp,
            moe_ep=pair.prefill_ep,
            query_block=16,
            float32_islands=pair.islands,
            transfer=pair.transfer,
        )
        dw = DecodeWorkerConfig(
            path,
            num_slots=SLOTS,
            dcp_size=pair.c,
            replicate_q=pair.replicate_q,
            moe_ep=pair.decode_ep,
            dtype=pair.dtype,
            kv_cache_dtype=pair.kv_cache_dtype,
            float32_islands=pair.islands,
            transfer=pair.transfer,
            transfer_quarantine_s=1.0,
        )
        self.driver: Driver | None = None  # the hand-off machines' side channel, opened on first use
        self.decode: DecodeStepDriver | None = None
        self.prefill = PrefillInstance(pw, LaunchConfig(pair.cp, free_port()), page_size=4)
        try:
            self.prefill.start()
            # the decode group's rendezvous port is picked only now: a free port picked before the
            # prefill ranks started could be taken by one of their own sockets meanwhile (seen in CI:
            # "Address already in use" on the decode's rank 0)
            self.decode = DecodeStepDriver(
                DecodeInstance(dw, LaunchConfig(pair.w, free_port()), page_size=pair.page_size),
                keep_logits=True,  # each step's logits are checked against the single-rank engine's
            )
            self.decode.instance.start()
        except BaseException:
            self.close()
            raise
        self.sparse = self.decode.instance.model_config.is_sparse
        self.mode = (dw.index_mode, dw.comm)

    def close(self) -> None:
        if self.driver is not None:
            self.driver.close()
        self.prefill.shutdown()
        if self.decode is not None:
            self.decode.instance.shutdown()

    def run(self, case: Case, prompts: list[list[int]], tag: str) -> list[Got]:
        if self.mode != (case.index_mode, case.comm):  # switched on the running ranks (clears the idle cache)
            self.decode.instance.reconfigure(case.index_mode, case.comm)
            self.mode = (case.index_mode, case.comm)
        self.prefill.chunk_size = case.chunk
        reqs = []
        for i, (ids, mt) in enumerate(zip(prompts, case.max_tokens)):
            params = SamplingParams(max_tokens=mt, ignore_eos=True)
            self.driver = self.driver or Driver(self.prefill, self.decode)
            reqs.append(self.driver.hand_off(ids, params, room=f"{tag}-r{i}"))
        got = {r.request_id: Got([]) for r in reqs}
        while not self.decode.scheduler.is_idle():
            batch = list(self.decode.scheduler.running)
            events = self.decode.step()
            failed = [(r.request_id, r.error) for r, _ in events if r.state == "failed"]
            assert not failed, f"{tag}: requests failed: {failed}"
            sels = self._selections(len(batch), tag) if self.sparse else None
            for b, r in enumerate(batch):
                got[r.request_id].logits.append(self.decode.last_logits[r.request_id])
                if sels is not None:
                    got[r.request_id].selections.append({layer: s[b] for layer, s in sels.items()})
        for r in reqs:
            got[r.request_id].tokens = list(r.output_ids)
        self.check_idle(tag)
        return [got[r.request_id] for r in reqs]

    def _selections(self, batch: int, tag: str) -> dict[int, torch.Tensor]:
        """Rank 0's selections of the last step; every rank selected the same positions."""
        every = self.decode.instance.selections()
        for rank, sel in enumerate(every[1:], 1):
            for layer, s in sel.items():
                assert torch.equal(s, every[0][layer]), (
                    f"{tag}: rank {rank} layer {layer} selects differently"
                )
        assert all(s.shape[0] == batch for s in every[0].values())
        return every[0]

    def reset(self) -> None:
        """After a failed case: every request on either side is dropped (shrinking reruns on these instances)."""
        s = self.decode.scheduler
        for req in list(s.queued) + list(s.waiting_for_kv.values()) + list(s.running):
            self.decode.abort(req.request_id)
        for rid in list(self.prefill.held):
            self.prefill.release(rid)

    def check_idle(self, tag: str) -> None:
        alloc, palloc = self.decode.instance.allocator, self.prefill.allocator
        assert self.decode.scheduler.is_idle() and not self.prefill.held, tag
        assert palloc.num_free == palloc.num_pages, f"{tag}: prefill pages leaked"
        assert alloc.num_free + alloc.num_held == alloc.num_pages, f"{tag}: decode pages leaked"
