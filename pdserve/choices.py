"""Every choice set of a flag or config field, defined once (torch-free).

Each is a str Enum: the CLI takes it as the option's type (typer lists its values), the config
dataclasses store the plain value and check it with `check`, and the modules that act on a choice
(`CACHE_MODES`, `COMM_MODES`, ...) take their tuples from here with `values`. A set's docstring,
where it has one, says what its values mean: it is the help of every option that takes the set
without a help of its own (pdserve/flags.py `option`).
"""

from __future__ import annotations

from enum import Enum


class Arch(str, Enum):
    glm_moe_dsa = "glm_moe_dsa"
    deepseek_v32 = "deepseek_v32"
    deepseek_v3 = "deepseek_v3"


class Size(str, Enum):
    tiny = "tiny"
    small = "small"
    mla = "mla"  # the real MLA dims (kv_lora_rank 512, rope 64), 2 layers: the flashinfer checks
    medium = "medium"  # ~1.7 GB of weights, ~0.7 GB read per decode step: weight-bound decode


class Quantize(str, Enum):
    fp8 = "fp8"


class ModelDType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float64 = "float64"


class KVCacheDType(str, Enum):
    """KV cache storage: auto (the model dtype) or fp8_e4m3 (1 byte per value, index keys with a
    float32 scale)."""

    auto = "auto"
    fp8_e4m3 = "fp8_e4m3"


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class AttentionOps(str, Enum):
    auto = "auto"
    torch = "torch"
    flashinfer = "flashinfer"
    triton = "triton"


class LinearOps(str, Enum):
    """--linear-ops: engine/gemm_ops.py."""

    auto = "auto"
    torch = "torch"
    triton = "triton"
    scaled_mm = "scaled_mm"


class MoeOps(str, Enum):
    """--moe-ops: engine/gemm_ops.py."""

    auto = "auto"
    torch = "torch"
    triton = "triton"


class Transfer(str, Enum):
    """KV hand-off data path between prefill and decode instances: tcp (ZMQ over TCP) or nixl
    (NIXL/UCX one-sided WRITEs; RDMA or NVLink where present). Both sides must use the same."""

    tcp = "tcp"
    nixl = "nixl"


class Layout(str, Enum):
    """Token layout: interleave (token p on rank p % C_p; the only one for sparse-attention
    models), zigzag (2*C_p blocks, for dense models), contiguous (comparison only)."""

    interleave = "interleave"
    zigzag = "zigzag"
    contiguous = "contiguous"


class CacheMode(str, Enum):
    """full: every rank keeps every layer's cache; layer-split: each rank keeps a contiguous block
    of layers."""

    full = "full"
    layer_split = "layer-split"


class DcpIndex(str, Enum):
    """Sparse-attention index keys on a decode instance: copy (every rank keeps all) or split (by
    token like the cache; ranks merge top-k candidates)."""

    copy = "copy"
    split = "split"


class DcpComm(str, Enum):
    """How partial attention results are merged: a2a (all-to-all) or ag_rs (all-gather +
    reduce-scatter)."""

    a2a = "a2a"
    ag_rs = "ag_rs"


class CpuComm(str, Enum):
    """Collectives between CPU ranks: shm (shared memory, ~15 us each), gloo (loopback TCP, ~0.5 ms
    each) or auto (shm on x86; with --nnodes > 1 for the groups inside one node, gloo across nodes)."""

    auto = "auto"
    shm = "shm"
    gloo = "gloo"


class Policy(str, Enum):
    """How the router chooses an instance: round_robin; least_load (fewest in-flight requests, then
    shortest queue / most free KV tokens); or cache_aware (the instance whose prefix cache is
    expected to hold the longest prefix of the prompt, from the prompts routed there and the
    evictions it reports, unless it is overloaded; else least_load)."""

    round_robin = "round_robin"
    least_load = "least_load"
    cache_aware = "cache_aware"


class Switch(str, Enum):
    on = "on"
    off = "off"


class Discovery(str, Enum):
    static = "static"
    k8s = "k8s"


class Restart(str, Enum):
    """An instance that exits once the stack is up: on-failure starts it again on the same port
    (backoff 1 s doubling to 30 s; the router picks it up once healthy); never stops the whole
    stack (exit 1). The router exiting always stops the stack."""

    on_failure = "on-failure"
    never = "never"


def values(choices: type[Enum]) -> tuple[str, ...]:
    """The plain values of a choice set, in declaration order."""
    return tuple(c.value for c in choices)


def check(value: str, choices: type[Enum], flag: str) -> str:
    """`value` if it is one of `choices`, else ValueError naming the flag and the allowed values."""
    if value not in values(choices):
        raise ValueError(f"{flag} must be one of {', '.join(values(choices))}, got {value!r}")
    return value
