"""`pdserve router` and `pdserve up` (the whole stack on one machine).

Their options are the option fields of `RouterConfig` / `StackConfig` (pdserve/flags.py); a command
declares only --internal-token-file and --check-config, and fills in what needs more than a copy
(the model, the tokens from the environment)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import typer

from .. import env
from ..flags import config_command
from ..instance_options import DEFAULT_MAX_KV_TOKENS
from ..router.config import RouterConfig
from ..router.launch import StackConfig
from .common import (
    InternalTokenFileOpt,
    app,
    fail,
    gpu_ids_value,
    internal_token,
    masked,
    model_arg,
    stack_token,
)


@app.command()
@config_command(RouterConfig, after={"internal_token_file": "internal_token"})
def router(
    values: dict,
    internal_token_file: InternalTokenFileOpt = None,
    check_config: bool = typer.Option(
        False,
        "--check-config",
        help="Validate the flags, print the config as JSON, and exit without starting.",
    ),
):
    """Run the router: an OpenAI-compatible API that sends each request to a prefill and a decode instance."""
    try:
        cfg = RouterConfig(
            **{
                **values,
                "model": str(model_arg(values["model"], check_config)),
                "prefill": tuple(values["prefill"]),
                "decode": tuple(values["decode"]),
                "allowed_instance_hosts": tuple(values["allowed_instance_hosts"]),
                "admin_token": RouterConfig.token_from_env(values["admin_token"]),
                "api_key": values["api_key"] or env.API_KEY.text(),
                "internal_token": internal_token(values["internal_token"], internal_token_file, check_config),
            }
        )
        cfg.validate_model()
    except ValueError as e:
        fail(str(e))
    if check_config:
        typer.echo(json.dumps(masked(asdict(cfg))))
        return
    if cfg.discovery == "k8s" and cfg.k8s_api is None and not os.environ.get("KUBERNETES_SERVICE_HOST"):
        fail("--discovery k8s outside a pod needs --k8s-api URL (no KUBERNETES_SERVICE_HOST)")
    from ..router.app import serve

    serve(cfg)


@app.command()
@config_command(StackConfig)
def up(
    values: dict,
    internal_token_file: InternalTokenFileOpt = None,
    check_config: bool = typer.Option(
        False,
        "--check-config",
        help="Validate the flags, print the stack's config as JSON, and exit without starting.",
    ),
):
    """Run the whole stack on this machine: prefill and decode instances plus the router, restarting an
    instance that dies; Ctrl-C stops it."""
    from ..router.launch import up as run_stack

    try:
        cfg = StackConfig(
            **{
                **values,
                "model": str(model_arg(values["model"], check_config)),
                "admin_token": RouterConfig.token_from_env(values["admin_token"]),
                "log_dir": str(values["log_dir"]),
                "internal_token": stack_token(values["internal_token"], internal_token_file),
                "gpu_ids": gpu_ids_value(values["gpu_ids"]),
            }
        )
        if not check_config and cfg.device == "cuda":  # the GPUs exist, before any process starts
            from ..runtime.device import check_devices

            check_devices("cuda", cfg.total_ranks, cfg.gpu_ids or ())
    except ValueError as e:
        fail(str(e))
    if not (Path(cfg.model) / "config.json").is_file():
        fail(f"{cfg.model} is not a checkpoint directory (no config.json)")
    if check_config:
        from .check_plan import echo_plan, up_plan

        try:
            plan = up_plan(
                cfg.model,
                cfg.prefill_instances,
                cfg.prefill_cp,
                cfg.decode_instances,
                cfg.decode_tp,
                cfg.decode_dcp,
                cfg.dcp_index,
                cfg.max_kv_tokens or DEFAULT_MAX_KV_TOKENS,
            )
        except ValueError as e:
            fail(str(e))
        echo_plan(masked(asdict(cfg)), plan)
        return
    raise typer.Exit(run_stack(cfg, echo=lambda line: typer.echo(line)))
