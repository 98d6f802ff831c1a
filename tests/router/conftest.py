"""Fixtures of the router tests: real prefill and decode servers (tests/servers.py starts them as processes)."""

from __future__ import annotations

import pytest

from tests.router.helpers import start_servers, stop_all


@pytest.fixture(scope="session")
def model_dir(tiny_checkpoints):
    return tiny_checkpoints[("glm_moe_dsa", "make-model")]


@pytest.fixture(scope="session")
def instances(model_dir):
    """One prefill instance (C_p = 2) and one decode instance (W = C_d = 2, split index): (p_url, d_url).
    Shared by the router test modules that leave both instances running and idle."""
    (prefill, p_url), (decode, d_url) = start_servers(
        model_dir,
        [
            ("prefill", "--cp-size", "2", "--bootstrap-timeout", "5"),
            (
                "decode",
                "--tp-size",
                "2",
                "--dcp-size",
                "2",
                "--dcp-index",
                "split",
                "--page-size",
                "4",
                "--transfer-timeout",
                "5",
            ),
        ],
    )
    try:
        yield p_url, d_url
    finally:
        stop_all([prefill, decode])
