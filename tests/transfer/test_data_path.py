"""The data path shared by both backends: packing rows into a payload, storing a payload into the
pool (run by run for a few runs, one indexed copy for many) and the checksum taken on both ends.

Rows are checked against their source rows in float64 (exact), over layouts with a few long
strided runs (a DCP destination) and with hundreds of two-row runs (shuffled small pages)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from pdserve.engine.kv_cache import KVPool
from pdserve.model.config import ModelConfig
from pdserve.transfer.base import RoomChecksum, row_digest
from pdserve.transfer.frames import new_ticket
from pdserve.transfer.nixl import NixlReceiver
from pdserve.transfer.nixl_send import NixlSender
from pdserve.transfer.plan import DecodeSide, PrefillSide, plan_transfer
from pdserve.transfer.rank_commands import (
    ExpectCmd,
    ForgetCmd,
    SendCmd,
    StageCmd,
    TransferStatusCmd,
    merge_checksums,
)
from pdserve.transfer.room import SLICE_RUNS, RoomSlots
from pdserve.transfer.tcp import (
    TcpReceiver,
    TcpSender,
)


# ---- the checksum ------------------------------------------------------------------------------------
def checksum(*chunks: torch.Tensor) -> int:
    c = RoomChecksum()
    for rows in chunks:
        c.update(0, 3, "kv", rows)
    return c.value()


def test_every_flipped_bit_changes_the_checksum():
    rows = torch.randn(6, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want = checksum(rows)
    raw = rows.view(torch.uint8).view(-1)
    for byte in range(0, raw.numel(), 7):
        for bit in (0, 3, 7):
            raw[byte] ^= 1 << bit
            assert checksum(rows) != want, (byte, bit)
            raw[byte] ^= 1 << bit
    assert checksum(rows) == want


def test_moved_dropped_or_repeated_rows_change_the_checksum():
    rows = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    want = checksum(rows)
    assert checksum(rows[[1, 0, 2, 3, 4, 5, 6, 7]]) != want
    assert checksum(rows[:7]) != want
    assert checksum(torch.cat([rows, rows[-1:]])) != want


def test_the_checksum_depends_on_the_rows_only():
    """Split into chunks at any row, or read from an unaligned view: the same value."""
    rows = torch.randn(9, 20, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
    want = checksum(rows)
    assert checksum(rows[:4], rows[4:]) == checksum(rows[:1], rows[1:8], rows[8:]) == want
    buf = torch.zeros(rows.numel() * 2 + 2, dtype=torch.uint8)
    unaligned = buf[2:].view(torch.bfloat16).view(9, 20)  # 2-byte aligned, rows of 40 bytes read as int64
    unaligned.copy_(rows)
    assert checksum(unaligned) == want
    assert row_digest(b"") == row_digest(torch.zeros(1, 0)) == bytes(8)


# ---- both backends, both store paths ---------------------------------------------------------------------
def layout(cfg: ModelConfig, kind: str, n: int = 300):
    """(PrefillSide, DecodeSide): 'dcp2' gives a few runs of source step 2 per transfer; 'fragmented'
    (shuffled pages of 2 slots) gives ~n/2 two-row runs, more than SLICE_RUNS."""
    prefill = PrefillSide(1, "full", cfg.num_layers, cfg.indexer_layers, range(40, 40 + n))
    if kind == "dcp2":
        return prefill, DecodeSide(2, 2, "copy", 4, range(n // 4 + 1))
    pages = list(range(n // 2 + 8))
    random.Random(0).shuffle(pages)
    return prefill, DecodeSide(1, 1, "copy", 2, pages)


@pytest.mark.parametrize("backend", ["tcp", "nixl", "nixl-region"])
@pytest.mark.parametrize("kind", ["dcp2", "fragmented"])
@pytest.mark.parametrize("residues", [1, 2])
def test_rows_arrive_exactly_and_the_checksums_agree(model_path, backend, kind, residues):
    """residues: the prefill pool's latent layout; with 2 (= C_d) a DCP destination's rows are
    contiguous in it, and NIXL sends them straight from the pool. NIXL WRITEs land in the decode
    pool ("nixl") or in a receive region the receiver copies from ("nixl-region", an fp8 pool's way)."""
    cfg = ModelConfig.from_pretrained(model_path)
    src = KVPool(cfg, 400, torch.float64, residues=residues)
    src.kv.normal_(generator=torch.Generator().manual_seed(3))
    src.index_k.normal_(generator=torch.Generator().manual_seed(4))
    prefill, decode = layout(cfg, kind)
    plan = plan_transfer(prefill, decode, 300)
    most_runs = max(len(t.runs) for t in plan)
    assert (most_runs > SLICE_RUNS) == (kind == "fragmented")  # both store paths are exercised
    ranks = range(decode.tp_size)
    dst = {r: KVPool(cfg, 400, torch.float64) for r in ranks}
    if backend == "tcp":
        recv = {r: TcpReceiver(r, lambda r=r: dst[r]) for r in ranks}
        sender = TcpSender(0, src)
    else:
        recv = {
            r: NixlReceiver(
                r,
                lambda r=r: dst[r],
                staging_bytes=4 << 20,
                name=f"test-path-d{r}-{kind}{residues}",
                direct=backend == "nixl",
            )
            for r in ranks
        }
        sender = NixlSender(
            0, src, staging_bytes=64 << 10, name=f"test-path-p-{kind}{residues}"
        )  # several chunks
    try:
        rows = {r: {} for r in ranks}
        for t in plan:
            rows[t.dst_rank][t.kind] = rows[t.dst_rank].get(t.kind, 0) + t.rows
        ticket, slots = (
            new_ticket(),
            RoomSlots.of(decode.pages, decode.page_size, decode.dcp_size, decode.index_mode),
        )
        endpoints = {r: recv[r].handle(StageCmd("room", ticket, rows))["endpoint"] for r in ranks}
        for r in ranks:
            recv[r].handle(ExpectCmd("room", ticket, {r: {0: sum(rows[r].values())}}, slots))
        reply = sender.send(SendCmd("room", ticket, plan, endpoints))
        assert reply["error"] is None, reply
        deadline = time.monotonic() + 10
        while not all(recv[r].handle(TransferStatusCmd("room"))["complete"] for r in ranks):
            assert time.monotonic() < deadline, [recv[r].handle(TransferStatusCmd("room")) for r in ranks]
            time.sleep(0.002)
        sums = merge_checksums([reply])
        for r in ranks:
            status = recv[r].handle(TransferStatusCmd("room"))
            assert status["error"] is None and status["checksum"] == sums[r]
        for t in plan:
            read_dst = dst[t.dst_rank].read_kv if t.kind == "kv" else dst[t.dst_rank].read_index
            read_src = src.read_kv if t.kind == "kv" else src.read_index
            for run in t.runs:
                got = read_dst(t.layer, torch.arange(run.dst, run.dst + run.length))
                assert torch.equal(got, read_src(t.layer, torch.tensor(list(run.src_rows())))), (
                    t.layer,
                    t.kind,
                    run,
                )
        if backend != "tcp":
            assert all(
                recv[r].handle(TransferStatusCmd("x"))["registered_pool"] == (2 if backend == "nixl" else 0)
                for r in ranks
            )
            row_bytes = {"kv": cfg.kv_entry_dim * 8, "index": cfg.index_head_dim * 8}
            sent = {k: sum(t.rows * row_bytes[k] for t in plan if t.kind == k) for k in row_bytes}
            status = sender.status()
            assert status["bytes_direct"] + status["bytes_packed"] == sum(sent.values())
            if kind == "fragmented":  # hundreds of two-row runs: packed, not one descriptor per run
                assert status["bytes_direct"] == 0
            else:  # the copied index is contiguous in the prefill pool; the latent rows when residues = C_d
                assert status["bytes_packed"] == (0 if residues == 2 else sent["kv"])
        for r in ranks:
            recv[r].handle(ForgetCmd("room", quiesced=True))
    finally:
        for r in ranks:
            recv[r].close()
        sender.close()


# ---- chunks out of order; rows checksummed from the pool's kept sums ---------------------------------------
def test_payloads_given_their_order_count_in_it_whatever_order_they_come():
    """A NIXL receiver checksums chunks as they land, which may not be the sent order: with each
    chunk's place given, the value is the sender's; without it, the order they came in counts."""
    rows = torch.randn(12, 16, generator=torch.Generator().manual_seed(5))
    parts = [rows[:3], rows[3:4], rows[4:9], rows[9:]]
    sent = checksum(*parts)
    landed = RoomChecksum()
    for i in (2, 0, 3, 1):
        landed.update(0, 3, "kv", parts[i], (i * 100, 0))
    assert landed.value() == sent
    unordered = RoomChecksum()
    for i in (2, 0, 3, 1):
        unordered.update(0, 3, "kv", parts[i])
    assert unordered.value() != sent
    same_place = RoomChecksum()  # items of one chunk share its offset: they count in the order given
    same_place.update(0, 3, "kv", rows[:6], (0, 0))
    same_place.update(0, 3, "kv", rows[6:], (0, 1))
    assert same_place.value() == sent
    assert RoomChecksum(landed.streams).value() == sent  # a reply's streams, merged


def _one_nixl_room(cfg, src, plan, decode, name: str) -> tuple[dict, dict, dict]:
    """Sends `plan` from `src` into fresh decode pools over NIXL (several chunks in flight):
    (the sender's reply, each decode rank's final status, the decode pools)."""
    ranks = range(decode.tp_size)
    dst = {r: KVPool(cfg, 400, src.dtype) for r in ranks}
    recv = {r: NixlReceiver(r, lambda r=r: dst[r], name=f"{name}-d{r}") for r in ranks}
    sender = NixlSender(0, src, chunk_bytes=16 << 10, name=f"{name}-p")
    try:
        rows = {r: {} for r in ranks}
        for t in plan:
            rows[t.dst_rank][t.kind] = rows[t.dst_rank].get(t.kind, 0) + t.rows
        ticket = new_ticket()
        slots = RoomSlots.of(decode.pages, decode.page_size, decode.dcp_size, decode.index_mode)
        endpoints = {r: recv[r].handle(StageCmd("room", ticket, rows))["endpoint"] for r in ranks}
        for r in ranks:
            recv[r].handle(ExpectCmd("room", ticket, {r: {0: sum(rows[r].values())}}, slots))
        reply = sender.send(SendCmd("room", ticket, plan, endpoints))
        assert reply["error"] is None, reply
        assert sender.status()["bytes_packed"] == 0  # every row went straight from the pool
        deadline = time.monotonic() + 10
        while not all(recv[r].handle(TransferStatusCmd("room"))["complete"] for r in ranks):
            assert time.monotonic() < deadline
            time.sleep(0.002)
        return reply, {r: recv[r].handle(TransferStatusCmd("room")) for r in ranks}, dst
    finally:
        for r in ranks:
            recv[r].close()
        sender.close()


def test_rows_sent_from_a_pool_with_sums_are_checksummed_from_them(model_path):
    """A prefill pool's kept sums stand for its rows: sent from it in chunks WRITTEN together, the
    rows arrive exactly and the checksums agree; a stored row changed behind the pool's back (not
    through a write) no longer matches its sum, and the receiver's checksum catches it."""
    cfg = ModelConfig.from_pretrained(model_path)
    src = KVPool(cfg, 400, torch.float64, residues=2, sums=True)
    g = torch.Generator().manual_seed(8)
    stored = torch.arange(40, 340)
    for layer in range(cfg.num_layers):
        idx = torch.randn(300, cfg.index_head_dim, generator=g, dtype=torch.float64)
        src.write(
            layer,
            stored,
            torch.randn(300, cfg.kv_entry_dim, generator=g, dtype=torch.float64),
            idx if cfg.has_indexer(layer) else None,
        )
    prefill, decode = layout(cfg, "dcp2")
    plan = plan_transfer(prefill, decode, 300)
    reply, status, dst = _one_nixl_room(cfg, src, plan, decode, "test-sums")
    sums = merge_checksums([reply])
    assert all(status[r]["error"] is None and status[r]["checksum"] == sums[r] for r in status)
    for t in plan:
        if t.kind == "kv":
            for run in t.runs:
                got = dst[t.dst_rank].read_kv(t.layer, torch.arange(run.dst, run.dst + run.length))
                assert torch.equal(got, src.read_kv(t.layer, torch.tensor(list(run.src_rows()))))
    src.kv[0, src.kv_row_ids(torch.tensor(100)), 3] += 1.0  # slot 100 at rest, not through write_kv
    reply, status, _ = _one_nixl_room(cfg, src, plan, decode, "test-sums-stale")
    sums = merge_checksums([reply])
    assert [status[r]["checksum"] == sums[r] for r in sorted(status)].count(False) == 1
