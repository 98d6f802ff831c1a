"""`pdserve router` and `pdserve up` (the whole stack on one machine)."""

from __future__ import annotations

import json
import os
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from .cli_common import (
    AttentionOpsOpt,
    DcpIndex,
    DeviceOpt,
    InternalTokenFileOpt,
    InternalTokenOpt,
    Transfer,
    app,
    device_args,
    fail,
    internal_token,
    masked,
    model_arg,
    stack_token,
)


class Restart(str, Enum):
    on_failure = "on-failure"
    never = "never"


class Policy(str, Enum):
    round_robin = "round_robin"
    least_load = "least_load"


class Discovery(str, Enum):
    static = "static"
    k8s = "k8s"


@app.command()
def router(
    prefill: list[str] = typer.Option(
        [],
        "--prefill",
        help="Base URL of a prefill instance, e.g. http://127.0.0.1:8100; repeat for several.",
    ),
    decode: list[str] = typer.Option(
        [], "--decode", help="Base URL of a decode instance, e.g. http://127.0.0.1:8200; repeat for several."
    ),
    model: Optional[Path] = typer.Option(
        None,
        help="Checkpoint directory whose tokenizer and chat template the router uses. Default: the built-in small model.",
    ),
    served_model_name: Optional[str] = typer.Option(
        None,
        help="The model name clients send and /v1/models lists. Default: the checkpoint directory's name.",
    ),
    policy: Policy = typer.Option(
        Policy.round_robin,
        help="How an instance is chosen: round_robin, or least_load (fewest in-flight requests, then shortest queue / most free KV tokens).",
    ),
    host: str = typer.Option("127.0.0.1", help="Address the OpenAI-compatible API listens on."),
    port: int = typer.Option(8000, help="Port of the OpenAI-compatible API."),
    admin_token: Optional[str] = typer.Option(
        None,
        help="Bearer token of the /admin API (default: PDSERVE_ADMIN_TOKEN; at least 24 random characters); without one the admin API is disabled.",
    ),
    api_key: Optional[str] = typer.Option(
        None,
        help="API key clients must send as `Authorization: Bearer KEY` on /v1/* (default: $PDSERVE_API_KEY); without one the OpenAI API is open.",
    ),
    internal_token_: InternalTokenOpt = None,
    internal_token_file: InternalTokenFileOpt = None,
    health_interval: float = typer.Option(2.0, help="Seconds between health checks of every instance."),
    max_attempts: int = typer.Option(
        3, min=1, help="Tries of one request on different instance pairs while no token reached the client."
    ),
    request_timeout: float = typer.Option(
        600.0,
        help="Deadline of one request, from arrival to its last token (every try and wait for room included); past it the client gets 504, or an error event once streaming began.",
    ),
    instance_timeout: float = typer.Option(
        300.0,
        help="Seconds an instance may stay silent before a try fails (and is retried elsewhere while no token was sent).",
    ),
    max_body_bytes: int = typer.Option(
        16 << 20, min=1, help="Request bodies larger than this are refused with 413 before they are parsed."
    ),
    max_prompt_bytes: int = typer.Option(
        8 << 20,
        min=1,
        help="Prompt text (or chat message contents) larger than this many UTF-8 bytes is refused with 400 before it is tokenized.",
    ),
    max_prompt_tokens: int = typer.Option(
        1 << 20,
        min=1,
        help="Prompts longer than this many tokens after tokenizing are refused with 400 (decode KV capacity is checked too).",
    ),
    max_in_flight: int = typer.Option(
        64,
        min=1,
        help="Requests of this router running on one instance at once; when every instance is full, requests wait for room.",
    ),
    max_queue: int = typer.Option(
        256,
        min=1,
        help="Requests that may wait for an instance with room; beyond that the router answers 429 with Retry-After.",
    ),
    discovery: Discovery = typer.Option(
        Discovery.static,
        help="static: only the --prefill / --decode URLs; k8s: also the Ready pods that match --selector, added and removed as they come and go (labels: deploy/README.md).",
    ),
    selector: Optional[str] = typer.Option(
        None, help="With --discovery k8s: the instances' pod label selector, KEY=VALUE[,KEY=VALUE]."
    ),
    namespace: Optional[str] = typer.Option(
        None, help="With --discovery k8s: the pods' namespace (default: the router pod's own)."
    ),
    k8s_api: Optional[str] = typer.Option(
        None,
        help="With --discovery k8s: the Kubernetes API base URL (default: the in-cluster API server with the pod's service account).",
    ),
    check_config: bool = typer.Option(
        False,
        "--check-config",
        help="Validate the flags, print the config as JSON, and exit without starting.",
    ),
):
    """Run the router: an OpenAI-compatible API that sends each request to a prefill and a decode instance."""
    from dataclasses import asdict

    from .router.config import RouterConfig

    try:
        cfg = RouterConfig(
            model=str(model_arg(model, check_config)),
            prefill=tuple(prefill),
            decode=tuple(decode),
            policy=policy.value,
            served_model_name=served_model_name,
            host=host,
            port=port,
            admin_token=RouterConfig.token_from_env(admin_token),
            health_interval_s=health_interval,
            api_key=api_key or os.environ.get("PDSERVE_API_KEY") or None,
            internal_token=internal_token(internal_token_, internal_token_file, check_config),
            max_attempts=max_attempts,
            request_timeout_s=request_timeout,
            instance_timeout_s=instance_timeout,
            max_body_bytes=max_body_bytes,
            max_prompt_bytes=max_prompt_bytes,
            max_prompt_tokens=max_prompt_tokens,
            max_in_flight=max_in_flight,
            max_queue=max_queue,
            discovery=discovery.value,
            selector=selector,
            namespace=namespace,
            k8s_api=k8s_api,
        )
    except ValueError as e:
        fail(str(e))
    if check_config:
        typer.echo(json.dumps(masked(asdict(cfg))))
        return
    if cfg.discovery == "k8s" and cfg.k8s_api is None and not os.environ.get("KUBERNETES_SERVICE_HOST"):
        fail("--discovery k8s outside a pod needs --k8s-api URL (no KUBERNETES_SERVICE_HOST)")
    from .router.app import serve

    serve(cfg)


@app.command()
def up(
    model: Optional[Path] = typer.Option(
        None, help="Checkpoint directory. Default: the built-in small model (built once, then reused)."
    ),
    prefill_instances: int = typer.Option(1, min=1, help="Number of prefill instances N."),
    prefill_cp: int = typer.Option(1, min=1, help="Context-parallel ranks C_p of every prefill instance."),
    decode_instances: int = typer.Option(1, min=1, help="Number of decode instances M."),
    decode_tp: int = typer.Option(1, min=1, help="Ranks W of every decode instance (tensor parallel)."),
    decode_dcp: int = typer.Option(
        1, min=1, help="Decode context-parallel size C_d of every decode instance (must divide --decode-tp)."
    ),
    dcp_index: DcpIndex = typer.Option(
        DcpIndex.copy,
        help="Decode sparse-attention index: copy (every rank keeps all keys) or split (by token).",
    ),
    transfer: Transfer = typer.Option(
        Transfer.tcp, help="KV hand-off data path between the instances: tcp or nixl."
    ),
    max_kv_tokens: Optional[int] = typer.Option(
        None,
        min=16,
        help="KV cache capacity in tokens of every instance (default: each server's own default).",
    ),
    policy: Policy = typer.Option(
        Policy.round_robin, help="The router's choice of instances: round_robin or least_load."
    ),
    host: str = typer.Option("127.0.0.1", help="Address the router's OpenAI-compatible API listens on."),
    port: int = typer.Option(8000, help="Port of the router's OpenAI-compatible API."),
    admin_token: Optional[str] = typer.Option(
        None, help="Bearer token of the router's /admin API (default: PDSERVE_ADMIN_TOKEN); none disables it."
    ),
    log_dir: Path = typer.Option(
        Path("pdserve-logs"), help="Directory for one log file per started process."
    ),
    ready_timeout: float = typer.Option(
        600.0, help="Seconds every process gets to become healthy before the launch is given up."
    ),
    restart: Restart = typer.Option(
        Restart.on_failure,
        help="An instance that exits once the stack is up: on-failure starts it again on the same port (backoff 1 s doubling to 30 s; the router picks it up once healthy); never stops the whole stack (exit 1). The router exiting always stops the stack.",
    ),
    shutdown_grace: float = typer.Option(
        30.0,
        min=0.0,
        help="Every instance's --shutdown-grace: on Ctrl-C / SIGTERM the instances drain this long (new requests 503, running ones finish) before they stop.",
    ),
    internal_token_: Optional[str] = typer.Option(
        None,
        "--internal-token",
        help="The stack's internal token (default: $PDSERVE_INTERNAL_TOKEN, else a new random one); it reaches the router and the instances through their environment, never their command lines.",
    ),
    internal_token_file: InternalTokenFileOpt = None,
    device: DeviceOpt = "cpu",
    gpu_ids: Optional[str] = typer.Option(
        None,
        help="--device cuda: comma-separated GPU ordinals, one per rank of the whole stack (prefill instances' ranks first, then decode instances'); the same ordinal twice puts two ranks on one GPU. Default: 0, 1, 2, ...",
    ),
    attention_ops: AttentionOpsOpt = "auto",
    check_config: bool = typer.Option(
        False,
        "--check-config",
        help="Validate the flags, print the stack's config as JSON, and exit without starting.",
    ),
):
    """Run the whole stack on this machine: prefill and decode instances plus the router, restarting an
    instance that dies; Ctrl-C stops it."""
    from .router.config import RouterConfig
    from .router.launch import StackConfig
    from .router.launch import up as run_stack

    try:
        cfg = StackConfig(
            model=str(model_arg(model, check_config)),
            prefill_instances=prefill_instances,
            prefill_cp=prefill_cp,
            decode_instances=decode_instances,
            decode_tp=decode_tp,
            decode_dcp=decode_dcp,
            dcp_index=dcp_index.value,
            transfer=transfer.value,
            host=host,
            port=port,
            policy=policy.value,
            admin_token=RouterConfig.token_from_env(admin_token),
            log_dir=str(log_dir),
            max_kv_tokens=max_kv_tokens,
            ready_timeout_s=ready_timeout,
            restart=restart.value,
            shutdown_grace_s=shutdown_grace,
            internal_token=stack_token(internal_token_, internal_token_file),
            attention_ops=attention_ops.value,
            **device_args(device, gpu_ids),
        )
        if not check_config and cfg.device == "cuda":  # the GPUs exist, before any process starts
            from .engine.device import check_devices

            check_devices("cuda", cfg.total_ranks, cfg.gpu_ids or ())
    except ValueError as e:
        fail(str(e))
    if not (Path(cfg.model) / "config.json").is_file():
        fail(f"{cfg.model} is not a checkpoint directory (no config.json)")
    if check_config:
        from dataclasses import asdict

        from .check_plan import echo_plan, up_plan

        try:
            plan = up_plan(
                cfg.model,
                prefill_instances,
                prefill_cp,
                decode_instances,
                decode_tp,
                decode_dcp,
                dcp_index.value,
                max_kv_tokens or 65536,
            )
        except ValueError as e:
            fail(str(e))
        echo_plan(masked(asdict(cfg)), plan)
        return
    raise typer.Exit(run_stack(cfg, echo=lambda line: typer.echo(line)))
