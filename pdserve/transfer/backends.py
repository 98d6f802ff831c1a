"""The KV hand-off data path of a rank, chosen by its config's `transfer`: "tcp" (transfer/tcp.py)
or "nixl" (transfer/nixl.py). Both honour the same commands; nixl is imported only when chosen."""

from __future__ import annotations

from .tcp import TcpReceiver, TcpSender

TRANSFERS = ("tcp", "nixl")


def check_transfer(transfer: str) -> None:
    if transfer not in TRANSFERS:
        raise ValueError(f"transfer must be one of {', '.join(TRANSFERS)}, got {transfer!r}")


def make_receiver(transfer: str, rank: int, pool):
    """A decode rank's receiver; pool() returns the rank's current KVPool."""
    check_transfer(transfer)
    if transfer == "nixl":
        from .nixl import NixlReceiver

        return NixlReceiver(rank, pool)
    return TcpReceiver(rank, pool)


def make_sender(transfer: str, rank: int, pool):
    check_transfer(transfer)
    if transfer == "nixl":
        from .nixl import NixlSender

        return NixlSender(rank, pool)
    return TcpSender(rank, pool)
