"""A frozen base weight kept in the release's FP8 / FP4 form, and the projections that use it.

Kept formats (:mod:`dsv4.checkpoint.quant`): ``float8_e4m3fn [out, in]`` with a ``float8_e8m0fnu [ceil(out/128),
ceil(in/128)]`` scale (FP8 block), or ``int8 [..., out, in/2]`` packed e2m1 with a ``float8_e8m0fnu [..., out,
ceil(in/32)]`` scale (FP4, stacked experts carry a leading expert axis). The bytes are the checkpoint's bytes.

:class:`FrozenProjection` multiplies by such a weight without ever saving its dequantised form: forward
dequantises (into the input's dtype), multiplies and drops it; backward dequantises again for the input gradient.
The weight gets no gradient. Saved for backward: the kept buffers themselves (no copy) and, for the experts, the
routing counts. So at most one layer's projection exists in the compute dtype at a time, in forward and in backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4.checkpoint.quant import (
    dequantize_fp4_packed,
    dequantize_fp8_block,
    fp4_scale_shape,
    fp8_scale_shape,
    quantize_fp4_packed,
    quantize_fp8_block,
)

KEPT_DTYPES = {"fp8": torch.float8_e4m3fn, "fp4": torch.int8}


def kept_format(weight: Tensor) -> str | None:
    """``"fp8"`` / ``"fp4"`` for a kept weight by its dtype, None for an ordinary one."""
    if weight.dtype == torch.float8_e4m3fn:
        return "fp8"
    if weight.dtype == torch.int8:
        return "fp4"
    return None


def quantize_kept(weight: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    """A float weight ``[..., out, in]`` -> its kept ``(weight, scale)`` in ``fmt`` (leading axes kept). On the meta
    device (the memory plan) only the shapes and dtypes are produced."""
    lead, (out, inp) = weight.shape[:-2], weight.shape[-2:]
    if weight.device.type == "meta":
        q_shape = (out, inp) if fmt == "fp8" else (out, inp // 2)
        s_shape = fp8_scale_shape((out, inp)) if fmt == "fp8" else fp4_scale_shape((out, inp))
        return (torch.empty(*lead, *q_shape, dtype=KEPT_DTYPES[fmt], device="meta"),
                torch.empty(*lead, *s_shape, dtype=torch.float8_e8m0fnu, device="meta"))
    flat = weight.detach().reshape(-1, out, inp)
    pairs = [quantize_fp8_block(w) if fmt == "fp8" else quantize_fp4_packed(w) for w in flat]
    q = torch.stack([p[0] for p in pairs]).reshape(*lead, *pairs[0][0].shape)
    s = torch.stack([p[1] for p in pairs]).reshape(*lead, *pairs[0][1].shape)
    return q, s


def dequantize_kept(weight: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    """Kept ``(weight, scale)`` -> the logical ``dtype [..., out, in]`` weight (exact: power-of-two scales)."""
    fmt = kept_format(weight)
    if weight.device.type == "meta":  # the memory plan: the dequantised weight's shape and dtype
        return torch.empty(logical_shape(weight), dtype=dtype, device="meta")
    if fmt == "fp4":  # one scale row per weight row: the leading axes fold into the rows
        out = dequantize_fp4_packed(weight.reshape(-1, weight.shape[-1]), scale.reshape(-1, scale.shape[-1]), dtype)
        return out.view(*weight.shape[:-1], 2 * weight.shape[-1])
    if fmt == "fp8":
        if weight.dim() == 2:
            return dequantize_fp8_block(weight, scale, dtype)
        return torch.stack([dequantize_fp8_block(w, s, dtype) for w, s in zip(weight.flatten(0, -3),
                                                                             scale.flatten(0, -3))]).view(weight.shape)
    raise ValueError(f"dequantize_kept: {weight.dtype} is not a kept format (float8_e4m3fn or int8)")


def logical_shape(weight: Tensor) -> tuple[int, ...]:
    """The float shape a kept weight stands for (FP4 packs two columns per byte)."""
    return (*weight.shape[:-1], 2 * weight.shape[-1]) if kept_format(weight) == "fp4" else tuple(weight.shape)


class FrozenProjection(torch.autograd.Function):
    """``op(x, dequantize(weight, scale))`` with the gradient for ``x`` only; see the module docstring.

    ``op(x, w) -> y`` and its input gradient ``op_input_grad(grad_y, w) -> grad_x`` are both linear in their first
    argument (closures may carry routing counts)."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, scale: Tensor, op, op_input_grad) -> Tensor:
        ctx.save_for_backward(weight, scale)
        ctx.op_input_grad = op_input_grad
        ctx.dtype = x.dtype
        return op(x, dequantize_kept(weight, scale, x.dtype))

    @staticmethod
    def backward(ctx, grad: Tensor):
        weight, scale = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = ctx.op_input_grad(grad.to(ctx.dtype), dequantize_kept(weight, scale, ctx.dtype))
        return grad_x, None, None, None, None


def frozen_projection(x: Tensor, weight: Tensor, scale: Tensor, op, op_input_grad) -> Tensor:
    """Apply :class:`FrozenProjection` (the kept weight is dequantised in forward and again in backward)."""
    return FrozenProjection.apply(x, weight, scale, op, op_input_grad)
