"""FP8 block-quantized checkpoints: the config block, quantization and dequantization.

The released DeepSeek-V3 / V3.2 and GLM-5 FP8 checkpoints store a quantized linear weight W [N, K]
as float8_e4m3fn plus one float32 `weight_scale_inv` [ceil(N / 128), ceil(K / 128)]:

    W[i, j] = fp8(W)[i, j] * scale_inv[i // 128, j // 128]

Edge blocks are partial when N or K is not a multiple of the block size. Which tensors are quantized
is read from the checkpoint (a `.weight` with a `.weight_scale_inv` beside it), not guessed; norms,
embeddings, the LM head, the router and the indexer stay unquantized in the releases.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where tensors are touched: config parsing stays torch-free
    import torch

FP8_MAX = 448.0  # largest finite e4m3fn value
FP8_BLOCK = (128, 128)  # the releases' block (rows, cols) per scale; the only one the fp8 kernels take
SCALE_SUFFIX = "_scale_inv"
SUPPORTED_METHODS = ("fp8",)


class QuantizationError(ValueError):
    """A checkpoint's quantization cannot be loaded; the message names the method or the tensor."""


@dataclass(frozen=True)
class QuantConfig:
    method: str  # "fp8"
    block: tuple[int, int]  # (rows, cols) per scale
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_config_dict(cls, d: dict) -> "QuantConfig | None":
        """None for an unquantized checkpoint; a QuantizationError for a method we cannot load."""
        q = d.get("quantization_config")
        if not q:
            return None
        method = str(q.get("quant_method") or q.get("quant_algo") or "unknown")
        if method not in SUPPORTED_METHODS:
            raise QuantizationError(
                f"unsupported quantization method {method!r} in config.json (supported: {', '.join(SUPPORTED_METHODS)}"
                " with e4m3 block scales, or an unquantized checkpoint)"
            )
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise QuantizationError(f"unsupported fp8 format {fmt!r} in config.json (supported: e4m3)")
        block = q.get("weight_block_size")
        if not block or len(block) != 2:
            raise QuantizationError(
                "fp8 quantization_config without weight_block_size [rows, cols] "
                "(per-tensor fp8 is not supported)"
            )
        skip = tuple(q.get("modules_to_not_convert") or ())
        return cls(method, (int(block[0]), int(block[1])), skip)

    def to_config_dict(self) -> dict:
        out = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": self.method,
            "weight_block_size": list(self.block),
        }
        if self.modules_to_not_convert:
            out["modules_to_not_convert"] = list(self.modules_to_not_convert)
        return out

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        rows, cols = shape
        return -(-rows // self.block[0]), -(-cols // self.block[1])


# Tensors the releases keep unquantized (names of their modules), whatever their size.
_NEVER_QUANTIZED = re.compile(
    r"(norm|embed_tokens|lm_head|\.mlp\.gate\.|indexer\.weights_proj|e_score_correction)"
)


def quantizable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether make-model --quantize fp8 quantizes `name`: 2-D projection weights, as the releases do."""
    return name.endswith(".weight") and len(shape) == 2 and not _NEVER_QUANTIZED.search(name)


def quantize_fp8(w: "torch.Tensor", block: tuple[int, int]) -> "tuple[torch.Tensor, torch.Tensor]":
    """(fp8 weight, float32 scale_inv) with one scale per block: amax / 448, so every value fits.

    w is [N, K], or [..., N, K] for stacked weights (experts: scales [..., ceil(N/b0), ceil(K/b1)]);
    the work happens where w lies (a GPU's weights are quantized there)."""
    import torch

    *lead, rows, cols = w.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(*lead, nr * br, nc * bc, dtype=torch.float32, device=w.device)
    padded[..., :rows, :cols] = w
    blocks = padded.view(*lead, nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12)  # [..., nr, nc]
    scale = amax / FP8_MAX
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(*lead, nr * br, nc * bc)[..., :rows, :cols].contiguous(), scale


def dequantize_fp8(
    q: "torch.Tensor", scale: "torch.Tensor", block: tuple[int, int], dtype: "torch.dtype"
) -> "torch.Tensor":
    """fp8 weight [N, K] times its block scale, in float64 when dtype is float64, else float32, then cast.

    fp8 has 4 significant bits and the scale 24, so the product is exact in float64 (and in float32
    only up to rounding): a float64 model sees exactly fp8(W) * scale."""
    import torch

    work = torch.float64 if dtype == torch.float64 else torch.float32
    rows, cols = q.shape
    full = scale.to(work).repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (q.to(work) * full).to(dtype)


def check_scale(key: str, weight_shape: tuple[int, ...], scale: "torch.Tensor", qcfg: QuantConfig) -> None:
    want = qcfg.scale_shape(tuple(weight_shape))
    if tuple(scale.shape) != want:
        raise QuantizationError(
            f"tensor {key} has shape {list(scale.shape)}, expected {list(want)} "
            f"(one scale per {qcfg.block[0]}x{qcfg.block[1]} block of a {list(weight_shape)} weight)"
        )
