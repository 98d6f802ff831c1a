"""Test-only fault injection, off unless the environment asks for it.

`PDSERVE_TEST_FAULT_IDS` = comma-separated request ids: a rank command that computes one of them
raises `InjectedFault` (decode: the last rank, after its forward, so every collective completed;
prefill: every rank, before its forward). Rank processes inherit the environment when they start,
so a test sets it before starting an instance. Nothing reads it unless it is set.

`PDSERVE_TEST_STEP_DELAY_S` = seconds: a decode instance's loop waits this long before each
decode step, so that a test can act while a stream is running (kill a rank after token 20 of 64).
Read once, when the module is imported.

`PDSERVE_TEST_KILL_AT_LAYER` = "room:layer:rank": that prefill rank kills itself (SIGKILL) right
after it posted that layer's rows of a streamed hand-off of that room (prefill_server/handoff_stream.py)
and they left: for KILL_FLUSH_S it settles its in-flight WRITEs and progresses its agent (TCP: its
queued frames go out meanwhile), so that a test sees rows arrive from a rank that then died, whatever
the machine's load.

`PDSERVE_TEST_FAULTS` = 1: a rank process accepts `ArmFaultCmd` (any rank worker, runtime/launcher.py),
which arms a one-shot fault by (kind, key) in that process; the code path that owns the fault takes
it (`take`). Kinds: "corrupt" (key: a room): the room's next send flips one payload byte after its
room MAC (transfer/tcp.py, nixl_send.py), which the receivers' check must catch. Without the
variable the command is refused, so production commands carry no test hook.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .. import env

FAULT_ENV = env.TEST_FAULT_IDS.name
STEP_DELAY_ENV = env.TEST_STEP_DELAY_S.name
KILL_AT_LAYER_ENV = env.TEST_KILL_AT_LAYER.name
FAULTS_ENV = env.TEST_FAULTS.name
_armed: set[tuple[str, str]] = set()  # (kind, key) of the faults armed in this process
_STEP_DELAY_S = env.TEST_STEP_DELAY_S.number()


class InjectedFault(RuntimeError):
    """A failure injected by a test (see the module doc)."""


def check_fault(request_ids: Iterable[str]) -> None:
    wanted = env.TEST_FAULT_IDS.text()
    if not wanted:
        return
    hit = sorted(set(wanted.split(",")) & set(request_ids))
    if hit:
        raise InjectedFault(f"injected fault for request {', '.join(hit)}")


def step_delay() -> None:
    if _STEP_DELAY_S > 0:
        time.sleep(_STEP_DELAY_S)


KILL_FLUSH_S = 0.2


def check_layer_fault(room: str, layer: int, rank: int, settle: Callable[[], object]) -> None:
    wanted = env.TEST_KILL_AT_LAYER.text()
    if wanted and wanted == f"{room}:{layer}:{rank}":
        end = time.monotonic() + KILL_FLUSH_S
        while time.monotonic() < end:
            settle()
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGKILL)


@dataclass(frozen=True)
class ArmFaultCmd:
    """A rank command (test-only): arm a one-shot fault of `kind` for `key` in the rank process."""

    kind: str
    key: str


def arm(kind: str, key: str) -> None:
    _armed.add((kind, key))


def take(kind: str, key: str) -> bool:
    """True once for each arming of (kind, key)."""
    if (kind, key) in _armed:
        _armed.discard((kind, key))
        return True
    return False


def arm_command(cmd: ArmFaultCmd) -> None:
    if not env.TEST_FAULTS.on():
        raise PermissionError(f"fault injection is off in this process ({FAULTS_ENV} is not 1)")
    arm(cmd.kind, cmd.key)
