"""bench/transfer.py (b): the per-byte work a hand-off adds to its WRITEs, each timed alone in one
process on one thread: packing one decode rank's rows into a contiguous buffer (when they are not
contiguous in the pool) and the room MAC a hand-off takes over every byte (docs/design.md invariant
8), which raw WRITEs skip: the receiver reads every byte for it; a NIXL sender sending from its
pool reads the sums the pool took as it stored the rows, a TCP sender reads the rows again. bench/ is on sys.path when a
script runs."""

from __future__ import annotations

import statistics
import time

import torch

MB = 1 << 20


def pack_cost(model: str, tokens: int, repeats: int) -> dict:
    """Packs decode rank 0's rows (tokens 0, 2, 4, ... of every layer: one run of step 2 per layer) of
    a full prefill pool into a staging buffer, as a sender does before a WRITE (tcp.pack_rows)."""
    from pdserve.kvcache.kv_cache import KVPool
    from pdserve.model.config import ModelConfig
    from pdserve.transfer.plan import Run
    from pdserve.transfer.tcp import pack_rows

    torch.set_num_threads(1)
    cfg = ModelConfig.from_pretrained(model)
    pool = KVPool(cfg, tokens, torch.float32)
    pool.kv.normal_()
    runs = (Run(0, 0, tokens // 2, 2),)
    staging = torch.empty(cfg.num_layers, tokens // 2, cfg.kv_entry_dim)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for layer in range(cfg.num_layers):
            pack_rows(pool, "kv", layer, runs, staging[layer])
        best = min(best, time.perf_counter() - t0)
    nbytes = staging.numel() * staging.element_size()
    print(
        f"pack: {nbytes / MB:.1f} MB of one decode rank's rows in {1000 * best:.1f} ms "
        f"({nbytes / best / 1e9:.2f} GB/s)",
        flush=True,
    )
    return {"bytes": nbytes, "seconds": best, "GBps": nbytes / best / 1e9}


def checksum_cost(model: str, tokens: int, repeats: int) -> dict:
    """The payload authentication a hand-off makes and raw WRITEs never make (docs/security.md):
    the room MAC (`RoomChecksum` under the frame key: keyed row hashes folded by row_mac.fold) of
    one decode rank's rows (tokens / 2 latent rows of every layer and, as the copied index ships
    them, every token's index keys of each indexer layer), taken by the receiver over the rows where
    they landed and by a sender over rows it packs (a NIXL sender reads the row hashes its pool kept
    for rows it WRITEs from the pool, KVPool.keep_row_hashes); and the TCP data frame's HMAC-SHA256 tag over
    the same bytes (taken by the TCP sender and receiver, not by NIXL)."""
    import hashlib
    import hmac

    from pdserve.model.config import ModelConfig
    from pdserve.transfer.base import RoomChecksum
    from pdserve.transfer.frames import DEV_FRAME_KEY

    torch.set_num_threads(1)
    cfg = ModelConfig.from_pretrained(model)
    n = tokens // 2
    rows = [torch.randn(n, cfg.kv_entry_dim) for _ in range(cfg.num_layers)]
    rows += [torch.randn(tokens, cfg.index_head_dim) for _ in cfg.indexer_layers]  # copied index: all
    flush_src, flush_dst = torch.ones(64 << 20), torch.empty(64 << 20)  # 256 MB: evicts the rows
    times, tag_times = [], []
    for _ in range(repeats):
        flush_dst.copy_(flush_src)  # the rows come from memory, as a pool's rows do
        t0, sums = time.perf_counter(), RoomChecksum(key=DEV_FRAME_KEY)
        for i, r in enumerate(rows):
            sums.update(0, i, "kv", r)
        sums.value()
        times.append(time.perf_counter() - t0)
        flush_dst.copy_(flush_src)
        t0 = time.perf_counter()
        for r in rows:
            hmac.new(DEV_FRAME_KEY, r.numpy(), hashlib.sha256).digest()
        tag_times.append(time.perf_counter() - t0)
    med, nbytes = statistics.median(times), sum(r.numel() * r.element_size() for r in rows)
    tag = statistics.median(tag_times)
    print(
        f"room MAC: {nbytes / MB:.1f} MB of one decode rank's rows (not in cache) in {1000 * med:.1f} ms "
        f"median ({nbytes / med / 1e9:.2f} GB/s, {1000 * med / (nbytes / MB):.2f} ms per MB, one core), taken "
        f"by the receiver (and a sender over the rows it packs); TCP frame tag (HMAC-SHA256) over the same bytes: "
        f"{1000 * tag:.1f} ms ({1000 * tag / (nbytes / MB):.2f} ms per MB)",
        flush=True,
    )
    return {
        "bytes": nbytes,
        "seconds": med,
        "seconds_min_max": [min(times), max(times)],
        "GBps": nbytes / med / 1e9,
        "ms_per_MB": 1000 * med / (nbytes / MB),
        "tcp_tag_seconds": tag,
        "tcp_tag_ms_per_MB": 1000 * tag / (nbytes / MB),
    }
