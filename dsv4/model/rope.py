"""Interleaved-pair rotary position embedding (RoPE) with optional YaRN frequencies.

Layout (as in the released model): RoPE acts on the LAST ``rope_dim`` dims of a head; inside them dims
``(2k, 2k+1)`` form pair ``k`` with frequency ``inv_freq[k] = theta ** (-2k / rope_dim)``, ``k < rope_dim/2``:

    out[2k]   = a * cos - b * sin          (a = x[2k], b = x[2k+1])
    out[2k+1] = a * sin + b * cos

The leading ``D - rope_dim`` ("nope") dims pass through. This is NOT the Llama rotate-half layout.

Tables: ``cos``/``sin`` have shape ``[B, L, rope_dim/2]`` (one column per pair, i.e. the first half of the
Llama-style ``cat(freqs, freqs)``), computed in fp32 from integer positions (any ``[B, L]`` int tensor; packed rows
use document-local positions). ``inv_freq`` is always fp32.

YaRN (compress rope only, no mscale): with ``correction_dim(n) = rope_dim * ln(orig / (2 pi n)) / (2 ln theta)``,
``low = floor(correction_dim(beta_fast))``, ``high = ceil(correction_dim(beta_slow))`` clamped to
``[0, rope_dim - 1]``, ``ramp_k = clamp((k - low) / (high - low), 0, 1)``:
``inv_freq'_k = inv_freq_k / factor * ramp_k + inv_freq_k * (1 - ramp_k)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

RopeTable = tuple[Tensor, Tensor]


def yarn_correction_range(rope_dim: int, theta: float, rope_scaling: dict[str, Any]) -> tuple[int, int]:
    """The (low, high) pair indices of the YaRN ramp, clamped to ``[0, rope_dim - 1]``."""
    orig = float(rope_scaling["original_max_position_embeddings"])
    beta_fast = float(rope_scaling.get("beta_fast", 32.0))
    beta_slow = float(rope_scaling.get("beta_slow", 1.0))

    def correction_dim(n_rot: float) -> float:
        return rope_dim * math.log(orig / (2 * math.pi * n_rot)) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    return low, high


def rope_inv_freq(rope_dim: int, theta: float, rope_scaling: dict[str, Any] | None = None) -> Tensor:
    """fp32 inverse frequencies ``[rope_dim // 2]``, YaRN-adjusted when ``rope_scaling`` is given."""
    if rope_dim % 2:
        raise ValueError(f"rope_inv_freq: rope_dim must be even, got {rope_dim}")
    k = torch.arange(rope_dim // 2, dtype=torch.float64)
    inv_freq = theta ** (-2.0 * k / rope_dim)
    if rope_scaling is not None:
        factor = float(rope_scaling["factor"])
        low, high = yarn_correction_range(rope_dim, theta, rope_scaling)
        span = (high - low) if high != low else 0.001
        ramp = ((k - low) / span).clamp(0.0, 1.0)
        inv_freq = inv_freq / factor * ramp + inv_freq * (1.0 - ramp)
    return inv_freq.to(torch.float32)


def rope_table(positions: Tensor, inv_freq: Tensor) -> RopeTable:
    """``(cos, sin)`` of shape ``[*positions.shape, rope_dim/2]`` in fp32 for integer ``positions``."""
    angles = positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(device=positions.device, dtype=torch.float32)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, table: RopeTable, inverse: bool = False) -> Tensor:
    """Rotate the last ``rope_dim`` dims of ``x`` pairwise (``inverse`` rotates by the negative angle).

    Shapes: ``x`` is ``[B, L, ..., D]``; ``cos``/``sin`` are ``[B, L, rope_dim/2]`` and broadcast over the middle
    dims (e.g. heads). Math in fp32; the result has ``x``'s dtype.
    """
    cos, sin = table
    half = cos.shape[-1]
    rope_dim = 2 * half
    if rope_dim > x.shape[-1]:
        raise ValueError(f"apply_rope: rope_dim {rope_dim} exceeds the last dim {x.shape[-1]}")
    if x.shape[:2] != cos.shape[:2]:
        raise ValueError(f"apply_rope: x leading dims {tuple(x.shape[:2])} != table {tuple(cos.shape[:2])}")
    extra = x.dim() - cos.dim()
    view = cos.shape[:2] + (1,) * extra + (half,)
    cos, sin = cos.reshape(view), sin.reshape(view)
    if inverse:
        sin = -sin
    nope, rot = x[..., : x.shape[-1] - rope_dim], x[..., x.shape[-1] - rope_dim :]
    pairs = rot.float().unflatten(-1, (half, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    out = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((nope, out.to(x.dtype)), dim=-1)
