"""Decode instance scheduler: the request lifecycle, as explicit queues (plain Python, no torch).

    submit() --> queued --(pages for prompt + max_tokens reserved)--> waiting_for_kv --(cache arrives)--> running
                                                                                              |
    finished <--(EOS, a stop token id, max_tokens)--------------------------------------------+
    aborted  <--(abort(), from any state: the request's pages are freed at once, or held for hold_s
              when a failed NIXL hand-off's senders may still write into them)

n > 1 choices: admission reserves pages for all n (each choice its own pages); the hand-off fills
choice 0's only, and `kv_ready` starts every choice once the engine copied the prompt's rows into
the children's pages (DecodeStepDriver, one CopyCmd). Choice i samples with seed + i; aborting the
request aborts every choice.
    failed   <--(fail(): computing this request raised; `error` says why, its pages are freed)

- queued: accepted, waiting for pages in arrival order (beyond max_queue a submit gets 429).
- Admission reserves every slot the request can ever need (prompt + max_tokens - 1: the last
  token is never cached), so a running request never stalls for memory and nothing is preempted.
  Requests are admitted in arrival order; one that does not fit yet waits at the head.
- waiting_for_kv: pages are reserved, the cache is being delivered (loaded directly today, by the
  KV hand-off). `kv_ready()` moves a request to running.
- running: continuous batching. Every step decodes one token for every running request;
  requests join and leave between steps.
The first output token comes with the cache (the prefill sampled it), so a request with
max_tokens = 1, or whose first token is EOS, finishes without a decode step.

Only the decode loop thread (loop.py, the skeleton of serving/instance_loop.py) touches it, through
step_driver.py: submit and abort arrive there as commands; each iteration admits and steps once.
Through the HTTP API (http_api.py), end to end:
1. The handler validates the body (token ids inside the vocab, sampling params) and puts a submit
   command on the loop thread's queue, with a callback that feeds this request's asyncio.Queue
   through `call_soon_threadsafe`; handlers never touch the instance.
2. The loop thread takes the command at the top of its next iteration; submit() accepts it or
   rejects it (it can never fit this instance's KV slots: 400). Without a KV hand-off the engine
   prefills the prompt locally; with one (`bootstrap`), the request waits for pages, then for the
   prefill's rows (transfer/decode_room.py).
3. Each step delivers the request's tokens (the first comes from the prefill) as they are sampled;
   then exactly one finish (stop | length | abort) or error event.
4. A client that disconnects before the finish aborts the request: its pages are freed at once.

With a prefix cache (kvcache/radix_cache.py) and the prompt's token ids known, admission first locks
the longest cached run of whole pages of the prompt in its cache namespace (params.cache_namespace;
at most prompt_len - 1 tokens; `cached_len`) and reserves only the rest; the request's pages are
the cached ones, then its own. A request that finishes (stop | length) puts the whole pages of
prompt + output tokens whose cache it computed into the tree, in its namespace; an aborted or
failed one only frees its own pages. Either way it unlocks its prefix.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from ..kvcache import kv_fit
from ..kvcache.page_allocator import PageAllocator
from ..kvcache.radix_cache import Node, RadixCache
from ..request import SamplingParams, TokenLogprob, choice_id

_ids = itertools.count()


class RequestState(str, Enum):
    """A decode request's lifecycle, as drawn in the module docstring."""

    new = "new"
    queued = "queued"
    waiting_for_kv = "waiting_for_kv"
    running = "running"
    finished = "finished"
    aborted = "aborted"
    failed = "failed"


@dataclass
class DecodeRequest:
    prompt_len: int
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = field(default_factory=lambda: f"decode-{next(_ids)}")
    pages: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)  # output_ids[0] is the prefill's first token
    logprobs: list[TokenLogprob] = field(default_factory=list)  # with params.logprobs: one per token this
    # instance sampled (a hand-off's first token has its logprobs in the TransferDone, not here)
    state: RequestState = RequestState.new
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None  # why it failed (state "failed")
    prompt_ids: list[int] | None = None  # known: the prefix cache can serve and keep it
    cached_len: int = 0  # leading prompt tokens whose pages came from the prefix cache
    cache_node: Node | None = field(default=None, repr=False)  # locked while the request holds pages
    choice: int = 0  # n > 1: which choice; choices 1.. are "children" of choice 0 (the request itself)
    parent: str | None = None  # a child's: the request id of choice 0
    children: list["DecodeRequest"] = field(default_factory=list)  # choices 1..n-1, pages reserved with it

    def logprob_wire(self, later: int) -> list:
        """The logprobs of the token with `later` tokens after it in `logprobs`, as the stream carries
        them (TokenLogprob.wire); [] without logprobs."""
        return self.logprobs[len(self.logprobs) - 1 - later].wire() if self.logprobs else []

    @property
    def num_slots_needed(self) -> int:
        return kv_fit.slots_per_choice(self.prompt_len, self.params.max_tokens)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_ids)


class DecodeScheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        eos_ids: tuple[int, ...],
        max_batch: int = 64,
        cache: RadixCache | None = None,
    ):
        self.allocator, self.eos_ids, self.max_batch, self.cache = allocator, set(eos_ids), max_batch, cache
        self.queued: deque[DecodeRequest] = deque()  # accepted, no pages yet
        self.waiting_for_kv: dict[str, DecodeRequest] = {}
        self.running: list[DecodeRequest] = []

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_pages * self.allocator.page_size

    def _tokens_for(self, req: DecodeRequest) -> int:
        """Slots to reserve at admission: n choices, each in whole pages of its own (kvcache/kv_fit.py)."""
        return kv_fit.kv_tokens(req.prompt_len, req.params.max_tokens, req.params.n, self.allocator.page_size)

    def check_fits(self, req: DecodeRequest) -> None:
        """ValueError (a 400) for a request that can never run here; the router refuses the same ones
        (router/pool.py, by the same kv_fit.fits) before sending them."""
        p = req.params
        if not kv_fit.fits(req.prompt_len, p.max_tokens, p.n, self.allocator.page_size, self.capacity_tokens):
            need = kv_fit.kv_tokens(req.prompt_len, p.max_tokens, p.n, self.allocator.page_size)
            raise ValueError(
                f"request needs {need} KV slots ({p.n} choices of prompt {req.prompt_len} + max_tokens "
                f"{p.max_tokens} - 1 tokens, each in whole pages of {self.allocator.page_size}); this "
                f"instance holds {self.capacity_tokens}"
            )

    def submit(self, req: DecodeRequest) -> None:
        self.check_fits(req)
        req.state = RequestState.queued
        self.queued.append(req)

    def admit(self) -> list[DecodeRequest]:
        """Reserves pages for queued requests in order; returns those now waiting for their cache."""
        admitted = []
        while self.queued and len(self.running) + len(self.waiting_for_kv) < self.max_batch:
            req = self.queued[0]
            if not self._reserve(req):
                break
            self.queued.popleft()
            req.children = [
                DecodeRequest(
                    req.prompt_len,
                    req.params.choice_params(i),
                    choice_id(req.request_id, i),
                    self.allocator.allocate(req.num_slots_needed),
                    state=RequestState.waiting_for_kv,
                    choice=i,
                    parent=req.request_id,
                )
                for i in range(1, req.params.n)
            ]
            req.state = RequestState.waiting_for_kv
            self.waiting_for_kv[req.request_id] = req
            admitted.append(req)
        return admitted

    def _reserve(self, req: DecodeRequest) -> bool:
        """Pages for the request (its cached prefix locked first); False when they do not fit yet."""
        if self.cache is None or not req.prompt_ids:
            if not self.allocator.can_allocate(self._tokens_for(req)):
                return False
            req.pages = self.allocator.allocate(req.num_slots_needed)
            return True
        ns = req.params.cache_namespace
        match = self.cache.match(req.prompt_ids[: req.prompt_len - 1], count=False, namespace=ns)
        self.cache.lock(match.node)
        cached = match.num_pages * self.allocator.page_size
        if not self.allocator.can_allocate(self._tokens_for(req) - cached):  # choices 1.. get their own pages
            self.cache.unlock(match.node)
            return False
        self.cache.hit_tokens += cached
        req.pages = match.pages + self.allocator.allocate(req.num_slots_needed - cached)
        req.cached_len, req.cache_node = cached, match.node
        return True

    def _release(self, req: DecodeRequest, reason: str, hold_s: float) -> None:
        """The request's own pages go back (or, finished, its computed whole pages join the tree)."""
        node, req.cache_node = req.cache_node, None
        if node is None:
            self.allocator.free(req.pages, hold_s)
            return
        own = req.pages[req.cached_len // self.allocator.page_size :]
        if reason in ("stop", "length") and hold_s == 0:
            computed = req.prompt_ids + req.output_ids[:-1]  # the last token is never cached
            self.allocator.free(self.cache.insert(computed, req.pages, req.params.cache_namespace))
        else:
            self.allocator.free(own, hold_s)
        self.cache.unlock(node)

    def kv_ready(self, request_id: str, first_token: int, more_first: list[int] = ()) -> DecodeRequest:
        """The cache is in place (copied into the children's pages for n > 1) and the prefill
        sampled `first_token` (and each child's first token, `more_first`); returns the request."""
        req = self.waiting_for_kv.pop(request_id)
        if len(more_first) != len(req.children):
            raise ValueError(
                f"{len(req.children) + 1} choices need as many first tokens, got {len(more_first) + 1}"
            )
        choices = ((req, first_token), *zip(req.children, more_first))
        for r, token in choices:  # every choice starts before any ends: an ending choice 0 must
            r.output_ids.append(token)  # not take the others for choices that never started
            r.state = RequestState.running
            self.running.append(r)
        for r, token in choices:
            reason = r.params.finish_reason(token, len(r.output_ids), self.eos_ids)
            if reason:
                self._finish(r, reason)
        return req

    def postprocess(self, batch: list[DecodeRequest], tokens: list[int]) -> list[DecodeRequest]:
        """Records one decode step's tokens; returns the requests that finished."""
        finished = []
        for req, tok in zip(batch, tokens):
            if req.state != RequestState.running:  # aborted while the step ran
                continue
            req.output_ids.append(tok)
            reason = req.params.finish_reason(tok, len(req.output_ids), self.eos_ids)
            if reason:
                self._finish(req, reason)
                finished.append(req)
        return finished

    def _finish(self, req: DecodeRequest, reason: str, hold_s: float = 0.0) -> None:
        if req in self.running:
            self.running.remove(req)
        self.waiting_for_kv.pop(req.request_id, None)
        if req in self.queued:
            self.queued.remove(req)
        if req.pages:
            self._release(req, reason, hold_s)
            req.pages = []
        for child in req.children:  # choices that never started share the request's fate
            if child.state == RequestState.waiting_for_kv:
                self.allocator.free(child.pages, hold_s)
                child.pages, child.state, child.finish_reason = [], RequestState.aborted, "abort"
        req.state = {"abort": RequestState.aborted, "error": RequestState.failed}.get(
            reason, RequestState.finished
        )
        req.finish_reason = reason

    def fail_children(self, req: DecodeRequest, message: str) -> list[DecodeRequest]:
        """Choices 1..n-1 that cannot start (their copy of the prompt failed) fail; choice 0 goes on."""
        dropped, req.children = req.children, []
        for child in dropped:
            self.allocator.free(child.pages)
            child.pages, child.error = [], message
            child.state, child.finish_reason = RequestState.failed, "error"
        return dropped

    def fail(self, req: DecodeRequest, message: str) -> None:
        """Computing this request raised: it ends with `message`, its pages are freed."""
        req.error = message
        self._finish(req, "error")

    def abort(self, request_id: str, hold_s: float = 0.0) -> DecodeRequest | None:
        """hold_s: its pages become reusable only that much later (see PageAllocator.free). Aborting
        a request with n > 1 aborts every choice still running."""
        found = None
        for req in list(self.queued) + list(self.waiting_for_kv.values()) + self.running:
            if req.request_id == request_id or req.parent == request_id:
                self._finish(req, "abort", hold_s)
                if found is None or req.request_id == request_id:
                    found = req
        return found

    def is_idle(self) -> bool:
        return not (self.queued or self.waiting_for_kv or self.running)
