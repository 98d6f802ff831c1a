"""KV storage: the tensors that hold latent cache entries and index keys, addressed by slot.

Bookkeeping (which request owns which slots) lives in PageAllocator; this class only stores.

kv_cache_dtype "auto" stores in the model dtype. "fp8_e4m3" stores one byte per value:
  - latent entries with a static scale of 1.0 (clamped to +-448), as FP8 MLA caches do: they come out
    of an RMSNorm (c_kv) or are rope'd keys of similar size, so one fixed scale keeps them in range;
  - index keys with one float32 scale per key (token x layer): their magnitudes vary a lot between
    tokens, and a per-key scale keeps small keys as accurate as large ones (132 bytes per key at 128).
Reads return the pool's compute dtype, so attention code never sees fp8, except a kernel that
converts tiles itself: `kv_stored` hands the triton decode (engine/attn_ops.TritonOps) the fp8 rows.

Device: the tensors live on `device` (a rank's GPU on cuda). Slot indices and written values may
come from the host (the TCP hand-off's frames, a test's LoadCmd): they are moved to the pool's
device here, and `read_into` a host buffer copies device -> host once, so the TCP path copies
through host memory while NIXL WRITEs VRAM to VRAM (transfer/nixl*.py).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..model.config import ModelConfig
from ..model.kernels import take_rows
from . import huge_pages
from .capacity import check_kv_cache_dtype, entry_bytes, index_bytes, tokens_for_budget

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_KV_SCALE = 1.0  # the latent entries' static scale: stored value = entry / scale


class KVPool:
    """Holds the entries of `layers` (default: every layer); a layer-split prefill rank holds a few.

    index_slots (default num_slots) sizes the index separately: a decode rank with a copied index
    keeps index keys for every slot of the instance but latent entries only for its own 1/C_d.

    residues R (default 1) lays the latent entries out residue-major: slot s lives at row
    (s % R) * ceil(num_slots / R) + s // R. Slots never change meaning (every caller passes slots);
    what changes is that slots s, s + R, s + 2R, ... are consecutive rows. A prefill pool with R = the
    decode instances' C_d holds each decode rank's tokens in contiguous rows, which a hand-off can
    WRITE without packing them first (`span`). Index keys stay slot-ordered: a copied index sends
    every slot, which is contiguous that way.

    scratch=True (a decode rank) adds one row past the slots to the latent entries and to the index
    keys (`scratch_row`, `scratch_index`): a decode step writes every request's new entry, and the
    rows that are not this rank's to keep (another rank's slot, a padding row of a batch bucket) go
    there, so the step needs no boolean mask, whose output shape would depend on values (a host
    sync; decode_server/dcp_backend.py). Nothing ever reads it; `nbytes` counts it, `slot_bytes`
    (the capacity, docs/design.md invariant 6) does not."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_slots: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        layers: list[int] | None = None,
        kv_cache_dtype: str = "auto",
        index_slots: int | None = None,
        residues: int = 1,
        scratch: bool = False,
    ):
        if residues < 1:
            raise ValueError(f"residues must be >= 1, got {residues}")
        self.residues, self.block = residues, -(-num_slots // residues)  # block: rows per residue
        self.num_slots = num_slots
        self.index_slots = num_slots if index_slots is None else index_slots
        self.dtype = dtype  # compute dtype: what reads return
        self.kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)
        self.fp8 = kv_cache_dtype == "fp8_e4m3"
        store = FP8 if self.fp8 else dtype
        self.layers = list(range(cfg.num_layers)) if layers is None else list(layers)
        self.kv_row = {layer: i for i, layer in enumerate(self.layers)}
        rows = self.block * residues  # num_slots, rounded up to a multiple of R
        if scratch and residues != 1:
            raise ValueError("a scratch row is for decode pools (residues 1)")
        self.scratch_row, self.scratch_index = (rows, self.index_slots) if scratch else (None, None)
        extra = int(scratch)
        # on huge pages (kvcache/huge_pages.py): a NIXL hand-off's kernel copies pin far fewer pages
        self.kv = huge_pages.zeros(
            len(self.layers), rows + extra, cfg.kv_entry_dim, dtype=store, device=device
        )  # [L, rows, c+rope]
        indexed = [layer for layer in self.layers if cfg.has_indexer(layer)]
        self.index_row = {layer: i for i, layer in enumerate(indexed)}
        shape = (len(indexed), self.index_slots + extra)
        self.index_k = huge_pages.zeros(
            *shape, max(cfg.index_head_dim, 1), dtype=store, device=device
        )  # [Li, slots, Di]
        # Per-key dequantization scale; None when keys are stored in the model dtype.
        self.index_scale = torch.ones(shape, dtype=torch.float32, device=device) if self.fp8 else None
        self.hasher: Callable[[torch.Tensor], torch.Tensor] | None = None  # keep_row_hashes
        self.row_hashes: dict[str, torch.Tensor] = {}  # kind -> [tables, rows, lanes] int64

    @property
    def nbytes(self) -> int:
        tensors = [self.kv, self.index_k] + ([self.index_scale] if self.fp8 else [])
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def slot_bytes(self) -> int:
        """nbytes without the scratch row: what the slots hold (the capacity)."""
        if self.scratch_row is None:
            return self.nbytes
        tensors = [self.kv, self.index_k] + ([self.index_scale] if self.fp8 else [])
        return self.nbytes - sum(t[:, :1].numel() * t.element_size() for t in tensors)

    def holds(self, layer: int) -> bool:
        return layer in self.kv_row

    @staticmethod
    def bytes_per_token(cfg: ModelConfig, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
        """E + I: one token's bytes in a pool holding every layer (see kvcache/capacity.py)."""
        return entry_bytes(cfg, kv_cache_dtype, dtype) + index_bytes(cfg, kv_cache_dtype, dtype)

    def keep_row_hashes(self, hasher: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """From now on every write also stores hasher(rows as stored) ([n, lanes] int64: a hand-off's
        keyed row hashes, transfer/row_mac.py) beside its rows, and copies copy them, so a sender
        reads the hashes of the rows it WRITEs (`span_hashes`) instead of hashing them while it sends.
        The rows already stored are hashed now. Rows changed other than through this pool's writes
        keep stale hashes, which a receiver's room MAC then refuses. Not for fp8 pools (rows travel
        dequantized from them, never as stored)."""
        if self.fp8:
            raise ValueError("an fp8 pool's rows never travel as stored: no row hashes")
        self.hasher = hasher
        lanes = hasher(self.kv.new_zeros(1, self.kv.shape[-1])).shape[1]
        self.row_hashes = {}
        for kind, table in (("kv", self.kv), ("index", self.index_k)):
            out = torch.empty(*table.shape[:2], lanes, dtype=torch.int64, device=table.device)
            for i, rows in enumerate(table):  # a layer at a time
                out[i] = hasher(rows)
            self.row_hashes[kind] = out

    def row_hash_nbytes(self, lanes: int) -> int:
        """What keep_row_hashes allocates for `lanes` int64 hashes per row (a meta pool answers too)."""
        return (
            (self.kv.shape[0] * self.kv.shape[1] + self.index_k.shape[0] * self.index_k.shape[1]) * lanes * 8
        )

    def span_hashes(self, kind: str, layer: int, start: int, n: int, step: int) -> torch.Tensor | None:
        """The row hashes ([n, lanes], a view) of `span`'s rows, or None when `span` gives none or
        the pool keeps no row hashes."""
        at = self._span(kind, layer, start, n, step) if self.hasher is not None else None
        return None if at is None else self.row_hashes[kind][at[0], at[1] : at[1] + n]

    def _put_hashes(self, kind: str, row: int, rows: torch.Tensor | slice, stored: torch.Tensor) -> None:
        if self.hasher is not None:
            _put(self.row_hashes[kind][row], rows, self.hasher(stored))

    def write(self, layer: int, slots: torch.Tensor, kv: torch.Tensor, index_k: torch.Tensor | None) -> None:
        """Latent entries and (in indexer layers) index keys of the same slots."""
        self.write_kv(layer, slots, kv)
        if index_k is not None:
            self.write_index(layer, slots, index_k)

    def write_kv(self, layer: int, rows: torch.Tensor | slice, kv: torch.Tensor) -> None:
        if self.fp8:
            kv = kv.float().clamp(-FP8_MAX, FP8_MAX)
        row, rows, kv = self.kv_row[layer], self._kv_rows(rows), kv.to(self.kv.dtype)
        _put(self.kv[row], rows, kv)
        self._put_hashes("kv", row, rows, kv)

    def write_index(self, layer: int, rows: torch.Tensor | slice, index_k: torch.Tensor) -> None:
        """Index rows may differ from latent rows (a decode rank's copied index holds every slot)."""
        row = self.index_row[layer]
        if self.fp8:
            index_k, scale = _quantize_per_key(index_k)
            self.index_scale[row, _on(rows, self.index_scale)] = scale.to(self.index_scale.device)
        index_k = index_k.to(self.index_k.dtype)
        _put(self.index_k[row], rows, index_k)
        self._put_hashes("index", row, rows, index_k)

    def read_into(self, kind: str, layer: int, slots: torch.Tensor | slice, out: torch.Tensor) -> None:
        """read_kv ("kv") or read_index ("index") of 1-D `slots` (or a slice, a strided one too),
        written into `out` [rows, width] (e.g. a sender's staging buffer) without an intermediate
        tensor when nothing is dequantized."""
        if self.fp8:
            out.copy_(self.read_kv(layer, slots) if kind == "kv" else self.read_index(layer, slots))
            return
        if kind == "kv":
            table, slots = self.kv[self.kv_row[layer]], self._kv_rows(slots)
        else:
            table = self.index_k[self.index_row[layer]]
        if isinstance(slots, slice):
            out.copy_(table[slots])
        elif out.device != table.device:  # a host staging buffer (TCP): one device -> host copy
            out.copy_(table.index_select(0, slots.to(table.device)))
        else:
            torch.index_select(table, 0, slots.to(table.device), out=out)

    def span(self, kind: str, layer: int, start: int, n: int, step: int) -> torch.Tensor | None:
        """The rows of slots start, start + step, ... (n of them) as a view of consecutive rows of the
        storage -- what a sender can WRITE without packing -- or None when they are not consecutive
        there or need dequantizing (fp8)."""
        at = self._span(kind, layer, start, n, step)
        return None if at is None else (self.kv if kind == "kv" else self.index_k)[at[0], at[1] : at[1] + n]

    def _span(self, kind: str, layer: int, start: int, n: int, step: int) -> tuple[int, int] | None:
        """(table, first row) of `span`'s rows, or None."""
        limit = self.num_slots if kind == "kv" else self.index_slots
        if self.fp8 or n < 1 or start < 0 or start + (n - 1) * step >= limit:
            return None  # out of range: the caller's packing path raises
        if kind == "index":
            return (self.index_row[layer], start) if step == 1 or n == 1 else None
        if n > 1 and step != self.residues:
            return None
        return self.kv_row[layer], start % self.residues * self.block + start // self.residues  # _kv_rows

    def _kv_rows(self, slots: torch.Tensor | slice) -> torch.Tensor | slice:
        """Storage rows of latent-entry slots (the slots themselves unless residue-major)."""
        if self.residues == 1:
            return slots
        if isinstance(slots, slice):
            slots = torch.arange(*slots.indices(self.num_slots), device=self.kv.device)
        return slots % self.residues * self.block + torch.div(slots, self.residues, rounding_mode="floor")

    def copy_kv(self, layer: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Latent rows src -> dst as stored (no dequantizing): choices that share one prompt."""
        row = self.kv_row[layer]
        table = self.kv[row]
        src, dst = self._kv_rows(_on(src, table)), self._kv_rows(_on(dst, table))
        table[dst] = table[src]
        if self.hasher is not None:
            self.row_hashes["kv"][row, dst] = self.row_hashes["kv"][row, src]

    def copy_index(self, layer: int, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Index rows src -> dst as stored, with their fp8 scales."""
        row = self.index_row[layer]
        self.index_k[row, _on(dst, self.index_k)] = self.index_k[row, _on(src, self.index_k)]
        if self.hasher is not None:
            h = self.row_hashes["index"]
            h[row, _on(dst, h)] = h[row, _on(src, h)]
        if self.fp8:
            self.index_scale[row, _on(dst, self.index_scale)] = self.index_scale[
                row, _on(src, self.index_scale)
            ]

    def kv_table(self, layer: int) -> torch.Tensor | None:
        """The latent rows of `layer` as stored ([rows, c + rope], row ids from `kv_row_ids`) when
        reading them converts nothing (not fp8, stored in the pool's dtype), else None."""
        table = self.kv[self.kv_row[layer]]
        return table if not self.fp8 and table.dtype == self.dtype else None

    kv_scale = FP8_KV_SCALE

    def kv_stored(self, layer: int) -> torch.Tensor:
        """The latent rows of `layer` as stored ([rows, c + rope], fp8 too: entry = row * kv_scale),
        for a kernel that converts tiles itself (engine/attn_ops.TritonOps)."""
        return self.kv[self.kv_row[layer]]

    def kv_row_ids(self, slots: torch.Tensor) -> torch.Tensor:
        """The storage rows of latent-entry slots (any shape), on the pool's device."""
        return self._kv_rows(_on(slots, self.kv))

    def read_kv(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        return take_rows(self.kv[self.kv_row[layer]], self._kv_rows(_on(slots, self.kv))).to(self.dtype)

    def read_index(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        row, slots = self.index_row[layer], _on(slots, self.index_k)
        if not self.fp8:
            return take_rows(self.index_k[row], slots)
        scale = self.index_scale[row, slots].unsqueeze(-1)
        return (self.index_k[row, slots].float() * scale).to(self.dtype)


def pool_for_budget(
    cfg,
    budget_bytes: int,
    dcp_size: int = 1,
    index_mode: str = "copy",
    page_size: int = 64,
    dtype=None,
    kv_cache_dtype: str = "auto",
    device="cpu",
):
    """The KVPool one decode rank would allocate for budget_bytes; its nbytes checks the formula.

    Latent rows are slots / C_d (capacity.tokens_for_budget); index rows are slots (copy) or slots / C_d (split)."""
    dtype = torch.bfloat16 if dtype is None else dtype
    slots = tokens_for_budget(cfg, budget_bytes, dcp_size, index_mode, page_size, kv_cache_dtype, dtype)
    rows = slots // dcp_size
    return KVPool(
        cfg,
        rows,
        dtype,
        device=device,
        kv_cache_dtype=kv_cache_dtype,
        index_slots=slots if index_mode == "copy" else rows,
    )


def _on(index, table: torch.Tensor):
    """An index tensor on the table's device (a slice or a tensor already there: unchanged)."""
    if isinstance(index, torch.Tensor) and index.device != table.device:
        return index.to(table.device)
    return index


def _put(table: torch.Tensor, rows: torch.Tensor | slice, values: torch.Tensor) -> None:
    """table[rows] = values; index_copy_ (2-3x faster on CPU than index_put; no fp8 kernel) where it
    applies. `rows` may be a slice: a plain copy, the fastest. Host rows or values (a TCP frame) are
    moved to the table's device first."""
    rows, values = _on(rows, table), values.to(table.device)
    if isinstance(rows, slice):
        table[rows].copy_(values)
    elif (
        table.dtype != FP8
        and rows.dim() == 1
        and rows.dtype == torch.int64
        and values.dim() == 2
        and len(values) == len(rows)
    ):
        table.index_copy_(0, rows, values)
    else:
        table[rows] = values


def _quantize_per_key(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k / scale, scale) with scale = max|k| / 448 per key, so each key uses fp8's full range.
    An all-zero key gets scale 1 instead of 0 (which would make 0/0 = NaN)."""
    k = k.float()
    amax = k.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (k / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX), scale
