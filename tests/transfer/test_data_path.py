"""The data path shared by both backends: packing rows into a payload, storing a payload into the
pool (run by run for a few runs, one indexed copy for many) and the checksum taken on both ends.

Rows are checked against their source rows in float64 (exact), over layouts with a few long
strided runs (a DCP destination) and with hundreds of two-row runs (shuffled small pages)."""

from __future__ import annotations

import random
import time

import msgpack
import pytest
import torch
import zmq

from pdserve.kvcache.kv_cache import KVPool
from pdserve.model.config import ModelConfig
from pdserve.serving.auth import sign, verify
from pdserve.transfer import tcp
from pdserve.transfer.base import RoomChecksum
from pdserve.transfer.frames import DATA, DEV_FRAME_KEY, new_ticket
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
from pdserve.transfer.room_rows import SLICE_RUNS, RoomSlots
from pdserve.transfer.tcp import (
    TcpReceiver,
    TcpSender,
)


# ---- the checksum ------------------------------------------------------------------------------------
def checksum(*chunks: torch.Tensor) -> int:
    c = RoomChecksum(key=DEV_FRAME_KEY)
    for rows in chunks:
        c.update(0, 3, "kv", rows)
    return c.value()


def row_sums(rows: torch.Tensor) -> torch.Tensor:
    """The old room checksum's digest: per row, the wrapping int64 sum of its bytes as int64 words."""
    return rows.reshape(len(rows), -1).contiguous().view(torch.int64).sum(1)


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


def test_a_forged_row_that_keeps_its_int64_sum_changes_the_room_mac():
    """+d on one int64 word and -d on another keep the row's wrapping sum (and so the CRC of row sums
    that the room checksum was): the keyed room MAC changes, and differs under another key."""
    rows = torch.randn(4, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    forged = rows.clone()
    words = forged.view(torch.int64)
    words[2, 1] += 12345
    words[2, 7] -= 12345
    assert torch.equal(rows.view(torch.int64).sum(1), words.sum(1))
    assert checksum(forged) != checksum(rows)
    other = RoomChecksum(key=bytes(32))
    other.update(0, 3, "kv", rows)
    assert other.value() != checksum(rows)


def test_the_checksum_depends_on_the_rows_only():
    """Split into chunks at any row, or read from an unaligned view: the same value."""
    rows = torch.randn(9, 20, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
    want = checksum(rows)
    assert checksum(rows[:4], rows[4:]) == checksum(rows[:1], rows[1:8], rows[8:]) == want
    buf = torch.zeros(rows.numel() * 2 + 2, dtype=torch.uint8)
    unaligned = buf[2:].view(torch.bfloat16).view(9, 20)  # 2-byte aligned, rows of 40 bytes read as int64
    unaligned.copy_(rows)
    assert checksum(unaligned) == want


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


@pytest.mark.parametrize("backend", ["tcp", "tcp-pieces", "nixl", "nixl-region"])
@pytest.mark.parametrize("kind", ["dcp2", "fragmented"])
@pytest.mark.parametrize("residues", [1, 2])
def test_rows_arrive_exactly_and_the_checksums_agree(model_path, backend, kind, residues, monkeypatch):
    """residues: the prefill pool's latent layout; with 2 (= C_d) a DCP destination's rows are
    contiguous in it, and NIXL sends them straight from the pool. NIXL WRITEs land in the decode
    pool ("nixl") or in a receive region the receiver copies from ("nixl-region", an fp8 pool's way).
    "tcp-pieces": TCP frames of at most 5 rows' bytes and 3 runs, so every transfer goes as many
    frames and runs are split between them."""
    if backend == "tcp-pieces":
        monkeypatch.setattr(
            tcp, "DATA_PAYLOAD_MAX", 5 * 8 * ModelConfig.from_pretrained(model_path).kv_entry_dim
        )
        monkeypatch.setattr(tcp, "DATA_RUNS_MAX", 3)
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
    if backend.startswith("tcp"):
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
        endpoints = {r: recv[r].handle(StageCmd("room", ticket, rows)).endpoint for r in ranks}
        for r in ranks:
            recv[r].handle(ExpectCmd("room", ticket, {r: {0: sum(rows[r].values())}}, slots))
        reply = sender.send(SendCmd("room", ticket, plan, endpoints))
        assert reply.error is None, reply
        deadline = time.monotonic() + 10
        while not all(recv[r].handle(TransferStatusCmd("room")).room.complete for r in ranks):
            assert time.monotonic() < deadline, [recv[r].handle(TransferStatusCmd("room")) for r in ranks]
            time.sleep(0.002)
        sums = merge_checksums([reply])
        for r in ranks:
            status = recv[r].handle(TransferStatusCmd("room")).room
            assert status.error is None and status.checksum == sums[r]
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
        if backend == "tcp-pieces":
            assert max(recv[r].frames for r in ranks) > 3 * len(plan)
        if not backend.startswith("tcp"):
            assert all(
                recv[r].handle(TransferStatusCmd("x")).counters["registered_pool"]
                == (2 if backend == "nixl" else 0)
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
    landed = RoomChecksum(key=DEV_FRAME_KEY)
    for i in (2, 0, 3, 1):
        landed.update(0, 3, "kv", parts[i], (i * 100, 0))
    assert landed.value() == sent
    unordered = RoomChecksum(key=DEV_FRAME_KEY)
    for i in (2, 0, 3, 1):
        unordered.update(0, 3, "kv", parts[i])
    assert unordered.value() != sent
    same_place = RoomChecksum(
        key=DEV_FRAME_KEY
    )  # items of one chunk share its offset: they count in the order given
    same_place.update(0, 3, "kv", rows[:6], (0, 0))
    same_place.update(0, 3, "kv", rows[6:], (0, 1))
    assert same_place.value() == sent
    assert RoomChecksum(landed.streams).value() == sent  # a reply's streams, merged


def test_a_rooms_mac_is_taken_once_every_row_came(monkeypatch):
    """A receiver is asked for its status while rows still arrive (decode rooms poll it): the room
    MAC, which folds every row hash, is taken once, with the room's last rows (0 before, no fold),
    and then equals the sender's."""
    from pdserve.transfer import base
    from pdserve.transfer.room_rows import RoomRows, count_rows

    folds, real = [], base.fold
    monkeypatch.setattr(base, "fold", lambda *a: folds.append(1) or real(*a))
    rows = torch.randn(10, 16, generator=torch.Generator().manual_seed(6))
    room = RoomRows(new_ticket(), {0: 10}, checksum=RoomChecksum(key=DEV_FRAME_KEY))
    head = {"src_rank": 0, "layer": 3, "kind": "kv"}
    count_rows(room, head, [rows[:4]])
    for _ in range(3):
        s = room.status()
        assert (s.rows, s.complete, s.checksum) == (4, False, 0)
    assert not folds
    before = time.monotonic()
    count_rows(room, head, [rows[4:]])
    assert folds == [
        1
    ]  # taken with the last rows, before they are stamped: last_row_at is when they were checked
    s = room.status()
    assert folds == [1]  # the status reads it back
    assert s.complete and s.checksum == checksum(rows)
    assert before <= s.last_row_at <= time.monotonic()


def _one_nixl_room(
    cfg, src, plan, decode, name: str, on_path=None, before_send=None
) -> tuple[dict, dict, dict]:
    """Sends `plan` from `src` into fresh decode pools over NIXL (several chunks in flight):
    (the sender's reply, each decode rank's final status, the decode pools). on_path(rank, pool),
    if given, runs on the receiver before it takes each notification, after that chunk's WRITE
    landed: an on-path attacker who rewrote the WRITE's bytes. before_send(), if given, runs once
    the sender is made (and `src` keeps its row hashes)."""
    ranks = range(decode.tp_size)
    dst = {r: KVPool(cfg, 400, src.dtype) for r in ranks}
    recv = {r: NixlReceiver(r, lambda r=r: dst[r], name=f"{name}-d{r}") for r in ranks}
    if on_path is not None:
        for r in ranks:
            take = recv[r]._on_notif
            recv[r]._on_notif = lambda msg, r=r, take=take: (on_path(r, dst[r]), take(msg))
    sender = NixlSender(0, src, chunk_bytes=16 << 10, name=f"{name}-p")
    if before_send is not None:
        before_send()
    try:
        rows = {r: {} for r in ranks}
        for t in plan:
            rows[t.dst_rank][t.kind] = rows[t.dst_rank].get(t.kind, 0) + t.rows
        ticket = new_ticket()
        slots = RoomSlots.of(decode.pages, decode.page_size, decode.dcp_size, decode.index_mode)
        endpoints = {r: recv[r].handle(StageCmd("room", ticket, rows)).endpoint for r in ranks}
        for r in ranks:
            recv[r].handle(ExpectCmd("room", ticket, {r: {0: sum(rows[r].values())}}, slots))
        reply = sender.send(SendCmd("room", ticket, plan, endpoints))
        assert reply.error is None, reply
        assert sender.status()["bytes_packed"] == 0  # every row went straight from the pool
        deadline = time.monotonic() + 10
        while not all(recv[r].handle(TransferStatusCmd("room")).room.complete for r in ranks):
            assert time.monotonic() < deadline
            time.sleep(0.002)
        return reply, {r: recv[r].handle(TransferStatusCmd("room")).room for r in ranks}, dst
    finally:
        for r in ranks:
            recv[r].close()
        sender.close()


def _filled_pool(cfg: ModelConfig) -> KVPool:
    """A prefill pool (latent rows residue-major by 2) with random rows in slots 40..339."""
    src = KVPool(cfg, 400, torch.float64, residues=2)
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
    return src


def test_rows_sent_straight_from_the_pool_arrive_with_equal_room_macs(model_path):
    """Rows WRITTEN straight from a prefill pool, in chunks in flight together, arrive exactly and
    the room MACs agree (a forged row among them: test_a_forged_nixl_payload_with_a_matching_checksum_fails)."""
    cfg = ModelConfig.from_pretrained(model_path)
    src = _filled_pool(cfg)
    prefill, decode = layout(cfg, "dcp2")
    plan = plan_transfer(prefill, decode, 300)
    reply, status, dst = _one_nixl_room(cfg, src, plan, decode, "test-sums")
    sums = merge_checksums([reply])
    assert all(status[r].error is None and status[r].checksum == sums[r] for r in status)
    for t in plan:
        if t.kind == "kv":
            for run in t.runs:
                got = dst[t.dst_rank].read_kv(t.layer, torch.arange(run.dst, run.dst + run.length))
                assert torch.equal(got, src.read_kv(t.layer, torch.tensor(list(run.src_rows()))))


# ---- a forged payload whose old checksum (crc32 of wrapping int64 row sums) matches --------------------------
def _forge(words: torch.Tensor) -> None:
    """+d on one int64 word of a row, -d on another: its wrapping int64 sum stays."""
    words[1] += 0x10001
    words[5] -= 0x10001


def test_a_forged_nixl_payload_with_a_matching_checksum_fails(model_path):
    """An on-path attacker rewrites one row of a NIXL WRITE as it lands in the decode pool, keeping
    the row's int64 sum (so the CRC of row sums the room checksum was would have matched): the
    receiver's room MAC differs from the one the sender put in TransferDone, so the decode room
    fails its check (decode_room._verify) and is never committed; the other rank's room agrees."""
    cfg = ModelConfig.from_pretrained(model_path)
    src = _filled_pool(cfg)
    prefill, decode = layout(cfg, "dcp2")
    plan = plan_transfer(prefill, decode, 300)
    t = next(t for t in plan if t.kind == "kv" and t.rows)
    run = t.runs[0]
    genuine = src.read_kv(t.layer, torch.tensor([next(iter(run.src_rows()))]))[0].clone()
    forged: list[torch.Tensor] = []

    def on_path(rank: int, pool: KVPool) -> None:
        if rank != t.dst_rank or forged:
            return
        li, row = pool.kv_row[t.layer], int(pool._kv_rows(torch.tensor([run.dst]))[0])
        if torch.equal(pool.kv[li, row], genuine):  # the WRITE has landed, its notification not taken
            _forge(pool.kv[li, row].view(torch.int64))
            forged.append(pool.kv[li, row].clone())

    reply, status, _ = _one_nixl_room(cfg, src, plan, decode, "test-forged", on_path)
    assert forged and not torch.equal(forged[0], genuine)
    assert torch.equal(row_sums(forged[0].view(1, -1)), row_sums(genuine.view(1, -1)))  # old checksum: same
    sums = merge_checksums([reply])
    assert status[t.dst_rank].complete and status[t.dst_rank].checksum != sums[t.dst_rank]
    assert all(status[r].checksum == sums[r] for r in status if r != t.dst_rank)


def test_a_forged_tcp_payload_with_a_matching_checksum_is_refused(model_path):
    """An on-path attacker between a TCP sender and receiver rewrites one frame's payload keeping
    every row's int64 sum, and passes header and tag on: the tag covers the payload, so the frame is
    dropped unstored (the old tag, over the payload's length only, would have verified); the room
    stays incomplete and fails by its timeout, and its rows in the pool are untouched."""
    cfg = ModelConfig.from_pretrained(model_path)
    src = _filled_pool(cfg)
    prefill, decode = layout(cfg, "fragmented")
    plan = plan_transfer(prefill, decode, 300)
    dst = KVPool(cfg, 400, torch.float64)
    recv, sender = TcpReceiver(0, lambda: dst), TcpSender(0, src)
    ctx = zmq.Context()
    attacker = ctx.socket(zmq.PULL)
    onward = ctx.socket(zmq.PUSH)
    try:
        path = f"tcp://127.0.0.1:{attacker.bind_to_random_port('tcp://127.0.0.1')}"
        onward.connect(recv.endpoint)
        ticket = new_ticket()
        slots = RoomSlots.of(decode.pages, decode.page_size, decode.dcp_size, decode.index_mode)
        expected = sum(t.rows for t in plan)
        recv.handle(ExpectCmd("room", ticket, {0: {0: expected}}, slots))
        assert sender.send(SendCmd("room", ticket, plan, {0: path})).error is None
        frames = [attacker.recv_multipart() for _ in plan]
        header, payload, tag = frames[0]
        forged = bytearray(payload)
        words = torch.frombuffer(forged, dtype=torch.int64)
        _forge(words)
        width = msgpack.unpackb(header)["width"]
        assert torch.equal(
            row_sums(torch.frombuffer(bytearray(payload), dtype=torch.int64).view(-1, width)),
            row_sums(words.view(-1, width)),
        )
        assert verify(
            DEV_FRAME_KEY,
            sign(DEV_FRAME_KEY, DATA, header, len(payload).to_bytes(8, "little")),
            DATA,
            header,
            len(forged).to_bytes(8, "little"),
        )
        onward.send_multipart([header, bytes(forged), tag])
        for f in frames[1:]:
            onward.send_multipart(f)
        rows = expected - plan[0].rows
        deadline = time.monotonic() + 10
        while recv.handle(TransferStatusCmd("room")).room.rows < rows or recv.unauthenticated < 1:
            assert time.monotonic() < deadline, recv.handle(TransferStatusCmd("room"))
            time.sleep(0.002)
        status = recv.handle(TransferStatusCmd("room")).room
        assert recv.unauthenticated == 1 and status.rows == rows and not status.complete
        assert status.error is None
        for dst_row, n in msgpack.unpackb(header)["runs"]:
            read = dst.read_kv if plan[0].kind == "kv" else dst.read_index
            assert not read(plan[0].layer, torch.arange(dst_row, dst_row + n)).any()  # never stored
    finally:
        attacker.close()
        onward.close()
        ctx.term()
        recv.close()
        sender.close()
