"""tests/gpu: the checks that need a CUDA GPU (run by tests/gpu/device_check.sh on the GPU machine).

Without CUDA nothing here is collected (so nothing is reported as passed or skipped on CPU CI).
Run alone (`pytest tests/gpu --confcutdir=tests/gpu`), these tests import only torch, pytest and
what pdserve's rank processes import (safetensors, tokenizers, msgpack, pyzmq, llguidance): the GPU
machine has no fastapi, uvicorn or httpx, so the suite's root conftest is left out there. What they
import is carried by fetch_wheels.sh, and tests/test_gpu_imports.py checks that on CPU.
"""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    from pdserve.checkpoints.random_checkpoint import make_model

    return str(make_model(tmp_path_factory.mktemp("gpu") / "tiny", "glm_moe_dsa", "tiny", seed=0))


@pytest.fixture(scope="session")
def mla(tmp_path_factory):
    """The released MLA dims (kv_lora_rank 512, rope 64) in two layers: what flashinfer runs."""
    from pdserve.checkpoints.random_checkpoint import make_model

    return str(make_model(tmp_path_factory.mktemp("gpu") / "mla", "glm_moe_dsa", "mla", seed=0))
