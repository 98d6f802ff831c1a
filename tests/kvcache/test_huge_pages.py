"""kvcache/huge_pages.py: host KV pools on transparent huge pages, same values as torch.zeros."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from pdserve.checkpoints.presets import hf_config
from pdserve.kvcache import huge_pages
from pdserve.kvcache.kv_cache import KVPool
from pdserve.model.config import ModelConfig

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.parametrize(
    "shape,dtype", [((3, 700, 576), torch.float32), ((5,), torch.float64), ((2, 2 << 20), torch.uint8)]
)
def test_zeros_is_torch_zeros(shape, dtype):
    t = huge_pages.zeros(*shape, dtype=dtype)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert torch.equal(t, torch.zeros(*shape, dtype=dtype))
    if t.numel() * t.element_size() >= huge_pages.HUGE:
        assert t.data_ptr() % huge_pages.HUGE == 0  # aligned, so every whole 2 MiB of it can be huge
    t.fill_(1)  # writable, and views nothing another tensor owns
    assert int(t.sum()) == t.numel()


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages are off")
def test_a_kv_pool_lies_on_huge_pages():
    cfg = ModelConfig.from_dict(hf_config("glm_moe_dsa", "tiny"))
    pool = KVPool(cfg, 32768, torch.float32)
    assert pool.kv.numel() * pool.kv.element_size() >= 4 * huge_pages.HUGE
    assert huge_pages.huge_page_bytes(pool.kv) >= huge_pages.HUGE  # the kernel backed it with some
    if "[madvise]" in THP.read_text():  # the measure tells them apart: fresh memory nobody advised is not
        # (a fresh mapping: torch.zeros may reuse heap that an earlier pool advised)
        plain = mmap.mmap(-1, pool.kv.numel() * pool.kv.element_size())
        small = torch.frombuffer(plain, dtype=pool.kv.dtype).fill_(0)
        assert huge_pages.huge_page_bytes(small) == 0
        del small
