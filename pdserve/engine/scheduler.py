"""Single-rank engine scheduler: plain Python over requests and page ids.

Request lifecycle (the queues are explicit):

    add() --> waiting --(pages for prompt + max_tokens free)--> prefilling --(last chunk)--> running
                                                                                          |
    finished <--(EOS, a stop token id, max_tokens, or abort)-------------------------------+

- Admission reserves every page the request can ever need (prompt + max_tokens - 1 slots), so a
  running request never stalls for memory and nothing is preempted.
- Each step is either one prefill chunk of the oldest prefilling request (chunks keep memory
  bounded for long prompts) or one decode step of every running request (continuous batching:
  requests join and leave the running batch between steps).
- abort() frees a request's pages at once, whichever queue it is in.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..kvcache.page_allocator import PageAllocator
from ..request import Request, Status


@dataclass
class Chunk:
    request: Request
    start: int  # first position computed in this step
    n: int  # positions computed


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        eos_ids: tuple[int, ...],
        prefill_chunk: int = 4096,
        max_batch: int = 64,
    ):
        self.allocator, self.eos_ids = allocator, set(eos_ids)
        self.prefill_chunk, self.max_batch = prefill_chunk, max_batch
        self.waiting: deque[Request] = deque()
        self.prefilling: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        if self.allocator.pages_for(req.max_total_tokens) > self.allocator.num_pages:
            raise ValueError(
                f"request needs {req.max_total_tokens} KV slots (prompt {len(req.prompt_ids)} + max_tokens "
                f"{req.params.max_tokens}); this engine holds {self.allocator.num_pages * self.allocator.page_size}"
            )
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def _admit(self) -> None:
        while self.waiting and len(self.running) + len(self.prefilling) < self.max_batch:
            req = self.waiting[0]
            if not self.allocator.can_allocate(req.max_total_tokens):
                return
            self.waiting.popleft()
            req.pages = self.allocator.allocate(req.max_total_tokens)
            req.status = Status.PREFILLING
            self.prefilling.append(req)

    def schedule(self) -> list[Chunk]:
        """The work of the next step: one prefill chunk, or one token for every running request."""
        self._admit()
        if self.prefilling:
            req = self.prefilling[0]
            n = min(self.prefill_chunk, len(req.prompt_ids) - req.num_cached)
            return [Chunk(req, req.num_cached, n)]
        return [Chunk(r, r.num_tokens - 1, 1) for r in self.running]

    def postprocess(self, chunks: list[Chunk], tokens: list[int | None]) -> list[Request]:
        """Record what a step computed; returns the requests that finished."""
        finished = []
        for chunk, tok in zip(chunks, tokens):
            req = chunk.request
            req.num_cached = chunk.start + chunk.n
            if tok is None:  # an intermediate prefill chunk samples nothing
                continue
            if req in self.prefilling:
                self.prefilling.remove(req)
                self.running.append(req)
                req.status = Status.RUNNING
            req.output_ids.append(tok)
            reason = req.params.finish_reason(tok, len(req.output_ids), self.eos_ids)
            if reason:
                self._finish(req, reason)
                finished.append(req)
        return finished

    def _finish(self, req: Request, reason: str) -> None:
        for queue in (self.running, self.prefilling, self.waiting):
            if req in queue:
                queue.remove(req)
        if req.pages:
            self.allocator.free(req.pages)
            req.pages = []
        req.status, req.finish_reason = Status.FINISHED, reason

    def abort(self, request_id: str) -> Request | None:
        for queue in (self.running, self.prefilling, self.waiting):
            for req in queue:
                if req.request_id == request_id:
                    self._finish(req, "abort")
                    return req
        return None
