"""`pdserve up` passes some of its options on to every instance (StackConfig, router/launch.py): each
such option takes the same values as the instance's own -- the same choices, the same lower bound,
the same default where "every instance's" is what it says -- and refuses what the instance
refuses, so a value `up` accepts never fails in an instance it started (one bound per knob)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from pdserve.decode_server.config import DecodeServerConfig
from pdserve.flags import flagged_fields
from pdserve.prefill_server.config import PrefillServerConfig
from pdserve.router.launch import StackConfig

P, D = PrefillServerConfig, DecodeServerConfig
# StackConfig field -> the server config fields it becomes (same_default: its default is theirs)
PASSED_ON = {
    "prefill_cp": ([(P, "cp_size")], True),
    "decode_tp": ([(D, "tp_size")], True),
    "decode_dcp": ([(D, "dcp_size")], True),
    "dcp_index": ([(D, "dcp_index")], True),
    "transfer": ([(P, "transfer"), (D, "transfer")], True),
    "prefix_cache": ([(P, "prefix_cache"), (D, "prefix_cache")], True),
    "max_kv_tokens": ([(P, "max_kv_tokens"), (D, "max_kv_tokens")], False),  # None: each server's own
    "bootstrap_timeout_s": ([(P, "bootstrap_timeout_s")], True),
    "shutdown_grace_s": ([(P, "shutdown_grace_s"), (D, "shutdown_grace_s")], True),
    "device": ([(P, "device"), (D, "device")], True),
    "attention_ops": ([(P, "attention_ops"), (D, "attention_ops")], True),
}


def _flags(cls) -> dict:
    return {f.name: (f, flag) for f, flag in flagged_fields(cls)}


@pytest.mark.parametrize("name", sorted(PASSED_ON))
def test_an_option_up_passes_on_has_the_instances_choices_bound_and_default(name):
    stack_field, stack_flag = _flags(StackConfig)[name]
    targets, same_default = PASSED_ON[name]
    for cls, field in targets:
        f, flag = _flags(cls)[field]
        where = f"up {stack_flag.flag_name(name)} vs {cls.__name__}.{field}"
        assert stack_flag.choices is flag.choices, where
        assert stack_flag.min == flag.min, (where, stack_flag.min, flag.min)
        if same_default:
            assert stack_field.default == f.default, (where, stack_field.default, f.default)


@pytest.mark.parametrize(
    "stack_field,server,field,bad,good",
    [
        (
            "bootstrap_timeout_s",
            P,
            "bootstrap_timeout_s",
            [0.0, -1.0, math.nan, math.inf, 86400.5],
            [86400.0, 0.1],
        ),
        ("shutdown_grace_s", P, "shutdown_grace_s", [-0.5], [0.0, 5.0]),
        ("decode_dcp", D, "dcp_size", [0], [1]),
    ],
)
def test_up_refuses_exactly_what_the_instance_refuses(tmp_path, stack_field, server, field, bad, good):
    base = {"model": str(tmp_path)}
    for value in bad:
        with pytest.raises(ValueError):
            StackConfig(**base, **{stack_field: value})
        with pytest.raises(ValueError):
            server(**base, **{field: value})
    for value in good:
        assert getattr(StackConfig(**base, **{stack_field: value}), stack_field) == value
        assert getattr(server(**base, **{field: value}), field) == value


def test_every_instance_option_up_restates_is_listed():
    """A StackConfig field named like an instance option (or documented as 'every instance's') is in
    PASSED_ON, so a new one cannot skip the checks above."""
    instance_fields = {f.name for f in dataclasses.fields(P)} | {f.name for f in dataclasses.fields(D)}
    restated = {f.name for f in dataclasses.fields(StackConfig) if f.name in instance_fields}
    # the router's own, the stack's one value, or the whole stack's GPUs (split per instance by up)
    routed = {"host", "port", "model", "internal_token", "gpu_ids"}
    assert restated - routed <= set(PASSED_ON), sorted(restated - routed - set(PASSED_ON))
