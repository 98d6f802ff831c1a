"""The KV hand-off data path of a rank, chosen by its config's `transfer`: "tcp" (transfer/tcp.py)
or "nixl" (transfer/nixl.py, nixl_send.py). Both honour the same commands; nixl is imported only when chosen."""

from __future__ import annotations

from .frames import DEV_FRAME_KEY
from .tcp import TcpReceiver, TcpSender

TRANSFERS = ("tcp", "nixl")


def check_transfer(transfer: str) -> None:
    if transfer not in TRANSFERS:
        raise ValueError(f"transfer must be one of {', '.join(TRANSFERS)}, got {transfer!r}")


def make_receiver(
    transfer: str,
    rank: int,
    pool,
    host: str = "127.0.0.1",
    quarantine_s: float = 60.0,
    key: bytes = DEV_FRAME_KEY,
):
    """A decode rank's receiver; pool() returns the rank's current KVPool. host: the address a TCP
    receiver binds and advertises (NIXL's addressing is UCX's: UCX_NET_DEVICES). quarantine_s: how
    long NIXL keeps what a failed room's senders may still WRITE into out of use. key: the cluster
    frame key every data frame / notification must be signed with (transfer/frames.py)."""
    check_transfer(transfer)
    if transfer == "nixl":
        from .nixl import NixlReceiver

        return NixlReceiver(rank, pool, quarantine_s=quarantine_s, key=key)
    return TcpReceiver(rank, pool, host, key)


def make_sender(transfer: str, rank: int, pool, key: bytes = DEV_FRAME_KEY):
    check_transfer(transfer)
    if transfer == "nixl":
        from .nixl_send import NixlSender

        return NixlSender(rank, pool, key=key)
    return TcpSender(rank, pool, key)
