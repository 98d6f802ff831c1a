"""The routed experts as two grouped triton GEMMs: no host synchronisation, static shapes.

`fused_moe(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)` computes what
model/moe_ops.moe_torch computes (its docstring gives the layouts) on a CUDA device:

  1. moe_align: the T*k (token, slot) pairs, pair p = t * k + j, are grouped by expert with torch
     ops on the device (up to PER_PAIR_MAX pairs, none of this: each pair is a block of its own,
     on the tile's first row, and its id is its block's expert). Each expert's group is padded to a multiple of BLOCK_M, so that a block of
     BLOCK_M rows belongs to one expert; `block_expert` names it (-1: a block past the used ones).
     Pairs routed to another rank (id -1) are left out. Sizes are upper bounds that depend only on
     T*k, E and BLOCK_M, never on the ids: nothing waits for the device and the whole call can be
     captured in a CUDA graph.
  2. the first product, [T*k, 2I]: row p is x[p // k] @ w13[e].T (gate and up together).
  3. h = silu(gate) * up in torch ([T*k, I]; quantized per row and 128 columns for w8a8).
  4. the second product, [T*k, H]: row p is topk_weights[p] * h[p] @ w2[e].T, into a zeroed buffer
     (pairs left out write nothing, so they add 0).
  5. out = buffer.view(T, k, H).sum(1): a fixed-order reduction, no atomics, so the result is the
     same bits on every run (and in a CUDA graph replay).

One kernel, `_moe_gemm_kernel`, does both products: a program takes BLOCK_M rows of one expert and
BLOCK_N output columns, C[rows, n] = A[rows] @ W[e, n, :]^T, accumulating in float32. Its weight
modes (the constexpr MODE):
  MODE_SAME  A and W in one dtype (bf16; float32 for the CPU interpreter tests)
  MODE_W8A16 fp8 W with 128x128 block scales, bf16 A: the fp8 tile is converted to A's dtype in
             registers (exact: every e4m3 value is a bf16 value), and each 128-wide k step's dot is
             scaled by the vector of its 128-row-group scales of n
  MODE_W8A8  fp8 W and fp8 A: A is quantized per row and 128 columns (`quantize_act`, scale
             [rows, ceil(K/128)]), and acc += dot(a, w) * a_scale[:, None] * w_scale[None, :].
             The fp8 dot's own accumulation (sm90 wgmma accumulates fp8 products imprecisely) spans
             one 128-wide k step only; the steps are summed in float32, as in DeepSeek-V3's recipe.

Tile choices (`moe_config`, a pure function of T*k, N, K and E; no autotuning at run time; the
numbers below were checked by bench/gpu_tune.py on an H200, bench/results/gpu_tune.json):
  BLOCK_K 128     the scale block: one k step meets one scale per row (A) and per 128 rows (W);
                  also the fp8 dot's minimum K (32) and the bf16 one's (16) with room to spare
  BLOCK_M 16      decode-sized inputs (fewer than 32 pairs per expert on average): most experts hold
                  a pair or two, and a block of 16 rows wastes the least padding; tl.dot's M minimum
                  is 16. At batch 1 (8 pairs, 8 experts) the grid is 8 used blocks x N/BLOCK_N
                  programs: with BLOCK_N 64 that is 512 programs for GLM-5's first product
                  (N = 2I = 4096) and 768 for its second (N = 6144), several per SM of an H200's 132,
                  each streaming a 64 x K strip of weights: enough loads in flight to hold HBM
                  bandwidth. BLOCK_N drops to 32 when that count would fall under 2 x 132.
  BLOCK_M 64      prefill: 64-row tiles are what one warpgroup's wgmma takes, with BLOCK_N 128 a
                  tile reuses each weight tile 64 times (compute-bound regime); GROUP_M 8 orders
                  programs so that neighbours share weight tiles in L2.
  num_stages      6 for decode (memory-bound: more loads in flight; 4.34 TB/s at batch 32 against
                  4.26 with 4), 3 for prefill, where a bf16 stage is (64 + 128) x 128 x 2 B =
                  48 KiB: 144 KiB of the 227 KiB shared memory.
  split           1 (MoeConfig.split deals the k steps to more programs, float32 partials summed in
                  a fixed order; at batch 1 splits of 2-8 were no faster on the H200: the nine
                  experts' weights stream at ~2.7 TB/s however the work is cut).
  num_warps 4     one warpgroup: the M = 16 tiles run as mma.sync (wgmma needs M % 64 == 0), the
                  M = 64 ones as one wgmma of 64 x 128.

Triton is imported at this module's import; callers import the module lazily (model/layers.py),
where the triton path was chosen (engine/gemm_ops.py). The kernels call only triton.language's
builtins (no @jit helpers of triton.language.standard such as tl.cdiv or tl.zeros), so that with
TRITON_INTERPRET=1 set before this module's import they run in triton's CPU interpreter even when
triton itself was imported earlier (tests/model/test_triton_kernels.py); that test also compiles
every variant for sm90 on the CPU, down to ptxas. The grid layout and the structure of the
kernel follow the published design of vLLM's fused_moe (Apache-2.0); the code is written here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
GROUP = 128  # the block-scale size along k (activations and weights) and along n (weights)
SMS = 132  # streaming multiprocessors of an H100 / H200: the parallelism the configs aim at

MODE_SAME, MODE_W8A16, MODE_W8A8 = 0, 1, 2
# Up to this many (token, slot) pairs (batch 4 at top-8), each pair is a block of its own (PER_PAIR):
# no grouping kernels at all (moe_align is ~20 small kernels, 50 us of a decode step on an H200),
# at the price of reading an expert twice when two pairs chose it (never within one token).
PER_PAIR_MAX = 32


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class MoeConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    split: int = 1  # programs per output tile along k (float32 partials, summed in a fixed order)


def moe_block_m(num_pairs: int, n_experts: int) -> int:
    """Rows per block: 16 while experts hold fewer than 32 pairs on average (decode), else 64."""
    return 16 if num_pairs < 32 * n_experts else 64


def moe_config(num_pairs: int, n: int, k: int, n_experts: int, sms: int = SMS) -> MoeConfig:
    """The tiles of one product with N output columns and K inputs (module docstring: why these).
    BLOCK_M depends on (num_pairs, n_experts) only, so both products of a call share moe_align."""
    block_m = moe_block_m(num_pairs, n_experts)
    kb = cdiv(k, GROUP)
    if block_m == 16:
        busy = min(num_pairs, n_experts)  # blocks with work, at most (one per expert hit)
        block_n = 64 if busy * cdiv(n, 64) >= 2 * sms else 32
        return MoeConfig(16, block_n, GROUP, 1, 4, max(2, min(6, kb)))  # 6: gpu_tune.json, decode32
    return MoeConfig(64, 128, GROUP, 8, 4, max(2, min(3, kb)))


def padded_pairs(num_pairs: int, n_experts: int, block_m: int) -> int:
    """EM, the rows of moe_align's output: every pair plus each non-empty expert's padding, at most
    min(num_pairs, n_experts) * (block_m - 1), rounded up to whole blocks."""
    return cdiv(num_pairs + min(num_pairs, n_experts) * (block_m - 1), block_m) * block_m


def moe_align(topk_ids: torch.Tensor, n_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the (token, slot) pairs of topk_ids [T, k] by expert, on the device, without a sync.

    Returns sorted_ids [EM] int32 (EM = padded_pairs(T*k, E, block_m)): the pair ids p = t * k + j,
    expert by expert in ascending order, pairs of one expert in ascending order, each expert's run
    padded with T*k (no pair) to a multiple of block_m; and block_expert [EM // block_m] int32: the
    expert of each block of block_m entries, -1 for the blocks past the used ones. Ids outside
    [0, E) (-1: another rank's expert) are left out. Every shape depends on T*k, E and block_m alone.
    """
    num_pairs = topk_ids.numel()
    dev = topk_ids.device
    em = padded_pairs(num_pairs, n_experts, block_m)
    flat = topk_ids.reshape(-1).long()
    bucket = torch.where((flat >= 0) & (flat < n_experts), flat, n_experts)  # E: pairs left out
    sorted_bucket, order = torch.sort(bucket, stable=True)
    # first[e]: where bucket e begins in sorted order (first[E]: the pairs left out begin)
    first = torch.searchsorted(sorted_bucket, torch.arange(n_experts + 1, device=dev))
    counts = first[1:] - first[:-1]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = torch.cat([ends - padded, ends.new_zeros(1)])  # a start for bucket E too (unused)
    pos = torch.arange(num_pairs, device=dev)
    # an expert's i-th pair goes to starts[e] + i; a pair left out to a slot of its own past EM
    dest = torch.where(
        sorted_bucket < n_experts, starts[sorted_bucket] + pos - first[sorted_bucket], em + pos
    )
    sorted_ids = torch.full((em + num_pairs,), num_pairs, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_start = torch.arange(0, em, block_m, device=dev)
    block_expert = torch.searchsorted(ends, block_start, right=True)  # first expert ending past it
    block_expert = torch.where(block_expert < n_experts, block_expert, -1).to(torch.int32)
    return sorted_ids[:em], block_expert


def quantize_act(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 e4m3 [M, K], float32 scale [M, ceil(K/group)]) with x ~ fp8 * scale per row
    and group of columns: scale = amax / 448 (amax clamped to 1e-12, so an all-zero group gets a
    tiny positive scale and quantizes to 0). Torch ops, no sync. The rounding to fp8 is torch's
    (round to nearest even), the same on the CPU and the GPU."""
    m, k = x.shape
    groups = cdiv(k, group)
    xf = x.float()
    if k % group:
        xf = F.pad(xf, (0, groups * group - k))
    blocks = xf.reshape(m, groups, group)
    scale = blocks.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(m, groups * group)
    return (q if k % group == 0 else q[:, :k].contiguous()), scale


# the value-dependent ints stay plain i32 (no recompile for each divisibility by 16 of T*k)
@triton.jit(do_not_specialize=["num_pairs", "num_pid_m", "k_blocks_per_split"])
def _moe_gemm_kernel(
    a_ptr,  # [rows, K]: x (first product, A row = pair // top_k) or h (second, A row = pair)
    a_scale_ptr,  # [rows, ceil(K/128)] float32 (MODE_W8A8), else unused
    w_ptr,  # [E, N, K]
    w_scale_ptr,  # [E, ceil(N/128), ceil(K/128)] float32 (fp8 modes), else unused
    out_ptr,  # [num_pairs, N], or [SPLIT, num_pairs, N] float32 partials (program_id 1: the split)
    topk_weights_ptr,  # [num_pairs] float32 (MUL_WEIGHT), else unused
    sorted_ids_ptr,  # [EM] int32
    block_expert_ptr,  # [EM // BLOCK_M] int32
    N,
    K,
    num_pairs,
    top_k,
    num_pid_m,
    k_blocks_per_split,
    stride_os,
    stride_am,
    stride_ak,
    stride_asm,
    stride_ask,
    stride_we,
    stride_wn,
    stride_wk,
    stride_wse,
    stride_wsn,
    stride_wsk,
    stride_om,
    stride_on,
    MUL_WEIGHT: tl.constexpr,
    MODE: tl.constexpr,
    PER_PAIR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    # program -> (block of rows, block of columns), GROUP_M row blocks side by side (L2 reuse)
    pid = tl.program_id(0)
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    num_in_group = GROUP_M * num_pid_n
    group_id = pid // num_in_group
    first_m = group_id * GROUP_M
    group_size = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % num_in_group) % group_size
    pid_n = (pid % num_in_group) // group_size

    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:  # a block past the used ones
        return
    expert = expert.to(tl.int64)

    if PER_PAIR:  # block pid_m is pair pid_m alone, on row 0 of the tile (no moe_align)
        pair = tl.where(tl.arange(0, BLOCK_M) == 0, pid_m, num_pairs)
    else:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ids_ptr + offs_m)
    row_ok = pair < num_pairs
    a_row = (pair // top_k).to(tl.int64)  # top_k is 1 in the second product
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    split = tl.program_id(1)
    kb_first = split * k_blocks_per_split
    kb_end = tl.minimum(kb_first + k_blocks_per_split, (K + BLOCK_K - 1) // BLOCK_K)
    offs_k = kb_first * BLOCK_K + tl.arange(0, BLOCK_K)

    a_ptrs = a_ptr + a_row[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    offs_k = tl.arange(0, BLOCK_K)  # within a step, for the masks
    if MODE != 0:
        # one scale per 128 rows of n; per k step, as BLOCK_K is the 128 of the k blocks
        ws_ptrs = w_scale_ptr + expert * stride_wse + (offs_n // 128) * stride_wsn
    if MODE == 2:
        as_ptrs = a_scale_ptr + a_row * stride_asm

    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for kb in range(kb_first, kb_end):
        k_left = K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
        w = tl.load(w_ptrs, mask=(offs_k[:, None] < k_left) & n_ok[None, :], other=0.0)
        if MODE == 0:
            acc = tl.dot(a, w, acc)
        elif MODE == 1:
            ws = tl.load(ws_ptrs + kb * stride_wsk, mask=n_ok, other=0.0)
            acc += tl.dot(a, w.to(a.dtype)) * ws[None, :]
        else:
            a_s = tl.load(as_ptrs + kb * stride_ask, mask=row_ok, other=0.0)
            ws = tl.load(ws_ptrs + kb * stride_wsk, mask=n_ok, other=0.0)
            acc += tl.dot(a, w) * a_s[:, None] * ws[None, :]
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk

    if MUL_WEIGHT:
        rw = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)
        acc = acc * rw[:, None]
    out_ptrs = (
        out_ptr + split * stride_os + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    )
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    out: torch.Tensor,
    topk_weights: torch.Tensor | None,
    sorted_ids: torch.Tensor,
    block_expert: torch.Tensor,
    top_k: int,
    mode: int,
    cfg: MoeConfig,
    per_pair: bool = False,
) -> None:
    """out[p] = (topk_weights[p] *) A[p // top_k or p] @ w[e].T for every pair p of sorted_ids. With
    cfg.split > 1 the k steps are dealt to that many programs per tile, whose float32 partials are
    summed in a fixed order into out (deterministic, no atomics)."""
    n, k = w.shape[1], w.shape[2]
    num_pairs, final = out.shape[0], out
    per = cdiv(cdiv(k, cfg.block_k), cfg.split)
    split = cdiv(cdiv(k, cfg.block_k), per)  # no program without a k step
    if split > 1:  # zeroed: pairs no program writes (another rank's expert) add 0
        out = torch.zeros(split, num_pairs, n, dtype=torch.float32, device=out.device)
    out_s = out.stride() if split > 1 else (0, *out.stride())
    assert mode == MODE_SAME or cfg.block_k == GROUP, "a k step must be one 128-wide block of scales"
    num_pid_m = block_expert.shape[0]
    # unused pointers get a tensor of the right kind (never read: their constexpr branch is off)
    a_scale_t = a_scale if a_scale is not None else out
    w_scale_t = w_scale if w_scale is not None else out
    weights_t = topk_weights if topk_weights is not None else out
    a_ss = a_scale.stride() if a_scale is not None else (0, 0)
    w_ss = w_scale.stride() if w_scale is not None else (0, 0, 0)
    grid = (num_pid_m * cdiv(n, cfg.block_n), split)
    _moe_gemm_kernel[grid](
        a,
        a_scale_t,
        w,
        w_scale_t,
        out,
        weights_t,
        sorted_ids,
        block_expert,
        n,
        k,
        num_pairs,
        top_k,
        num_pid_m,
        per,
        out_s[0],
        a.stride(0),
        a.stride(1),
        a_ss[0],
        a_ss[1],
        w.stride(0),
        w.stride(1),
        w.stride(2),
        w_ss[0],
        w_ss[1],
        w_ss[2],
        out_s[1],
        out_s[2],
        MUL_WEIGHT=topk_weights is not None,
        MODE=mode,
        PER_PAIR=per_pair,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if split > 1:
        final.copy_(out.sum(dim=0))


def _check(x, w13, w2, topk_ids, w13_scale, w2_scale) -> tuple[int, int, int, int, bool]:
    tokens, hidden = x.shape
    n_experts, two_i, h13 = w13.shape
    inter = two_i // 2
    if h13 != hidden or tuple(w2.shape) != (n_experts, hidden, inter) or two_i % 2:
        raise ValueError(f"w13 {list(w13.shape)} / w2 {list(w2.shape)} do not fit x {list(x.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_ids {list(topk_ids.shape)} is not [T={tokens}, k]")
    fp8 = w13.dtype == FP8
    if (w2.dtype == FP8) != fp8:
        raise ValueError(f"w13 is {w13.dtype}, w2 {w2.dtype}: both fp8 or neither")
    if fp8:
        want13 = (n_experts, cdiv(two_i, GROUP), cdiv(hidden, GROUP))
        want2 = (n_experts, cdiv(hidden, GROUP), cdiv(inter, GROUP))
        for name, s, want in (("w13_scale", w13_scale, want13), ("w2_scale", w2_scale, want2)):
            if s is None or tuple(s.shape) != want or s.dtype != torch.float32:
                got = None if s is None else (list(s.shape), s.dtype)
                raise ValueError(f"{name} must be float32 {list(want)} (128x128 blocks), not {got}")
    elif w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise ValueError(f"weights {w13.dtype} / {w2.dtype} must be fp8 or x's dtype {x.dtype}")
    return tokens, hidden, n_experts, inter, fp8


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    *,
    fp8_act: bool | None = None,
) -> torch.Tensor:
    """The routed experts of x [T, H] -> [T, H] in x's dtype (bf16; float32 for the interpreter
    tests), as model/moe_ops.moe_torch. fp8 weights (with their 128x128 block scales) run w8a8
    (fp8_act=True: activations quantized per row and 128 columns) or w8a16 (False); by default
    w8a16 for up to PER_PAIR_MAX pairs (the two quantizations are ~16 small kernels there), w8a8
    above (on the H200, 2026-12-04, w8a8 took 1.76 ms for batch 32 at tp1 where w8a16 took 2.08).
    topk_ids must lie in [-1, E). No host sync;
    every shape and grid depends on the shapes only (CUDA-graph capturable); deterministic."""
    tokens, hidden, n_experts, inter, fp8 = _check(x, w13, w2, topk_ids, w13_scale, w2_scale)
    top_k = topk_ids.shape[1]
    num_pairs = tokens * top_k
    if num_pairs == 0:  # no launch with an empty grid
        return torch.zeros_like(x)
    cfg1 = moe_config(num_pairs, 2 * inter, hidden, n_experts)
    cfg2 = moe_config(num_pairs, hidden, inter, n_experts)
    per_pair = num_pairs <= PER_PAIR_MAX
    if fp8_act is None:  # w8a16 where quantizing the activations costs more kernels than it saves
        fp8_act = not per_pair
    mode = (MODE_W8A8 if fp8_act else MODE_W8A16) if fp8 else MODE_SAME
    if per_pair:  # each pair a block of its own: its expert is its id, nothing to group
        block_expert = topk_ids.reshape(-1)
        sorted_ids = block_expert  # not read
    else:
        sorted_ids, block_expert = moe_align(topk_ids, n_experts, cfg1.block_m)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()

    x = x.contiguous()
    a, a_scale = quantize_act(x) if mode == MODE_W8A8 else (x, None)
    gate_up = torch.empty(num_pairs, 2 * inter, dtype=x.dtype, device=x.device)  # rows left out: unread
    _grouped_gemm(
        a, a_scale, w13, w13_scale, gate_up, None, sorted_ids, block_expert, top_k, mode, cfg1, per_pair
    )

    if mode == MODE_W8A8:
        a, a_scale = quantize_act(F.silu(gate_up[:, :inter].float()) * gate_up[:, inter:].float())
    else:  # in x's dtype: two kernels (silu rounds once, as in the reference's bf16 run)
        a, a_scale = F.silu(gate_up[:, :inter]) * gate_up[:, inter:], None
    down = torch.zeros(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _grouped_gemm(a, a_scale, w2, w2_scale, down, weights, sorted_ids, block_expert, 1, mode, cfg2, per_pair)
    return down.view(tokens, top_k, hidden).sum(dim=1)
