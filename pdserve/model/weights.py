"""Load a Hugging Face safetensors checkpoint into a CausalLM, or a rank's part of it, without a
second copy of the weights.

The rank's model is built on the meta device with its parallel slices applied (model/shard.py),
given uninitialised storage on its device, and each checkpoint tensor's slice for this rank is read
with safetensors `get_slice` and copied into its parameter: a rank never reads or allocates another
rank's part, and at most one slice is in flight on the host. Released checkpoints and transformers'
save_pretrained store routed experts per expert (`mlp.experts.N.gate_proj.weight`); transformers'
in-memory fused layout (`mlp.experts.gate_up_proj`) is accepted too. Anything missing, misshapen or
unknown is a one-line WeightError naming it.

FP8 block-quantized checkpoints (quant.py): a `.weight` stored as float8_e4m3fn with a
`.weight_scale_inv` beside it either stays fp8 (`keep_fp8`, where shard.py allows: the weight and the
block rows of its scales are copied as they are) or is dequantized block by block to the run dtype
as it is read (the blocks that cover the rank's slice only). Multi-token-prediction layers (the
`num_nextn_predict_layers` layers after the last decoder layer) are skipped unread, with one line.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig
from .fusion import fuse_projections
from .layers import Experts, Linear
from .quant import SCALE_SUFFIX, QuantizationError, check_scale, dequantize_fp8
from .shard import EXPERT_KEY, FP8, Cut, build_rank_model, materialize, quantized_modules
from .transformer import CausalLM, Embedding

_LAYER_PREFIX = "model.layers."


class WeightError(ValueError):
    """A checkpoint's tensors do not match the model; the message names the tensor."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise WeightError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def checkpoint_keys(model_dir: Path, files: list[Path]) -> list[str]:
    """Every tensor name of the checkpoint (the index's, or the single file's header)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    with safe_open(str(files[0]), framework="pt") as f:
        return list(f.keys())


_FP8_FILE_DTYPES = ("F8_E4M3",)
_OTHER_FP8 = ("F8_E5M2",)


@dataclass
class _Dest:
    """Where one checkpoint tensor's slice for this rank goes."""

    name: str  # the parameter (bookkeeping)
    tensor: torch.Tensor  # the rank's storage for it
    cut: Cut | None  # the slice of the checkpoint tensor it holds (dim counted in that tensor)
    scale: torch.Tensor | None = None  # fp8 kept: the storage of its block scales
    expert: tuple[int, str] | None = None  # (expert, projection) of a per-expert tensor
    fused: bool = False  # transformers' stacked experts on a rank with a TP or EP share of them

    def full_shape(self) -> tuple[int, ...]:
        shape = list(self.tensor.shape)
        if self.cut is not None:
            shape[self.cut.dim % len(shape)] = self.cut.full
        return tuple(shape)


_SKIP = object()  # a tensor of this model that another rank holds (expert parallelism)


class _Filler:
    """Routes checkpoint tensors to this rank's parameter slices and remembers what has been filled."""

    def __init__(self, model: CausalLM, cfg: ModelConfig):
        self.cfg = cfg
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.modules = dict(model.named_modules())
        self.todo = set(self.params)
        if cfg.tie_word_embeddings:
            self.todo.discard("lm_head.weight")
        self.expert_parts: dict[str, set[tuple[int, str]]] = {}

    def target(self, key: str):
        """The _Dest of `key`, _SKIP for another rank's expert, None for a tensor not in the model."""
        m = EXPERT_KEY.match(key)
        if m:
            return self._expert_target(m.group(1), int(m.group(2)), m.group(3))
        if key not in self.params:
            return None
        path, _, attr = key.rpartition(".")
        module = self.modules.get(path)
        cut = None
        if (
            isinstance(module, Linear)
            and module.cut is not None
            and (attr == "weight" or module.cut.dim == 0)
        ):
            cut = module.cut
            scale = module.weight_scale_inv if attr == "weight" else None
            return _Dest(key, self.params[key], cut, scale)
        if isinstance(module, Experts) and (module.cut is not None or module.first_expert is not None):
            return _Dest(key, self.params[key], None, fused=True)  # read by _Reader._read_fused
        if isinstance(module, Linear) and attr == "weight":
            return _Dest(key, self.params[key], None, module.weight_scale_inv)
        if isinstance(module, Embedding):  # vocab-parallel: its rows
            return _Dest(key, self.params[key], module.cut)
        return _Dest(key, self.params[key], cut)

    def _expert_target(self, prefix: str, e: int, kind: str):
        ex = self.modules.get(prefix)
        if not isinstance(ex, Experts):
            return None
        if ex.first_expert is not None:
            e -= ex.first_expert
            if not 0 <= e < ex.n_routed:
                return _SKIP
        elif e >= ex.n_routed:
            return None
        inter = ex.down_proj.shape[2]
        cut = ex.cut
        scale = None
        if kind == "down_proj":
            if ex.down_scale_inv is not None:
                scale = ex.down_scale_inv[e]
            return _Dest(
                f"{prefix}.down_proj",
                ex.down_proj[e],
                None if cut is None else replace(cut, dim=1),
                scale,
                (e, kind),
            )
        half = slice(0, inter) if kind == "gate_proj" else slice(inter, 2 * inter)
        if ex.gate_up_scale_inv is not None:
            rows = ex.gate_up_scale_inv.shape[1] // 2
            scale = ex.gate_up_scale_inv[e][:rows] if kind == "gate_proj" else ex.gate_up_scale_inv[e][rows:]
        dest = ex.gate_up_proj[e][half]
        return _Dest(
            f"{prefix}.gate_up_proj", dest, None if cut is None else replace(cut, dim=0), scale, (e, kind)
        )

    def is_mtp(self, key: str) -> bool:
        """A tensor of the multi-token-prediction layers shipped after the last decoder layer."""
        if not key.startswith(_LAYER_PREFIX):
            return False
        layer = key[len(_LAYER_PREFIX) :].split(".", 1)[0]
        n = self.cfg.num_layers
        return layer.isdigit() and n <= int(layer) < n + self.cfg.num_nextn_predict_layers

    def ignorable(self, key: str) -> bool:
        return key.endswith("rotary_emb.inv_freq") or (
            key == "lm_head.weight" and self.cfg.tie_word_embeddings
        )

    def check_known(self, key: str, where: Path):
        """The destination of `key`, None (or _SKIP) for a tensor to skip, or a WeightError for an unknown one."""
        hit = self.target(key)
        if hit is None and not self.ignorable(key):
            raise WeightError(
                f"unexpected tensor {key} in {where.name}: not part of a {self.cfg.model_type} model"
            )
        return hit

    def check_shape(self, key: str, shape: tuple[int, ...], dest: _Dest) -> None:
        if tuple(shape) != dest.full_shape():
            raise WeightError(f"tensor {key} has shape {list(shape)}, expected {list(dest.full_shape())}")

    def filled(self, dest: _Dest) -> None:
        if dest.expert is None:
            self.todo.discard(dest.name)
            return
        parts = self.expert_parts.setdefault(dest.name, set())
        parts.add(dest.expert)
        ex = self.modules[dest.name.rsplit(".", 1)[0]]
        if len(parts) == ex.n_routed * (1 if dest.name.endswith("down_proj") else 2):
            self.todo.discard(dest.name)

    def check_complete(self, model_dir: Path) -> None:
        if self.todo:
            first = sorted(self.todo)[0]
            more = f" (and {len(self.todo) - 1} more)" if len(self.todo) > 1 else ""
            raise WeightError(f"missing tensor {first}{more} in {model_dir}")


def check_tensor_names(cfg: ModelConfig, names, where: str = "the index") -> dict[str, int]:
    """Classifies checkpoint tensor names as the loader would, on a meta-device model (no memory):
    counts of loaded tensors, block scales, skipped MTP tensors and ignored ones; a WeightError names
    the first tensor the loader would reject."""
    with torch.device("meta"):
        filler = _Filler(CausalLM(cfg), cfg)
    counts = {"load": 0, "scale": 0, "mtp": 0, "ignored": 0}
    for key in names:
        if filler.is_mtp(key):
            kind = "mtp"
        elif key.endswith(SCALE_SUFFIX):
            filler.check_known(key[: -len(SCALE_SUFFIX)], Path(where))
            kind = "scale"
        else:
            kind = "ignored" if filler.check_known(key, Path(where)) is None else "load"
        counts[kind] += 1
    return counts


def rank_model(
    model_dir: str | Path,
    dtype: torch.dtype,
    float32_islands: bool = True,
    shard: Callable[[CausalLM], None] | None = None,
    keep_fp8: bool = False,
) -> CausalLM:
    """The model a rank would load, on the meta device (no memory, no weights read): its shapes and
    dtypes give its weight bytes (shard.weight_bytes_by_dtype) before anything is allocated."""
    model_dir = Path(model_dir)
    cfg = replace(ModelConfig.from_pretrained(model_dir), float32_islands=float32_islands)
    fp8 = set()
    if keep_fp8:
        try:
            keys = checkpoint_keys(model_dir, checkpoint_files(model_dir))
        except WeightError:  # a config.json alone (--check-config): the tensors the releases quantize
            keys = None
        fp8 = quantized_modules(cfg, keys)
    return build_rank_model(cfg, dtype, shard, fp8)


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: Callable[[str], None] | None = None,
    float32_islands: bool = True,
    shard: Callable[[CausalLM], None] | None = None,
    keep_fp8: bool = False,
    check: Callable[[CausalLM], None] | None = None,
) -> CausalLM:
    """float32_islands: see ModelConfig; False gives a true float64 model (parallel equality checks).
    shard: applies this rank's parallel slices to the meta model (model/shard.py cut_*), so only
    they are allocated and read. keep_fp8: fp8 checkpoint weights stay fp8 where they can.
    check: called with the rank's meta model before any storage is allocated (it raises to refuse
    a rank that cannot fit: shard.weight_bytes_by_dtype gives its bytes)."""
    model_dir = Path(model_dir)
    files = checkpoint_files(model_dir)
    model = rank_model(model_dir, dtype, float32_islands, shard, keep_fp8)
    cfg = model.config
    if check is not None:
        check(model)
    if progress is None and len(files) > 1:
        progress = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    materialize(model, device)
    filler = _Filler(model, cfg)
    reader = _Reader(filler, cfg, dtype)
    with torch.no_grad():
        for i, path in enumerate(files, 1):
            if not path.is_file():
                raise WeightError(
                    f"checkpoint shard {path.name} listed in the index is missing from {model_dir}"
                )
            if progress:
                progress(f"loading weights: shard {i}/{len(files)} ({path.name})")
            with safe_open(str(path), framework="pt") as f:
                reader.read_shard(f, path)
    reader.finish(model_dir)
    filler.check_complete(model_dir)
    if reader.mtp_skipped:
        (progress or _stderr)(
            f"skipped {reader.mtp_skipped} tensors of {cfg.num_nextn_predict_layers} "
            f"multi-token-prediction layer(s) (layers {cfg.num_layers}+; not served)"
        )
    fuse_projections(model)  # the weights stay where they are, their names too (fusion.py)
    return model


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _read(f, key: str, cut: Cut | None) -> torch.Tensor:
    """The checkpoint tensor `key`, or only its slice `cut` (safetensors reads no other bytes)."""
    if cut is None:
        return f.get_tensor(key)
    part = f.get_slice(key)
    return part[cut.index(len(part.get_shape()))]


class _Reader:
    """Reads one shard at a time: skips MTP layers unread, pairs fp8 weights with their block scales
    (in the same shard, or held until the other shard: the rank's blocks of an fp8 weight, 1 byte
    per value) and either keeps each fp8 slice or dequantizes it to the run dtype."""

    def __init__(self, filler: _Filler, cfg: ModelConfig, dtype: torch.dtype):
        self.filler, self.cfg, self.dtype = filler, cfg, dtype
        self.held_weights: dict[str, tuple[torch.Tensor, Path]] = {}  # fp8 weight blocks waiting for a scale
        self.held_scales: dict[str, torch.Tensor] = {}  # scale rows waiting for their weight
        self.mtp_skipped = 0

    def read_shard(self, f, path: Path) -> None:
        keys = set(f.keys())
        for key in f.keys():
            if self.filler.is_mtp(key):
                self.mtp_skipped += 1
            elif key.endswith(SCALE_SUFFIX):
                weight_key = key[: -len(SCALE_SUFFIX)]
                dest = self.filler.check_known(weight_key, path)
                if not isinstance(dest, _Dest):
                    continue
                scale = self._read_scale(f, key, dest)
                if weight_key in self.held_weights:
                    self._fill_fp8(weight_key, *self.held_weights.pop(weight_key), scale, dest)
                elif weight_key not in keys:
                    self.held_scales[key] = scale
            else:
                self._read_tensor(f, key, path, keys)

    def _block(self, cut: Cut) -> int:
        return self.cfg.quantization.block[cut.dim % 2]

    def _read_scale(self, f, key: str, dest: _Dest) -> torch.Tensor:
        """The block rows (or columns) of a scale that cover the rank's slice, its full shape checked."""
        qcfg = self.cfg.quantization
        part = f.get_slice(key)
        if qcfg is not None:
            try:
                check_scale(key, dest.full_shape(), _Shape(part.get_shape()), qcfg)
            except QuantizationError as e:
                raise WeightError(str(e)) from None
        cut = dest.cut
        return f.get_tensor(key) if cut is None else part[cut.blocks(self._block(cut)).index(2)]

    def _read_tensor(self, f, key: str, path: Path, keys: set[str]) -> None:
        dest = self.filler.check_known(key, path)
        if not isinstance(dest, _Dest):
            return
        part = f.get_slice(key)
        shape, file_dtype = tuple(part.get_shape()), part.get_dtype()
        if dest.fused:
            self._read_fused(key, part, dest)
            return
        self.filler.check_shape(key, shape, dest)
        scale_key = key + SCALE_SUFFIX
        if file_dtype not in _FP8_FILE_DTYPES:
            if file_dtype in _OTHER_FP8:
                raise WeightError(
                    f"tensor {key} is {file_dtype}: only float8_e4m3fn block-quantized weights load"
                )
            if scale_key in keys or scale_key in self.held_scales:
                raise WeightError(
                    f"tensor {key} is {file_dtype} but has a {key}{SCALE_SUFFIX}: "
                    "only float8_e4m3fn weights carry block scales"
                )
            if dest.tensor.dtype == FP8:
                raise WeightError(f"tensor {key} is {file_dtype}, but the index gives it block scales (fp8)")
            dest.tensor.copy_(_read(f, key, dest.cut))
            self.filler.filled(dest)
            return
        if self.cfg.quantization is None:
            raise WeightError(f"tensor {key} is float8_e4m3fn but config.json has no quantization_config")
        cover = None if dest.cut is None else dest.cut.cover(self._block(dest.cut))
        q = _read(f, key, cover)
        if scale_key in keys:
            self._fill_fp8(key, q, path, self._read_scale(f, scale_key, dest), dest)
        elif scale_key in self.held_scales:
            self._fill_fp8(key, q, path, self.held_scales.pop(scale_key), dest)
        else:
            self.held_weights[key] = (q, path)

    def _read_fused(self, key: str, part, dest: _Dest) -> None:
        """transformers' in-memory layout [E, 2I, H] / [E, H, I]: the rank's experts and intermediate span."""
        ex = self.filler.modules[key.rpartition(".")[0]]
        down = key.endswith("down_proj")
        inter = ex.down_proj.shape[2] if ex.cut is None else ex.cut.full
        hidden = ex.down_proj.shape[1]
        want = (
            (self.cfg.n_routed_experts, hidden, inter)
            if down
            else (self.cfg.n_routed_experts, 2 * inter, hidden)
        )
        if tuple(part.get_shape()) != want:
            raise WeightError(f"tensor {key} has shape {list(part.get_shape())}, expected {list(want)}")
        if part.get_dtype() in _FP8_FILE_DTYPES + _OTHER_FP8:
            raise WeightError(f"tensor {key}: stacked experts load unquantized only")
        first = ex.first_expert or 0
        experts = slice(first, first + ex.n_routed)
        span = slice(0, inter) if ex.cut is None else slice(ex.cut.start, ex.cut.stop)
        if down:
            dest.tensor.copy_(part[experts, :, span])
        else:
            gate = part[experts, span]
            up = part[experts, inter + span.start : inter + span.stop]
            dest.tensor.copy_(torch.cat([gate, up], dim=1))
        self.filler.filled(dest)

    def _fill_fp8(self, key: str, q: torch.Tensor, path: Path, scale: torch.Tensor, dest: _Dest) -> None:
        if dest.tensor.dtype == FP8:  # kept: the cut is on block boundaries, so q is exactly its slice
            dest.tensor.copy_(q)
            dest.scale.copy_(scale)
        else:
            block = self.cfg.quantization.block
            full = dequantize_fp8(q, scale, block, self.dtype)
            if dest.cut is not None:
                cover = dest.cut.cover(self._block(dest.cut))
                full = full[dest.cut.index(2, cover.start)]
            dest.tensor.copy_(full)
        self.filler.filled(dest)

    def finish(self, model_dir: Path) -> None:
        if self.held_weights:
            key = sorted(self.held_weights)[0]
            raise WeightError(
                f"missing tensor {key}{SCALE_SUFFIX} in {model_dir}: {key} is float8 and needs "
                "its block scales"
            )
        if self.held_scales:
            key = sorted(self.held_scales)[0]
            raise WeightError(
                f"missing tensor {key[: -len(SCALE_SUFFIX)]} in {model_dir} (its {key} is present)"
            )


class _Shape:
    """A shape standing in for a tensor where only `.shape` is read (check_scale on a slice's header)."""

    def __init__(self, shape):
        self.shape = tuple(shape)
