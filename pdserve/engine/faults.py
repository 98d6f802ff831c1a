"""Test-only fault injection, off unless the environment asks for it.

`PDSERVE_TEST_FAULT_IDS` = comma-separated request ids: a rank command that computes one of them
raises `InjectedFault` (decode: the last rank, after its forward, so every collective completed;
prefill: every rank, before its forward). Rank processes inherit the environment when they start,
so a test sets it before starting an instance. Nothing reads it unless it is set.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

FAULT_ENV = "PDSERVE_TEST_FAULT_IDS"


class InjectedFault(RuntimeError):
    """A failure injected by a test (see the module doc)."""


def check_fault(request_ids: Iterable[str]) -> None:
    wanted = os.environ.get(FAULT_ENV)
    if not wanted:
        return
    hit = sorted(set(wanted.split(",")) & set(request_ids))
    if hit:
        raise InjectedFault(f"injected fault for request {', '.join(hit)}")
