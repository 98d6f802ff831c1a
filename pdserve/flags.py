"""Each flag declared once: on its config dataclass field (torch-free, typer imported only to build a command).

A config field that is also a command-line option is declared with `option(default, help, ...)`:
the field's default, its help text, its flag name (default: `--` + the field name with dashes),
its lower bound and its choice set (a `choices.py` Enum, whose docstring is the help where the
field gives none) live in that one place. `config_command`
turns a config class into the typer signature of a subcommand: one option per such field, in field
order, followed by the command's own extra parameters (`after` places one behind a given field). The
command receives the fields' values as a dict (choices as their plain values), adds what needs more
than a copy (the model path, the internal token, a byte size given as text) and builds the config,
whose `__post_init__` checks what the option types cannot.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable
from dataclasses import MISSING, dataclass
from enum import Enum
from typing import Annotated, Any

MODEL_HELP = "Checkpoint directory. Default: the built-in small model."
SHUTDOWN_GRACE_HELP = (
    "Seconds running requests get to finish after SIGTERM: new requests and /health answer 503 "
    "(draining) at once; what still runs at the end gets an error; then exit 0. A second "
    "signal cuts it short."
)
DTYPE_HELP = (
    "Weights, activations and KV cache dtype (decode: the cache's unless --kv-cache-dtype says "
    "otherwise). Default: float32 on cpu, bfloat16 on cuda."
)
EXACT_DTYPE_HELP = (
    "Compute everything in --dtype: no float32 islands for norms, softmax, router and indexer scores "
    "(the reference's default numerics); for true float64 checks against a float64 reference."
)
DEVICE_HELP = (
    "Where the ranks run: cpu, or cuda (rank r on the r-th GPU of --gpu-ids; NCCL between ranks on "
    "distinct GPUs, the host comm for ranks sharing one). A GPU that is missing is a startup error."
)
GPU_IDS_HELP = (
    "--device cuda: comma-separated GPU ordinals, one per rank (e.g. 0,0 puts two ranks on GPU 0). "
    "Default: rank r uses GPU r."
)
ATTENTION_OPS_HELP = (
    "Attention kernels: torch (any device and dtype; the float32 reference), flashinfer (CUDA, bf16/fp16, "
    "MLA dims 512 + 64, flashinfer-python installed), triton (CUDA: MLA decode reading an fp8 or bf16 "
    "cache as stored, float32 accumulation; fp8 on compute capability 8.9+) or auto (flashinfer where it "
    "can run; with --kv-cache-dtype fp8_e4m3 on cuda triton, an error where neither runs; else torch). "
    "The choice and its reason are printed at startup; flashinfer or triton where it cannot run is an error."
)
LINEAR_OPS_HELP = (
    "Products with fp8 weights: torch (dequantized 128 rows at a time), triton (block-scaled fp8 GEMM, "
    "CUDA), scaled_mm (torch's block-scaled scaled_mm for prefill-sized products, triton below) or auto "
    "(scaled_mm, else triton, else torch). Other weights always use F.linear. Printed at startup; an "
    "implementation that cannot run is an error."
)
DEQUANTIZE_HELP = (
    "FP8 block-quantized checkpoints: dequantize every weight to --dtype as it is read. Without it an fp8 "
    "weight stays fp8 on cuda (weight + 128x128 block scales, multiplied by --linear-ops / --moe-ops) "
    "wherever the rank's slice falls on block boundaries; on cpu weights are always dequantized."
)
MOE_OPS_HELP = (
    "Routed experts: torch (the grouped loop) or triton (the fused MoE kernel: no host sync, bf16 or fp8, "
    "the shared expert folded in; CUDA) or auto (triton where it can run). Printed at startup; triton "
    "where it cannot run is an error."
)
MOE_EP_HELP = (
    "Expert parallelism: the routed experts are split by id across the ranks (rank r holds experts "
    "[r E/W, (r+1) E/W) whole, fp8 kept as in the checkpoint) instead of each rank holding a slice "
    "of every expert; the number of routed experts must be a multiple of the ranks. Decode: every "
    "rank holds every token, so nothing is exchanged beyond the usual all-reduce. Prefill: tokens go "
    "to their experts' ranks and back by all-to-all (with --moe-tp: no exchange, the block already "
    "sees every token)."
)
PREFIX_CACHE_HELP = (
    "Prefix cache: a radix tree over token ids keeps the KV pages of finished prompts, so a prompt "
    "that starts with a cached prefix (a shared system prompt, an earlier turn) computes only the "
    "rest; unreferenced cached pages are evicted, least recently used first, when memory runs short. "
    "On a decode instance the cached pages also keep generated tokens, and a hand-off ships only "
    "the rows it does not hold."
)
INTERNAL_TOKEN_HELP = (
    "The internal token that authenticates pdserve's own processes to each other (instance HTTP "
    "APIs, side channel, data path); the same on the router and every instance. Default: "
    "$PDSERVE_INTERNAL_TOKEN. A value given here is visible in `ps`: prefer the variable or "
    "--internal-token-file."
)

NODE_HELP = {
    "nnodes": "Hosts the instance's ranks are split over (the rank count must be a multiple): node 0 "
    "runs the HTTP API, the loop and its ranks, every other node an agent that runs its own. Default: "
    "$LWS_GROUP_SIZE (a LeaderWorkerSet pod), else 1.",
    "node_rank": "This host's node (0: the leader; its ranks are node_rank x ranks per node + 0, 1, ...). "
    "Default: $LWS_WORKER_INDEX, else 0.",
    "dist_addr": "HOST[:PORT] of node 0, the same on every node: the ranks' rendezvous listens there "
    "(PORT, default --dist-port) and the leader's node link at PORT + 1 (authenticated with the internal "
    "token). Default: $LWS_LEADER_ADDRESS, else 127.0.0.1.",
    "node_timeout": "Seconds a node (agent or leader) may stay silent before the instance counts it dead: "
    "the leader then fails its requests and restarts the whole group, /health answering 503 meanwhile.",
    "gloo_ifname": "Network interface of gloo between the ranks (GLOO_SOCKET_IFNAME). Default: "
    "$GLOO_SOCKET_IFNAME, else lo for a loopback --dist-addr, else the interface holding the address "
    "that reaches --dist-addr.",
    "nccl_ifname": "--device cuda: NCCL's socket interface (NCCL_SOCKET_IFNAME; default: NCCL's choice).",
    "nccl_ib_hca": "--device cuda: the InfiniBand / RoCE adapters NCCL uses between nodes (NCCL_IB_HCA, "
    "e.g. mlx5_0,mlx5_1; default: NCCL's choice).",
}


@dataclass(frozen=True)
class Flag:
    """How a config field appears on the command line."""

    help: str
    name: str | None = None  # e.g. "--shutdown-grace" for shutdown_grace_s; None: from the field name
    min: float | None = None
    choices: type[Enum] | None = None  # the option takes these values; the field holds the plain value
    cli_type: Any = None  # the option's type when it is not the field's (a path, a size given as text)
    cli_default: Any = None  # the option's default when it is not the field's (with has_cli_default)
    has_cli_default: bool = False
    # `pdserve up`: the (config class, field) pairs this option becomes in the processes it starts
    passes_to: tuple[tuple[type, str], ...] = ()

    def flag_name(self, field_name: str) -> str:
        return self.name or "--" + field_name.replace("_", "-")


def option(
    default: Any = MISSING,
    help: str = "",
    *,
    name: str | None = None,
    min: float | None = None,
    choices: type[Enum] | None = None,
    cli_type: Any = None,
    cli_default: Any = MISSING,
    repr: bool = True,
    default_factory: Callable[[], Any] | Any = MISSING,
    passes_to: tuple[tuple[type, str], ...] = (),
) -> Any:
    """A dataclass field that is also a command-line option (see the module docstring)."""
    has = cli_default is not MISSING
    if not help and choices is not None and choices.__doc__ != Enum.__doc__:  # the set's own help
        help = " ".join(inspect.cleandoc(choices.__doc__ or "").split())
    flag = Flag(help, name, min, choices, cli_type, cli_default if has else None, has, passes_to)
    if choices is not None and default is not MISSING and default is not None:
        default = choices(default).value  # a typo in a default fails at import
    return dataclasses.field(
        default=default, default_factory=default_factory, repr=repr, metadata={"flag": flag}
    )


def passed_on(
    *targets: tuple[type, str],
    who: str,
    name: str | None = None,
    default: Any = MISSING,
    help: str | None = None,
    **kw: Any,
) -> Any:
    """An option of a launcher (`pdserve up`) that it passes on as each target's own (config class,
    field): its choices, lower bound, help and default (unless `default` is given, e.g. None for
    "each process's own") are the first target's, so the two cannot drift apart; `who` says whose
    option it is in the help ("every prefill instance's"; `help` replaces the target's own text).
    `name`: the launcher's flag, when the target's would be ambiguous (--prefill-cp for --cp-size)."""
    cls, field = targets[0]
    f = {x.name: x for x in dataclasses.fields(cls)}[field]
    flag = f.metadata["flag"]
    text = help or flag.help
    if text[:1].isupper() and text[1:2].islower():  # "How ..." -> "...'s --policy: how ..."
        text = text[0].lower() + text[1:]
    help = f"{who[0].upper()}{who[1:]} {flag.flag_name(field)}: {text}"
    return option(
        f.default if default is MISSING else default,
        help,
        name=name or flag.name,
        min=flag.min,
        choices=flag.choices,
        passes_to=targets,
        **kw,
    )


def passed_values(cfg, target: type) -> dict[str, Any]:
    """target's field -> value for the options of `cfg` (a launcher's config) that pass on to it
    (`passed_on`); an option set to None is left out (the process's own default then holds)."""
    out = {}
    for f, flag in flagged_fields(type(cfg)):
        value = getattr(cfg, f.name)
        out |= {field: value for cls, field in flag.passes_to if cls is target and value is not None}
    return out


def as_args(cls, values: dict[str, Any]) -> list[str]:
    """The command-line arguments that give these fields of `cls` these values (a bool is an on-flag:
    given when true, left out at its default false; tuples comma-separated): how a launcher passes a
    config on to a process it starts."""
    fields = {f.name: (f, flag) for f, flag in flagged_fields(cls)}
    args: list[str] = []
    for field, value in values.items():
        f, flag = fields[field]
        name = flag.flag_name(field)
        if isinstance(value, bool):
            if not value and f.default is not False:
                raise ValueError(f"{name} is an on-flag: false cannot be passed on")
            args += [name] if value else []
        elif isinstance(value, tuple):
            args += [name, ",".join(str(v) for v in value)]
        else:
            args += [name, str(value)]
    return args


def flagged_fields(cls) -> list[tuple[dataclasses.Field, Flag]]:
    """The fields of a config dataclass that are command-line options, in field order."""
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(cls) if "flag" in f.metadata]


def _default(f: dataclasses.Field, flag: Flag) -> Any:
    default = flag.cli_default if flag.has_cli_default else f.default
    if default is MISSING:
        raise TypeError(f"option {f.name} needs a default or a cli_default")
    return flag.choices(default) if flag.choices is not None and default is not None else default


def warn_secret_on_argv(flag: str) -> None:
    """A secret given on the command line is readable by every user of the machine (ps,
    /proc/PID/cmdline): said on stderr, once per flag (its --help names the variable or file form)."""
    import sys

    print(
        f"warning: {flag} on the command line is visible to every user of this machine (ps, "
        f"/proc/<pid>/cmdline); prefer its environment variable or file form (see --help)",
        file=sys.stderr,
    )


def config_command(cls, after: dict[str, str] | None = None) -> Callable[[Callable], Callable]:
    """Decorator: `fn(values: dict, **extra)` becomes a typer command whose options are `cls`'s
    option fields (named and typed as declared there) plus fn's own keyword parameters `extra`;
    `after` maps an extra parameter to the field it follows (default: after every field)."""
    import typer

    hints = typing.get_type_hints(cls, include_extras=False)
    after = after or {}

    def decorate(fn: Callable) -> Callable:
        own = list(inspect.signature(fn, eval_str=True).parameters.values())[1:]
        fn_hints = typing.get_type_hints(fn, include_extras=True)
        own = [p.replace(annotation=fn_hints.get(p.name, p.annotation)) for p in own]
        by_field: dict[str, str] = {}  # parameter name -> field name
        params: list[inspect.Parameter] = []
        for f, flag in flagged_fields(cls):
            decl = flag.flag_name(f.name)
            pname = decl[2:].replace("-", "_")
            by_field[pname] = f.name
            typ = flag.cli_type or flag.choices or hints[f.name]
            info = typer.Option(decl, help=flag.help, min=flag.min)
            params.append(
                inspect.Parameter(
                    pname,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=_default(f, flag),
                    annotation=Annotated[typ, info],
                )
            )
            params += [
                p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own if after.get(p.name) == f.name
            ]
        params += [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own if p.name not in after]

        secrets = {f.name: flag.flag_name(f.name) for f, flag in flagged_fields(cls) if not f.repr}

        def command(**kwargs):
            values = {}
            for pname, field_name in by_field.items():
                value = kwargs.pop(pname)
                values[field_name] = value.value if isinstance(value, Enum) else value
                if field_name in secrets and value is not None:
                    warn_secret_on_argv(secrets[field_name])
            return fn(values, **kwargs)

        command.__name__, command.__qualname__, command.__doc__ = fn.__name__, fn.__qualname__, fn.__doc__
        command.__signature__ = inspect.Signature(params)
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate
