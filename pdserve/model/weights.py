"""Load a Hugging Face safetensors checkpoint into a CausalLM without a second copy of the weights.

The model is built on the meta device, given uninitialised storage in the target dtype, and each
checkpoint tensor is read once and copied into its parameter (at most one tensor is in flight).
Released checkpoints and transformers' save_pretrained store routed experts per expert
(`mlp.experts.N.gate_proj.weight`); transformers' in-memory fused layout (`mlp.experts.gate_up_proj`)
is accepted too. Anything missing, misshapen or unknown is a one-line WeightError naming it.

FP8 block-quantized checkpoints (quant.py): a `.weight` stored as float8_e4m3fn with a
`.weight_scale_inv` beside it is dequantized block by block to the run dtype as it is read, so the
peak stays near one copy of the run-dtype weights. Multi-token-prediction layers (the
`num_nextn_predict_layers` layers after the last decoder layer) are skipped unread, with one line.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open

from .config import ModelConfig
from .fusion import fuse_projections
from .quant import SCALE_SUFFIX, QuantizationError, check_scale, dequantize_fp8
from .transformer import CausalLM

# Parameters the reference keeps in float32 whatever the model dtype.
FP32_PARAM_PATTERNS = (re.compile(r"\.indexer\.weights_proj\."), re.compile(r"\.e_score_correction_bias$"))
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


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


def build_empty_model(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device = "cpu") -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.to(dtype)
    for name, p in model.named_parameters():
        if cfg.float32_islands and any(pat.search(name) for pat in FP32_PARAM_PATTERNS):
            p.data = p.data.float()
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty gives every parameter its own storage; re-tie
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


class _Filler:
    """Routes checkpoint tensors to parameter slices and remembers what has been filled."""

    def __init__(self, model: CausalLM, cfg: ModelConfig):
        self.cfg = cfg
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.todo = set(self.params)
        if cfg.tie_word_embeddings:
            self.todo.discard("lm_head.weight")
        self.expert_parts: dict[str, set[tuple[int, str]]] = {}

    def target(self, key: str) -> tuple[str, torch.Tensor] | None:
        m = _EXPERT.match(key)
        if m:
            prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
            inter = self.cfg.moe_intermediate_size
            if kind == "down_proj":
                return f"{prefix}.down_proj", self.params[f"{prefix}.down_proj"][e]
            full = self.params[f"{prefix}.gate_up_proj"][e]
            return f"{prefix}.gate_up_proj", full[:inter] if kind == "gate_proj" else full[inter:]
        if key in self.params:
            return key, self.params[key]
        return None

    def is_mtp(self, key: str) -> bool:
        """A tensor of the multi-token-prediction layers shipped after the last decoder layer."""
        m = _LAYER.match(key)
        n = self.cfg.num_layers
        return bool(m) and n <= int(m.group(1)) < n + self.cfg.num_nextn_predict_layers

    def ignorable(self, key: str) -> bool:
        return key.endswith("rotary_emb.inv_freq") or (
            key == "lm_head.weight" and self.cfg.tie_word_embeddings
        )

    def check_known(self, key: str, where: Path) -> tuple[str, torch.Tensor] | None:
        """The destination of `key`, None for a tensor to skip, or a WeightError for an unknown one."""
        hit = self.target(key)
        if hit is None and not self.ignorable(key):
            raise WeightError(
                f"unexpected tensor {key} in {where.name}: not part of a {self.cfg.model_type} model"
            )
        return hit

    def fill(self, key: str, tensor: torch.Tensor, where: Path) -> None:
        hit = self.check_known(key, where)
        if hit is None:
            return
        name, dest = hit
        if tuple(tensor.shape) != tuple(dest.shape):
            raise WeightError(f"tensor {key} has shape {list(tensor.shape)}, expected {list(dest.shape)}")
        dest.copy_(tensor)
        m = _EXPERT.match(key)
        if m:
            parts = self.expert_parts.setdefault(name, set())
            parts.add((int(m.group(2)), m.group(3)))
            n_needed = self.cfg.n_routed_experts * (1 if name.endswith("down_proj") else 2)
            if len(parts) == n_needed:
                self.todo.discard(name)
        else:
            self.todo.discard(name)

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


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    progress: Callable[[str], None] | None = None,
    float32_islands: bool = True,
) -> CausalLM:
    """float32_islands: see ModelConfig; False gives a true float64 model (parallel equality checks)."""
    model_dir = Path(model_dir)
    cfg = replace(ModelConfig.from_pretrained(model_dir), float32_islands=float32_islands)
    files = checkpoint_files(model_dir)
    if progress is None and len(files) > 1:
        progress = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    model = build_empty_model(cfg, dtype, device)
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


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class _Reader:
    """Reads one shard at a time: skips MTP layers unread, pairs fp8 weights with their block scales
    (in the same shard, or held until the other shard: an fp8 weight is 1 byte per value) and
    dequantizes each to the run dtype before it is copied into its parameter."""

    def __init__(self, filler: _Filler, cfg: ModelConfig, dtype: torch.dtype):
        self.filler, self.cfg, self.dtype = filler, cfg, dtype
        self.held_weights: dict[str, tuple[torch.Tensor, Path]] = {}  # fp8 weights waiting for a scale
        self.held_scales: dict[str, torch.Tensor] = {}  # scales waiting for their weight
        self.mtp_skipped = 0

    def read_shard(self, f, path: Path) -> None:
        keys = set(f.keys())
        for key in f.keys():
            if self.filler.is_mtp(key):
                self.mtp_skipped += 1
            elif key.endswith(SCALE_SUFFIX):
                weight_key = key[: -len(SCALE_SUFFIX)]
                self.filler.check_known(weight_key, path)
                if weight_key in self.held_weights:
                    self._fill_fp8(weight_key, *self.held_weights.pop(weight_key), f.get_tensor(key))
                elif weight_key not in keys:
                    self.held_scales[key] = f.get_tensor(key)
            else:
                self._read_tensor(f, key, path, keys)

    def _read_tensor(self, f, key: str, path: Path, keys: set[str]) -> None:
        tensor = f.get_tensor(key)
        if tensor.dtype not in _FP8_DTYPES:
            if key + SCALE_SUFFIX in keys or key + SCALE_SUFFIX in self.held_scales:
                raise WeightError(
                    f"tensor {key} is {tensor.dtype} but has a {key}{SCALE_SUFFIX}: "
                    "only float8_e4m3fn weights carry block scales"
                )
            self.filler.fill(key, tensor, path)
            return
        if self.cfg.quantization is None:
            raise WeightError(f"tensor {key} is {tensor.dtype} but config.json has no quantization_config")
        if tensor.dtype != torch.float8_e4m3fn:
            raise WeightError(
                f"tensor {key} is {tensor.dtype}: only float8_e4m3fn block-quantized weights load"
            )
        scale_key = key + SCALE_SUFFIX
        if scale_key in keys:
            self._fill_fp8(key, tensor, path, f.get_tensor(scale_key))
        elif scale_key in self.held_scales:
            self._fill_fp8(key, tensor, path, self.held_scales.pop(scale_key))
        else:
            self.filler.check_known(key, path)
            self.held_weights[key] = (tensor, path)

    def _fill_fp8(self, key: str, q: torch.Tensor, path: Path, scale: torch.Tensor) -> None:
        qcfg = self.cfg.quantization
        try:
            check_scale(key + SCALE_SUFFIX, tuple(q.shape), scale, qcfg)
        except QuantizationError as e:
            raise WeightError(str(e)) from None
        self.filler.fill(key, dequantize_fp8(q, scale, qcfg.block, self.dtype), path)

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
