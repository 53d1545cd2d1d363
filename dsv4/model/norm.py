"""RMSNorm, with and without a learnable weight.

``rms_norm(x) = x / sqrt(mean(x**2, dim=-1) + eps) * weight``, computed in fp32 and cast back to the input
dtype. Shapes: any ``[..., dim]`` in, same shape out. The weight-less variant is used by hyper-connections
(``RMSNorm_noweight``) and by the per-head query norm.
"""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """RMS-normalise the last dim of ``x`` in fp32; multiply by ``weight`` if given; return ``x.dtype``."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim of width ``dim``; learnable weight (ones) unless ``weight=False``."""

    def __init__(self, dim: int, eps: float = 1e-6, weight: bool = True) -> None:
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if weight else None

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.eps, self.weight)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, weight={self.weight is not None}"
