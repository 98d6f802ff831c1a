"""The native few-row product (native/rows.c): float32 x [M <= 8, K] times W [N, K]^T on the CPU,
and the other ops of a decode step (below), built with the machine's C compiler at first use and
called through ctypes.

Why: a decode step's products have one row per request, so each is a read of W and little else,
and its speed is the rate W is read at. The kernels torch ships do not read at the memory's rate
for this shape. Cold W on this AMD EPYC VM (2 threads, `python bench/engine.py` has the step-level
effect), reading rates in GB/s:

    W (N x K)      MKL (W x^T)^T   oneDNN   plain sum of W   this kernel
    512 x 512            12          13            33             32
    2048 x 2048          14          21-29         41-44          30-41
    4096 x 2048          15          32-33         44-48          41-44

Torch's own sum reading the same matrix is the yardstick: this kernel streams each thread's block
of W once, in order, as a sum does.

The rest of a decode step is many small ops, each slower than its arithmetic: after a weight
stream has flushed the caches, a torch op on a [1, 2048] row costs 20-60 us (an RMSNorm is seven of
them). So the same library holds one call each for what a step does between its products:
attention with its log-sum-exp over keys given, or over a sparse layer's selection read where it
lies in the cache (native/attend.c, also a sparse prefill's sub-blocks of a few dozen queries),
the DSA indexer's scores and its top-k (exactly torch's tie rule; a NaN score keeps torch's),
RMSNorm, the grouped MoE routing of a step's few tokens and their routed experts (native/moe.c). Medium preset, batch 1, an
in-process A/B on this VM (these ops on / off): 36.7 vs 38.3 ms per step; small model 7.1 vs 10.6 ms.

Inputs are checked by the `*_usable` functions; anything else (float64, other devices, more rows,
an odd layout) keeps torch's kernels, and so does a machine where the kernel cannot be built (no C
compiler, a CPU without AVX2 and FMA, a torch without libgomp): `status()` says which, and the
servers print it at startup. PDSERVE_NATIVE=0 turns it off.

One kernel is not a decode step's: the keyed row hashes of the hand-off's room MAC
(transfer/row_mac.py, native/rowhash.c, `row_hash`): Toeplitz NH over the rows' bytes, unsigned
64-bit arithmetic: the room MAC of one decode rank's rows of a 16k-token hand-off (42 MB, not in
cache, one core) at 13.1 GB/s, against 7.0-7.2 GB/s for the polynomial hash it replaced
(bench/transfer_costs.py `checksum_cost`; docs/security.md, Room MAC).

The library itself (where it is built, how it is loaded and called): native/lib.py.
"""

from __future__ import annotations

import torch

from .lib import MAX_ROWS, _call, _floats, _lib, _out, _state, status  # noqa: F401 (the API)

MAX_HEADS = 1024  # attend.c MAX_HEADS
MAX_BATCH = 64  # queries with keys of their own (a decode batch) that attend / index_scores take
ROW_HASH_LANES, ROW_HASH_SHIFT = 2, 4  # rowhash.c LANES, SHIFT (transfer/row_mac.py defines the hash)


def row_hash_key_words(length: int) -> int:
    """Key words the row hash of a row of `length` bytes takes: its 32-bit words (zero-padded to whole
    8-byte pairs), plus ROW_HASH_SHIFT per lane after the first."""
    return (length + 7) // 8 * 2 + ROW_HASH_SHIFT * (ROW_HASH_LANES - 1)


def usable(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether x [M, K] (M <= MAX_ROWS) times w [N, K]^T (+ b [N]) can take the kernel: float32 CPU
    tensors whose rows are contiguous, and the kernel built."""
    return (
        x.dim() == 2
        and w.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.shape[1] == w.shape[1]
        and x.stride(1) == 1
        and w.stride(1) == 1
        and _floats(x, w)
        and (b is None or (_floats(b) and b.is_contiguous() and b.shape == w.shape[:1]))
        and _lib() is not None
    )


def heads_usable(x: torch.Tensor, w: torch.Tensor, contract: int) -> bool:
    """Whether x [M, H, D] (M <= MAX_ROWS) and w [H, a, b] can take a heads kernel: x's dim 2 and
    w's dim `contract` (2: heads_linear, 1: heads_axpy) of one size, float32 CPU tensors with
    contiguous last dims, and the kernels built."""
    return (
        x.dim() == 3
        and w.dim() == 3
        and 0 < x.shape[0] <= MAX_ROWS
        and x.shape[1] == w.shape[0]
        and x.shape[2] == w.shape[contract]
        and x.stride(2) == 1
        and w.stride(2) == 1
        and _floats(x, w)
        and _lib() is not None
    )


def rows_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T (+ b) -> [M, N] by the kernel (one head of `heads_linear`, without its views: a decode
    step makes this call some hundred times); the caller checked `usable`."""
    (M, K), N = x.shape, w.shape[0]
    y = _out(x, M, N)
    bias = b.data_ptr() if b is not None else None
    _call("pd_heads_linear", x.data_ptr(), x.stride(0), 0, w.data_ptr(), w.stride(0), 0, bias,
          y.data_ptr(), N, 0, M, 1, N, K)  # fmt: skip
    return y


def heads_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, H, K], w [H, N, K] (+ b [N]) -> y [M, H, N], y[m, h] = w[h] x[m, h] (+ b); the caller
    checked `heads_usable(x, w, 2)` (and the bias, as `usable` does)."""
    (M, H, K), N = x.shape, w.shape[1]
    y = _out(x, M, H, N)
    xs, ws = x.stride(), w.stride()
    bias = b.data_ptr() if b is not None else None
    _call("pd_heads_linear", *(x.data_ptr(), xs[0], xs[1]), *(w.data_ptr(), ws[1], ws[0]), bias,
          *(y.data_ptr(), H * N, N), M, H, N, K)  # fmt: skip
    return y


def heads_axpy(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, H, N], w [H, N, C] -> y [M, H, C], y[m, h] = x[m, h] w[h]; the caller checked
    `heads_usable(x, w, 1)`."""
    (M, H, N), C = x.shape, w.shape[2]
    y = _out(x, M, H, C)
    xs, ws = x.stride(), w.stride()
    _call("pd_heads_axpy", *(x.data_ptr(), xs[0], xs[1]), *(w.data_ptr(), ws[1], ws[0]),
          *(y.data_ptr(), H * C, C), M, H, N, C)  # fmt: skip
    return y


def _few_queries(q: torch.Tensor, keys: torch.Tensor) -> bool:
    """q [B, H, D] against keys [S, D] shared (B <= MAX_ROWS: more queries over the same keys are
    a prefill, a matmul's job) or [B, S, D] per query (B <= MAX_BATCH: a decode batch)."""
    if keys.dim() == 2:
        return 0 < q.shape[0] <= MAX_ROWS
    return keys.dim() == 3 and 0 < q.shape[0] <= MAX_BATCH and keys.shape[0] == q.shape[0]


def attend_usable(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, dv: int) -> bool:
    """Whether `kernels.attend`'s q [B, H, D], keys [S, D] or [B, S, D] (`_few_queries`) and valid
    [B, S] can take `attend`: float32 CPU tensors with contiguous last dims, a bool mask, values
    within the keys, and the kernels built."""
    return (
        q.dim() == 3
        and 0 < q.shape[1] <= MAX_HEADS
        and _few_queries(q, keys)
        and keys.shape[-1] == q.shape[2]
        and 0 < dv <= q.shape[2]
        and valid.dtype == torch.bool
        and valid.shape == (q.shape[0], keys.shape[-2])
        and valid.device.type == "cpu"
        and q.stride(2) == 1
        and keys.stride(-1) == 1
        and _floats(q, keys)
        and _lib() is not None
    )


def attend(
    q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scale: float, dv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.attend` by the kernel (native/attend.c): out [B, H, dv], lse [B, H]; the caller
    checked `attend_usable`."""
    (B, H, D), S = q.shape, keys.shape[-2]
    out, lse = _out(q, B, H, dv), _out(q, B, H)
    qs, vs = q.stride(), valid.stride()
    ks = (0, keys.stride(0)) if keys.dim() == 2 else keys.stride()[:2]
    _call("pd_attend", *(q.data_ptr(), qs[0], qs[1]), *(keys.data_ptr(), *ks), None, 0,
          *(valid.data_ptr(), *vs), out.data_ptr(), lse.data_ptr(), B, H, S, D, dv, scale)  # fmt: skip
    return out, lse


def attend_rows_usable(q: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, dv: int) -> bool:
    """Whether q [B, H, D] (B <= MAX_BATCH) over the rows `rows` [B, S] (int64, -1: no key) of
    table [N, D] can take `attend_rows`: float32 CPU tensors, contiguous row ids, and the kernels built."""
    return (
        q.dim() == 3
        and 0 < q.shape[0] <= MAX_BATCH
        and 0 < q.shape[1] <= MAX_HEADS
        and table.dim() == 2
        and table.shape[1] == q.shape[2]
        and 0 < dv <= q.shape[2]
        and rows.dtype == torch.int64
        and rows.dim() == 2
        and rows.shape[0] == q.shape[0]
        and rows.is_contiguous()
        and rows.is_cpu
        and q.stride(2) == 1
        and table.stride(1) == 1
        and _floats(q, table)
        and _lib() is not None
    )


def attend_rows(
    q: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, scale: float, dv: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kernels.attend(q, table[rows], rows >= 0, scale, dv)` without the gathered copy: the kernel
    reads each selected row where it is. The caller checked `attend_rows_usable`; a valid row id
    beyond the table is an IndexError."""
    (B, H, D), S = q.shape, rows.shape[1]
    out, lse = _out(q, B, H, dv), _out(q, B, H)
    valid = rows >= 0
    qs = q.stride()
    _call("pd_attend", *(q.data_ptr(), qs[0], qs[1]), *(table.data_ptr(), S, table.stride(0)),
          rows.data_ptr(), table.shape[0], *(valid.data_ptr(), S, 1), out.data_ptr(), lse.data_ptr(),
          B, H, S, D, dv, scale)  # fmt: skip
    return out, lse


def moe_usable(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether a decode step's rows x [M, H] (M <= MAX_ROWS) can go through routed experts stored
    stacked, gate_up [E, 2I, H] and down [E, H, I], by `moe_rows`: float32 CPU tensors with
    contiguous rows, and the kernels built."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.stride(1) == 1
        and gate_up.dim() == down.dim() == 3
        and gate_up.shape[2] == down.shape[1] == x.shape[1]
        and gate_up.shape[1] == 2 * down.shape[2]
        and gate_up.shape[0] == down.shape[0]
        and gate_up.stride(2) == down.stride(2) == 1
        and _floats(x, gate_up, down)
        and _lib() is not None
    )


def moe_rows(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
):
    """[M, H]: row m is sum_j weights[m, j] * expert_{ids[m, j]}(x[m]) summed in ascending expert
    order (SwiGLU: down(silu(gate x) * up x)); the caller checked `moe_usable`. An id outside the
    table raises IndexError."""
    (M, H), I, k = x.shape, down.shape[2], ids.shape[-1]
    if ids.shape != (M, k) or weights.shape != (M, k):
        raise ValueError(f"expert ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must be [{M}, k]")
    ids = ids.to(device=x.device, dtype=torch.int64).contiguous()
    weights = weights.to(device=x.device, dtype=torch.float32).contiguous()
    y = _out(x, M, H)
    gs, ds = gate_up.stride(), down.stride()
    _call("pd_moe_rows", x.data_ptr(), x.stride(0), gate_up.data_ptr(), gs[0], gs[1], down.data_ptr(), ds[0],
          ds[1], ids.data_ptr(), weights.data_ptr(), M, k, gate_up.shape[0], H, I, y.data_ptr(), H)  # fmt: skip
    return y


def rms_norm_usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether x [M, N] (M <= MAX_ROWS) with weight w [N] can take `rms_norm`: float32 CPU tensors
    with contiguous rows, and the kernels built."""
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.stride(1) == 1
        and w.shape == x.shape[1:]
        and w.is_contiguous()
        and _floats(x, w)
        and _lib() is not None
    )


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * w -> [M, N]; the caller checked `rms_norm_usable`."""
    M, N = x.shape
    y = _out(x, M, N)
    _call("pd_rms_norm", x.data_ptr(), x.stride(0), w.data_ptr(), y.data_ptr(), N, M, N, eps)
    return y


def index_scores_usable(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether `kernels.index_scores`' q [B, H, D], w [B, H] and keys [S, D] or [B, S, D]
    (`_few_queries`) can take `index_scores`: float32 CPU tensors with contiguous last dims, and the
    kernels built."""
    return (
        q.dim() == 3
        and 0 < q.shape[1] <= MAX_HEADS
        and w.shape == q.shape[:2]
        and _few_queries(q, keys)
        and keys.shape[-1] == q.shape[2]
        and q.stride(2) == w.stride(1) == keys.stride(-1) == 1
        and _floats(q, w, keys)
        and _lib() is not None
    )


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """[B, S] = sum_h w[:, h] * relu(scale * q[:, h] . k); the caller checked `index_scores_usable`."""
    (B, H, D), S = q.shape, keys.shape[-2]
    out = _out(q, B, S)
    ks = (0, keys.stride(0)) if keys.dim() == 2 else keys.stride()[:2]
    _call("pd_index_scores", q.data_ptr(), q.stride(0), q.stride(1), w.data_ptr(), w.stride(0),
          keys.data_ptr(), *ks, out.data_ptr(), B, H, S, D, scale)  # fmt: skip
    return out


def topk_usable(scores: torch.Tensor, valid: torch.Tensor, k: int) -> bool:
    """Whether `kernels.topk_earliest` of scores [B, S] can take `topk_earliest`: float32 CPU
    scores with contiguous rows, a bool mask of their shape, k >= 1, and the kernels built."""
    return (
        scores.dim() == 2
        and scores.shape[1] > 0
        and k >= 1
        and scores.stride(1) == 1
        and valid.dtype == torch.bool
        and valid.shape == scores.shape
        and valid.device.type == "cpu"
        and _floats(scores)
        and _lib() is not None
    )


def topk_earliest(scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor | None:
    """`kernels.topk_earliest` by the kernel: [B, k] ascending indices, -1 padded; None when a valid
    score is NaN (the caller keeps torch's rule). The caller checked `topk_usable`."""
    B, S = scores.shape
    out = torch.empty(B, k, dtype=torch.int64, device=scores.device)
    err = _lib().pd_topk_earliest(scores.data_ptr(), scores.stride(0), valid.data_ptr(), *valid.stride(),
                                  B, S, k, out.data_ptr(), torch.get_num_threads())  # fmt: skip
    if err < 0:
        raise MemoryError("the native kernel pd_topk_earliest could not allocate its scratch")
    return None if err else out


def route_usable(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, k: int
) -> bool:
    """Whether a decode step's rows x [M, H] (M <= MAX_ROWS) can be routed by `route_rows` over w
    [E, H] with the score correction bias [E]: float32 CPU tensors with contiguous rows, groups of
    at least two experts and enough of them for k, and the kernels built."""
    E = w.shape[0] if w.dim() == 2 else 0
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.stride(1) == 1
        and E > 0
        and w.shape[1] == x.shape[1]
        and w.stride(1) == 1
        and bias.shape == (E,)
        and bias.is_contiguous()
        and n_group > 0
        and E % n_group == 0
        and E // n_group >= 2
        and 0 < topk_group <= n_group
        and 0 < k <= topk_group * (E // n_group)
        and _floats(x, w, bias)
        and _lib() is not None
    )


def route_rows(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor,
    n_group: int,
    topk_group: int,
    k: int,
    norm: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [M, k], expert ids [M, k], each row's ascending) of grouped sigmoid routing, as
    layers.TopkRouter computes them; the caller checked `route_usable`."""
    (M, H), E = x.shape, w.shape[0]
    ids = torch.empty(M, k, dtype=torch.int64, device=x.device)
    weights = _out(x, M, k)
    _call("pd_route_rows", x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), bias.data_ptr(), E, H, n_group,
          topk_group, k, int(norm), scaling, M, ids.data_ptr(), weights.data_ptr())  # fmt: skip
    return weights, ids


def row_hash(b: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """The keyed row hashes of transfer/row_mac.py by native/rowhash.c: b [n, L] uint8 rows on the
    CPU (each row contiguous, any address) under key words k [row_hash_key_words(L)] int32 ->
    [n, ROW_HASH_LANES] int64 (the 64-bit NH sums). None where the kernel is not built or the layout is not this one: the
    caller keeps torch's form."""
    if b.dim() != 2 or b.dtype != torch.uint8 or not b.is_cpu or k.dtype != torch.int32 or not k.is_cpu:
        return None
    n, length = b.shape
    ld = b.stride(0) if n > 1 else length
    bad_key = k.shape != (row_hash_key_words(length),) or not k.is_contiguous()
    if (length > 1 and b.stride(1) != 1) or ld < length or bad_key:
        return None
    if _lib() is None:
        return None
    out = torch.empty(n, ROW_HASH_LANES, dtype=torch.int64)
    _call("pd_row_hash", b.data_ptr(), ld, n, length, k.data_ptr(), out.data_ptr())
    return out
