"""Issue 41's full kill acceptance, in `make test-system` for its minutes (not for root: the stack
runs on loopback): `pdserve up` with two decode instances, 20 SIGKILLs of a serving decode rank
under streamed and non-streamed greedy load; no request is lost (each ends exact, none with an
error), every kill migrated at least one stream, and no page leaks (every instance healthy and
exactly idle at the end). `--restart-backoff-max 2` brings a killed instance back within seconds."""

from __future__ import annotations

import pytest

from tests.router.test_migration_up import kills_under_load, started_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tiny_checkpoints, tmp_path_factory):
    model_dir = tiny_checkpoints[("glm_moe_dsa", "make-model")]
    with started_stack(model_dir, tmp_path_factory.mktemp("up-logs"), "--restart-backoff-max", "2") as s:
        yield s


def test_twenty_kills_under_load_lose_no_request_and_leak_no_page(stack):
    kills_under_load(stack, 20)
