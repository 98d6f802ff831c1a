"""What happens to one request's logits between the model and temperature / top-k / top-p.

Order (vLLM's): logit_bias, min_tokens (EOS and stop token ids masked while fewer than min_tokens
were produced), repetition penalty (over prompt and output tokens: positive logits divided,
negative ones multiplied), presence and frequency penalties (over output tokens), then the grammar's
token mask. Log-probabilities are taken before any of this (`token_logprob`), from the raw logits in
float64, as vLLM and SGLang report them by default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .request import SamplingParams, TokenLogprob


def process(
    logits: torch.Tensor,
    p: SamplingParams,
    output_ids: Sequence[int],
    eos_ids: Sequence[int],
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """[V] raw logits -> [V] processed ones (a new tensor; `allowed`: [V] bool, the grammar's mask)."""
    logits = logits.clone()
    vocab = logits.numel()
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias if t < vocab], dtype=torch.int64)
        bias = torch.tensor([b for t, b in p.logit_bias if t < vocab], dtype=logits.dtype)
        logits.index_add_(0, ids.to(logits.device), bias.to(logits.device))
    if len(output_ids) < p.min_tokens:
        banned = [t for t in (*p.stop_token_ids, *(() if p.ignore_eos else eos_ids)) if t < vocab]
        logits[banned] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*p.prompt_ids, *output_ids}), dtype=torch.int64, device=logits.device)
        seen = seen[seen < vocab]
        vals = logits[seen]
        r = p.repetition_penalty
        logits[seen] = torch.where(vals > 0, vals / r, vals * r)
    if (p.presence_penalty or p.frequency_penalty) and output_ids:
        counts = torch.bincount(torch.tensor(list(output_ids), dtype=torch.int64), minlength=vocab)[:vocab]
        counts = counts.to(device=logits.device, dtype=logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    # a tiny repetition penalty (any positive one is valid) overflows a logit to +inf: float32's
    # largest value (sampling runs in float32) keeps that token the most likely without a NaN
    big = torch.finfo(torch.float32).max
    logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=big).clamp(max=big)
    if allowed is not None:
        logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
    if logits.max() == float("-inf"):
        raise ValueError("no token is allowed (grammar, min_tokens and logit_bias exclude every token)")
    return logits


def token_logprob(raw_logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """The sampled token's log-softmax of the raw [V] logits (float64) and the k most likely."""
    lp = torch.log_softmax(raw_logits.double(), dim=-1)
    top: tuple[tuple[int, float], ...] = ()
    if k:
        vals, ids = lp.topk(min(k, lp.numel()))
        top = tuple(zip(ids.tolist(), vals.tolist()))
    return TokenLogprob(float(lp[token]), top)


def prompt_logprobs(logits: torch.Tensor, next_ids: torch.Tensor, k: int) -> list[TokenLogprob]:
    """[N, V] logits at N prompt positions and [N] the tokens that follow them -> one entry each."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    chosen = lp.gather(1, next_ids.view(-1, 1).to(lp.device))[:, 0].tolist()
    if not k:
        return [TokenLogprob(c) for c in chosen]
    vals, ids = lp.topk(min(k, lp.shape[1]), dim=-1)
    return [TokenLogprob(c, tuple(zip(i, v))) for c, i, v in zip(chosen, ids.tolist(), vals.tolist())]
