"""A linear layer computed in fp32 from a half-precision weight, without an fp32 copy of the whole weight.

``F.linear(x.float(), w.float())`` over a ``[V, d]`` vocabulary head in bf16 (the DSpark drafter's frozen head
under FSDP2 mixed precision: V4.1-Flash's is 129280 x 5120) allocates a 2.5 GB fp32 copy of the weight, and autograd
keeps it until backward. :func:`upcast_linear` computes the same product a block of ``chunk`` weight rows at a time
(each output column is the same fp32 dot product), saves only the weight as it is (no copy) and upcasts the blocks
again in backward; the weight gets no gradient (frozen heads). At most one block of ``chunk x d`` fp32 exists at a
time. An fp32 weight goes straight to ``F.linear`` (its ``.float()`` is itself: no copy to avoid).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 8192  # weight rows upcast at a time (V4.1-Flash's head: 160 MiB of fp32 per block)


class _UpcastLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, chunk: int) -> Tensor:
        ctx.dtype = x.dtype
        x = x.float()
        ctx.save_for_backward(weight)
        ctx.chunk = chunk
        out = x.new_empty(*x.shape[:-1], weight.shape[0])
        for i in range(0, weight.shape[0], chunk):
            out[..., i:i + chunk] = F.linear(x, weight[i:i + chunk].float())
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (weight,) = ctx.saved_tensors
        grad_x = None
        if ctx.needs_input_grad[0]:
            chunk = ctx.chunk
            grad_x = sum(grad[..., i:i + chunk] @ weight[i:i + chunk].float() for i in range(0, weight.shape[0], chunk))
            grad_x = grad_x.to(ctx.dtype)
        return grad_x, None, None


def upcast_linear(x: Tensor, weight: Tensor, chunk: int = CHUNK) -> Tensor:
    """``x [..., d] @ weight [V, d].T`` in fp32 -> ``[..., V]`` fp32, with the gradient for ``x`` only (module
    docstring); ``weight`` is frozen (``ValueError`` when it requires a gradient)."""
    if weight.requires_grad:
        raise ValueError(f"upcast_linear: the weight {list(weight.shape)} requires a gradient; it computes the "
                         "input's gradient only (a frozen head)")
    if weight.dtype == torch.float32:
        return F.linear(x.float(), weight)
    if chunk < 1:
        raise ValueError(f"upcast_linear: chunk must be >= 1 weight rows, got {chunk}")
    return _UpcastLinear.apply(x, weight, chunk)
