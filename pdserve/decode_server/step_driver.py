"""Drives a decode instance: schedule -> forward -> postprocess, one step at a time.

The scheduler decides (plain Python over requests and pages), the instance executes on its ranks,
and rank 0 samples on its device (engine/batch_sampler.py): each step carries one `SampleRow` per
request, built here with the grammar's mask from this process's matchers (`Sampler`), and answers
token ids and logprobs; the matchers then consume the tokens. Rank 0 keeps the requests' generators
and drops them when they end (with the next step, or at once when nothing else runs).
Requests submitted with their cache given directly (or computed by a local single-rank prefill when
none is given) are the path the KV hand-off replaces: its first token is sampled here and, as a
hand-off's is by the prefill, with a generator of its own, so the decode's stream starts fresh.
"""

from __future__ import annotations

import torch

from ..engine.batch_sampler import SampleRow
from ..engine.constraint import Grammars
from ..engine.llm_engine import LLMEngine
from ..engine.sampler import Sampler
from ..model.tokenizer import decodable_vocab
from ..request import SamplingParams, TokenLogprob, choice_id
from ..runtime.launcher import RankError
from .instance import DecodeInstance
from .rank_worker import StepResult
from .scheduler import DecodeRequest, DecodeScheduler


class DecodeStepDriver:
    def __init__(self, instance: DecodeInstance, max_batch: int = 64, keep_logits: bool = False):
        """keep_logits: rank 0 also returns each step's logits, kept in `last_logits` (checks)."""
        self.instance = instance
        self.scheduler = DecodeScheduler(
            instance.allocator, instance.model_config.eos_token_ids, max_batch, cache=instance.cache
        )
        mcfg = instance.model_config
        grammars = Grammars(instance.worker.model_dir, mcfg.vocab_size, mcfg.eos_token_ids)
        # the local prefill's sampler and the grammars' matchers; no id past the tokenizer, as on rank 0
        vocab = decodable_vocab(instance.worker.model_dir, mcfg.vocab_size)
        self.sampler = Sampler(grammars, mcfg.eos_token_ids, vocab)
        self._caches: dict[str, tuple[torch.Tensor, dict[int, torch.Tensor], int]] = {}
        self._local: LLMEngine | None = None
        self._remote: set[str] = set()  # requests whose cache comes by KV hand-off (transfer/decode_room.py)
        # the local prefill's: first token's logprobs, other choices' (token, logprobs)
        self._firsts: dict[str, tuple[TokenLogprob | None, list]] = {}
        self.pending: list[
            tuple[DecodeRequest, int | None]
        ] = []  # choices 1.. started by kv_ready: events of
        # the next step() (the loop steps while there are any, even when every choice already finished)
        self.keep_logits = keep_logits
        self.last_logits: dict[str, torch.Tensor] = {}  # request id -> [vocab] of the last step (keep_logits)
        self.grammar_wait = False  # the last step left out every running request: their grammars compile
        self._sampled: set[str] = set()  # requests rank 0 may hold a generator for
        self._forget: set[str] = set()  # ... that ended: rank 0 drops them with the next rank call

    def _local_prefill(self) -> LLMEngine:
        if self._local is None:  # built on first use: only the direct-load path needs it
            w = self.instance.worker
            self._local = LLMEngine.from_pretrained(
                w.model_dir,
                w.dtype,
                float32_islands=w.float32_islands,
                max_kv_tokens=self.instance.allocator.num_pages * self.instance.allocator.page_size,
            )
        return self._local

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        cache: tuple[torch.Tensor, dict[int, torch.Tensor], int] | None = None,
    ) -> DecodeRequest:
        """Accepts a request; `cache` = (latent [L, P, D], index keys, first token) or None to prefill locally."""
        params = params or SamplingParams()
        req = DecodeRequest(len(prompt_ids), params)
        if request_id:
            req.request_id = request_id
        self.scheduler.check_fits(req)
        self._prepare_grammar(params)
        if cache is None:  # before queueing: a failed prefill must leave nothing behind
            logits, kv, index = self._local_prefill().prefill_with_cache(list(prompt_ids))
            (first, lp), *more = self.sampler.sample_choices(logits, params, req.request_id)
            self.sampler.forget_choices(req.request_id, params.n)  # as the prefill does: decode starts fresh
            cache = (kv, index, first)
            self._firsts[req.request_id] = (lp, more)
        self._caches[req.request_id] = cache
        self.scheduler.submit(req)
        return req

    def submit_remote(
        self,
        prompt_len: int,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        prompt_ids: list[int] | None = None,
    ) -> DecodeRequest:
        """Accepts a request whose cache a KV hand-off will deliver: once admitted it waits in
        waiting_for_kv until `kv_ready()` (after a verified transfer) or `abort()`. prompt_ids (its
        length prompt_len): the prefix cache may serve its leading pages (decode_server/scheduler.py)."""
        if prompt_ids is not None and len(prompt_ids) != prompt_len:
            raise ValueError(f"{len(prompt_ids)} prompt ids for a {prompt_len}-token prompt")
        req = DecodeRequest(prompt_len, params or SamplingParams(), prompt_ids=prompt_ids)
        if request_id:
            req.request_id = request_id
        self.scheduler.submit(req)
        self._remote.add(req.request_id)
        self._prepare_grammar(req.params)  # compiles while the prefill runs
        return req

    def _prepare_grammar(self, params: SamplingParams) -> None:
        try:
            self.sampler.grammar_ready(params)
        except Exception:  # a grammar that fails to compile fails its request at its first step
            pass

    def kv_ready(
        self,
        request_id: str,
        first_token: int,
        first_logprob: TokenLogprob | None = None,
        more_first: list[tuple[int, TokenLogprob | None]] = (),
    ) -> DecodeRequest:
        """A hand-off delivered and verified this request's cache: it joins the running batch.
        `first_logprob`: the local prefill's logprobs of the first token (a hand-off's come in its
        TransferDone); `more_first`: n > 1, choices 1..n-1's first tokens: the prompt's rows are
        copied into their pages first (one CopyCmd; no second transfer), then every choice runs.
        Their first tokens are events of the next step()."""
        self._remote.discard(request_id)
        req = self.scheduler.waiting_for_kv[request_id]
        if req.children:
            try:
                self.instance.copy_prompt(req.pages, [c.pages for c in req.children], req.prompt_len)
            except RankError:
                raise
            except Exception as e:  # the other choices fail, choice 0 goes on
                failed = self.scheduler.fail_children(req, f"copying the prompt's cache failed: {e}")
                self.pending += [(c, None) for c in failed]
                more_first = []
        self.scheduler.kv_ready(request_id, first_token, [t for t, _ in more_first])
        if first_logprob is not None:
            req.logprobs.append(first_logprob)
        for child, (token, lp) in zip(req.children, more_first):
            if lp is not None:
                child.logprobs.append(lp)
            self.pending.append((child, token))
        if req.state == "finished":
            self._ended(request_id)
        return req

    def abort(self, request_id: str, hold_s: float = 0.0) -> DecodeRequest | None:
        """hold_s > 0: a failed hand-off's senders may still WRITE into its pages (DecodeInstance.forget)."""
        self._remote.discard(request_id)
        self._caches.pop(request_id, None)
        self._firsts.pop(request_id, None)
        req = self.scheduler.abort(request_id, hold_s)
        for i in range(req.params.n if req is not None and req.parent is None else 1):
            self._ended(choice_id(request_id, i))
        return req

    def _ended(self, request_id: str) -> None:
        """The request ended: its matcher goes, and rank 0's generator with the next rank call."""
        self.sampler.forget(request_id)
        if request_id in self._sampled:
            self._sampled.discard(request_id)
            self._forget.add(request_id)

    def step(self) -> list[tuple[DecodeRequest, int | None]]:
        """Admits what fits (loading its cache), then decodes one token for every running request.
        Events are (request, token); a request that failed has token None, state "failed" and its
        `error` (docs/design.md invariant 9: the others go on). RankError (a broken rank group) propagates."""
        events = self.admit()  # may start choices 1.. of a request (pending, before their decode tokens)
        events, self.pending = self.pending + events, []
        batch = list(self.scheduler.running)
        self.last_logits, self.grammar_wait = {}, False
        if batch:
            events += self._decode(batch)
        for req, _ in events:
            if req.state in ("finished", "aborted", "failed"):
                self._ended(req.request_id)
        if not self.scheduler.running:  # no step soon to carry the news
            self.forget_ended()
        return events

    def forget_ended(self) -> None:
        """Rank 0 drops the generators of the requests that ended since the last rank call (a step
        carries them; the loop calls this when it has no step to run, so an idle instance holds none)."""
        if not self._forget:
            return
        try:
            self.instance.forget_sampling(tuple(sorted(self._forget)))
        except RankError:
            raise
        except Exception:  # kept: the next rank call carries them again
            return
        self._forget.clear()

    def _decode(self, batch: list[DecodeRequest]) -> list[tuple[DecodeRequest, int | None]]:
        batch, rows, events = self._sample_rows(batch)
        if not batch:
            self.grammar_wait = not events
            return events
        try:
            result = self._forward(batch, rows)
        except RankError:
            raise
        except Exception:  # CommandFailed (the group is usable) or a main-process error
            return events + self._decode_one_by_one(batch, rows)
        return events + self._accept(batch, result)

    def _sample_rows(
        self, batch: list[DecodeRequest]
    ) -> tuple[list[DecodeRequest], list[SampleRow], list[tuple[DecodeRequest, None]]]:
        """Each request's SampleRow (its grammar's mask from its matcher); a request whose grammar
        still compiles (in the background: engine/constraint.py) sits this step out, one whose
        matcher fails leaves the batch, failed."""
        kept, rows, events = [], [], []
        eos = self.instance.model_config.eos_token_ids
        for req in batch:
            try:
                if not self.sampler.grammar_ready(req.params):
                    continue
                mask = self.sampler.grammar_mask(req.params, req.request_id, req.output_ids)
                rows.append(SampleRow.of(req.request_id, req.params, req.output_ids, eos, mask))
                kept.append(req)
            except Exception as e:
                events.append(self._fail(req, e))
        return kept, rows, events

    def _forward(self, batch: list[DecodeRequest], rows: list[SampleRow]) -> StepResult:
        self._sampled.update(r.request_id for r in batch if not r.params.greedy)
        forget = tuple(sorted(self._forget))
        result = self.instance.sample_step(
            [r.output_ids[-1] for r in batch],
            [r.pages for r in batch],
            [r.num_tokens for r in batch],
            rows,
            forget,
            self.keep_logits,
        )
        self._forget.difference_update(forget)
        return result

    def _decode_one_by_one(
        self, batch: list[DecodeRequest], rows: list[SampleRow]
    ) -> list[tuple[DecodeRequest, int | None]]:
        """A batched step failed and the rank group is still usable: each request runs alone, and
        only those that fail alone fail. A decode step is idempotent per request (running it again
        writes the same entry into the same slot, and rank 0 redraws the same token: its generators
        remember their last step), so re-running the others changes nothing."""
        events = []
        for req, row in zip(batch, rows):
            try:
                result = self._forward([req], [row])
            except RankError:
                raise
            except Exception as e:
                events.append(self._fail(req, e))
                continue
            events += self._accept([req], result)
        return events

    def _accept(
        self, batch: list[DecodeRequest], result: StepResult
    ) -> list[tuple[DecodeRequest, int | None]]:
        """Rank 0's tokens: each fed to its request's grammar matcher; a row's error fails only its request."""
        events, ok, tokens = [], [], []
        for i, (req, row) in enumerate(zip(batch, result.rows)):
            if row.error is not None:
                self.scheduler.fail(req, row.error)
                events.append((req, None))
                continue
            try:
                self.sampler.consume(req.params, req.request_id, row.token)
            except Exception as e:
                events.append(self._fail(req, e))
                continue
            if row.logprob is not None:
                req.logprobs.append(row.logprob)
            ok.append(req)
            tokens.append(row.token)
            if result.logits is not None:
                self.last_logits[req.request_id] = result.logits[i]
        self.scheduler.postprocess(ok, tokens)
        return events + list(zip(ok, tokens))

    def _fail(self, req: DecodeRequest, e: Exception) -> tuple[DecodeRequest, None]:
        self.scheduler.fail(req, f"{type(e).__name__}: {e}")
        return req, None

    def admit(self) -> list[tuple[DecodeRequest, int | None]]:
        """Reserves pages for what fits; loads directly given caches (those run at once). Requests
        submitted with submit_remote() stay in waiting_for_kv, their pages reserved for the hand-off.
        A cache that fails to load fails its request (token None)."""
        events = []
        for req in self.scheduler.admit():
            if req.request_id in self._remote:
                continue
            kv, index, first = self._caches.pop(req.request_id)
            try:
                self.instance.load(req.pages, kv, index)
            except RankError:
                raise
            except Exception as e:
                events.append(self._fail(req, e))
                continue
            lp, more = self._firsts.pop(req.request_id, (None, []))
            self.kv_ready(req.request_id, first, lp, more)
            events.append((req, first))
        return events

    def run_until_idle(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if self.scheduler.is_idle() or self._only_awaiting_transfers():
                self.forget_ended()
                return
            self.step()
        raise RuntimeError("decode engine did not become idle")

    def _only_awaiting_transfers(self) -> bool:
        """Nothing can progress here: every request left waits for a hand-off someone else drives."""
        s = self.scheduler
        return not s.queued and not s.running and set(s.waiting_for_kv) <= self._remote
