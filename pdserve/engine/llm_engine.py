"""The single-process, single-rank engine: schedule -> forward -> postprocess.

Used directly by `pdserve generate`, by the benchmarks, and as the reference that the parallel
prefill and decode servers must agree with.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..kvcache.kv_cache import KVPool
from ..kvcache.page_allocator import PageAllocator
from ..model.config import ModelConfig
from ..model.tokenizer import decodable_vocab
from ..model.transformer import CausalLM
from ..model.weights import load_model
from ..request import Request, SamplingParams
from .attn_ops import make_attention_ops
from .model_runner import ModelRunner
from .sampler import Sampler
from .scheduler import Chunk, Scheduler
from .single_backend import SingleRankBackend

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r} (supported: {', '.join(DTYPES)})")
    return DTYPES[name]


class LLMEngine:
    def __init__(
        self,
        model: CausalLM,
        max_kv_tokens: int = 32768,
        page_size: int = 16,
        prefill_chunk: int = 4096,
        query_block: int = 256,
        max_batch: int = 64,
        attention_ops: str = "auto",  # engine/attn_ops.py
        announce: str = "",  # a name: print the ops choice to stderr under it
        vocab_limit: int | None = None,  # ids never sampled from here up (model/tokenizer.py decodable_vocab)
    ):
        self.model, self.config = model, model.config
        param = next(model.parameters())
        dtype, self.device = param.dtype, param.device
        pages = -(-max_kv_tokens // page_size)
        self.allocator = PageAllocator(pages, page_size)
        self.pool = KVPool(self.config, pages * page_size, dtype, device=self.device)
        self.ops = make_attention_ops(attention_ops, self.device, dtype, self.config, who=announce)
        self.backend = SingleRankBackend(self.config, self.pool, query_block, self.ops)
        self.runner = ModelRunner(model, self.allocator, self.backend)
        self.scheduler = Scheduler(self.allocator, self.config.eos_token_ids, prefill_chunk, max_batch)
        self.sampler = Sampler(vocab_limit=vocab_limit)

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        dtype: str | torch.dtype = "float32",
        float32_islands: bool = True,
        device: str | torch.device = "cpu",
        **kwargs,
    ) -> "LLMEngine":
        model = load_model(model_dir, parse_dtype(dtype), device, float32_islands=float32_islands)
        kwargs.setdefault("vocab_limit", decodable_vocab(model_dir, model.config.vocab_size))
        return cls(model, **kwargs)

    @property
    def model_config(self) -> ModelConfig:
        return self.config

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None) -> Request:
        bad = [t for t in prompt_ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        req = Request(list(prompt_ids), params or SamplingParams())
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> None:
        if self.scheduler.abort(request_id) is not None:
            self.sampler.forget(request_id)

    def step(self) -> list[tuple[Request, int]]:
        """Runs one step; returns the (request, token) pairs it produced."""
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        logits = self.runner.run(chunks)
        tokens: list[int | None] = [None] * len(chunks)
        done = [i for i, c in enumerate(chunks) if c.start + c.n == c.request.num_tokens]
        if done:
            sampled = self.sampler.sample(
                logits[done],
                [chunks[i].request.params for i in done],
                [chunks[i].request.request_id for i in done],
            )
            for i, tok in zip(done, sampled):
                tokens[i] = tok
        for req in self.scheduler.postprocess(chunks, tokens):
            self.sampler.forget(req.request_id)
        return [(c.request, t) for c, t in zip(chunks, tokens) if t is not None]

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[list[int]]:
        """Runs the given prompts together (continuous batching) and returns their output ids."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        reqs = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        while self.scheduler.has_work():
            self.step()
        return [r.output_ids for r in reqs]

    def prefill_logits(self, prompt_ids: list[int]) -> torch.Tensor:
        """Logits at every prompt position [T, V] (for checks against a reference); frees its cache."""
        return self._prefill_once(prompt_ids, all_logits=True)[0]

    def prefill_with_cache(
        self, prompt_ids: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]:
        """One prompt's last-position logits [V], latent entries [L, n, c + rope] and index keys
        {indexer layer: [n, Di]}: what a decode instance needs to continue it. Frees its pages."""
        logits, slots = self._prefill_once(prompt_ids, all_logits=False)
        kv = torch.stack([self.pool.read_kv(layer, slots) for layer in range(self.config.num_layers)])
        index = {layer: self.pool.read_index(layer, slots) for layer in self.config.indexer_layers}
        return logits[0], kv, index

    def _prefill_once(self, prompt_ids: list[int], all_logits: bool) -> tuple[torch.Tensor, torch.Tensor]:
        req = Request(list(prompt_ids), SamplingParams(max_tokens=1))
        req.pages = self.allocator.allocate(len(prompt_ids))
        try:
            logits = self.runner.run([Chunk(req, 0, len(prompt_ids))], all_logits=all_logits)
            return logits, torch.tensor(
                self.allocator.slots(req.pages, 0, len(prompt_ids)), device=self.device
            )
        finally:
            self.allocator.free(req.pages)
