"""Fixtures of the hand-off tests: the model, the single-rank oracle and the real instances, kept
for the session so test_nixl_handoff.py and test_tcp_handoff.py share the shapes they both use."""

from __future__ import annotations

import pytest

from pdserve.engine.llm_engine import LLMEngine
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
