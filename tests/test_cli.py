"""The `pdserve` command line: make-model, generate --json, and --help for every flag."""

from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest
import typer

from pdserve.cli.main import app
from pdserve.engine.llm_engine import LLMEngine
from pdserve.model.tokenizer import Tokenizer
from pdserve.request import SamplingParams


def pdserve(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_make_model_then_generate_json_matches_engine(tmp_path):
    out = tmp_path / "m"
    proc = pdserve("make-model", str(out), "--arch", "deepseek_v32", "--size", "tiny", "--seed", "3")
    assert proc.returncode == 0, proc.stderr
    assert (out / "config.json").is_file()
    proc = pdserve(
        "generate",
        "--model",
        str(out),
        "--prompt",
        "hello world",
        "--max-new-tokens",
        "12",
        "--ignore-eos",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    tok = Tokenizer.from_pretrained(out)
    engine = LLMEngine.from_pretrained(out)
    want = engine.generate([tok.encode("hello world")], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert result["token_ids"] == want and len(want) == 12
    assert result["text"] == tok.decode(want)


def test_generate_token_ids_sampling_is_reproducible_with_a_seed(tiny_checkpoints):
    path = str(tiny_checkpoints[("glm_moe_dsa", "make-model")])
    args = (
        "generate",
        "--model",
        path,
        "--token-ids",
        "5,6,7",
        "--max-new-tokens",
        "10",
        "--temperature",
        "1.5",
        "--top-k",
        "50",
        "--top-p",
        "0.9",
        "--seed",
        "11",
        "--ignore-eos",
        "--json",
    )
    a, b = pdserve(*args), pdserve(*args)
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout) == json.loads(b.stdout)


@pytest.mark.parametrize(
    "args,message",
    [
        (("--prompt", "x", "--token-ids", "1"), "exactly one of"),
        (("--token-ids", "1,a"), "comma-separated integers"),
        (("--token-ids", "1", "--top-p", "0"), "top_p"),
    ],
)
def test_generate_bad_input_is_a_clear_error(tiny_checkpoints, args, message):
    proc = pdserve("generate", "--model", str(tiny_checkpoints[("glm_moe_dsa", "make-model")]), *args)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_every_flag_of_every_command_has_help():
    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        assert command.help, name
        for param in command.params:
            if isinstance(param, click.Option):
                assert param.help and len(param.help) > 10, f"{name} {param.opts}"
            else:
                assert getattr(param, "help", None), f"{name} argument {param.name}"


def test_help_lists_the_generate_flags():
    proc = pdserve("generate", "--help")
    assert proc.returncode == 0
    for flag in (
        "--model",
        "--prompt",
        "--token-ids",
        "--max-new-tokens",
        "--temperature",
        "--top-p",
        "--top-k",
        "--seed",
        "--dtype",
        "--json",
    ):
        assert flag in proc.stdout, flag
