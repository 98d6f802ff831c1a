"""What one prefill rank process does: load the model, hold its share of the cache, run chunks.

The launcher (runtime/launcher.py) sends every rank the same command; each rank computes its own
tokens of every chunk, and the rank that holds the prompt's last token samples the first token.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from ..engine.attn_ops import make_attention_ops
from ..engine.gemm_ops import apply_gemm_ops
from ..engine.llm_engine import parse_dtype
from ..engine.logits_process import bitmask_words, decodable, prompt_logprobs, unpack_bitmask
from ..engine.sampler import Sampler
from ..kvcache.kv_cache import KVPool
from ..model.config import ModelConfig
from ..model.shard import weight_bytes_by_dtype
from ..model.tokenizer import decodable_vocab
from ..model.weights import load_model
from ..request import SamplingParams, TokenLogprob
from ..runtime.device import rank_device
from ..runtime.expert_parallel import wrap_moe_ep
from ..runtime.faults import check_fault
from ..runtime.launcher import RankWorker
from ..runtime.memory_check import check_device_fits
from ..runtime.pipe_tensors import to_pipe
from ..transfer.backends import make_sender
from ..transfer.rank_commands import SendCmd, SenderStatus, SenderStatusCmd, SendReply, StreamedSend
from ..transfer.row_mac import LANES
from .cp_backend import ChunkPlan, CPBackend, layer_owners
from .handoff_stream import LayerStream
from .layouts import split_positions
from .moe_tp import TokenSplit, shard_prefill_ffn, wrap_moe_tp
from .worker_config import PrefillWorkerConfig

PROMPT_LOGPROB_ROWS = 64  # echo's prompt logprobs: logits of this many positions at once


@dataclass(frozen=True)
class PrefillCmd:
    request_id: str
    token_ids: list[int]
    slots: list[int]  # cache slot of every position [0, len(token_ids))
    chunk_size: int
    params: SamplingParams
    cached_len: int = 0  # positions [0, cached_len) are already in the cache at those slots
    want_logits: bool = False
    # the grammar's mask for the first token (constraint.Matcher.bitmask), computed by the server
    # process, which compiles grammars off its loop; params.grammar is None then: ranks compile none
    first_mask: bytes | None = None
    # a hand-off sent while computing (prefill_server/handoff_stream.py); the reply's `sent` answers it
    stream: StreamedSend | None = None


@dataclass(frozen=True)
class PrefillRankInfo:
    """A rank's readiness answer (PrefillInstance.rank_infos; /info's ranks)."""

    rank: int
    pid: int
    cache_bytes: int
    weight_bytes: int  # parameters and fp8 block scales
    layers: list[int]  # the layers whose cache this rank keeps
    weight_bytes_by_dtype: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PrefillRankReply:
    """A rank's answer to PrefillCmd: the first token from the rank that holds the last position."""

    rank: int
    token: int | None = None  # None on every rank but the one that computed the last position
    logits: tuple | None = None  # [vocab] (runtime/pipe_tensors.py wire), with PrefillCmd.want_logits
    seconds: float = 0.0  # this rank's wall time in the command
    comm_seconds: float = 0.0  # of which in the CP collectives (CPBackend.comm_s)
    logprob: TokenLogprob | None = None  # the first token's, with params.logprobs
    prompt_logprobs: dict[int, TokenLogprob] | None = None  # position p -> of token p + 1, own positions
    more: list[tuple[int, TokenLogprob | None]] = field(default_factory=list)  # choices 1..n-1's first tokens
    sent: SendReply | None = None  # with PrefillCmd.stream: SendCmd's reply (checksums or the error)
    computed_at: float = 0.0  # time.monotonic() when its last chunk was computed (before the stream closed)


@dataclass(frozen=True)
class DumpCacheCmd:
    slots: list[int]  # returns this rank's entries at these slots for every layer it holds (CacheDump)


CacheDump = dict[
    int, tuple[torch.Tensor, "torch.Tensor | None"]
]  # layer -> (latent rows, index keys or None)


class PrefillRankWorker(RankWorker):
    def __init__(self, rank: int, world: int, cfg: PrefillWorkerConfig):
        self.rank, self.world, self.cfg = rank, world, cfg
        dtype = parse_dtype(cfg.dtype)
        self.device = dev = rank_device(cfg.device)
        layers = None

        def fits(meta_model) -> None:  # before anything is allocated: weights + KV + workspace
            pool = self._make_pool(meta_model.config, layers, "meta")
            kv = pool.nbytes + (pool.row_hash_nbytes(LANES) if cfg.transfer == "nixl" else 0)  # NixlSender's
            check_device_fits(f"prefill rank {rank}", dev, weight_bytes_by_dtype(meta_model), kv)

        if cfg.cache == "layer-split":
            n_layers = ModelConfig.from_pretrained(cfg.model_dir).num_layers
            layers = [i for i, owner in enumerate(layer_owners(n_layers, world)) if owner == rank]
        self.model = load_model(
            cfg.model_dir,
            dtype,
            dev,
            float32_islands=cfg.float32_islands,
            shard=lambda m: shard_prefill_ffn(m, rank, world, cfg.moe_tp, cfg.moe_ep),
            keep_fp8=cfg.keep_fp8,
            check=fits,
        )
        self.mcfg = self.model.config
        self.split = TokenSplit(rank, world)
        if cfg.moe_tp:
            wrap_moe_tp(self.model, self.split)
        elif cfg.moe_ep:
            wrap_moe_ep(self.model, world)
        apply_gemm_ops(self.model, cfg.linear_ops, cfg.moe_ops, dev, f"prefill rank {rank} ({dev})")
        self.pool = self._make_pool(self.mcfg, layers, dev)
        ops = make_attention_ops(cfg.attention_ops, dev, dtype, self.mcfg, who=f"prefill rank {rank} ({dev})")
        self.backend = CPBackend(self.mcfg, self.pool, rank, world, cfg.query_block, ops)
        # no padded LM-head row is sampled, nor listed among echo's prompt logprobs
        self.vocab = vocab = decodable_vocab(cfg.model_dir, self.mcfg.vocab_size)
        self.sampler = Sampler(None, self.mcfg.eos_token_ids, vocab)  # grammars: the server's (first_mask)
        self.sender = make_sender(
            cfg.transfer, rank, self.pool, cfg.frame_key
        )  # KV hand-off data path (transfer/tcp.py, nixl.py)

    def _make_pool(self, mcfg, layers: list[int] | None, device) -> KVPool:
        cfg = self.cfg
        dtype = parse_dtype(cfg.dtype)
        return KVPool(
            mcfg,
            cfg.num_slots,
            dtype,
            device,
            layers=layers,
            residues=cfg.kv_residues or self.world,
        )

    def info(self) -> PrefillRankInfo:
        by_dtype = weight_bytes_by_dtype(self.model)
        return PrefillRankInfo(
            self.rank, os.getpid(), self.pool.nbytes, sum(by_dtype.values()), list(self.pool.layers), by_dtype
        )

    def commands(self) -> dict:
        return {
            PrefillCmd: self.prefill,
            DumpCacheCmd: self.dump,
            SendCmd: lambda cmd: self.sender.send(cmd),
            SenderStatusCmd: lambda _: SenderStatus(self.sender.status()),
        }

    @torch.inference_mode()
    def prefill(self, cmd: PrefillCmd) -> PrefillRankReply:
        check_fault([cmd.request_id])  # test-only, off by default (runtime/faults.py)
        t_start, self.backend.comm_s = time.perf_counter(), 0.0
        stream = LayerStream(self.sender, cmd.stream, self.rank) if cmd.stream else None
        try:
            last_hidden, prompt_lp = self._chunks(cmd, stream)
            computed_at = time.monotonic()
        finally:
            self.backend.on_stored = None
            sent = stream.close() if stream else None  # every WRITE it posted is done or cancelled
        token, logits, lp, more = None, None, None, []
        if last_hidden is not None:
            logits = self.model.compute_logits(last_hidden)  # [1, vocab]
            allowed = None
            if cmd.first_mask is not None:
                words = bitmask_words([cmd.first_mask], self.mcfg.vocab_size, logits.device)
                allowed = unpack_bitmask(words, self.mcfg.vocab_size)[0]
            try:  # n > 1: every choice's first token from these logits, each with its own seed stream
                (token, lp), *more = self.sampler.sample_choices(
                    logits[0], cmd.params, cmd.request_id, allowed
                )
            finally:
                self.sampler.forget_choices(cmd.request_id, cmd.params.n)
            logits = to_pipe(logits[0]) if cmd.want_logits else None  # runtime/pipe_tensors.py wire
        seconds = time.perf_counter() - t_start
        return PrefillRankReply(
            self.rank, token, logits, seconds, self.backend.comm_s, lp, prompt_lp, more, sent, computed_at
        )

    def _chunks(self, cmd: PrefillCmd, stream: LayerStream | None):
        """Runs the prompt's chunks: (the last position's hidden state on its rank else None,
        this rank's prompt logprobs or None); a stream posts each layer's rows as they are stored."""
        n, dev = len(cmd.token_ids), self.device
        slots = torch.tensor(cmd.slots, dtype=torch.int64, device=dev)
        last_hidden, k = None, cmd.params.prompt_logprobs
        prompt_lp: dict[int, TokenLogprob] | None = None if k is None else {}
        if stream:
            stream.ready(cmd.cached_len)  # the prefix cache's rows exist already
            self.backend.on_stored = stream.layer
        for c0 in range(cmd.cached_len, n, cmd.chunk_size):
            c1 = min(n, c0 + cmd.chunk_size)
            plan = ChunkPlan(c0, c1, split_positions(self.cfg.layout, c0, c1, self.world), slots[:c1])
            mine = plan.positions[self.rank]
            self.split.counts = plan.counts
            if stream:
                stream.chunk(c1)
            self.backend.begin(plan)
            ids = torch.tensor([cmd.token_ids[p] for p in mine], dtype=torch.int64, device=dev)
            positions = torch.tensor(mine, dtype=torch.int64, device=dev)
            hidden = self.model(ids, positions, self.backend)  # [len(mine), hidden]
            self.backend.finish()
            if stream:
                stream.chunk_done()
            if prompt_lp is not None:
                prompt_lp.update(self._prompt_logprobs(hidden, mine, cmd.token_ids, k))
            if c1 == n and mine and mine[-1] == n - 1:
                last_hidden = hidden[-1:]
        return last_hidden, prompt_lp

    def _prompt_logprobs(self, hidden, mine: list[int], token_ids: list[int], k: int) -> dict:
        """This rank's positions p < n - 1: the logprob of token p + 1 given the prompt up to p."""
        rows = [i for i, p in enumerate(mine) if p + 1 < len(token_ids)]
        out: dict[int, TokenLogprob] = {}
        for b in range(
            0, len(rows), PROMPT_LOGPROB_ROWS
        ):  # [block, vocab] logits at a time, not [chunk, vocab]
            block = rows[b : b + PROMPT_LOGPROB_ROWS]
            logits = decodable(self.model.compute_logits(hidden[block]), self.vocab)
            nxt = torch.tensor([token_ids[mine[i] + 1] for i in block], dtype=torch.int64)
            out.update(zip((mine[i] for i in block), prompt_logprobs(logits, nxt, k)))
        return out

    def dump(self, cmd: DumpCacheCmd) -> CacheDump:
        slots = torch.tensor(cmd.slots, dtype=torch.int64, device=self.device)
        out = {}
        for layer in self.pool.layers:  # replies travel through a pipe: runtime/pipe_tensors.py wire
            idx = to_pipe(self.pool.read_index(layer, slots)) if self.mcfg.has_indexer(layer) else None
            out[layer] = (to_pipe(self.pool.read_kv(layer, slots)), idx)
        return out
