"""What the randomized equality sweep draws (issue 14), as plain seeded Python.

A *pair* is the instance topology: architecture, prefill (C_p, layout, cache, moe-tp, moe-ep), decode
(W, C_d, replicated q, kv-cache dtype, page size, moe-ep) and the data path between them. Starting rank
processes costs seconds, so each pair serves CASES_PER_PAIR drawn *cases*: index mode and merge
backend (switched on the running decode ranks), prefill chunk size, and a batch of 1-5 requests with
prompt lengths drawn to include 1, < C_d, = C_d and index_topk +- 1, and max_tokens 1-40.

Case K of seed S belongs to pair K // CASES_PER_PAIR and is drawn from its own generator, so
`--seed S --case K` rebuilds exactly that case (and its pair) without drawing any other.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import torch

from pdserve.prefill_server.layouts import ALLOWED_LAYOUTS

ARCHS = ("glm_moe_dsa", "deepseek_v32", "deepseek_v3")
DECODE_SHAPES = ((1, 1), (2, 1), (2, 2), (3, 1), (3, 3), (4, 1), (4, 2), (4, 4))  # (W, C_d), C_d | W
CASES_PER_PAIR = 12
TOPK = 8  # the tiny presets' index_topk
EXPERTS = 8  # the tiny presets' routed experts: --moe-ep only where the ranks divide them
TEST_FILE = "tests/sweep/test_sweep.py"


@dataclass(frozen=True)
class Pair:
    arch: str
    transfer: str  # tcp | nixl
    cp: int
    layout: str
    cache: str  # full | layer-split
    moe_tp: bool
    w: int
    c: int
    replicate_q: bool
    kv_cache_dtype: str  # auto (the model dtype) | fp8_e4m3
    page_size: int  # a multiple of C_d
    dtype: str = "float64"
    islands: bool = False  # the float32 islands (the servers' default); never with float64 here
    prefill_ep: bool = False  # --moe-ep on the prefill ranks
    decode_ep: bool = False  # --moe-ep on the decode ranks


@dataclass(frozen=True)
class Case:
    number: int  # K
    index_mode: str
    comm: str
    chunk: int
    lengths: tuple[int, ...]
    max_tokens: tuple[int, ...]

    def prompt(self, seed: int, i: int) -> list[int]:
        g = torch.Generator().manual_seed(hash((seed, self.number, i)) & 0x7FFFFFFF)
        return torch.randint(4, 500, (self.lengths[i],), generator=g).tolist()

    def only(self, keep: list[int]) -> "Case":
        """The same case with only the requests at these indexes (shrinking a failure)."""
        return Case(
            self.number,
            self.index_mode,
            self.comm,
            self.chunk,
            tuple(self.lengths[i] for i in keep),
            tuple(self.max_tokens[i] for i in keep),
        )


def draw_pair(seed: int, p: int) -> Pair:
    """Pair p of seed `seed`. The first three pairs of a run take one architecture each with
    C_p >= 2 and C_d >= 2, so every run has every architecture in CP, DCP and a hand-off."""
    rng = random.Random(f"{seed}/pair/{p}")
    arch = ARCHS[p % len(ARCHS)]
    cp = rng.randint(2 if p < len(ARCHS) else 1, 4)
    shapes = [s for s in DECODE_SHAPES if s[1] >= 2] if p < len(ARCHS) else DECODE_SHAPES
    w, c = rng.choice(shapes)
    layouts = ALLOWED_LAYOUTS[arch] if cp > 1 else ALLOWED_LAYOUTS[arch][:1]
    pair = Pair(
        arch,
        rng.choice(("tcp", "nixl")),
        cp,
        rng.choice(layouts),
        rng.choice(("full", "layer-split")),
        rng.random() < 0.5,
        w,
        c,
        c > 1 and rng.random() < 0.5,
        "fp8_e4m3" if rng.random() < 0.3 else "auto",
        c * rng.choice((1, 2, 4)),
    )
    # drawn last, so the fields above draw as they did before --moe-ep existed
    return replace(
        pair,
        prefill_ep=rng.random() < 0.4 and cp > 1 and EXPERTS % cp == 0,
        decode_ep=rng.random() < 0.4 and w > 1 and EXPERTS % w == 0,
    )


def draw_case(seed: int, k: int, pair: Pair) -> Case:
    rng = random.Random(f"{seed}/case/{k}")
    c = pair.c
    special = [1, max(1, c - 1), c, TOPK - 1, TOPK + 1]
    if rng.random() < 0.3:  # a short request alone in the batch
        lengths = [rng.choice([1, max(1, c - 1), c])]
    else:
        n = rng.randint(2, 5)
        lengths = [rng.choice(special) if rng.random() < 0.6 else rng.randint(2, 70) for _ in range(n)]
    max_tokens = [rng.choice((1, rng.randint(2, 12), rng.randint(2, 40))) for _ in lengths]
    return Case(
        k,
        rng.choice(("copy", "split")),
        rng.choice(("a2a", "ag_rs")),
        rng.choice((4096, 16, 5)),
        tuple(lengths),
        tuple(max_tokens),
    )


def repro_command(seed: int, k: int, keep: list[int] | None = None) -> str:
    cmd = f"pytest {TEST_FILE} --seed {seed} --case {k}"
    return cmd + (f" --requests {','.join(map(str, keep))}" if keep is not None else "")
