"""Per-request sampling: greedy, temperature, top-k, top-p, with a per-request seeded generator;
logit processing (logits_process.py: bias, min_tokens, penalties, the grammar's mask) before it and
the sampled token's logprobs (of the raw logits) beside it."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import logits_process
from .request import SamplingParams, TokenLogprob, choice_id


class Sampler:
    def __init__(self, grammars=None, eos_ids: Sequence[int] = ()):
        """grammars: engine/constraint.py `Grammars` (None: a request with a grammar fails)."""
        self._generators: dict[str, torch.Generator] = {}
        self._matchers: dict = {}  # request id -> constraint.Matcher
        self.grammars, self.eos_ids = grammars, tuple(eos_ids)

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._matchers.pop(request_id, None)

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
            if p.greedy and not p.processes_logits:
                out.append(greedy[row])
                continue
            out.append(self.sample_row(logits[row], p, rid)[0])
        return out

    def sample_row(
        self, logits: torch.Tensor, p: SamplingParams, request_id: str, output_ids: Sequence[int] = ()
    ) -> tuple[int, TokenLogprob | None]:
        """[V] logits of a request that produced `output_ids` so far -> (token, its logprobs when
        p.logprobs is set). The grammar's matcher consumes the output tokens it has not seen yet
        (the prefill's first token, on the decode side) and then the sampled one."""
        raw = logits
        if p.processes_logits:
            logits = logits_process.process(
                logits, p, output_ids, self.eos_ids, self._allowed(p, request_id, output_ids)
            )
        if p.greedy:
            token = int(logits.argmax())
        else:
            probs = filtered_probs(logits.float().cpu(), p)  # the generators are CPU ones
            token = int(torch.multinomial(probs, 1, generator=self._generator(request_id, p.seed)))
        if p.grammar is not None:
            self._matchers[request_id].consume(token)
        lp = None if p.logprobs is None else logits_process.token_logprob(raw, token, p.logprobs)
        return token, lp

    def sample_choices(
        self, logits: torch.Tensor, p: SamplingParams, request_id: str
    ) -> list[tuple[int, TokenLogprob | None]]:
        """A prompt's first token for each of its p.n choices from the same [V] logits, choice i with
        p.choice_params(i) under its own id (request.choice_id)."""
        return [self.sample_row(logits, p.choice_params(i), choice_id(request_id, i)) for i in range(p.n)]

    def forget_choices(self, request_id: str, n: int) -> None:
        for i in range(n):
            self.forget(choice_id(request_id, i))

    def _allowed(self, p: SamplingParams, request_id: str, output_ids: Sequence[int]) -> torch.Tensor | None:
        if p.grammar is None:
            return None
        m = self._matchers.get(request_id)
        if m is None:
            if self.grammars is None:
                raise ValueError("this instance cannot apply grammars")
            m = self._matchers[request_id] = self.grammars.matcher(p.grammar)
        for token in output_ids[m.consumed :]:
            m.consume(token)
        return m.allowed()


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
