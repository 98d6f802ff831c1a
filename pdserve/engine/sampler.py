"""Per-request sampling: greedy, temperature, top-k, top-p, with a per-request seeded generator."""

from __future__ import annotations

import torch

from .request import SamplingParams


class Sampler:
    def __init__(self):
        self._generators: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator:
        g = self._generators.get(request_id)
        if g is None:
            g = torch.Generator()
            if seed is None:
                g.seed()  # nondeterministic, as a user who gives no seed expects
            else:
                g.manual_seed(seed)
            self._generators[request_id] = g
        return g

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], request_ids: list[str]) -> list[int]:
        """logits [B, V] -> one token id per row."""
        out = []
        greedy = logits.argmax(dim=-1).tolist()  # first maximum wins, as in the reference
        for row, (p, rid) in enumerate(zip(params, request_ids)):
            if p.greedy:
                out.append(greedy[row])
                continue
            probs = filtered_probs(logits[row].float().cpu(), p)  # the generators are CPU ones
            out.append(int(torch.multinomial(probs, 1, generator=self._generator(rid, p.seed))))
        return out


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[V] logits -> [V] probabilities after temperature, top-k and top-p."""
    # shift first: with a tiny temperature (any finite one is allowed) logits / T overflows to +-inf
    # and inf - inf in the softmax would be NaN; shifted, the largest logit stays exactly 0. A
    # temperature below the dtype's smallest normal would round to 0 (0 / 0): it is floored there.
    logits = (logits - logits.max()) / max(p.temperature, torch.finfo(logits.dtype).tiny)
    if 0 < p.top_k < logits.numel():
        kth = logits.topk(p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (sorted_probs.cumsum(0) - sorted_probs) >= p.top_p
        drop[0] = False  # explicitly: a top_p below the dtype's resolution compares as 0 >= 0
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs
