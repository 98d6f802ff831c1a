"""Every PDSERVE_* environment variable pdserve reads, in one place: its name, what it does, its
default and how its value is read (a flag 0/1, a number, text). Code reads a variable only through
its `EnvKnob` here (tests/test_env_knobs.py fails on a PDSERVE_* name anywhere else in pdserve/), so
this module is the list a user or an operator needs. Torch-free: the CLI and the router import it.

A malformed value is a ValueError naming the variable, never a silent default."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EnvKnob:
    name: str
    help: str
    default: str | None = None

    def text(self) -> str | None:
        """The value, else the default; an empty value counts as unset."""
        return os.environ.get(self.name) or self.default

    def on(self) -> bool:
        """A 0/1 switch."""
        value = self.text() or "0"
        if value not in ("0", "1"):
            raise ValueError(f"{self.name} must be 0 or 1, got {value!r}")
        return value == "1"

    def number(self) -> float:
        value = self.text() or "0"
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"{self.name} must be a number, got {value!r}") from None

    def set(self, value: str, env: dict | None = None) -> None:
        """Sets it in `env` (default: this process's environment, inherited by its children)."""
        (os.environ if env is None else env)[self.name] = value


INTERNAL_TOKEN = EnvKnob(
    "PDSERVE_INTERNAL_TOKEN",
    "The secret the router and every instance share (instance APIs, side channels, node links); "
    "`pdserve up` makes one per stack when it is unset.",
)
ADMIN_TOKEN = EnvKnob("PDSERVE_ADMIN_TOKEN", "The router's /admin bearer token (else --admin-token).")
API_KEY = EnvKnob("PDSERVE_API_KEY", "The router's client API key (else --api-key).")
CACHE = EnvKnob(
    "PDSERVE_CACHE", "Where built-in models and native kernels are cached (default ~/.cache/pdserve)."
)
NATIVE = EnvKnob(
    "PDSERVE_NATIVE",
    "0: torch's kernels instead of the native CPU kernels (few-row ops, room MAC row hashes).",
    "1",
)
ONEDNN = EnvKnob("PDSERVE_ONEDNN", "1: oneDNN for every CPU product (opt in: its heap grows).", "0")
ONEDNN_GEMV = EnvKnob("PDSERVE_ONEDNN_GEMV", "0: no oneDNN for one-row CPU products.", "1")
GROUP_RESTARTS = EnvKnob(
    "PDSERVE_GROUP_RESTARTS", "Set by a server for its re-executed self: how often its rank group restarted."
)
TEST_FAULTS = EnvKnob("PDSERVE_TEST_FAULTS", "Tests only: 1 lets rank processes accept ArmFaultCmd.", "0")
TEST_FAULT_IDS = EnvKnob("PDSERVE_TEST_FAULT_IDS", "Tests only: request ids whose rank commands fail.")
TEST_STEP_DELAY_S = EnvKnob("PDSERVE_TEST_STEP_DELAY_S", "Tests only: seconds a decode loop waits per step.")
TEST_KILL_AT_LAYER = EnvKnob(
    "PDSERVE_TEST_KILL_AT_LAYER", "Tests only: room:layer:rank, a prefill rank that kills itself there."
)

KNOBS = {
    k.name: k
    for k in (
        INTERNAL_TOKEN,
        ADMIN_TOKEN,
        API_KEY,
        CACHE,
        NATIVE,
        ONEDNN,
        ONEDNN_GEMV,
        GROUP_RESTARTS,
        TEST_FAULTS,
        TEST_FAULT_IDS,
        TEST_STEP_DELAY_S,
        TEST_KILL_AT_LAYER,
    )
}
