"""The root-only system tests (`make test-system`, which `.ci/run` calls after `make test`): hosts
in network namespaces, the image built offline, the compose stack. They skip unless
PDSERVE_SYSTEM_TESTS=1 (so `make test` never runs them) and skip, naming what is missing, without
root or the tools they use."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def missing(*tools: str) -> str | None:
    """Why the system tests cannot run here, or None."""
    if os.environ.get("PDSERVE_SYSTEM_TESTS") != "1":
        return "system test: run by `make test-system` (PDSERVE_SYSTEM_TESTS=1)"
    if os.geteuid() != 0:
        return "system test: needs root (network namespaces, nft, tc, dockerd)"
    absent = [t for t in tools if shutil.which(t) is None]
    return f"system test: missing {', '.join(absent)}" if absent else None


def pytest_collection_modifyitems(config, items):
    reason = missing("ip", "nft", "tc")
    if reason is None:
        return
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.skip(reason=reason))
