"""The bounds the benches state their results against, measured on this machine or counted from the
model: the float32 matmul rate (prefill), the memory-copy bandwidth and the bytes a decode step must
read (decode at batch 1). bench/ is on sys.path when a script runs."""

from __future__ import annotations

import statistics
import time


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _with_threads(threads: int, fn):
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def matmul_gflops(threads: int, n: int = 2048, repeats: int = 5) -> float:
    """This CPU's float32 matmul rate with `threads` torch threads: the better of torch.mm (this
    torch's BLAS, MKL) and oneDNN's product (pdserve/model/kernels.py `onednn_linear`, which the
    engine uses for prefill with PDSERVE_ONEDNN=1), best of `repeats` n x n products each. On this
    AMD EPYC oneDNN is about 2.2x MKL: the CPU can do that much, whichever the engine uses."""
    import torch

    from pdserve.model.kernels import ONEDNN_AVAILABLE, onednn_linear

    def measure():
        a, b = torch.randn(n, n), torch.randn(n, n)
        kernels = [lambda: torch.mm(a, b)] + ([lambda: onednn_linear(a, b)] if ONEDNN_AVAILABLE else [])
        rates = []
        for k in kernels:
            k()
            rates.append(2 * n**3 / _best(k, repeats) / 1e9)
        return max(rates)

    return _with_threads(threads, measure)


def memcpy_gbps(threads: int, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes copied per second by a large tensor copy with `threads` threads (best of `repeats`): the
    bytes it reads; its traffic (STREAM's convention, which decode_roofline's bound uses) is twice
    this, as it writes as many bytes as it reads."""
    import torch

    def measure():
        src = torch.ones(nbytes // 4)
        dst = torch.empty_like(src)
        dst.copy_(src)
        return nbytes / _best(lambda: dst.copy_(src), repeats) / 1e9

    return _with_threads(threads, measure)


def read_gbps(threads: int, nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Bytes per second a pure read stream reaches with `threads` threads: the sum of a large tensor
    (best of `repeats`). About memcpy's traffic (twice memcpy_gbps) on this machine: a decode step
    only reads, and a cold matrix-vector product can read this fast."""
    import torch

    def measure():
        src = torch.ones(nbytes // 4)
        src.sum()
        return nbytes / _best(src.sum, repeats) / 1e9

    return _with_threads(threads, measure)


def torch_calls(fn) -> int:
    """How many torch operator calls (views included) `fn()` makes: what a step costs in Python and
    dispatch, whatever its tensors' sizes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.calls += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.calls


def call_us(repeats: int = 20000) -> float:
    """The median-of-5 time of one small torch call (an add of two 8-element tensors), in µs: the
    fixed cost each call of a step pays before it touches any data."""
    import statistics

    import torch

    a, b = torch.ones(8), torch.ones(8)

    def run():
        for _ in range(repeats):
            torch.add(a, b)

    return 1e6 * statistics.median(_best(run, 1) for _ in range(5)) / repeats


def _active_params(model_dir: str) -> tuple[object, float, int]:
    """(config, parameters one token multiplies by, LM head parameters): routed experts scaled by
    top-k / E, no embedding table (a lookup), no norms or biases (not matmuls)."""
    import torch

    from pdserve.model.config import ModelConfig
    from pdserve.model.transformer import CausalLM

    cfg = ModelConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = CausalLM(cfg)
    per_token, head = 0.0, 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue
        if name.startswith("lm_head"):
            head = p.numel()
        elif ".experts." in name and cfg.n_routed_experts:
            per_token += p.numel() * cfg.num_experts_per_tok / cfg.n_routed_experts
        elif p.dim() >= 2:
            per_token += p.numel()
    return cfg, per_token, head


def prefill_gflop(model_dir: str, tokens: int) -> float:
    """Linear-layer GFLOP of prefilling `tokens` (2 x active parameters per token, the LM head once).
    Attention and the indexer's scores are left out, so this is a lower bound of the work."""
    _, per_token, head = _active_params(model_dir)
    return 2 * (per_token * tokens + head) / 1e9


def decode_bytes_per_step(model_dir: str, context: int, value_bytes: int = 4) -> dict:
    """Bytes one decode step at batch 1 must read: the active weights (top-k experts of each MoE
    layer), the LM head, and the cache: every cached index key of the indexer layers plus the
    selected (top-k, or all when dense) latent entries of every layer."""
    cfg, per_token, head = _active_params(model_dir)
    weights = (per_token + head) * value_bytes
    picked = min(cfg.index_topk, context) if cfg.index_topk else context
    latent = cfg.num_layers * picked * cfg.kv_entry_dim * value_bytes
    index = len(cfg.indexer_layers) * context * cfg.index_head_dim * value_bytes if cfg.index_topk else 0
    return {
        "weights": weights,
        "latent_cache": latent,
        "index_keys": index,
        "total": weights + latent + index,
    }


def decode_roofline(model_dir: str, context: int, ours: dict) -> dict:
    """Decode batch 1 against its memory bounds. `ours` is bench/engine.py's decode result: the
    median ms per step, and `bandwidth_windows`, each window's median step paired with the
    bandwidths measured right after it (a window without a step time only gives bandwidths).

    The bound: the bytes a step reads over memcpy's bandwidth counted as STREAM counts a copy (the
    bytes read plus the bytes written), which on this machine is about a pure read stream's rate.
    A copy's read rate alone (the convention before 2026-12-01) is no bound: a copy spends half its
    traffic writing, and the medium preset's step read faster than that (116-124% of it) while this
    VM's memory was slow.
    Fractions are the medians of the windows' fractions; the bandwidths are the windows' medians."""
    step = decode_bytes_per_step(model_dir, context)
    windows = ours.get("bandwidth_windows") or []
    median = lambda xs: statistics.median(xs) if xs else None  # noqa: E731

    def bound(gbps: float) -> float:
        return 1000 * step["total"] / gbps / 1e9  # ms per step

    def fraction(key: str, factor: float = 1.0) -> float | None:
        return median([bound(factor * w[key]) / w["ms_per_step"] for w in windows if w.get("ms_per_step")])

    copy_read = median([w["memcpy_read_GBps"] for w in windows])
    read = median([w["read_GBps"] for w in windows])
    calls, call_cost = ours.get("torch_calls_per_step"), ours.get("call_us")
    return {
        "ms_per_step": ours.get("ms_per_step"),
        "bytes_per_step": step,
        "memcpy_GBps_2_threads": 2 * copy_read,  # read + write, as STREAM's Copy counts
        "bound_ms_per_step": bound(2 * copy_read),
        "fraction_of_bound": fraction("memcpy_read_GBps", 2.0),
        "read_GBps_2_threads": read,
        "read_bound_ms_per_step": bound(read),
        "fraction_of_read_bound": fraction("read_GBps"),
        # the lenient convention, recorded to show it is no bound (fractions above 1 happen)
        "memcpy_read_GBps_2_threads": copy_read,
        "fraction_of_memcpy_read_rate": fraction("memcpy_read_GBps"),
        "windows": len([w for w in windows if w.get("ms_per_step")]),
        # what the step pays whatever its bytes: its torch calls at the cost of an empty one
        "torch_calls_per_step": calls,
        "call_us": call_cost,
        "call_floor_ms_per_step": calls * call_cost / 1000 if calls and call_cost else None,
    }
