"""The `pdserve` command line. One entry point, one subcommand per process role or tool."""

from __future__ import annotations

import json
import os
import sys
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from .admin_cli import KVCacheDType, admin_app, parse_bytes
from .admin_cli import ModelDType as DType

app = typer.Typer(
    help="pdserve: disaggregated prefill/decode serving for long-context MLA + sparse-attention models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


class Arch(str, Enum):
    glm_moe_dsa = "glm_moe_dsa"
    deepseek_v32 = "deepseek_v32"
    deepseek_v3 = "deepseek_v3"


class Size(str, Enum):
    tiny = "tiny"
    small = "small"


class Quantize(str, Enum):
    fp8 = "fp8"


BUILTIN_ARCH, BUILTIN_SIZE = "glm_moe_dsa", "small"


def builtin_model_dir() -> Path:
    """The built-in model, written once by `make-model` and reused."""
    root = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))
    return root / "models" / f"{BUILTIN_SIZE}-{BUILTIN_ARCH}-seed0"


def ensure_builtin_model() -> Path:
    path = builtin_model_dir()
    if not (path / "config.json").is_file():
        from .model.random_checkpoint import make_model

        print(f"building the built-in {BUILTIN_SIZE} {BUILTIN_ARCH} model in {path} (once)", file=sys.stderr)
        make_model(path, BUILTIN_ARCH, BUILTIN_SIZE, seed=0, overwrite=True)
    return path


def model_arg(model: Optional[Path], check_config: bool) -> Path:
    """--model, or the built-in model: built on first use, except by --check-config, which only reads config.json."""
    if check_config:
        from .check_plan import model_for_check
        from .model.presets import hf_config

        return model_for_check(model, builtin_model_dir(), hf_config(BUILTIN_ARCH, BUILTIN_SIZE))
    return model or ensure_builtin_model()


SHUTDOWN_GRACE_HELP = (
    "Seconds running requests get to finish after SIGTERM: new requests and /health answer 503 "
    "(draining) at once; what still runs at the end gets an error; then exit 0. A second "
    "signal cuts it short."
)


INTERNAL_TOKEN_HELP = (
    "The internal token that authenticates pdserve's own processes to each other (instance HTTP "
    "APIs, side channel, data path); the same on the router and every instance. Default: "
    "$PDSERVE_INTERNAL_TOKEN. A value given here is visible in `ps`: prefer the variable or "
    "--internal-token-file."
)
INTERNAL_TOKEN_FILE_HELP = "A file holding the internal token (e.g. a mounted Kubernetes Secret)."


def internal_token(flag: Optional[str], file: Optional[Path], check_config: bool) -> Optional[str]:
    """The internal token (engine/auth.py), required unless only the config is checked."""
    from .engine.auth import AuthConfigError, load_internal_token

    try:
        return load_internal_token(flag, str(file) if file else None, required=not check_config)
    except AuthConfigError as e:
        fail(str(e))


def _stack_token(flag: Optional[str], file: Optional[Path]) -> str:
    from .engine.auth import AuthConfigError, load_internal_token, new_token

    try:
        return load_internal_token(flag, str(file) if file else None, required=False) or new_token()
    except AuthConfigError as e:
        fail(str(e))


def masked(config: dict) -> dict:
    """A config for printing: secrets as "***" (or null when unset)."""
    return {
        k: ("***" if v else None) if k in ("internal_token", "admin_token", "api_key") else v
        for k, v in config.items()
    }


def fail(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)
    raise typer.Exit(2)


@app.command("make-model")
def make_model_cmd(
    out_dir: Path = typer.Argument(
        ..., help="Directory to write the checkpoint into (must be empty or absent)."
    ),
    arch: Arch = typer.Option(Arch.glm_moe_dsa, help="Architecture (Hugging Face model_type)."),
    size: Size = typer.Option(
        Size.tiny, help="tiny: for tests (seconds); small: for benchmarks (tens of millions of parameters)."
    ),
    seed: int = typer.Option(0, help="Random seed; the same seed writes byte-identical files."),
    max_shard_mb: Optional[float] = typer.Option(
        None,
        help="Split the weights into shards of at most this many MiB (with model.safetensors.index.json).",
    ),
    overwrite: bool = typer.Option(False, help="Replace OUT_DIR if it already holds files."),
    quantize: Optional[Quantize] = typer.Option(
        None,
        help="fp8: the released FP8 layout (e4m3 projection weights with a float32 weight_scale_inv per 128 x 128 block; norms, embeddings, LM head, router and indexer weights_proj unquantized).",
    ),
    check_config: bool = typer.Option(
        False, "--check-config", help="Validate the arguments, print them as JSON, and exit without writing."
    ),
):
    """Write a deterministic random checkpoint in the Hugging Face layout (transformers loads it too)."""
    shard = int(max_shard_mb * 2**20) if max_shard_mb else None
    if check_config:
        if shard is not None and shard <= 0:
            fail(f"--max-shard-mb must be positive, got {max_shard_mb}")
        if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not overwrite:
            fail(f"{out_dir} already holds files (give --overwrite to replace them)")
        typer.echo(
            json.dumps(
                {
                    "out_dir": str(out_dir),
                    "arch": arch.value,
                    "size": size.value,
                    "seed": seed,
                    "max_shard_bytes": shard,
                    "overwrite": overwrite,
                    "quantize": quantize.value if quantize else None,
                }
            )
        )
        return
    from .model.random_checkpoint import make_model

    try:
        path = make_model(
            out_dir,
            arch.value,
            size.value,
            seed=seed,
            max_shard_bytes=shard,
            overwrite=overwrite,
            quantize=quantize.value if quantize else None,
        )
    except (ValueError, FileExistsError) as e:
        fail(str(e))
    typer.echo(str(path))


def _parse_token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        fail(f"--token-ids must be comma-separated integers, got {text!r}")


@app.command()
def generate(
    model: Optional[Path] = typer.Option(
        None, help="Checkpoint directory. Default: the built-in small model (built on first use)."
    ),
    prompt: Optional[str] = typer.Option(
        None, help="Prompt text (tokenized with the checkpoint's tokenizer)."
    ),
    token_ids: Optional[str] = typer.Option(
        None, help="Prompt as comma-separated token ids, e.g. 1,2,3 (instead of --prompt)."
    ),
    chat: bool = typer.Option(
        False, help="Wrap --prompt as a user message with the checkpoint's chat template."
    ),
    max_new_tokens: int = typer.Option(32, min=1, help="Number of tokens to generate at most."),
    temperature: float = typer.Option(0.0, min=0.0, help="Sampling temperature; 0 means greedy."),
    top_p: float = typer.Option(
        1.0,
        min=0.0,
        max=1.0,
        help="Nucleus sampling: keep the smallest set of tokens with this much probability.",
    ),
    top_k: int = typer.Option(0, min=0, help="Keep only the k most likely tokens; 0 disables."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling (ignored when greedy)."),
    dtype: DType = typer.Option(DType.float32, help="Weights, activations and KV cache dtype."),
    threads: int = typer.Option(0, min=0, help="torch threads; 0 means one per CPU core."),
    ignore_eos: bool = typer.Option(False, help="Keep generating past the end-of-sequence token."),
    as_json: bool = typer.Option(
        False,
        "--json",
        help='Print one JSON object {"token_ids": [...], "text": "..."} (generated tokens only).',
    ),
):
    """Run the single-rank engine on one prompt and print the generated text."""
    import torch

    from .engine.llm_engine import LLMEngine
    from .engine.request import SamplingParams
    from .model.tokenizer import Tokenizer

    if (prompt is None) == (token_ids is None):
        fail("give exactly one of --prompt or --token-ids")
    torch.set_num_threads(threads or os.cpu_count() or 1)
    model_dir = model or ensure_builtin_model()
    if not (model_dir / "config.json").is_file():
        fail(f"{model_dir} is not a checkpoint directory (no config.json)")
    tok = Tokenizer.from_pretrained(model_dir)
    if prompt is not None:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
        ids = tok.encode(text)
    else:
        ids = _parse_token_ids(token_ids)
    if not ids:
        fail("the prompt is empty")
    try:
        params = SamplingParams(
            max_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            ignore_eos=ignore_eos,
        )
        engine = LLMEngine.from_pretrained(model_dir, dtype.value, max_kv_tokens=len(ids) + max_new_tokens)
        out = engine.generate([ids], params)[0]
    except ValueError as e:
        fail(str(e))
    text_out = tok.decode(out)
    if as_json:
        typer.echo(json.dumps({"token_ids": out, "text": text_out}))
    else:
        typer.echo(text_out)


class Layout(str, Enum):
    interleave = "interleave"
    zigzag = "zigzag"
    contiguous = "contiguous"


class CacheMode(str, Enum):
    full = "full"
    layer_split = "layer-split"


class Transfer(str, Enum):
    tcp = "tcp"
    nixl = "nixl"


@app.command()
def prefill(
    model: Optional[Path] = typer.Option(
        None, help="Checkpoint directory. Default: the built-in small model."
    ),
    cp_size: int = typer.Option(
        1, min=1, help="Context-parallel ranks C_p: the prompt's tokens are split across them."
    ),
    cp_layout: Layout = typer.Option(
        Layout.interleave,
        help="Token layout: interleave (token p on rank p % C_p; the only one for sparse-attention models), zigzag (2*C_p blocks, for dense models), contiguous (comparison only).",
    ),
    cache: CacheMode = typer.Option(
        CacheMode.full,
        help="full: every rank keeps every layer's cache; layer-split: each rank keeps a contiguous block of layers.",
    ),
    chunk_size: int = typer.Option(
        4096,
        min=1,
        help="Prompt tokens per prefill chunk; each chunk is split across the ranks, earlier chunks are read from the cache.",
    ),
    moe_tp: bool = typer.Option(
        False,
        "--moe-tp",
        help="Split MLP/MoE weights across the ranks (all-gather tokens, reduce-scatter outputs) instead of replicating them.",
    ),
    host: str = typer.Option("127.0.0.1", help="Address the HTTP control API listens on."),
    port: int = typer.Option(8100, help="Port of the HTTP control API."),
    dist_port: int = typer.Option(
        29500, help="TCP port the ranks use to form their torch.distributed group."
    ),
    dtype: DType = typer.Option(DType.float32, help="Weights, activations and KV cache dtype."),
    max_kv_tokens: int = typer.Option(
        65536, min=16, help="KV cache capacity in tokens (per rank, every rank holds the same slots)."
    ),
    threads_per_rank: int = typer.Option(1, min=1, help="torch threads in each rank process."),
    bootstrap_timeout: float = typer.Option(
        30.0,
        help="Seconds a hand-off request waits for its decode instance's page reservation before it fails.",
    ),
    transfer: Transfer = typer.Option(
        Transfer.tcp,
        help="KV hand-off data path to decode instances: tcp (ZMQ over TCP) or nixl (NIXL/UCX one-sided WRITEs; RDMA or NVLink where present). Both sides must use the same.",
    ),
    max_queue: int = typer.Option(
        256,
        min=1,
        help="Requests waiting to be prefilled beyond this many are refused with 429 and Retry-After (bounded admission; the router then tries another instance).",
    ),
    kv_residues: int = typer.Option(
        0,
        min=0,
        help="Store each layer's latent cache residue-major by R residues (slot s at row (s % R) * ceil(slots / R) + s // R), so each rank of a decode instance with C_d = R finds its tokens in contiguous rows, which --transfer nixl WRITEs straight from the cache without packing. 0 (default): the CP size. Any value works with any decode instance; only the packing cost differs.",
    ),
    shutdown_grace: float = typer.Option(30.0, min=0.0, help=SHUTDOWN_GRACE_HELP),
    internal_token_: Optional[str] = typer.Option(None, "--internal-token", help=INTERNAL_TOKEN_HELP),
    internal_token_file: Optional[Path] = typer.Option(None, help=INTERNAL_TOKEN_FILE_HELP),
    check_config: bool = typer.Option(
        False,
        "--check-config",
        help="Validate the flags and the checkpoint (config.json alone is enough), print the config and its plan (topology, weight and KV bytes per rank) as JSON, and exit without starting.",
    ),
):
    """Run a prefill instance: C_p rank processes with context parallelism, behind an HTTP control API."""
    from dataclasses import asdict

    from .prefill_server.server import PrefillServerConfig, serve

    try:
        cfg = PrefillServerConfig(
            shutdown_grace_s=shutdown_grace,
            internal_token=internal_token(internal_token_, internal_token_file, check_config),
            model=str(model_arg(model, check_config)),
            cp_size=cp_size,
            cp_layout=cp_layout.value,
            cache=cache.value,
            chunk_size=chunk_size,
            moe_tp=moe_tp,
            host=host,
            port=port,
            dist_port=dist_port,
            dtype=dtype.value,
            max_kv_tokens=max_kv_tokens,
            threads_per_rank=threads_per_rank,
            bootstrap_timeout_s=bootstrap_timeout,
            transfer=transfer.value,
            kv_residues=kv_residues,
            max_queue=max_queue,
        )
        cfg.validate_model()
        if check_config:
            from .check_plan import echo_plan, prefill_plan

            slots = -(-cfg.max_kv_tokens // cfg.page_size) * cfg.page_size
            plan = prefill_plan(cfg.model, cfg.cp_size, cfg.cache, cfg.moe_tp, cfg.dtype, slots)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    if check_config:
        echo_plan(masked(asdict(cfg)), plan)
        return
    serve(cfg)


class DcpIndex(str, Enum):
    copy = "copy"
    split = "split"


class DcpComm(str, Enum):
    a2a = "a2a"
    ag_rs = "ag_rs"


class CpuComm(str, Enum):
    auto = "auto"
    shm = "shm"
    gloo = "gloo"


@app.command()
def decode(
    model: Optional[Path] = typer.Option(
        None, help="Checkpoint directory. Default: the built-in small model."
    ),
    tp_size: int = typer.Option(
        1, min=1, help="Decode ranks W: attention heads are split across them (tensor parallel)."
    ),
    dcp_size: int = typer.Option(
        1,
        min=1,
        help="Decode context-parallel size C_d (must divide --tp-size): each group of C_d ranks splits the KV cache by token.",
    ),
    dcp_index: DcpIndex = typer.Option(
        DcpIndex.copy,
        help="Sparse-attention index keys: copy (every rank keeps all) or split (by token like the cache; ranks merge top-k candidates).",
    ),
    dcp_comm: DcpComm = typer.Option(
        DcpComm.a2a,
        help="How partial attention results are merged: a2a (all-to-all) or ag_rs (all-gather + reduce-scatter).",
    ),
    replicate_q_proj: bool = typer.Option(
        False,
        "--replicate-q-proj",
        help="Each rank keeps the query projection for every head slice of its DCP group, so queries need no all-gather (more weight memory).",
    ),
    kv_cache_dtype: KVCacheDType = typer.Option(
        KVCacheDType.auto,
        help="KV cache storage: auto (the model dtype) or fp8_e4m3 (1 byte per value, index keys with a float32 scale).",
    ),
    kv_memory: Optional[str] = typer.Option(
        None,
        help="KV cache budget per rank, e.g. 80GiB, 512MiB or plain bytes; sets the token capacity (instead of --max-kv-tokens).",
    ),
    max_kv_tokens: Optional[int] = typer.Option(
        None,
        min=1,
        help="KV cache capacity in tokens of the whole instance, rounded up to whole pages (default 65536 unless --kv-memory is given).",
    ),
    page_size: int = typer.Option(
        64, min=1, help="KV slots per page; must be a multiple of --dcp-size (pages are C_d-wide)."
    ),
    host: str = typer.Option("127.0.0.1", help="Address the HTTP API listens on."),
    port: int = typer.Option(8200, help="Port of the HTTP API."),
    dist_port: int = typer.Option(
        29600, help="TCP port the ranks use to form their torch.distributed group."
    ),
    dtype: DType = typer.Option(
        DType.float32,
        help="Weights and activations dtype (and KV cache dtype when --kv-cache-dtype is auto).",
    ),
    threads_per_rank: int = typer.Option(
        1, min=1, help="torch threads in each rank process (and in the server's local prefill)."
    ),
    max_batch: int = typer.Option(
        64, min=1, help="Most requests decoded together in one step (continuous batching)."
    ),
    max_queue: int = typer.Option(
        256,
        min=1,
        help="Accepted requests waiting for KV pages beyond this many are refused with 429 and Retry-After (bounded admission).",
    ),
    cpu_comm: CpuComm = typer.Option(
        CpuComm.auto,
        help="Collectives between CPU ranks: shm (shared memory, ~15 us each), gloo (loopback TCP, ~0.5 ms each) or auto (shm on x86).",
    ),
    transfer_timeout: float = typer.Option(
        30.0,
        help="Seconds a hand-off request waits for the prefill's rows after its pages were reserved before it fails.",
    ),
    heartbeat_timeout: float = typer.Option(
        5.0,
        help="Seconds of silence (no heartbeat) from a prefill instance after which its hand-offs in flight fail (it died).",
    ),
    data_host: str = typer.Option(
        "127.0.0.1",
        help="Address the ranks' TCP receivers (--transfer tcp) listen on and advertise to prefill ranks; on a cluster, this host's address that prefill hosts can reach (e.g. the pod IP).",
    ),
    transfer: Transfer = typer.Option(
        Transfer.tcp,
        help="KV hand-off data path from prefill instances: tcp (ZMQ over TCP) or nixl (NIXL/UCX one-sided WRITEs). Both sides must use the same.",
    ),
    shutdown_grace: float = typer.Option(30.0, min=0.0, help=SHUTDOWN_GRACE_HELP),
    transfer_quarantine: float = typer.Option(
        60.0,
        help="--transfer nixl: seconds the pages of a hand-off that failed while its prefill may still be sending stay out of use (NIXL WRITEs land in the cache itself; a late one must not reach another request).",
    ),
    internal_token_: Optional[str] = typer.Option(None, "--internal-token", help=INTERNAL_TOKEN_HELP),
    internal_token_file: Optional[Path] = typer.Option(None, help=INTERNAL_TOKEN_FILE_HELP),
    gpu_memory: Optional[str] = typer.Option(
        None,
        help="With --check-config: memory of one GPU, e.g. 141GiB; adds whether this instance fits one GPU per rank and, per C_d, the fewest ranks that hold the weights and the KV tokens they leave room for.",
    ),
    check_config: bool = typer.Option(
        False,
        "--check-config",
        help="Validate the flags and the checkpoint (config.json alone is enough), print the config with its num_slots and plan (topology, weight and KV bytes per rank) as JSON, and exit without starting.",
    ),
):
    """Run a decode instance: W rank processes with tensor + decode context parallelism, behind an HTTP API."""
    from dataclasses import asdict

    from .decode_server.server import DEFAULT_MAX_KV_TOKENS, DecodeServerConfig, serve

    if kv_memory is not None and max_kv_tokens is not None:
        fail("give either --kv-memory or --max-kv-tokens, not both")
    try:
        budget = parse_bytes(kv_memory) if kv_memory is not None else None
        cfg = DecodeServerConfig(
            model=str(model_arg(model, check_config)),
            tp_size=tp_size,
            dcp_size=dcp_size,
            shutdown_grace_s=shutdown_grace,
            internal_token=internal_token(internal_token_, internal_token_file, check_config),
            dcp_index=dcp_index.value,
            dcp_comm=dcp_comm.value,
            replicate_q_proj=replicate_q_proj,
            kv_cache_dtype=kv_cache_dtype.value,
            kv_memory=budget,
            max_kv_tokens=DEFAULT_MAX_KV_TOKENS
            if budget is None and max_kv_tokens is None
            else max_kv_tokens,
            page_size=page_size,
            host=host,
            port=port,
            dist_port=dist_port,
            dtype=dtype.value,
            threads_per_rank=threads_per_rank,
            max_batch=max_batch,
            cpu_comm=cpu_comm.value,
            transfer_timeout_s=transfer_timeout,
            transfer=transfer.value,
            heartbeat_timeout_s=heartbeat_timeout,
            data_host=data_host,
            transfer_quarantine_s=transfer_quarantine,
            max_queue=max_queue,
        )
        cfg.validate_model()
        num_slots = cfg.num_slots()
        if check_config:
            from .check_plan import decode_plan, echo_plan

            plan = decode_plan(
                cfg.model,
                cfg.tp_size,
                cfg.dcp_size,
                cfg.dcp_index,
                cfg.replicate_q_proj,
                cfg.dtype,
                cfg.kv_cache_dtype,
                cfg.page_size,
                num_slots,
                parse_bytes(gpu_memory) if gpu_memory is not None else None,
            )
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    if check_config:
        echo_plan(masked({**asdict(cfg), "num_slots": num_slots}), plan)
        return
    serve(cfg)


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
    internal_token_: Optional[str] = typer.Option(None, "--internal-token", help=INTERNAL_TOKEN_HELP),
    internal_token_file: Optional[Path] = typer.Option(None, help=INTERNAL_TOKEN_FILE_HELP),
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
    internal_token_file: Optional[Path] = typer.Option(None, help=INTERNAL_TOKEN_FILE_HELP),
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
            internal_token=_stack_token(internal_token_, internal_token_file),
        )
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


app.add_typer(admin_app, name="admin")


def main() -> None:
    import logging

    # server logs: errors with their id (engine/http_edge.py) and any traceback go to stderr
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    main()
