"""Straight-through fake quantisation of activations: the cache formats of DeepSeek's inference, in training.

Each function rounds ``x [..., C]`` in blocks of ``block`` consecutive channels to a low-precision format and back
(the result has ``x``'s dtype and shape); the gradient passes through unchanged (straight-through estimator).
Arithmetic is fp32. A trailing partial block (``C % block``) is rounded as if zero-padded.

* :func:`fake_quant_fp8` (window KV, blocks of 32): ``scale = 2^ceil(log2(max(amax, 1e-4) * (1/448)))`` (a power
  of two, the ceiling taken exactly on the fp32 value), ``q = e4m3(clamp(x / scale, -448, 448)) * scale``.
* :func:`fake_quant_fp4` (E2M1 values ``{0, 0.5, 1, 1.5, 2, 3, 4, 6}``, round to nearest, ties to the even code):
  ``scale="e4m3"`` (compressed KV, blocks of 16): ``scale = e4m3(max(amax, 6 * 2^-9) / 6)``; ``scale="pow2"``
  (indexer queries and keys, blocks of 32): ``scale = 2^ceil(log2(max(amax, 6 * 2^-126) * (1/6)))``;
  ``q = e2m1(clamp(x / scale, -6, 6)) * scale``.

The scale arithmetic (a multiply by the rounded reciprocal, the exact power-of-two ceiling) follows the released
inference code, so a value on a rounding boundary lands where it lands there.

Where each family applies them (``config.fake_quant``):

* V4.1 (:mod:`dsv4.model.v41`): window KV ``fake_quant_fp8(kv, 32)`` over the whole RoPE'd vector; compressed KV
  ``fake_quant_fp4(rows, 16, "e4m3")``; indexer queries and keys ``fake_quant_fp4(x, 32, "pow2")``.
* V4 (:mod:`dsv4.model.attention`, :mod:`dsv4.model.indexer`): :func:`fake_quant_v4_kv` on the window KV and on
  the compressed KV (FP8, blocks of 64, power-of-two scales, the non-RoPE channels only: the last ``rope_dim``
  channels stay exact); :func:`fake_quant_v4_index` on the indexer queries and keys (after RoPE, the Hadamard
  rotation :func:`hadamard`, then FP4 in blocks of 32 with power-of-two scales; the scores are dot products, which
  the orthonormal rotation leaves unchanged apart from the rounding).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

E4M3_MAX = 448.0
E2M1_MAX = 6.0
_E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def pow2_ceil(x: Tensor) -> Tensor:
    """The smallest power of two ``>= x`` for positive normal fp32 ``x``, exactly (no logarithm)."""
    mantissa, exponent = torch.frexp(x)  # x = mantissa * 2^exponent, mantissa in [0.5, 1)
    exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.ldexp(torch.ones_like(x), exponent)


def _blocks(x: Tensor, block: int) -> tuple[Tensor, int]:
    """``x [..., C]`` fp32 zero-padded to whole blocks -> ``[..., C/block, block]``, and ``C``."""
    if block < 1:
        raise ValueError(f"fake quantisation: block must be >= 1, got {block}")
    channels = x.shape[-1]
    return F.pad(x.float(), (0, -channels % block)).unflatten(-1, (-1, block)), channels


def _e2m1(x: Tensor) -> Tensor:
    """Round fp32 ``x`` (already in ``[-6, 6]``) to the nearest E2M1 value, ties to the even code."""
    levels = x.new_tensor(_E2M1_LEVELS)
    magnitude = x.abs()
    distance = (magnitude.unsqueeze(-1) - levels).abs()  # exact: each level is within a factor 2 of its neighbours
    code = distance.argmin(dim=-1)  # the first (lower) code on a tie
    upper = (code + 1).clamp(max=len(_E2M1_LEVELS) - 1)
    tie = (distance.gather(-1, upper.unsqueeze(-1)).squeeze(-1) == distance.gather(-1, code.unsqueeze(-1)).squeeze(-1))
    code = torch.where(tie & (code % 2 == 1), upper, code)
    return torch.copysign(levels[code], x)


def _fp8_round(x: Tensor, block: int) -> Tensor:
    grouped, channels = _blocks(x, block)
    amax = grouped.abs().amax(-1, keepdim=True)
    scale = pow2_ceil(amax.clamp_min(1e-4) * (1 / E4M3_MAX))
    rounded = (grouped / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * scale
    return rounded.flatten(-2)[..., :channels].to(x.dtype)


def _fp4_round(x: Tensor, block: int, scale_format: str) -> Tensor:
    grouped, channels = _blocks(x, block)
    amax = grouped.abs().amax(-1, keepdim=True)
    if scale_format == "e4m3":
        scale = (amax.clamp_min(E2M1_MAX * 2**-9) / E2M1_MAX).to(torch.float8_e4m3fn).float()
    elif scale_format == "pow2":
        scale = pow2_ceil(amax.clamp_min(E2M1_MAX * 2**-126) * (1 / E2M1_MAX))
    else:
        raise ValueError(f"fake_quant_fp4: scale must be 'e4m3' or 'pow2', got {scale_format!r}")
    rounded = _e2m1((grouped / scale).clamp(-E2M1_MAX, E2M1_MAX)) * scale
    return rounded.flatten(-2)[..., :channels].to(x.dtype)


class _StraightThrough(torch.autograd.Function):
    """Forward: ``round_fn(x)``; backward: the incoming gradient unchanged."""

    @staticmethod
    def forward(ctx, x: Tensor, round_fn, *args):  # type: ignore[override]
        return round_fn(x, *args)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return (grad, None) + (None,) * (ctx.needs_input_grad.__len__() - 2)


def fake_quant_fp8(x: Tensor, block: int = 32) -> Tensor:
    """FP8 E4M3 with power-of-two block scales (the window KV cache), straight-through."""
    return _StraightThrough.apply(x, _fp8_round, block)


def fake_quant_fp4(x: Tensor, block: int, scale: Literal["e4m3", "pow2"]) -> Tensor:
    """FP4 E2M1 with E4M3 (``"e4m3"``: compressed KV, blocks of 16) or power-of-two (``"pow2"``: indexer q/k,
    blocks of 32) block scales, straight-through."""
    return _StraightThrough.apply(x, _fp4_round, block, scale)


def hadamard(x: Tensor) -> Tensor:
    """``x [..., n] @ H_n / sqrt(n)``: the orthonormal Walsh-Hadamard transform (Sylvester order,
    ``H_{2m} = [[H_m, H_m], [H_m, -H_m]]``) over the last dim, ``n`` a power of two; symmetric and its own inverse.
    Differentiable (the gradient is the same transform). Arithmetic in fp32; the result has ``x``'s dtype."""
    n = x.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard: the last dim must be a power of two, got {n}")
    y = x.float()
    h = 1
    while h < n:
        pairs = y.unflatten(-1, (n // (2 * h), 2, h))
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return (y * n**-0.5).to(x.dtype)


V4_KV_BLOCK = 64  # DeepSeek-V4's window / compressed KV: FP8 blocks of 64 non-RoPE channels
V4_INDEX_BLOCK = 32  # DeepSeek-V4's indexer queries / keys: FP4 blocks of 32 (after the Hadamard rotation)


def fake_quant_v4_kv(kv: Tensor, rope_dim: int) -> Tensor:
    """DeepSeek-V4's KV cache numerics: the first ``D - rope_dim`` channels of ``kv [..., D]`` through
    :func:`fake_quant_fp8` in blocks of 64, the last ``rope_dim`` (RoPE) channels unchanged; straight-through."""
    nope = kv.shape[-1] - rope_dim
    if nope < 0:
        raise ValueError(f"fake_quant_v4_kv: rope_dim {rope_dim} exceeds the last dim {kv.shape[-1]}")
    return torch.cat((fake_quant_fp8(kv[..., :nope], V4_KV_BLOCK), kv[..., nope:]), dim=-1)


def fake_quant_v4_index(x: Tensor) -> Tensor:
    """DeepSeek-V4's indexer numerics for queries / keys ``x [..., D_I]`` (RoPE'd): :func:`hadamard`, then
    :func:`fake_quant_fp4` in blocks of 32 with power-of-two scales. The result stays in the rotated basis (queries
    and keys both are, so their dot products are the scores); straight-through in the rounding."""
    return fake_quant_fp4(hadamard(x), V4_INDEX_BLOCK, "pow2")
