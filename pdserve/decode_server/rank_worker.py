"""What one decode rank process does: its weight slices, its rows of the cache, one step at a time.

The launcher sends every rank the same command. A step runs the model on every running request's
newest token (tensor parallel over the W ranks, context parallel over the DCP group; the LM head is
vocab-parallel and all-gathers the logits, so one rank's answer is enough); rank 0 samples each
request's next token on its device (engine/batch_sampler.py: the step carries one `SampleRow` per
request) and answers a
`StepResult`: token ids and the logprobs asked for, never [B, vocab] logits, which it returns only
for checks (a step without sampling rows, or one that asks for them beside the tokens).
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from ..engine.attn_ops import make_attention_ops
from ..engine.batch_sampler import BatchSampler, Sampled, SampleRow
from ..engine.gemm_ops import apply_gemm_ops
from ..engine.llm_engine import parse_dtype
from ..kvcache.capacity import page_bytes_per_rank
from ..kvcache.kv_cache import KVPool
from ..model.layers import Experts
from ..model.shard import weight_bytes_by_dtype
from ..model.tokenizer import decodable_vocab
from ..model.weights import load_model
from ..runtime.comm import make_comm
from ..runtime.device import check_devices, rank_device
from ..runtime.faults import check_fault
from ..runtime.launcher import RankWorker
from ..runtime.memory_check import (
    WORKSPACE_BYTES,
    RankMemoryError,
    check_device_fits,
    device_memory,
    gib,
    kv_tokens_for_memory,
)
from ..runtime.pipe_tensors import to_pipe
from ..runtime.sync_check import forbid_host_sync
from ..transfer.backends import make_receiver
from ..transfer.rank_commands import TRANSFER_CMDS
from .cuda_graphs import StepGraphs, graph_blocker, use_graphs
from .dcp_backend import DCPBackend, DCPGroup, DecodeBatch
from .step_metadata import StepInputs, StepMetadata
from .tp import shard_decode_model, wrap_decode_tp
from .worker_config import DecodeWorkerConfig


def step_forward(model, backend: DCPBackend, inputs: StepInputs, logits: bool) -> torch.Tensor:
    """A decode step on the device, from its inputs to the logits [B, vocab] (logits=False: the
    final hidden states [B, hidden]): no host sync (runtime/sync_check.py), so a CUDA graph can hold it."""
    backend.begin(DecodeBatch(inputs.page_table, inputs.lengths, inputs.page_size))
    hidden = model(inputs.token_ids.long(), inputs.positions.long(), backend)  # [B, hidden]
    return model.compute_logits(hidden) if logits else hidden


@dataclass(frozen=True)
class LoadCmd:
    """A request's prompt cache given directly (for tests; the KV hand-off replaces it)."""

    slots: list[int]  # global slots of positions 0..P-1
    kv: torch.Tensor  # [L, P, c + rope]
    index: dict[int, torch.Tensor]  # indexer layer -> [P, Di]


@dataclass(frozen=True)
class CopyCmd:
    """Positions 0..P-1 of one request's cache copied into other requests' slots (n choices share
    one prompt: one prefill, one hand-off). Position p sits on decode rank p % C_d in every request
    (docs/design.md invariant 4), so each rank copies its own rows only."""

    src: list[int]  # global slots of positions 0..P-1
    dst: list[list[int]]  # per copy: the global slots of the same positions


@dataclass(frozen=True)
class StepCmd:
    token_ids: list[int]  # the newest token of each running request
    pages: list[list[int]]  # per request: its pages (page tables are small; slot lists would be O(context))
    lengths: list[int]  # per request: S, so positions 0..S-1 are read and S-1 is the newest token
    page_size: int
    request_ids: tuple[str, ...] = ()  # for error messages and the test-only fault hook (runtime/faults.py)
    # one per request: rank 0 samples and answers a StepResult; None: rank 0 answers the logits (checks)
    sampling: tuple[SampleRow, ...] | None = None
    forget: tuple[str, ...] = ()  # requests that ended: rank 0 drops their generators first
    return_logits: bool = False  # with sampling rows: the StepResult carries the logits too (checks)


@dataclass(frozen=True)
class StepResult:
    """Rank 0's answer to a StepCmd with sampling rows: one outcome per request, in the batch's order."""

    rows: list[Sampled]
    # [B, vocab], only when asked: runtime/pipe_tensors.py wire (DecodeInstance.sample_step rebuilds it)
    logits: tuple | torch.Tensor | None = None


@dataclass(frozen=True)
class ForgetSamplingCmd:
    """Requests that ended with no step to carry them: rank 0 drops their generators now."""

    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class DecodeRankInfo:
    """A rank's answer to InfoCmd and ReconfigureCmd, and its readiness ack (DecodeInstance.rank_infos)."""

    rank: int
    pid: int
    cache_bytes: int
    weight_bytes: int  # parameters and fp8 block scales
    empty_selections: int  # sparse-attention selections that found no key on this rank (DCP split)
    index_mode: str  # follows ReconfigureCmd
    data_endpoint: str | None  # its KV hand-off receiver
    weight_bytes_by_dtype: dict[str, int] = field(default_factory=dict)  # "float8_e4m3fn", "bfloat16", ...
    num_slots: int = 0  # the instance's KV slots (chosen by the ranks under --gpu-memory-utilization)


@dataclass(frozen=True)
class DumpCmd:
    slots: list[int]  # returns this rank's stored rows among these global slots (RankRows)


@dataclass(frozen=True)
class RankRows:
    """A decode rank's answer to DumpCmd (checks): its own slots among those asked for and their rows,
    the latent cache per layer and the index keys per indexer layer (runtime/pipe_tensors.py wire
    from the rank, tensors once DecodeInstance.dump has them)."""

    slots: list[int]
    kv: dict[int, Any]
    index: dict[int, Any]


@dataclass(frozen=True)
class InfoCmd:
    """Each rank's `DecodeRankInfo`."""


@dataclass(frozen=True)
class SelectionsCmd:
    """Each rank's selected positions of the last step per indexer layer ([B, k], -1 padded; checks)."""


@dataclass(frozen=True)
class SamplingStreamsCmd:
    """The request ids rank 0 holds a sampling generator for (checks: none once every request ended)."""


@dataclass(frozen=True)
class ReconfigureCmd:
    """Switches index mode / merge backend and clears the cache (lets tests sweep them on one instance)."""

    index_mode: str
    comm: str


class DecodeRankWorker(RankWorker):
    _batch_sampler: BatchSampler | None = None  # rank 0's generators and sampling, built on first use
    _rows = 0  # the last step's requests (its outputs past them are padding)

    def __init__(self, rank: int, world: int, cfg: DecodeWorkerConfig):
        if world % cfg.dcp_size:
            raise ValueError(f"--dcp-size {cfg.dcp_size} must divide --tp-size {world}")
        self.rank, self.world, self.cfg = rank, world, cfg
        self.dtype = parse_dtype(cfg.dtype)
        self.device = rank_device(cfg.device)
        device_comm = check_devices(cfg.device, world // cfg.nnodes, cfg.gpu_ids, nodes=cfg.nnodes).comm
        who = f"decode rank {rank}"

        def fits(meta_model) -> None:  # before anything is allocated: weights + KV + workspace
            weights = weight_bytes_by_dtype(meta_model)
            if cfg.num_slots is None:
                self.cfg = replace(cfg, num_slots=self._slots_from_memory(meta_model.config, weights, who))
            kv = self._make_pool(meta_model.config, cfg.index_mode, "meta").nbytes
            check_device_fits(who, self.device, weights, kv)

        self.model = load_model(
            cfg.model_dir,
            self.dtype,
            self.device,
            float32_islands=cfg.float32_islands,
            shard=lambda m: shard_decode_model(m, rank, world, cfg.dcp_size, cfg.replicate_q, cfg.moe_ep),
            keep_fp8=cfg.keep_fp8,
            check=fits,
        )
        self.mcfg = self.model.config
        # rank 0 samples no id past the tokenizer (padded LM-head rows); read now, not in the first step
        self.vocab_limit = decodable_vocab(cfg.model_dir, self.mcfg.vocab_size) if rank == 0 else None
        self.ops = make_attention_ops(
            cfg.attention_ops, self.device, self.dtype, self.mcfg, cfg.kv_cache_dtype, who
        )
        self.tp_comm = make_comm(self._cpu_comm(range(world)), rank, world, device_comm=device_comm)
        wrap_decode_tp(self.model, rank, world, self.tp_comm)
        apply_gemm_ops(self.model, cfg.linear_ops, cfg.moe_ops, self.device, f"decode rank {rank}")
        for m in self.model.modules():  # the step must not sync: the torch MoE without routed shapes
            if isinstance(m, Experts):
                m.static_shapes = True
        blocker = graph_blocker(self.device.type, world, device_comm, self.ops.name)
        self.graphs = StepGraphs() if use_graphs(cfg.cuda_graphs, blocker, who) else None
        self.metadata: StepMetadata | None = None  # built by the first step (it brings the page size)
        group = None
        for g in range(world // cfg.dcp_size):  # every rank creates every group, in the same order
            members = list(range(g * cfg.dcp_size, (g + 1) * cfg.dcp_size))
            pg = dist.new_group(members) if cfg.dcp_size > 1 else None
            if rank in members:
                group, mine = pg, members
        self.dcp = DCPGroup(
            rank % cfg.dcp_size,
            cfg.dcp_size,
            make_comm(self._cpu_comm(mine), rank % cfg.dcp_size, cfg.dcp_size, group, device_comm),
        )
        self._build(cfg.index_mode, cfg.comm)
        # KV hand-off data path (transfer/tcp.py or nixl.py): stores arriving rows into the current pool
        self.receiver = make_receiver(
            cfg.transfer,
            rank,
            lambda: self.pool,
            cfg.data_host,
            cfg.transfer_quarantine_s,
            cfg.frame_key,
        )

    def _cpu_comm(self, members) -> str:
        """--cpu-comm for a group of these ranks: shared memory needs them on one node, else gloo."""
        per = self.world // self.cfg.nnodes
        return self.cfg.cpu_comm if len({r // per for r in members}) == 1 else "gloo"

    def _slots_from_memory(self, mcfg, weights: dict[str, int], who: str) -> int:
        """The instance's slots under --gpu-memory-utilization: what this rank's GPU holds
        (memory_check.kv_tokens_for_memory), the least over the ranks (every rank the same slots)."""
        cfg, workspace = self.cfg, WORKSPACE_BYTES["cuda"]
        total, used = device_memory(self.device)
        page = page_bytes_per_rank(
            mcfg, cfg.dcp_size, cfg.index_mode, cfg.page_size, cfg.kv_cache_dtype, self.dtype
        )
        w, u = sum(weights.values()), cfg.gpu_memory_utilization
        mine = kv_tokens_for_memory(total, used, w, workspace, u, page, cfg.page_size)
        least = torch.tensor(
            [mine], dtype=torch.int64, device=self.device if dist.get_backend() == "nccl" else "cpu"
        )
        if self.world > 1:
            dist.all_reduce(least, op=dist.ReduceOp.MIN)
        slots = int(least[0])  # once, at startup
        print(
            f"{who}: KV pool {slots} tokens (--gpu-memory-utilization {u}: {self.device} {gib(total)} total, "
            f"{gib(used)} in use, weights {gib(w)}, workspace {gib(workspace)}; this GPU alone {mine})",
            file=sys.stderr,
            flush=True,
        )
        if slots == 0:
            raise RankMemoryError(
                f"{who}: --gpu-memory-utilization {u} leaves no KV page ({page} bytes per rank) after the "
                f"weights ({gib(w)}), the workspace ({gib(workspace)}) and the {gib(used)} in use of {gib(total)}"
            )
        return slots

    def _make_pool(self, mcfg, index_mode: str, device) -> KVPool:
        cfg = self.cfg
        rows = cfg.num_slots // cfg.dcp_size
        return KVPool(
            mcfg,
            rows,
            self.dtype,
            device,
            kv_cache_dtype=cfg.kv_cache_dtype,
            index_slots=cfg.num_slots if index_mode == "copy" else rows,
            scratch=True,  # where a step's rows that are not this rank's to keep write (dcp_backend.py)
        )

    def _build(self, index_mode: str, comm: str) -> None:
        self.cfg = replace(self.cfg, index_mode=index_mode, comm=comm)
        self.pool = None  # the old pool is freed before the new one is allocated
        self.pool = self._make_pool(self.mcfg, index_mode, self.device)
        self.backend = DCPBackend(
            self.mcfg, self.pool, self.dcp, index_mode, comm, self.cfg.replicate_q, self.ops
        )
        if self.graphs is not None:  # captured over the old pool: captured again
            self.graphs = StepGraphs()

    def info(self) -> DecodeRankInfo:
        by_dtype = weight_bytes_by_dtype(self.model)
        return DecodeRankInfo(
            self.rank,
            os.getpid(),
            self.pool.slot_bytes,
            sum(by_dtype.values()),
            self.backend.empty_selections,
            self.cfg.index_mode,
            self.receiver.endpoint if hasattr(self, "receiver") else None,
            by_dtype,
            self.cfg.num_slots,
        )

    def commands(self) -> dict:
        return {
            StepCmd: self.step,
            LoadCmd: self.load,
            CopyCmd: self.copy,
            DumpCmd: self.dump,
            ReconfigureCmd: self._reconfigure,
            ForgetSamplingCmd: self._forget_sampling,
            TRANSFER_CMDS: lambda cmd: self.receiver.handle(cmd),
            InfoCmd: lambda _: self.info(),
            SelectionsCmd: lambda _: {  # runtime/pipe_tensors.py: a step's small tensors as bytes
                layer: to_pipe(sel[: self._rows]) for layer, sel in self.backend.selections.items()
            },
            SamplingStreamsCmd: lambda _: self._sampler().request_ids if self.rank == 0 else [],
        }

    def _sampler(self) -> BatchSampler:
        if self._batch_sampler is None:
            self._batch_sampler = BatchSampler(self.vocab_limit)
        return self._batch_sampler

    def _forget_sampling(self, cmd: ForgetSamplingCmd) -> None:
        if self.rank == 0:
            self._sampler().forget(cmd.request_ids)

    def _reconfigure(self, cmd: ReconfigureCmd) -> DecodeRankInfo:
        self._build(cmd.index_mode, cmd.comm)
        return self.info()

    def _own(self, slots: torch.Tensor) -> torch.Tensor:
        return slots % self.dcp.size == self.dcp.rank

    def load(self, cmd: LoadCmd) -> None:
        dev = self.device
        slots = torch.tensor(cmd.slots, dtype=torch.int64, device=dev)
        own = self._own(slots)
        rows = slots[own] // self.dcp.size
        for layer in range(self.mcfg.num_layers):
            self.pool.write_kv(layer, rows, cmd.kv[layer].to(dev)[own])
            if layer in cmd.index:
                index = cmd.index[layer].to(dev)
                if self.cfg.index_mode == "copy":
                    self.pool.write_index(layer, slots, index)
                else:
                    self.pool.write_index(layer, rows, index[own])

    def copy(self, cmd: CopyCmd) -> None:
        src = torch.tensor(cmd.src, dtype=torch.int64, device=self.device)
        own = self._own(src)
        for dst_slots in cmd.dst:
            dst = torch.tensor(dst_slots, dtype=torch.int64, device=self.device)
            if len(dst) != len(src) or not torch.equal(self._own(dst), own):
                raise ValueError("a copy's slots must hold the same positions on the same ranks")
            for layer in self.pool.layers:
                self.pool.copy_kv(layer, src[own] // self.dcp.size, dst[own] // self.dcp.size)
            for layer in self.pool.index_row:
                if self.cfg.index_mode == "copy":  # every rank keeps every slot's index key
                    self.pool.copy_index(layer, src, dst)
                else:
                    self.pool.copy_index(layer, src[own] // self.dcp.size, dst[own] // self.dcp.size)

    def _step_metadata(self, page_size: int) -> StepMetadata:
        if self.metadata is None or self.metadata.page_size != page_size:
            cfg = self.cfg
            pad = self.device.type == "cuda" if cfg.pad_steps is None else cfg.pad_steps
            # padded: fixed shapes, buffers (and graphs) per bucket
            self.metadata = StepMetadata(
                self.device, page_size, cfg.num_slots // page_size, cfg.max_batch, pad
            )
        return self.metadata

    @torch.inference_mode()
    def step(self, cmd: StepCmd):
        if self.rank == 0 and cmd.forget:  # first: a failure below must not keep them
            self._sampler().forget(cmd.forget)
        inputs = self._step_metadata(cmd.page_size).fill(cmd.token_ids, cmd.pages, cmd.lengths)
        self._rows = inputs.rows
        # every rank: the LM head is vocab-parallel (its logits are a collective)
        run = lambda: step_forward(self.model, self.backend, inputs, logits=True)  # noqa: E731
        with forbid_host_sync() if self.cfg.forbid_host_sync else contextlib.nullcontext():
            out = run() if self.graphs is None else self.graphs.run(inputs.key, run)
        if self.rank == self.world - 1:  # after every collective: the other ranks still answer
            check_fault(cmd.request_ids)
        if self.rank != 0:
            return None
        logits = out[: inputs.rows]  # [B, vocab]: padding rows dropped
        if cmd.sampling is None:
            return to_pipe(logits)  # through a pipe
        rows = self._sampler().sample(logits, cmd.sampling)
        return StepResult(rows, to_pipe(logits) if cmd.return_logits else None)

    def dump(self, cmd: DumpCmd) -> RankRows:
        slots = torch.tensor(cmd.slots, dtype=torch.int64, device=self.device)
        own = self._own(slots)
        rows = slots[own] // self.dcp.size
        index = {}
        for layer in self.pool.index_row:
            index[layer] = to_pipe(
                self.pool.read_index(layer, slots if self.cfg.index_mode == "copy" else rows)
            )
        return RankRows(
            slots[own].tolist(), {l: to_pipe(self.pool.read_kv(l, rows)) for l in self.pool.layers}, index
        )
