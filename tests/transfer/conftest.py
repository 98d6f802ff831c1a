"""Fixtures of the hand-off tests: the model, the single-rank oracle and the real instances, kept
for the session so test_nixl_handoff.py and test_tcp_handoff.py share the shapes they both use."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.kvcache.kv_cache import KVPool
from pdserve.model.config import ModelConfig
from tests.transfer.handoff_helpers import Instances


@pytest.fixture(scope="session")
def model_path(tiny_checkpoints):
    return str(tiny_checkpoints[("glm_moe_dsa", "make-model")])


@pytest.fixture(scope="session")
def single(model_path):
    return LLMEngine.from_pretrained(model_path, "float64", float32_islands=False, max_kv_tokens=512)


@pytest.fixture(scope="session")
def instances(model_path):
    inst = Instances(model_path)
    yield inst
    inst.close()


@pytest.fixture()
def pools(model_path):
    """(model config, a random source pool, an empty destination pool) of 64 slots: in-process data-path tests."""
    cfg = ModelConfig.from_pretrained(model_path)
    src, dst = KVPool(cfg, 64, torch.float64), KVPool(cfg, 64, torch.float64)
    src.kv.normal_(generator=torch.Generator().manual_seed(0))
    src.index_k.normal_(generator=torch.Generator().manual_seed(1))
    return cfg, src, dst
