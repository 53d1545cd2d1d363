"""The CSA2 compressor of a V4.1 Full layer: ``x [B, L, d] -> latent [B, L // r, D]`` (before RoPE), ``r`` in {1, 2}.

* ratio 2: non-overlapping pairs pooled per channel, ``sum_i wkv(x_i) * softmax_i(wgate(x_i))`` in fp32 (V4's
  non-overlap pooling, :func:`dsv4.model.compressor.pool_windows`, without ``ape``), cast to ``x``'s dtype, then
  ``norm``. A window whose two tokens are not of one document (id 0 in the window metadata) pools to 0; no query
  sees it.
* ratio 1: ``norm(wkv(x))`` per token (the projection in ``x``'s dtype, as the released code does), no gate.

``wkv`` / ``wgate`` are fp32 parameters (hidden -> head_dim); ratio 1 has no ``wgate``. The latent feeds both the
attention's compressed rows (RoPE'd at each window's first position) and the indexer keys of the same layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv4.model.compressor import WindowMetadata, pool_windows
from dsv4.model.norm import RMSNorm


class CSA2Compressor(nn.Module):
    """``forward(x [B, L, d], windows) -> [B, L // ratio, head_dim]`` (normalised, not rotated)."""

    def __init__(self, hidden_size: int, head_dim: int, ratio: int, eps: float) -> None:
        super().__init__()
        if ratio not in (1, 2):
            raise ValueError(f"CSA2Compressor: ratio must be 1 or 2, got {ratio}")
        self.ratio = ratio
        self.head_dim = head_dim
        self.wkv = nn.Linear(hidden_size, head_dim, bias=False, dtype=torch.float32)
        self.wgate = nn.Linear(hidden_size, head_dim, bias=False, dtype=torch.float32) if ratio > 1 else None
        self.norm = RMSNorm(head_dim, eps)

    def forward(self, x: Tensor, windows: WindowMetadata) -> Tensor:
        b, length, _ = x.shape
        p = length // self.ratio
        if windows.seq_ids.shape != (b, p):
            raise ValueError(f"CSA2Compressor: window metadata {tuple(windows.seq_ids.shape)} != ({b}, {p})")
        if self.ratio == 1:
            return self.norm(F.linear(x, self.wkv.weight.to(x.dtype)))
        xf = x[:, : p * self.ratio].float()
        kv = F.linear(xf, self.wkv.weight.float())
        gate = F.linear(xf, self.wgate.weight.float())
        no_ape = kv.new_zeros(self.ratio, self.head_dim)
        return self.norm(pool_windows(kv, gate, no_ape, windows.seq_ids, overlap=False).to(x.dtype))
