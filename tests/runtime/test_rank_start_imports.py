"""A cpu rank forks from a forkserver that imported only runtime/rank_process.py `_PRELOAD`: what a
rank runs at its start (the meta plan, the TP cut, materializing, loading) must not pull in torch's
Python meta references, whose first call imports torch._dynamo (~1 s of CPU) or torch.fx's symbolic
shapes with sympy (~0.3 s), in every rank of every instance start."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import sys, torch
from pdserve.decode_server.tp import shard_decode_model
from pdserve.model.weights import load_model, rank_model
path = sys.argv[1]
shard = lambda m: shard_decode_model(m, 1, 2, 1, False)  # W = 2: experts, heads and vocab cut
rank_model(path, torch.float32, shard=shard)  # the meta plan
load_model(path, torch.float64, shard=shard)
load_model(path, torch.float32)  # a whole model (prefill ranks, the single-rank engine)
print(" ".join(m for m in ("torch._dynamo", "torch.fx.experimental.symbolic_shapes", "sympy") if m in sys.modules))
"""


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "deepseek_v3"])
def test_loading_a_rank_model_imports_no_meta_reference_machinery(tiny_checkpoints, arch):
    path = tiny_checkpoints[(arch, "make-model")]
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(path)], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "", f"loading imported {out.stdout.strip()}"
