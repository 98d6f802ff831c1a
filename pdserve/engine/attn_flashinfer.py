"""The flashinfer ops (engine/attn_ops.py): the only module that imports flashinfer.

Written against flashinfer-python 0.7.4 (attn_ops.FLASHINFER_VERSION; its plan()/run() changed in
0.7, so every call is here). Attention of B query rows over per-row key lists is MLA decode with
page size 1: the keys are a table of rows [R, 1, kv_lora + rope] (one token per page), and CSR
metadata gives each query row its key rows (qo_indptr = 0..B, kv_indptr = prefix sums of the
counts, kv_indices = the rows, kv_len = the counts). `BatchMLAPagedAttentionWrapper` is planned
with the canonical `MLAPlanMetadata.csr(...)`, packed query/KV layouts and `lse_mode="base2"`;
its LSE (base 2) is converted to natural log. A row with no key is given lse -inf and out 0 here,
whatever the kernel wrote. The plan is reused while the rows' key mask is unchanged, i.e. once
per indexer layer and the shared layers after it. Top-k is flashinfer.top_k(deterministic=True,
tie_break=SMALL), the earlier-key-wins rule, then sorted ascending and -1 padded like the torch op.
The merge is the torch one (a few elementwise ops on [N, B, H]).
"""

from __future__ import annotations

import math

import torch

from ..model.kernels import merge_attention, take_rows

WORKSPACE_BYTES = 128 << 20  # flashinfer's documented starting point for the float workspace


class FlashinferOps:
    name = "flashinfer"

    def __init__(self, device: torch.device, backend: str, flashinfer_module=None):
        if flashinfer_module is None:
            import flashinfer
            import flashinfer.mla
            import flashinfer.topk

            flashinfer_module = flashinfer
        self.fi, self.device, self.backend = flashinfer_module, device, backend
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.wrapper = self.fi.mla.BatchMLAPagedAttentionWrapper(self.workspace, backend=backend)
        self._planned: tuple | None = None  # (valid mask, heads, dims, scale, dtype) of the current plan
        self.plans = 0  # how many times plan() ran (tests check the reuse)

    # ---- attention ----------------------------------------------------------------------------
    def attend(self, q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, scale: float, dv: int):
        """Same contract as model/kernels.attend: q [B, H, D]; keys [S, D] shared or [B, S, D]."""
        B, H, D = q.shape
        rope = D - dv
        table = keys if keys.dim() == 2 else keys.reshape(-1, D)  # [R, D]
        rows = torch.arange(valid.shape[1], device=valid.device, dtype=torch.int32).expand(B, -1)
        if keys.dim() == 3:  # row b's keys are rows b * S .. b * S + S - 1 of the flattened table
            rows = rows + (torch.arange(B, device=valid.device, dtype=torch.int32) * valid.shape[1])[:, None]
        lens = valid.sum(dim=-1, dtype=torch.int32)  # [B]
        key = (
            valid.clone(),
            H,
            dv,
            rope,
            float(scale),
            q.dtype,
            table.dtype,
        )  # a copy: callers may reuse theirs
        if not self._same_plan(key):
            kv_indptr = torch.zeros(B + 1, dtype=torch.int32, device=valid.device)
            kv_indptr[1:] = torch.cumsum(lens, 0)
            metadata = self.fi.mla.MLAPlanMetadata.csr(
                qo_indptr=torch.arange(B + 1, dtype=torch.int32, device=valid.device),
                kv_indptr=kv_indptr,
                kv_indices=rows[valid].contiguous(),  # row-major: row b's keys in ascending order
                kv_len_arr=lens,
            )
            self.wrapper.plan(
                metadata=metadata,
                num_heads=H,
                head_dim_ckv=dv,
                head_dim_kpe=rope,
                page_size=1,
                causal=False,
                sm_scale=float(scale),
                q_data_type=q.dtype,
                kv_data_type=table.dtype,
                query_layout="packed",
                kv_cache_layout="packed",
                lse_mode="base2",
            )
            self._planned, self.plans = key, self.plans + 1
        out, lse2 = self.wrapper.run(
            query=q.contiguous(), kv_cache=table.contiguous().unsqueeze(1), return_lse=True
        )
        lse = lse2.float() * math.log(2.0)  # base 2 -> natural log
        empty = (lens == 0)[:, None]  # [B, 1]
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty[..., None], 0.0)
        return out, lse

    def attend_rows(self, q: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, scale: float, dv: int):
        """attend over table[rows] (rows [B, S], -1: no key), gathered first."""
        return self.attend(q, take_rows(table, rows.clamp(min=0)), rows >= 0, scale, dv)

    def _same_plan(self, key: tuple) -> bool:
        old = self._planned
        if old is None or old[1:] != key[1:] or old[0].shape != key[0].shape:
            return False
        return bool(torch.equal(old[0], key[0]))

    # ---- selection and merge -------------------------------------------------------------------
    def topk(self, scores: torch.Tensor, valid: torch.Tensor, k: int) -> torch.Tensor:
        B, S = scores.shape
        if k <= 0 or S == 0:
            return torch.full((B, max(k, 0)), -1, dtype=torch.int64, device=scores.device)
        kk = min(k, S)
        masked = scores.float().masked_fill(~valid, float("-inf"))
        values, idx = self.fi.top_k(
            masked, kk, sorted=False, deterministic=True, tie_break=self.fi.topk.TopKTieBreak.SMALL
        )
        idx = torch.where(torch.isinf(values), torch.full_like(idx, S), idx.long())  # invalid keys last
        idx = idx.sort(dim=-1).values
        idx = torch.where(idx >= S, torch.full_like(idx, -1), idx)
        if kk < k:
            idx = torch.cat([idx, idx.new_full((B, k - kk), -1)], dim=1)
        return idx

    def merge(self, outs: torch.Tensor, lses: torch.Tensor):
        return merge_attention(outs, lses)
