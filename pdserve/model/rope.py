"""Rotary position embedding: inverse frequencies (default and yarn) and the two layouts.

The reference computes the angles in float32 and casts cos/sin to the model dtype; we do the same
so that float64 runs agree with it bit for bit on this part.
"""

from __future__ import annotations

import math

import torch

from .config import RopeConfig


def inv_freq_and_scale(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [dim/2] float32, attention factor that multiplies cos and sin)."""
    dim, base = rope.dim, rope.theta
    # explicit device: the model may be built under torch.device("meta") before its weights load
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").to(torch.float) / dim)
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(_mscale(factor, rope.mscale) / _mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = _mscale(factor)
    low, high = _correction_range(rope, dim, base)
    if low == high:
        high += 0.001  # avoids a division by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight
    return inv_freq, attention_factor


def _mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _correction_range(rope: RopeConfig, dim: int, base: float) -> tuple[float, float]:
    def corr_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = corr_dim(rope.beta_fast), corr_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin of each position's angles, computed in float32 by the CPU's cos and sin.

    On another device the angles' cos and sin come from a table the CPU computed once for every
    position below max_positions: a GPU's float32 cos/sin differ from the CPU's by an ulp (1e-7
    relative), which float64 equality checks against the CPU reference would see.
    """

    def __init__(self, rope: RopeConfig, max_positions: int = 0):
        super().__init__()
        # a plain attribute, not a buffer: it must survive materializing a meta model (model/shard.py)
        self.inv_freq, self.attention_scaling = inv_freq_and_scale(rope)
        self.max_positions = max_positions
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _angles(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        return freqs.cos() * self.attention_scaling, freqs.sin() * self.attention_scaling

    def _table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._tables:
            if self.max_positions <= 0:
                raise ValueError("RotaryEmbedding on a non-CPU device needs max_positions")
            cos, sin = self._angles(torch.arange(self.max_positions, device="cpu"))
            self._tables[device] = (cos.to(device), sin.to(device))
        return self._tables[device]

    @torch.no_grad()
    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, dim/2]: one angle per rotated pair."""
        if positions.device.type == "cpu":
            cos, sin = self._angles(positions)
        else:
            cos_table, sin_table = self._table(positions.device)
            cos, sin = cos_table[positions], sin_table[positions]
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotates the last dim of x [T, ..., dim] with cos/sin [T, dim/2].

    interleave: pairs are (x0, x1), (x2, x3), ... and the output is laid out as [evens | odds]
    (the reference's layout). Otherwise pairs are (x_i, x_{i+dim/2}) (rotate_half).
    """
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.view(shape), sin.view(shape)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
