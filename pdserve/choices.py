"""Every choice set of a flag or config field, defined once (torch-free).

Each is a str Enum: the CLI takes it as the option's type (typer lists its values), the config
dataclasses store the plain value and check it with `check`, and the modules that act on a choice
(`CACHE_MODES`, `COMM_MODES`, ...) take their tuples from here with `values`.
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


class Quantize(str, Enum):
    fp8 = "fp8"


class ModelDType(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float64 = "float64"


class KVCacheDType(str, Enum):
    auto = "auto"
    fp8_e4m3 = "fp8_e4m3"


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class AttentionOps(str, Enum):
    auto = "auto"
    torch = "torch"
    flashinfer = "flashinfer"


class Transfer(str, Enum):
    tcp = "tcp"
    nixl = "nixl"


class Layout(str, Enum):
    interleave = "interleave"
    zigzag = "zigzag"
    contiguous = "contiguous"


class CacheMode(str, Enum):
    full = "full"
    layer_split = "layer-split"


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


class Policy(str, Enum):
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
