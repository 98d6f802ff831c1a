"""What happens to a request's logits between the model and temperature / top-k / top-p.

Order (vLLM's): logit_bias, min_tokens (EOS and stop token ids masked while fewer than min_tokens
were produced), repetition penalty (over prompt and output tokens: positive logits divided,
negative ones multiplied), presence and frequency penalties (over output tokens, those of a
migrated request's `SamplingParams.generated` included), then the grammar's token mask. Log-probabilities are taken before any of this (`token_logprob`), from the raw logits in
float64, as vLLM and SGLang report them by default. Before everything, both samplers set the ids the
tokenizer lacks to -inf (`decodable`: rows of an LM head padded past the tokenizer), so they are
never sampled nor reported; an unpadded model's logits are untouched.

Everything works on a batch of rows on the logits' own device (`process_batch`, `logprob_tensors`:
a decode step's rows are processed on the sampling rank, engine/batch_sampler.py); the one-row forms
(`process`, `token_logprob`) are those with a batch of one, so both samplers compute the same thing.
A row's settings travel as `RowProcessing`: plain numbers and token ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..request import SamplingParams, TokenLogprob

NO_TOKEN_ALLOWED = "no token is allowed (grammar, min_tokens and logit_bias exclude every token)"


@dataclass(frozen=True)
class RowProcessing:
    """One row's logit processing as numbers and ids (the grammar's mask is passed beside it)."""

    logit_bias: tuple[tuple[int, float], ...] = ()
    banned: tuple[int, ...] = ()  # -inf: EOS and stop ids while fewer than min_tokens were produced
    repetition_penalty: float = 1.0
    seen: tuple[int, ...] = ()  # prompt and output ids, sorted and unique (repetition penalty)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    output_ids: tuple[int, ...] = ()  # counted by the presence and frequency penalties

    @classmethod
    def of(cls, p: SamplingParams, output_ids: Sequence[int], eos_ids: Sequence[int]) -> "RowProcessing":
        """The processing of a request that produced `output_ids` so far (p.generated, the output
        of the request it continues, counts for the penalties, not for min_tokens)."""
        banned = ()
        if len(output_ids) < p.min_tokens:
            banned = (*p.stop_token_ids, *(() if p.ignore_eos else eos_ids))
        seen = ()
        if p.repetition_penalty != 1.0:
            seen = tuple(sorted({*p.prompt_ids, *p.generated, *output_ids}))
        counted = (*p.generated, *output_ids) if p.presence_penalty or p.frequency_penalty else ()
        return cls(
            tuple(p.logit_bias),
            tuple(banned),
            p.repetition_penalty,
            seen,
            p.presence_penalty,
            p.frequency_penalty,
            counted,
        )


def decodable(logits: torch.Tensor, limit: int | None) -> torch.Tensor:
    """[..., V] logits with the ids at or above `limit` (LM-head rows past the tokenizer's size,
    model/tokenizer.py `decodable_vocab`) at -inf, so that nothing samples or reports them; the
    same tensor when there are none (limit None or >= V: an unpadded model's logits are untouched)."""
    if limit is None or limit >= logits.shape[-1]:
        return logits
    return logits.index_fill(-1, torch.arange(limit, logits.shape[-1], device=logits.device), float("-inf"))


def process(
    logits: torch.Tensor,
    p: SamplingParams,
    output_ids: Sequence[int],
    eos_ids: Sequence[int],
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """[V] raw logits -> [V] processed ones (a new tensor; `allowed`: [V] bool, the grammar's mask)."""
    rows = [RowProcessing.of(p, output_ids, eos_ids)]
    out, ok = process_batch(logits[None], rows, None if allowed is None else allowed[None])
    if not bool(ok[0]):
        raise ValueError(NO_TOKEN_ALLOWED)
    return out[0]


def process_batch(
    logits: torch.Tensor, rows: Sequence[RowProcessing], allowed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, V] raw logits -> ([B, V] processed ones (a new tensor), [B] bool: the row allows a token).
    `allowed`: [B, V] bool, the grammar's masks. Each row's arithmetic is exactly the one-row form's:
    per-row numbers act at the precision a Python number has in torch's scalar ops (float32 for
    float32 and narrower logits, float64 for float64), rounded back to the logits' dtype."""
    logits = logits.clone()
    vocab, dev, dt = logits.shape[1], logits.device, logits.dtype
    num = torch.promote_types(dt, torch.float32)
    at = [(i, t, b) for i, r in enumerate(rows) for t, b in r.logit_bias if t < vocab]
    if at:
        i, t, b = zip(*at)
        bias = to_device(b, dt, dev)
        logits.index_put_((_ids(i, dev), _ids(t, dev)), bias, accumulate=True)
    at = [(i, t) for i, r in enumerate(rows) for t in r.banned if t < vocab]
    if at:
        i, t = zip(*at)
        logits[_ids(i, dev), _ids(t, dev)] = float("-inf")
    at = [(i, t, r.repetition_penalty) for i, r in enumerate(rows) for t in r.seen if t < vocab]
    if at:
        i, t, rp = zip(*at)
        where = (_ids(i, dev), _ids(t, dev))
        vals, r = logits[where], to_device(rp, num, dev)
        logits[where] = torch.where(vals > 0, (vals / r).to(dt), (vals * r).to(dt))
    _penalize_counts(logits, rows, num)
    # a tiny repetition penalty (any positive one is valid) overflows a logit to +inf: float32's
    # largest value (sampling runs in float32) keeps that token the most likely without a NaN;
    # bfloat16 and float16 logits (a GPU model's) take their own largest, which float32 holds
    big = min(torch.finfo(torch.float32).max, torch.finfo(dt).max)
    logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=big).clamp(max=big)
    if allowed is not None:
        logits = logits.masked_fill(~allowed.to(dev), float("-inf"))
    return logits, logits.amax(dim=-1) != float("-inf")


def _penalize_counts(logits: torch.Tensor, rows: Sequence[RowProcessing], num: torch.dtype) -> None:
    """Presence and frequency penalties, in place, on the rows that have output tokens."""
    pen = [i for i, r in enumerate(rows) if (r.presence_penalty or r.frequency_penalty) and r.output_ids]
    if not pen:
        return
    vocab, dev, dt = logits.shape[1], logits.device, logits.dtype
    at = [(j, t) for j, i in enumerate(pen) for t in rows[i].output_ids if t < vocab]
    counts = torch.zeros(len(pen), vocab, dtype=dt, device=dev)  # [P, V]
    if at:
        j, t = zip(*at)
        counts.index_put_((_ids(j, dev), _ids(t, dev)), torch.ones((), dtype=dt, device=dev), accumulate=True)
    freq = to_device([rows[i].frequency_penalty for i in pen], num, dev)[:, None]
    pres = to_device([rows[i].presence_penalty for i in pen], num, dev)[:, None]
    sub = (freq * counts).to(dt) + (pres * (counts > 0).to(dt)).to(dt)
    idx = _ids(pen, dev)
    logits[idx] = logits[idx] - sub


def to_device(values, dtype: torch.dtype, device) -> torch.Tensor:
    """Host numbers (a sequence or a numpy array) as a tensor on `device`. To a GPU through pinned
    memory, without waiting: a copy from pageable memory would first wait for every kernel queued
    on the stream (the step's forward), once per small tensor of a sampling step."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, device="cpu").pin_memory().to(device, non_blocking=True)


def _ids(values, device) -> torch.Tensor:
    return to_device(values, torch.int64, device)


def bitmask_words(masks: Sequence[bytes | None], vocab: int, device) -> torch.Tensor:
    """Grammar masks as llguidance computes them (little-endian 32-bit words, bit i of word j is
    token 32j + i; None: every token allowed) -> [B, ceil(V / 32)] int32 on `device`, one copy.
    Words past the vocabulary are dropped; a mask too short for it raises."""
    width = (vocab + 31) // 32
    words = np.full((len(masks), width), -1, dtype=np.int32)
    for i, m in enumerate(masks):
        if m is not None:
            row = np.frombuffer(m, dtype="<i4")  # llguidance may pad it past the vocabulary
            if len(row) < width:
                raise ValueError(f"a grammar mask of {len(row)} words for a vocabulary of {vocab} tokens")
            words[i] = row[:width]
    return to_device(words, torch.int32, device)


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, ceil(V / 32)] int32 packed masks -> [B, V] bool (on their device)."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # [B, W, 32]: an arithmetic shift keeps bit i at the bottom
    return bits.flatten(1)[:, :vocab].bool()


def logprob_tensors(
    raw_logits: torch.Tensor, tokens: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[B, V] raw logits and [B] chosen tokens -> ([B] their float64 log-softmax, [B, k'] the top
    values, [B, k'] their ids), k' = min(k, V), all on the logits' device."""
    lp = torch.log_softmax(raw_logits.double(), dim=-1)
    chosen = lp.gather(1, tokens.view(-1, 1).to(lp.device))[:, 0]
    vals, ids = lp.topk(min(k, lp.shape[1]), dim=-1)
    return chosen, vals, ids


def token_logprob(raw_logits: torch.Tensor, token: int, k: int) -> TokenLogprob:
    """The sampled token's log-softmax of the raw [V] logits (float64) and the k most likely."""
    tokens = to_device([token], torch.int64, raw_logits.device)
    chosen, vals, ids = logprob_tensors(raw_logits[None], tokens, k)
    return TokenLogprob(float(chosen[0]), tuple(zip(ids[0].tolist(), vals[0].tolist())))


def prompt_logprobs(logits: torch.Tensor, next_ids: torch.Tensor, k: int) -> list[TokenLogprob]:
    """[N, V] logits at N prompt positions and [N] the tokens that follow them -> one entry each."""
    chosen, vals, ids = logprob_tensors(logits, next_ids, k)
    return [
        TokenLogprob(c, tuple(zip(i, v))) for c, i, v in zip(chosen.tolist(), ids.tolist(), vals.tolist())
    ]
