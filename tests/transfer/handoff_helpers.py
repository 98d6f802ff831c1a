"""Helpers of the hand-off tests over real rank processes (test_tcp_handoff.py, test_nixl_handoff.py)."""

from __future__ import annotations

import time

import torch

from pdserve.decode_server.instance import DecodeInstance
from pdserve.decode_server.step_driver import DecodeStepDriver
from pdserve.decode_server.worker_config import DecodeWorkerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.prefill_server.instance import PrefillInstance
from pdserve.prefill_server.worker_config import PrefillWorkerConfig
from pdserve.request import SamplingParams
from pdserve.runtime.launcher import LaunchConfig
from tests.reference import assert_close, free_port
from tests.transfer.handoff_driver import hand_off

PROMPT_LENGTHS = (1, 9, 23)  # one token, index_topk + 1, not a multiple of any C or page size
MAX_TOKENS = 12  # every context passes index_topk + 1 while decoding (long decodes: test_dcp_equality.py)
QUARANTINE_S = 1.5  # test decode instances: pages of a room dropped mid-send stay unused this long


class Instances:
    """Started on first use, one per (data path, shape); `close` shuts them down."""

    def __init__(self, path: str):
        self.path, self.prefill, self.decode = path, {}, {}

    def get_prefill(self, cp: int, cache: str, transfer: str = "tcp") -> PrefillInstance:
        if (transfer, cp, cache) not in self.prefill:
            w = PrefillWorkerConfig(
                self.path,
                num_slots=512,
                dtype="float64",
                cache=cache,
                query_block=16,
                float32_islands=False,
                transfer=transfer,
            )
            self.prefill[transfer, cp, cache] = PrefillInstance(w, LaunchConfig(cp, free_port())).start()
        return self.prefill[transfer, cp, cache]

    def get_decode(self, w: int, c: int, index_mode: str, transfer: str = "tcp") -> DecodeStepDriver:
        if (transfer, w, c) not in self.decode:
            cfg = DecodeWorkerConfig(
                self.path,
                num_slots=256,
                dcp_size=c,
                index_mode=index_mode,
                dtype="float64",
                float32_islands=False,
                transfer=transfer,
                transfer_quarantine_s=QUARANTINE_S,
            )
            inst = DecodeInstance(cfg, LaunchConfig(w, free_port()), page_size=4)
            self.decode[transfer, w, c] = DecodeStepDriver(inst.start())
        engine = self.decode[transfer, w, c]
        if engine.instance.index_mode != index_mode:
            engine.instance.reconfigure(index_mode, "a2a")
        return engine

    def close(self, transfer: str | None = None) -> None:
        """Shuts down the instances of one data path (default: all)."""
        for table in (self.prefill, self.decode):
            for key in [k for k in table if transfer in (None, k[0])]:
                inst = table.pop(key)
                (inst.instance if isinstance(inst, DecodeStepDriver) else inst).shutdown()


HELD_RECV = ("staging_bytes", "quarantined")  # a receiver's counters of what an idle one holds none of
HELD_SEND = ("xfer_handles", "stuck", "staging_bytes")  # ... and a sender's


def prompt(n: int) -> list[int]:
    return torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def assert_idle(prefill: PrefillInstance, decode: DecodeStepDriver, wait_s: float = 5.0) -> None:
    """Pages, held requests and every data-path counter are back at idle (receivers store what is
    already notified on their own threads, hence the short wait)."""
    assert not prefill.held and prefill.allocator.num_free == prefill.allocator.num_pages
    prefill.allocator.check_integrity()
    assert_decode_idle(decode, wait_s, prefill)


def assert_decode_idle(
    decode: DecodeStepDriver, wait_s: float = 5.0, prefill: PrefillInstance | None = None
) -> None:
    """The decode side of assert_idle (and the prefill's senders, when given)."""
    alloc = decode.instance.allocator
    assert decode.scheduler.is_idle()
    alloc.check_integrity()
    deadline = time.monotonic() + wait_s
    while alloc.num_free != alloc.num_pages:  # pages held after a failure come back after QUARANTINE_S
        assert time.monotonic() < deadline, (
            f"{alloc.num_held} pages held, {alloc.num_free} of {alloc.num_pages} free"
        )
        time.sleep(0.05)
    while True:
        recv = decode.instance.transfer_status("none")
        send = prefill.transfer_status() if prefill is not None else []
        busy = [s for s in recv if s.counters["open_rooms"] or any(s.counters.get(k) for k in HELD_RECV)]
        busy += [s for s in send if any(s.counters.get(k) for k in HELD_SEND)]
        if not busy:
            break
        assert time.monotonic() < deadline, f"not idle: receivers {recv}, senders {send}"
        time.sleep(0.01)
    assert all(
        s.counters.get("registered_regions", 1) == 1 for s in recv + send
    )  # registered once, never again


def check_handoffs(prefill: PrefillInstance, decode: DecodeStepDriver, single: LLMEngine, tag: str) -> None:
    """Hands off prompts of PROMPT_LENGTHS: rows exact (check_rows), MAX_TOKENS greedy tokens equal the
    single-rank engine's, both sides idle afterwards."""
    for n in PROMPT_LENGTHS:
        ids, what = prompt(n), f"{tag} n={n}"
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        want = single.generate([ids], [params])[0]
        rows = prefill_rows_of(prefill, ids)
        before = time.monotonic()
        req = hand_off(prefill, decode, ids, params)
        for s in prefill.transfer_status():  # each sender's clock of its send (bench/transfer.py)
            c = s.counters
            assert before <= c["last_send_began"] <= c["last_send_ended"] <= time.monotonic(), (what, s)
        check_rows(prefill, decode, single, ids, req.pages, rows, what)
        decode.run_until_idle()
        assert req.output_ids == want, what
        assert_idle(prefill, decode)


def check_rows(
    prefill: PrefillInstance,
    decode: DecodeStepDriver,
    single: LLMEngine,
    ids: list[int],
    pages: list[int],
    prefill_rows: dict | None,
    tag: str,
) -> None:
    """Every decode rank stores exactly the prefill's rows of its tokens (prefill_rows None: rows a
    prefix cache held, not bit-compared), which match the single-rank engine."""
    _, want_kv, want_index = single.prefill_with_cache(ids)
    inst, n = decode.instance, len(ids)
    slots, C = inst.slots(pages, n), inst.worker.dcp_size
    copy = inst.index_mode == "copy"
    for rank, dump in enumerate(inst.dump(slots)):
        own = [p for p in range(n) if slots[p] % C == rank % C]
        assert dump.slots == [slots[p] for p in own], f"{tag} rank {rank} slots"
        for layer, rows in dump.kv.items():
            if prefill_rows is not None:
                assert torch.equal(rows, prefill_rows[layer][0][own]), (
                    f"{tag} rank {rank} layer {layer} latent"
                )
            assert_close(rows, want_kv[layer][own], f"{tag} rank {rank} layer {layer} latent vs single")
        for layer, keys in dump.index.items():
            pos = list(range(n)) if copy else own
            if prefill_rows is not None:
                assert torch.equal(keys, prefill_rows[layer][1][pos]), (
                    f"{tag} rank {rank} layer {layer} index"
                )
            assert_close(keys, want_index[layer][pos], f"{tag} rank {rank} layer {layer} index vs single")


def prefill_rows_of(prefill: PrefillInstance, ids: list[int]) -> dict:
    """The prefill instance's own cache rows of this prompt (from whichever rank holds each layer)."""
    res = prefill.prefill("peek", ids)
    rows = {}
    for dump in prefill.dump_cache(res.slots):
        rows.update(dump)
    prefill.release("peek")
    return rows
