"""A decode step's rows sampled together on the sampling rank's device (rank 0 of a decode instance).

The server process builds one `SampleRow` per running request each step (its settings, the output
ids its penalties count, its grammar's packed mask from the matcher it keeps) and the step command
carries them; the rank samples on the logits' own device and answers one `Sampled` per row (a token
and its logprobs, or an error), never the [B, vocab] logits. What it computes is `Sampler.sample_row`
row for row (engine/sampler.py), through the same batched helpers (logits_process.process_batch,
filtered_probs_batch, logprob_tensors), with one copy to the host at the end.

Generators: one per request, kept here by request id, created from the seed on its first sampled
token exactly as `Sampler._generator` does (on the CPU the same seed gives the same tokens), and
forgotten when the server says the request ended. Each remembers the step of its last draw and its
state before it: a step the server runs again (a batch that failed on another rank is re-run request
by request) redraws the same token instead of advancing the stream.

A row's failure (no token allowed, probabilities torch.multinomial would refuse, a malformed mask)
fails that row alone (docs/design.md invariant 9): flagged rows get their error, and a batch that
raises anyway is sampled again one row at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from ..request import SamplingParams, TokenLogprob
from . import logits_process
from .logits_process import RowProcessing
from .sampler import PROBS_ERRORS, draw, filtered_probs_batch, probs_problem

NO_TOKEN = 100  # status of a row whose processing left no token (PROBS_ERRORS' keys are the others)
ERRORS = {NO_TOKEN: f"ValueError: {logits_process.NO_TOKEN_ALLOWED}", **PROBS_ERRORS}


@dataclass(frozen=True)
class SampleRow:
    """What sampling one request's next token needs (small: built by the server every step)."""

    request_id: str
    step: int  # tokens the request has produced: running a step again redraws the same token
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    logprobs: int | None = None  # None: none; k: the token's logprob and the top k
    processing: RowProcessing | None = None  # None: the raw logits are sampled
    bitmask: bytes | None = None  # the grammar's allowed tokens (constraint.Matcher.bitmask)

    @classmethod
    def of(
        cls,
        request_id: str,
        p: SamplingParams,
        output_ids: Sequence[int],
        eos_ids: Sequence[int],
        bitmask: bytes | None = None,
    ) -> "SampleRow":
        proc = RowProcessing.of(p, output_ids, eos_ids) if p.processes_logits else None
        return cls(
            request_id, len(output_ids), p.temperature, p.top_k, p.top_p, p.seed, p.logprobs, proc, bitmask
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def processes(self) -> bool:
        return self.processing is not None or self.bitmask is not None


@dataclass(frozen=True)
class Sampled:
    """One row's outcome: its token and logprobs, or the error that fails only its request."""

    token: int | None
    logprob: TokenLogprob | None = None
    error: str | None = None


class _Stream:
    """A request's generator, the step of its last draw and its state before that draw."""

    def __init__(self, generator: torch.Generator):
        self.generator, self.step, self.before = generator, -1, None


class BatchSampler:
    def __init__(self, vocab_limit: int | None = None):
        """vocab_limit: ids at or above it are never sampled nor reported (as `Sampler`'s)."""
        self._streams: dict[str, _Stream] = {}  # request id -> its generator, on the logits' device
        self.vocab_limit = vocab_limit

    @property
    def request_ids(self) -> list[str]:
        """The requests it holds a generator for (checks: none once every request ended)."""
        return sorted(self._streams)

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._streams.pop(rid, None)

    def sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[Sampled]:
        """[B, V] logits and one row each -> one `Sampled` each."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{len(rows)} sampling rows for {logits.shape[0]} rows of logits")
        logits = logits_process.decodable(logits, self.vocab_limit)
        try:
            return self._sample(logits, rows)
        except Exception as e:
            if len(rows) == 1:
                return [Sampled(None, error=f"{type(e).__name__}: {e}")]
        return [self.sample(logits[i : i + 1], [row])[0] for i, row in enumerate(rows)]

    def _sample(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> list[Sampled]:
        dev, vocab = logits.device, logits.shape[1]
        work = logits
        status = torch.zeros(len(rows), dtype=torch.int64, device=dev)  # [B]: 0 or a key of ERRORS
        proc = [i for i, r in enumerate(rows) if r.processes]
        if proc:
            idx = _index(proc, dev)
            allowed = None
            if any(rows[i].bitmask is not None for i in proc):
                words = logits_process.bitmask_words([rows[i].bitmask for i in proc], vocab, dev)
                allowed = logits_process.unpack_bitmask(words, vocab)  # [P, V]
            rp = [rows[i].processing or RowProcessing() for i in proc]
            sub, ok = logits_process.process_batch(logits[idx], rp, allowed)
            work = logits.index_copy(0, idx, sub)
            status = status.index_copy(0, idx, torch.where(ok, 0, NO_TOKEN))
        tokens = work.argmax(dim=-1)  # greedy rows: the first maximum wins, as in the reference
        drawn = [i for i, r in enumerate(rows) if not r.greedy]
        if drawn:
            idx = _index(drawn, dev)
            rs = [rows[i] for i in drawn]
            probs = filtered_probs_batch(
                work[idx].float(), [r.temperature for r in rs], [r.top_k for r in rs], [r.top_p for r in rs]
            )
            tokens = tokens.index_copy(0, idx, draw(probs, [self._generator(r, dev) for r in rs]))
            first = status[idx]  # a processing failure is reported before the probabilities'
            status = status.index_copy(0, idx, torch.where(first != 0, first, probs_problem(probs)))
        return self._results(logits, rows, tokens, status)

    def _results(
        self, logits: torch.Tensor, rows: Sequence[SampleRow], tokens: torch.Tensor, status: torch.Tensor
    ) -> list[Sampled]:
        """Logprobs of the rows that ask, then everything to the host in one copy."""
        b, vocab = len(rows), logits.shape[1]
        parts = [tokens.double(), status.double()]
        groups: dict[int, list[int]] = {}  # top-k size -> its rows: one topk each, so that ties
        for i, r in enumerate(rows):  # come out in the order the one-row form gives them
            if r.logprobs is not None:
                groups.setdefault(min(r.logprobs, vocab), []).append(i)
        for k, members in groups.items():
            idx = _index(members, logits.device)
            chosen, vals, ids = logits_process.logprob_tensors(logits[idx], tokens[idx], k)
            parts += [chosen, vals.flatten(), ids.double().flatten()]  # ids < 2**53 stay exact
        host = torch.cat(parts).tolist()
        logprobs: dict[int, TokenLogprob] = {}
        at = 2 * b
        for k, members in groups.items():
            n = len(members)
            vals, ids = host[at + n : at + n + n * k], host[at + n + n * k : at + n + 2 * n * k]
            for j, i in enumerate(members):
                top = zip(map(int, ids[j * k : (j + 1) * k]), vals[j * k : (j + 1) * k])
                logprobs[i] = TokenLogprob(host[at + j], tuple(top))
            at += n + 2 * n * k
        out = []
        for i in range(b):
            code = int(host[b + i])
            if code:
                out.append(Sampled(None, error=ERRORS[code]))
            else:
                out.append(Sampled(int(host[i]), logprobs.get(i)))
        return out

    def _generator(self, row: SampleRow, device: torch.device) -> torch.Generator:
        s = self._streams.get(row.request_id)
        if s is None:
            g = torch.Generator(device=device)
            if row.seed is None:
                g.seed()  # nondeterministic, as a user who gives no seed expects
            else:
                g.manual_seed(row.seed)
            s = self._streams[row.request_id] = _Stream(g)
        if row.step == s.step:  # the same step again: the same draw
            s.generator.set_state(s.before)
        elif row.step > s.step:
            s.step, s.before = row.step, s.generator.get_state()
        else:
            raise ValueError(f"request {row.request_id}: step {row.step} after step {s.step}")
        return s.generator


def _index(rows: list[int], device) -> torch.Tensor:
    return logits_process.to_device(rows, torch.int64, device)
