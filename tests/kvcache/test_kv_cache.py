"""KVPool storage: exact round trips in the model dtype, bounded error in fp8, byte counts."""

from __future__ import annotations

import pytest
import torch

from pdserve.checkpoints.presets import hf_config
from pdserve.kvcache.kv_cache import KVPool
from pdserve.model.config import ModelConfig

FP8_REL = 2.0**-4  # e4m3: 3 mantissa bits, round to nearest -> relative error <= 1/16


def tiny(arch: str = "glm_moe_dsa", **overrides) -> ModelConfig:
    return ModelConfig.from_dict({**hf_config(arch, "tiny"), **overrides})


def test_auto_round_trips_exactly_in_float64():
    cfg = tiny()
    pool = KVPool(cfg, 32, torch.float64)
    g = torch.Generator().manual_seed(0)
    slots = torch.tensor([3, 17, 0, 31])
    for layer in range(cfg.num_layers):
        kv = torch.randn(4, cfg.kv_entry_dim, generator=g, dtype=torch.float64)
        idx = (
            torch.randn(4, cfg.index_head_dim, generator=g, dtype=torch.float64)
            if cfg.has_indexer(layer)
            else None
        )
        pool.write(layer, slots, kv, idx)
        assert torch.equal(pool.read_kv(layer, slots), kv)
        if idx is not None:
            assert torch.equal(pool.read_index(layer, slots), idx)
    assert pool.kv.dtype == torch.float64 and pool.index_scale is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_latent_round_trip_within_fp8_precision(dtype):
    cfg = tiny()
    pool = KVPool(cfg, 64, dtype, kv_cache_dtype="fp8_e4m3")
    g = torch.Generator().manual_seed(1)
    # Normal fp8 range (>= 2^-6) up to a few hundred, both signs.
    mag = torch.exp(torch.empty(64, cfg.kv_entry_dim).uniform_(-4.0, 5.5, generator=g))
    kv = mag * torch.where(torch.rand(mag.shape, generator=g) < 0.5, -1.0, 1.0)
    slots = torch.arange(64)
    pool.write(1, slots, kv, None)
    out = pool.read_kv(1, slots)
    assert pool.kv.dtype == torch.float8_e4m3fn and out.dtype == dtype
    assert ((out.double() - kv.double()).abs() / kv.double().abs()).max() <= FP8_REL + 2**-8
    # Out-of-range values are clamped to the largest finite fp8 value, never inf/NaN.
    pool.write(1, slots[:2], torch.full((2, cfg.kv_entry_dim), 1e4), None)
    assert torch.all(pool.read_kv(1, slots[:2]) == 448)


def test_fp8_index_keys_of_very_different_magnitudes_keep_relative_precision():
    cfg = tiny()
    pool = KVPool(cfg, 16, torch.float32, kv_cache_dtype="fp8_e4m3")
    g = torch.Generator().manual_seed(2)
    base = torch.randn(6, cfg.index_head_dim, generator=g)
    keys = base * torch.tensor([1e-6, 1e-3, 1.0, 10.0, 1e3, 1e5]).unsqueeze(1)
    slots = torch.tensor([0, 5, 7, 9, 11, 15])
    pool.write(0, torch.arange(16), torch.zeros(16, cfg.kv_entry_dim), torch.zeros(16, cfg.index_head_dim))
    pool.write(0, slots, torch.zeros(6, cfg.kv_entry_dim), keys)
    out = pool.read_index(0, slots)
    # Per key, relative to its own largest value: the error a per-token scale promises.
    err = (out - keys).abs().amax(dim=1) / keys.abs().amax(dim=1)
    assert err.max() <= FP8_REL, err
    assert torch.equal(
        pool.read_index(0, torch.tensor([1, 2])), torch.zeros(2, cfg.index_head_dim)
    )  # zero keys


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "deepseek_v3"])
@pytest.mark.parametrize(
    "kv_cache_dtype,dtype", [("auto", torch.bfloat16), ("auto", torch.float64), ("fp8_e4m3", torch.bfloat16)]
)
def test_nbytes_per_slot_equals_the_formula(arch, kv_cache_dtype, dtype):
    cfg = tiny(arch)
    pool = KVPool(cfg, 48, dtype, kv_cache_dtype=kv_cache_dtype)
    per_token = KVPool.bytes_per_token(cfg, dtype, kv_cache_dtype=kv_cache_dtype)
    assert pool.nbytes == 48 * per_token
    item = 1 if kv_cache_dtype == "fp8_e4m3" else dtype.itemsize
    scale = 4 if kv_cache_dtype == "fp8_e4m3" else 0
    n_idx = len(cfg.indexer_layers)
    assert per_token == cfg.num_layers * cfg.kv_entry_dim * item + n_idx * (cfg.index_head_dim * item + scale)
    if kv_cache_dtype == "auto":  # the keyword's default keeps the old two-argument call working
        assert KVPool.bytes_per_token(cfg, dtype) == per_token


def test_index_slots_sizes_the_index_separately():
    cfg = tiny()
    pool = KVPool(cfg, 8, torch.float32, kv_cache_dtype="fp8_e4m3", index_slots=32)
    assert pool.kv.shape[1] == 8 and pool.index_k.shape[1] == 32 and pool.index_scale.shape == (2, 32)
    e_row, i_row = cfg.num_layers * cfg.kv_entry_dim, 2 * (cfg.index_head_dim + 4)
    assert pool.nbytes == 8 * e_row + 32 * i_row


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_layer_subset_pool_holds_only_those_layers(kv_cache_dtype):
    cfg = tiny()  # indexer on layers 0 and 2
    pool = KVPool(cfg, 16, torch.float32, layers=[1, 3], kv_cache_dtype=kv_cache_dtype)
    assert pool.layers == [1, 3] and [pool.holds(i) for i in range(4)] == [False, True, False, True]
    assert pool.kv_row == {1: 0, 3: 1} and pool.index_row == {}
    pool.write(3, torch.tensor([2]), torch.ones(1, cfg.kv_entry_dim), None)
    assert torch.equal(pool.read_kv(3, torch.tensor([2])), torch.ones(1, cfg.kv_entry_dim))
    assert pool.nbytes == 2 * 16 * cfg.kv_entry_dim * (1 if kv_cache_dtype == "fp8_e4m3" else 4)
    with pytest.raises(KeyError):
        pool.read_kv(0, torch.tensor([2]))
    mixed = KVPool(cfg, 16, torch.float32, layers=[1, 2], kv_cache_dtype=kv_cache_dtype)
    assert mixed.index_row == {2: 0} and mixed.index_k.shape[0] == 1


def test_unknown_kv_cache_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match=r"'fp8'.*auto, fp8_e4m3"):
        KVPool(tiny(), 4, torch.float32, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="fp4"):
        KVPool.bytes_per_token(tiny(), torch.float32, kv_cache_dtype="fp4")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_slices_index_lists_and_read_into_agree(kv_cache_dtype):
    """write_* by slice or by 1-D rows and read_into by (strided) slice or rows give read_*'s values."""
    cfg = tiny()
    by_rows, by_slice = (KVPool(cfg, 40, torch.float32, kv_cache_dtype=kv_cache_dtype) for _ in range(2))
    g = torch.Generator().manual_seed(5)
    layer = cfg.indexer_layers[0]
    kv, idx = torch.randn(10, cfg.kv_entry_dim, generator=g), torch.randn(10, cfg.index_head_dim, generator=g)
    by_rows.write_kv(layer, torch.arange(12, 22), kv)
    by_rows.write_index(layer, torch.arange(12, 22), idx)
    by_slice.write_kv(layer, slice(12, 22), kv)
    by_slice.write_index(layer, slice(12, 22), idx)
    assert torch.equal(by_rows.kv, by_slice.kv) and torch.equal(by_rows.index_k, by_slice.index_k)
    strided = torch.arange(12, 22, 3)
    for kind, read in (("kv", by_rows.read_kv), ("index", by_rows.read_index)):
        want = read(layer, strided)
        for slots in (strided, slice(12, 22, 3)):
            out = torch.full_like(want, float("nan"))
            by_rows.read_into(kind, layer, slots, out)
            assert torch.equal(out, want)


@pytest.mark.parametrize("residues", [2, 3])
def test_a_residue_major_pool_stores_the_same_slots(residues):
    """Slot meaning is unchanged (reads, writes by rows or slice equal a plain pool's); rows s, s + R, ...
    are consecutive in storage, which `span` returns as one view; other strides have no span."""
    cfg = tiny()
    plain, major = KVPool(cfg, 40, torch.float64), KVPool(cfg, 40, torch.float64, residues=residues)
    g = torch.Generator().manual_seed(6)
    slots = torch.randperm(40, generator=g)[:25]
    for layer in range(cfg.num_layers):
        kv = torch.randn(25, cfg.kv_entry_dim, generator=g, dtype=torch.float64)
        for pool in (plain, major):
            pool.write_kv(layer, slots, kv)
            pool.write_kv(layer, slice(3, 9), kv[:6] * 2)
    every = torch.arange(40)
    for layer in range(cfg.num_layers):
        assert torch.equal(major.read_kv(layer, every), plain.read_kv(layer, every))
        assert torch.equal(major.read_kv(layer, every.view(4, 10)), plain.read_kv(layer, every.view(4, 10)))
        out = torch.empty(4, cfg.kv_entry_dim, dtype=torch.float64)
        major.read_into("kv", layer, slice(5, 5 + 4 * residues, residues), out)
        span = major.span("kv", layer, 5, 4, residues)
        assert torch.equal(span, out) and torch.equal(
            out, plain.read_kv(layer, torch.arange(5, 5 + 4 * residues, residues))
        )
        assert span.is_contiguous() and major.span("kv", layer, 5, 4, 1) is None
    assert plain.span("kv", 0, 5, 4, 1) is not None and plain.span("kv", 0, 5, 4, 2) is None
    assert major.span("index", cfg.indexer_layers[0], 5, 4, 1) is not None  # index keys stay slot-ordered
    assert (
        major.span("kv", 0, 38, 2, residues) is None and major.span("kv", 0, -1, 1, residues) is None
    )  # out of range


@pytest.mark.parametrize("residues", [1, 2])
def test_kept_row_hashes_follow_every_write_and_copy(residues):
    """keep_row_hashes: the hash a pool keeps for each row (what a NIXL sender reads instead of hashing
    the rows it WRITEs) equals the hash of the row as stored, through writes by slots and by slice
    (float64 values stored as bf16: the stored bytes are hashed), index writes, copies, and for rows
    stored before it was turned on."""
    from functools import partial

    from pdserve.transfer.row_mac import row_macs

    cfg, key = tiny(), b"pool row hashes".ljust(32, b".")
    pool = KVPool(cfg, 40, torch.bfloat16, residues=residues)
    g = torch.Generator().manual_seed(9)
    indexed = cfg.indexer_layers[0]

    def rows(n: int, width: int) -> torch.Tensor:
        return torch.randn(n, width, generator=g, dtype=torch.float64)

    pool.write(indexed, torch.arange(10), rows(10, cfg.kv_entry_dim), rows(10, cfg.index_head_dim))
    pool.keep_row_hashes(partial(row_macs, key))
    assert sum(h.numel() * 8 for h in pool.row_hashes.values()) == pool.row_hash_nbytes(
        2
    )  # the fit check's count
    for layer in range(cfg.num_layers):
        slots = torch.randperm(40, generator=g)[:25]
        idx = rows(25, cfg.index_head_dim) if cfg.has_indexer(layer) else None
        pool.write(layer, slots, rows(25, cfg.kv_entry_dim), idx)
        pool.write_kv(layer, slice(3, 9), rows(6, cfg.kv_entry_dim))
    pool.write_index(indexed, slice(12, 20), rows(8, cfg.index_head_dim))
    pool.copy_kv(0, torch.tensor([1, 2]), torch.tensor([30, 31]))
    pool.copy_index(indexed, torch.tensor([4, 5]), torch.tensor([36, 39]))
    for layer in range(cfg.num_layers):
        spans = [("kv", r, 40 // residues, residues) for r in range(residues)]
        spans += [("index", 0, 40, 1)] if cfg.has_indexer(layer) else []
        for kind, start, n, step in spans:
            kept = pool.span_hashes(kind, layer, start, n, step)
            assert torch.equal(kept, row_macs(key, pool.span(kind, layer, start, n, step)))
    assert pool.span_hashes("kv", 0, 0, 4, residues + 1) is None  # no span: no hashes either
    assert KVPool(cfg, 40, torch.bfloat16).span_hashes("kv", 0, 0, 4, 1) is None  # a pool that keeps none
    with pytest.raises(ValueError, match="fp8"):
        KVPool(cfg, 8, torch.bfloat16, kv_cache_dtype="fp8_e4m3").keep_row_hashes(partial(row_macs, key))
