"""`--data-host`: a decode rank's TCP receiver listens on, and advertises, the address it is given,
so prefill ranks on other hosts can reach it; rows sent there arrive. A wildcard is refused."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from pdserve.decode_server.config import DecodeServerConfig
from pdserve.kvcache.kv_cache import KVPool
from pdserve.model.config import ModelConfig
from pdserve.transfer.frames import new_ticket
from pdserve.transfer.plan import DecodeSide, PrefillSide, plan_transfer
from pdserve.transfer.rank_commands import (
    ExpectCmd,
    SendCmd,
    TransferStatusCmd,
    merge_checksums,
)
from pdserve.transfer.room_rows import RoomSlots
from pdserve.transfer.tcp import (
    TcpReceiver,
    TcpSender,
)


def outward_address() -> str:
    """This machine's address on its default route (no packet is sent); 127.0.0.1 without one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def test_receiver_listens_and_advertises_the_data_host(model_path):
    host = outward_address()
    cfg = ModelConfig.from_pretrained(model_path)
    src, dst = KVPool(cfg, 32, torch.float64), KVPool(cfg, 32, torch.float64)
    src.kv.normal_(generator=torch.Generator().manual_seed(0))
    recv, sender = TcpReceiver(0, lambda: dst, host), TcpSender(0, src)
    try:
        assert recv.endpoint.startswith(f"tcp://{host}:")
        plan = [
            t
            for t in plan_transfer(
                PrefillSide(1, "full", cfg.num_layers, cfg.indexer_layers, range(10, 22)),
                DecodeSide(1, 1, "split", 4, (1, 0, 2)),
                12,
            )
            if t.kind == "kv"
        ]
        ticket = new_ticket()
        recv.handle(
            ExpectCmd(
                "r", ticket, {0: {0: sum(t.rows for t in plan)}}, RoomSlots.of((1, 0, 2), 4, 1, "split")
            )
        )
        reply = sender.send(SendCmd("r", ticket, plan, {0: recv.endpoint}))
        deadline = time.monotonic() + 5
        while not recv.handle(TransferStatusCmd("r")).room.complete:
            assert time.monotonic() < deadline, recv.handle(TransferStatusCmd("r"))
            time.sleep(0.005)
        assert recv.handle(TransferStatusCmd("r")).room.checksum == merge_checksums([reply])[0]
        for t in plan:
            for run in t.runs:
                got = dst.read_kv(t.layer, torch.arange(run.dst, run.dst + run.length))
                assert torch.equal(got, src.read_kv(t.layer, torch.tensor(list(run.src_rows()))))
    finally:
        recv.close()
        sender.close()


@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_a_wildcard_data_host_is_refused(model_path, host):
    with pytest.raises(ValueError, match="wildcard"):
        DecodeServerConfig.create(model=str(model_path), max_kv_tokens=64, data_host=host)
