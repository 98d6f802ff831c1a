"""`pdserve up` composes its options from the server and router configs (StackConfig,
router/launch.py): an option it passes on is declared with `passed_on` (flags.py), so it takes the
instance's own choices, lower bound and default; `up` checks it by building the configs that
receive it (one rule per knob); and the arguments it starts each process with parse, through that
process's own command, back to exactly the config `up` checked."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
from typer.testing import CliRunner

from pdserve.checkpoints.presets import hf_config
from pdserve.cli.main import app
from pdserve.decode_server.config import DecodeServerConfig
from pdserve.flags import flagged_fields
from pdserve.prefill_server.config import PrefillServerConfig
from pdserve.router.config import RouterConfig
from pdserve.router.launch import Stack, StackConfig

P, D = PrefillServerConfig, DecodeServerConfig
PASSED_ON = {f.name: flag.passes_to for f, flag in flagged_fields(StackConfig) if flag.passes_to}


def _flags(cls) -> dict:
    return {f.name: (f, flag) for f, flag in flagged_fields(cls)}


@pytest.mark.parametrize("name", sorted(PASSED_ON))
def test_an_option_up_passes_on_has_the_instances_choices_bound_and_default(name):
    stack_field, stack_flag = _flags(StackConfig)[name]
    for cls, field in PASSED_ON[name]:
        f, flag = _flags(cls)[field]
        where = f"up {stack_flag.flag_name(name)} vs {cls.__name__}.{field}"
        assert stack_flag.choices is flag.choices, where
        assert stack_flag.min == flag.min, (where, stack_flag.min, flag.min)
        if stack_field.default is not None:  # None: each instance's own default
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
        ("decode_dcp", D, "dcp_size", [0, 3], [1, 2]),
        ("max_kv_tokens", P, "max_kv_tokens", [0, 8], [16, 4096]),
        ("attention_ops", D, "attention_ops", ["fast"], ["torch"]),
    ],
)
def test_up_refuses_exactly_what_the_instance_refuses(tmp_path, stack_field, server, field, bad, good):
    base = {"model": str(tmp_path)}
    shape = {"tp_size": 2} if server is D else {}  # decode_tp 2 below: --dcp-size 3 must divide it
    for value in bad:
        with pytest.raises(ValueError, match="instance would refuse"):
            StackConfig(**base, decode_tp=2, **{stack_field: value})
        with pytest.raises(ValueError):
            server.create(**base, **shape, **{field: value})
    for value in good:
        assert getattr(StackConfig(**base, decode_tp=2, **{stack_field: value}), stack_field) == value
        assert getattr(server.create(**base, **shape, **{field: value}), field) == value


def test_up_refuses_what_its_router_refuses(tmp_path):
    bad_keys = tmp_path / "keys"
    bad_keys.write_text("alice:short\n")
    for bad in ({"max_migrations": -1}, {"api_key_file": str(bad_keys)}, {"policy": "random"}):
        with pytest.raises(ValueError, match="the router would refuse"):
            StackConfig(model=str(tmp_path), **bad)


def test_every_option_up_restates_is_passed_on():
    """A StackConfig field named like a server's or the router's field is declared with `passed_on`
    (so it cannot drift from the option it becomes), or is one `up` sets per process itself."""
    theirs = {f.name for cls in (P, D, RouterConfig) for f in dataclasses.fields(cls)}
    restated = {f.name for f in dataclasses.fields(StackConfig) if f.name in theirs}
    # the stack's model, secrets that travel in the environment, the whole stack's GPUs (split per instance)
    own = {"model", "internal_token", "admin_token", "gpu_ids"}
    assert restated - own <= set(PASSED_ON), sorted(restated - own - set(PASSED_ON))
    assert {"prefill_cp", "decode_tp", "decode_dcp"} <= set(PASSED_ON)  # renamed: --prefill-cp is --cp-size


def _shown(*args: str) -> dict:
    r = CliRunner().invoke(app, [*args, "--check-config"], env={"PDSERVE_ADMIN_TOKEN": ""})
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_the_processes_up_starts_get_the_configs_up_checked(tmp_path):
    """Each instance's arguments, through its own command (--check-config), give the config `up`
    built from instance_fields; the router's give its options (both ways of a bool)."""
    (tmp_path / "config.json").write_text(json.dumps(hf_config("glm_moe_dsa", "tiny")))
    (tmp_path / "tokenizer.json").write_text("{}")  # the router checks only that it is there
    cfg = StackConfig(
        model=str(tmp_path),
        log_dir=str(tmp_path / "logs"),
        prefill_cp=2,
        decode_tp=2,
        decode_dcp=2,
        dcp_index="split",
        prefix_cache="off",
        max_kv_tokens=4096,
        bootstrap_timeout_s=12.5,
        shutdown_grace_s=0.25,
        max_migrations=0,
        report_cached_tokens=True,
    )
    stack = Stack(cfg)
    for role, cls in (("prefill", P), ("decode", D)):
        shown = _shown(*stack.instance_args(role, 0, 8100))
        expected = dataclasses.asdict(
            cls.create(**cfg.instance_fields(role, 0), port=8100, dist_port=shown["dist_port"])
        )
        assert {k: shown[k] for k in expected if k != "internal_token"} == {
            k: json.loads(json.dumps(v)) for k, v in expected.items() if k != "internal_token"
        }
        for field in ("max_kv_tokens", "prefix_cache", "shutdown_grace_s"):  # what was asked arrived
            assert shown[field] == getattr(cfg, field), (role, field)
    router = _shown(*stack.router_args(["http://127.0.0.1:1"], ["http://127.0.0.1:2"]))
    assert (router["max_migrations"], router["report_cached_tokens"], router["policy"]) == (
        0,
        True,
        "round_robin",
    )
    quiet = Stack(dataclasses.replace(cfg, report_cached_tokens=False))
    assert (
        _shown(*quiet.router_args(["http://127.0.0.1:1"], ["http://127.0.0.1:2"]))["report_cached_tokens"]
        is False
    )


def test_no_config_is_changed_once_built():
    """Frozen configs are built whole (InstanceOptions.create fills the defaults that follow from
    other fields; the CLI parses --gpu-ids): object.__setattr__ appears only where wire messages
    normalise what msgpack decoded (lists back to tuples, string keys back to ints)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "pdserve"
    users = sorted(
        str(p.relative_to(root)) for p in root.rglob("*.py") if "object.__setattr__" in p.read_text()
    )
    assert users == ["transfer/messages.py", "transfer/plan.py"], users
