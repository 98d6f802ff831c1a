"""Per-request sampling: greedy, temperature, top-k, top-p, with a per-request seeded generator;
logit processing (logits_process.py: bias, min_tokens, penalties, the grammar's mask) before it and
the sampled token's logprobs (of the raw logits) beside it.

`Sampler` samples one row at a time on the CPU (the prefill's first tokens, the single-rank engine)
and keeps the grammar matchers of its process; a decode step's rows are sampled together on the
sampling rank's device by engine/batch_sampler.py, with `filtered_probs_batch` and `draw` below."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..request import SamplingParams, TokenLogprob, choice_id
from . import logits_process
from .logits_process import to_device


class Sampler:
    def __init__(self, grammars=None, eos_ids: Sequence[int] = (), vocab_limit: int | None = None):
        """grammars: engine/constraint.py `Grammars` (None: a request with a grammar fails);
        vocab_limit: ids at or above it are never sampled nor reported (model/tokenizer.py
        `decodable_vocab`: LM-head rows past the tokenizer; None: every row is a token)."""
        self._generators: dict[str, torch.Generator] = {}
        self._matchers: dict = {}  # request id -> constraint.Matcher
        self.grammars, self.eos_ids, self.vocab_limit = grammars, tuple(eos_ids), vocab_limit

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
        logits = logits_process.decodable(logits, self.vocab_limit)
        out = []
        greedy = logits.argmax(dim=-1).tolist()  # first maximum wins, as in the reference
        for row, (p, rid) in enumerate(zip(params, request_ids)):
            if p.greedy and not p.processes_logits:
                out.append(greedy[row])
                continue
            out.append(self.sample_row(logits[row], p, rid)[0])
        return out

    def sample_row(
        self,
        logits: torch.Tensor,
        p: SamplingParams,
        request_id: str,
        output_ids: Sequence[int] = (),
        allowed: torch.Tensor | None = None,
    ) -> tuple[int, TokenLogprob | None]:
        """[V] logits of a request that produced `output_ids` so far -> (token, its logprobs when
        p.logprobs is set). The grammar's matcher consumes the output tokens it has not seen yet
        (the prefill's first token, on the decode side) and then the sampled one. `allowed`: [V]
        bool, a grammar's mask computed elsewhere (a prefill rank's first token; p.grammar is None)."""
        raw = logits = logits_process.decodable(logits, self.vocab_limit)
        if p.processes_logits or allowed is not None:
            if allowed is None:
                allowed = self._allowed(p, request_id, output_ids)
            logits = logits_process.process(logits, p, output_ids, self.eos_ids, allowed)
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
        self, logits: torch.Tensor, p: SamplingParams, request_id: str, allowed: torch.Tensor | None = None
    ) -> list[tuple[int, TokenLogprob | None]]:
        """A prompt's first token for each of its p.n choices from the same [V] logits, choice i with
        p.choice_params(i) under its own id (request.choice_id); `allowed` as in sample_row."""
        return [
            self.sample_row(logits, p.choice_params(i), choice_id(request_id, i), (), allowed)
            for i in range(p.n)
        ]

    def forget_choices(self, request_id: str, n: int) -> None:
        for i in range(n):
            self.forget(choice_id(request_id, i))

    def grammar_ready(self, p: SamplingParams) -> bool:
        """Whether the request's grammar is compiled (True without one); it starts compiling in the
        background if it is not. GrammarError if its compile failed or ran out of time."""
        if p.grammar is None or self.grammars is None:
            return True
        self.grammars.prepare(p.grammar)
        return self.grammars.ready(p.grammar)

    def grammar_mask(self, p: SamplingParams, request_id: str, output_ids: Sequence[int]) -> bytes | None:
        """The request's grammar mask for its next token (constraint.Matcher.bitmask: what a decode
        step carries to the sampling rank), or None without a grammar; its matcher is fed the output
        tokens it has not seen first."""
        return None if p.grammar is None else self._matcher(p, request_id, output_ids).bitmask()

    def consume(self, p: SamplingParams, request_id: str, token: int) -> None:
        """A token sampled elsewhere (the decode step's sampling rank) fed to the request's matcher."""
        if p.grammar is not None:
            self._matchers[request_id].consume(token)

    def _allowed(self, p: SamplingParams, request_id: str, output_ids: Sequence[int]) -> torch.Tensor | None:
        return None if p.grammar is None else self._matcher(p, request_id, output_ids).allowed()

    def _matcher(self, p: SamplingParams, request_id: str, output_ids: Sequence[int]):
        m = self._matchers.get(request_id)
        if m is None:
            if self.grammars is None:
                raise ValueError("this instance cannot apply grammars")
            m = self._matchers[request_id] = self.grammars.matcher(p.grammar)
        m.advance(p.generated, output_ids)
        return m


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """[V] logits -> [V] probabilities after temperature, top-k and top-p."""
    return filtered_probs_batch(logits[None], [p.temperature], [p.top_k], [p.top_p])[0]


def filtered_probs_batch(
    logits: torch.Tensor, temperature: Sequence[float], top_k: Sequence[int], top_p: Sequence[float]
) -> torch.Tensor:
    """[B, V] logits -> [B, V] probabilities after each row's temperature, top-k and top-p (on the
    logits' device; the settings are host numbers, so no row's choice waits for the device)."""
    dev, vocab = logits.device, logits.shape[1]
    # shift first: with a tiny temperature (any finite one is allowed) logits / T overflows to +-inf
    # and inf - inf in the softmax would be NaN; shifted, the largest logit stays exactly 0. A
    # temperature below the dtype's smallest normal would round to 0 (0 / 0): it is floored there.
    tiny = torch.finfo(logits.dtype).tiny
    temp = to_device([max(t, tiny) for t in temperature], logits.dtype, dev)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temp[:, None]
    ks = [k if 0 < k < vocab else 0 for k in top_k]  # 0: no top-k filter on that row
    if any(ks):
        kth = logits.topk(max(ks), dim=-1).values  # [B, max k], descending
        kth = kth.gather(1, to_device([max(k, 1) - 1 for k in ks], torch.int64, dev).view(-1, 1))
        off = to_device([k == 0 for k in ks], torch.bool, dev).view(-1, 1)
        logits = logits.masked_fill((logits < kth) & ~off, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if any(x < 1.0 for x in top_p):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        limit = to_device(list(top_p), probs.dtype, dev).view(-1, 1)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= limit
        drop[:, 0] = False  # explicitly: a top_p below the dtype's resolution compares as 0 >= 0
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        kept = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        kept = kept / kept.sum(dim=-1, keepdim=True)
        on = to_device([x < 1.0 for x in top_p], torch.bool, dev).view(-1, 1)
        probs = torch.where(on, kept, probs)  # a row with top_p = 1 keeps its softmax as it is
    return probs


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """[B, V] probabilities -> [B] tokens, row i drawn exactly as torch.multinomial(probs[i], 1,
    generator=generators[i]) draws it: its one-sample algorithm (argmax of p / q, q ~ Exp(1), the
    noise from that row's generator), without its checks that wait for the device (`probs_problem`)."""
    q = torch.empty_like(probs)
    for row, g in zip(q, generators):
        row.exponential_(1.0, generator=g)
    return (probs / q).argmax(dim=-1)


PROBS_ERRORS = {
    1: "RuntimeError: probability tensor contains either `inf`, `nan` or element < 0",
    2: "RuntimeError: invalid multinomial distribution (sum of probabilities <= 0)",
}


def probs_problem(probs: torch.Tensor) -> torch.Tensor:
    """[B, V] probabilities -> [B] int64: 0, or the key in PROBS_ERRORS of what torch.multinomial
    would have raised for that row."""
    valid = (probs.amax(dim=-1) < float("inf")) & (probs.amin(dim=-1) >= 0)
    empty = probs.sum(dim=-1) == 0
    zero = torch.zeros((), dtype=torch.int64, device=probs.device)
    return torch.where(~valid, zero + 1, torch.where(empty, zero + 2, zero))
