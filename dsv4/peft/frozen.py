"""A frozen base weight kept in the release's FP8 / FP4 form, and the projections that use it.

Kept formats (:mod:`dsv4.checkpoint.quant`, with ``quantize_kept`` / ``dequantize_kept``): ``float8_e4m3fn [out,
in]`` with a ``float8_e8m0fnu [ceil(out/R), ceil(in/C)]`` scale in the family's ``R x C`` tiles (FP8 block: 128 x 128
in V4, 32 x 32 in V4.1), or ``int8 [..., out, in/2]`` packed e2m1 with a ``float8_e8m0fnu [..., out, ceil(in/32)]``
scale (FP4, stacked experts carry a leading expert axis). The bytes are the checkpoint's bytes, decoded as the
family's :class:`~dsv4.checkpoint.quant.QuantScheme` says.

:class:`FrozenProjection` multiplies by such a weight without ever saving its dequantised form: forward
dequantises (into the input's dtype), multiplies and drops it; backward dequantises again for the input gradient.
The weight gets no gradient. Saved for backward: the kept buffers themselves (no copy) and, for the experts, the
routing counts. So at most one layer's projection exists in the compute dtype at a time, in forward and in backward.
"""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4.checkpoint.quant import QuantScheme, dequantize_kept


class FrozenProjection(torch.autograd.Function):
    """``op(x, dequantize(weight, scale))`` with the gradient for ``x`` only; see the module docstring.

    ``op(x, w) -> y`` and its input gradient ``op_input_grad(grad_y, w) -> grad_x`` are both linear in their first
    argument (closures may carry routing counts); ``scheme``: the family's formats the kept bytes are in."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, scale: Tensor, op, op_input_grad, scheme: QuantScheme) -> Tensor:
        ctx.save_for_backward(weight, scale)
        ctx.op_input_grad = op_input_grad
        ctx.dtype = x.dtype
        ctx.scheme = scheme
        return op(x, dequantize_kept(weight, scale, x.dtype, scheme))

    @staticmethod
    def backward(ctx, grad: Tensor):
        weight, scale = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = ctx.op_input_grad(grad.to(ctx.dtype), dequantize_kept(weight, scale, ctx.dtype, ctx.scheme))
        return grad_x, None, None, None, None, None


def frozen_projection(x: Tensor, weight: Tensor, scale: Tensor, op, op_input_grad, scheme: QuantScheme) -> Tensor:
    """Apply :class:`FrozenProjection` (the kept weight, in ``scheme``'s formats, is dequantised in forward and again
    in backward)."""
    return FrozenProjection.apply(x, weight, scale, op, op_input_grad, scheme)
