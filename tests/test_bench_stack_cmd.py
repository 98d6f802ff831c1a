"""The benches that start the whole stack (bench/serve.py, bench/prefix_cache.py) build a `pdserve up`
command line the real CLI takes: every flag is one of `up`'s options and none is given twice (a
flag StackProcess reads from the bench's arguments must exist there: prefix_cache.py once lacked
--policy and failed at start)."""

import pytest
import typer.main

from pdserve.cli.main import app


def up_options() -> set[str]:
    command = typer.main.get_command(app).commands["up"]
    return {opt for param in command.params for opt in param.opts}


def flags(cmd: list[str]) -> list[str]:
    assert cmd[1:4] == ["-m", "pdserve.cli", "up"]
    return [x for x in cmd[4:] if x.startswith("--")]


def check(cmd: list[str]) -> None:
    given = flags(cmd)
    assert not set(given) - up_options(), cmd
    assert len(given) == len(set(given)), cmd


def test_serve_bench_starts_a_valid_stack(bench_module):
    serve, stack = bench_module("serve"), bench_module("serve_stack")
    a = serve.parse_args(["--quick"])
    sp = stack.StackProcess(a, "/models/x", "/tmp/logs")
    check(sp.cmd)
    assert sp.cmd[sp.cmd.index("--policy") + 1] == "least_load"


@pytest.mark.parametrize("side", ["baseline", "cached"])
def test_prefix_cache_bench_starts_a_valid_stack_per_side(bench_module, side):
    pc = bench_module("prefix_cache")
    a = pc.parse_args(["--quick"])
    cache, policy = pc.SIDES[side]
    sp = pc.stack_process(a, side, "/models/x", "/tmp/logs")
    check(sp.cmd)
    assert sp.cmd[sp.cmd.index("--policy") + 1] == policy
    assert sp.cmd[sp.cmd.index("--prefix-cache") + 1] == cache
