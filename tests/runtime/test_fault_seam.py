"""runtime/faults.py's seam: a rank process accepts ArmFaultCmd only with PDSERVE_TEST_FAULTS=1, a
fault fires once per arming, and production commands carry no test hook."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.runtime import faults
from pdserve.runtime.faults import ArmFaultCmd, arm_command, take
from pdserve.transfer.rank_commands import SendCmd


def test_arming_is_refused_unless_enabled(monkeypatch):
    monkeypatch.delenv(faults.FAULTS_ENV)
    with pytest.raises(PermissionError, match="fault injection is off"):
        arm_command(ArmFaultCmd("corrupt", "room-x"))
    assert not take("corrupt", "room-x")


def test_a_fault_fires_once_per_arming(monkeypatch):
    monkeypatch.setenv(faults.FAULTS_ENV, "1")
    arm_command(ArmFaultCmd("corrupt", "room-y"))
    assert not take("corrupt", "room-z") and take("corrupt", "room-y") and not take("corrupt", "room-y")


def test_send_commands_carry_no_test_hook():
    assert [f.name for f in dataclasses.fields(SendCmd)] == [
        "room",
        "ticket",
        "plan",
        "endpoints",
        "send_timeout_ms",
    ]
