"""Flags declared once (pdserve/flags.py): a config field with `option(...)` is a CLI option with the
field's name, default, bound and choice set, and the servers' commands are built from their configs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

import pytest
import typer
from typer.testing import CliRunner

from pdserve import choices
from pdserve.cli.main import app
from pdserve.decode_server.config import DecodeServerConfig
from pdserve.flags import config_command, flagged_fields, option
from pdserve.prefill_server.config import PrefillServerConfig
from pdserve.router.config import RouterConfig
from pdserve.router.launch import StackConfig


class Color(str, Enum):
    red = "red"
    light_blue = "light-blue"


@dataclass(frozen=True)
class ToyConfig:
    name: str = option("x", "The name.")
    color: str = option("red", "The color.", choices=Color)
    wait_s: float = option(1.5, "Seconds to wait.", name="--wait", min=0.0)
    hidden: int = 3  # not an option
    verbose: bool = option(False, "Talk more.")


def _toy_app(seen: list):
    toy = typer.Typer(add_completion=False)

    @toy.command()
    @config_command(ToyConfig, after={"extra": "color"})
    def run(values: dict, extra: int = typer.Option(7, help="Not a field."), last: bool = False):
        """The toy command."""
        seen.append((values, extra, last))

    return toy


def test_one_declaration_makes_an_option():
    seen: list = []
    toy = _toy_app(seen)
    r = CliRunner().invoke(toy, ["--color", "light-blue", "--wait", "2", "--verbose", "--extra", "1"])
    assert r.exit_code == 0, r.output
    assert seen == [({"name": "x", "color": "light-blue", "wait_s": 2.0, "verbose": True}, 1, False)]
    cmd = typer.main.get_command(toy)
    assert [p.name for p in cmd.params] == ["name", "color", "extra", "wait", "verbose", "last"]
    assert "The toy command." in cmd.help
    bad = CliRunner().invoke(toy, ["--color", "green"])
    assert bad.exit_code == 2 and "green" in bad.output
    assert CliRunner().invoke(toy, ["--wait", "-1"]).exit_code == 2  # the field's min
    with pytest.raises(ValueError):
        option("purple", "A typo in a default fails at import.", choices=Color)


NOT_OPTIONS = {  # config fields no flag sets
    PrefillServerConfig: {"page_size"},
    DecodeServerConfig: set(),
    RouterConfig: {"retry_backoff_s", "connect_timeout_s", "default_max_tokens"},
    StackConfig: set(),
}
FILLED_IN = {
    "model",
    "internal_token",
    "kv_memory",
    "prefill",
    "decode",
    "allowed_instance_hosts",
    "log_dir",
    "dtype",
    "gpu_ids",
    "cuda_graphs",
    "nnodes",  # the flag, else the LeaderWorkerSet's variable (runtime/nodes.py)
    "node_rank",
    "dist_addr",
}  # by the command


@pytest.mark.parametrize(
    ("command", "cls"),
    [
        ("prefill", PrefillServerConfig),
        ("decode", DecodeServerConfig),
        ("router", RouterConfig),
        ("up", StackConfig),
    ],
)
def test_command_options_are_the_config_fields(command, cls):
    cmd = typer.main.get_command(app).commands[command]
    params = {p.opts[0]: p for p in cmd.params if p.param_type_name == "option"}
    for f, flag in flagged_fields(cls):
        p = params.pop(flag.flag_name(f.name))
        assert p.help == flag.help and p.min == flag.min
        if f.name not in FILLED_IN:
            default = p.default.value if isinstance(p.default, Enum) else p.default
            assert default == f.default, f.name
        if flag.choices is not None:
            assert p.type_descriptor.annotation is flag.choices
    # what is not a config field: the token file, --gpu-memory (decode), --check-config, --help
    assert set(params) <= {"--internal-token-file", "--gpu-memory", "--check-config", "--help"}
    not_flags = {f.name for f in dataclasses.fields(cls)} - {f.name for f, _ in flagged_fields(cls)}
    assert not_flags == NOT_OPTIONS[cls]


@pytest.mark.parametrize(
    ("cls", "field", "choice_set"),
    [
        (PrefillServerConfig, "cache", choices.CacheMode),
        (PrefillServerConfig, "cp_layout", choices.Layout),
        (PrefillServerConfig, "transfer", choices.Transfer),
        (DecodeServerConfig, "dcp_comm", choices.DcpComm),
        (DecodeServerConfig, "cpu_comm", choices.CpuComm),
        (DecodeServerConfig, "dcp_index", choices.DcpIndex),
    ],
)
def test_configs_check_the_same_choice_sets(cls, field, choice_set, tmp_path):
    with pytest.raises(ValueError, match="must be one of " + ", ".join(choices.values(choice_set))):
        cls.create(model=str(tmp_path), **{field: "bogus"})


def test_modules_take_their_choice_sets_from_choices():
    from pdserve.decode_server.dcp_backend import COMM_MODES, INDEX_MODES
    from pdserve.kvcache.capacity import KV_CACHE_DTYPES
    from pdserve.prefill_server.layouts import LAYOUTS
    from pdserve.router.config import DISCOVERY, POLICIES
    from pdserve.router.supervise import RESTART_POLICIES
    from pdserve.runtime.comm import CPU_COMMS
    from pdserve.transfer.backends import TRANSFERS
    from pdserve.transfer.plan import CACHE_MODES
    from pdserve.transfer.plan import INDEX_MODES as PLAN_INDEX_MODES

    assert COMM_MODES == choices.values(choices.DcpComm) and CPU_COMMS == choices.values(choices.CpuComm)
    assert INDEX_MODES == PLAN_INDEX_MODES == choices.values(choices.DcpIndex)
    assert KV_CACHE_DTYPES == choices.values(choices.KVCacheDType) and LAYOUTS == choices.values(
        choices.Layout
    )
    assert CACHE_MODES == choices.values(choices.CacheMode) and TRANSFERS == choices.values(choices.Transfer)
    assert POLICIES == choices.values(choices.Policy) and DISCOVERY == choices.values(choices.Discovery)
    assert RESTART_POLICIES == choices.values(choices.Restart)
