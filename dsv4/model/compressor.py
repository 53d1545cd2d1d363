"""KV compressor: pools every window of ``r`` tokens into one compressed K=V row.

Shapes: input block ``x [B, L, d_m]`` (window-aligned: row 0 starts a window), output ``[B, P, D]`` with
``P = L // r`` (a trailing partial window is dropped).

* Non-overlap (``r != 4``): ``pooled_p = sum_i kv[p, i] * softmax_i(gate[p, i] + ape[i])`` per channel.
* Overlap (``r == 4``, projections of width ``2D``): window ``p`` pools ``2r`` slots, slots ``r..2r-1`` are the
  second feature half of its own tokens, slots ``0..r-1`` the first feature half of window ``p-1``'s tokens.
  Missing/other-document previous window -> kv 0 / gate -inf; a gate that is -inf in every slot becomes 0.
* Window metadata (section 3): a window's id is the document id if all its ``r`` tokens share an id > 0, else 0
  (an id-0 window pools nothing: its own slots are masked); its position is ``position_ids[first] // r``. The
  overlap "previous" slots are kept only when the previous window has the same id > 0 (reset at document start).
* Then cast to the input dtype, RMSNorm over D, RoPE on the last ``rope_dim`` dims at ``position * r``.

Correct per-document behaviour needs every document to start on a window boundary (the packer aligns documents to
the shard multiple). The block's first window gets its predecessor from ``prev_features``: the previous block's
``compressor(x, boundary=True)``. The single-rank path passes none (sequence start); a context-parallel rank
receives them from its predecessor, so the compressor never needs an all-gather of raw rows.

Projections (wkv, wgate) and ape are fp32 and the pooling runs in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dsv4.model.norm import RMSNorm
from dsv4.model.rope import RopeTable, apply_rope


@dataclass
class WindowMetadata:
    """Per-window metadata of a window-aligned block for one ratio.

    ``seq_ids [B, P]`` (0 = invalid window), ``positions [B, P]`` (document-local window index),
    ``rope`` (cos, sin) ``[B, P, rope_dim/2]`` at ``positions * ratio`` (None on key-side copies that need no
    rotation), ``prev_seq_ids [B]``: id of the window just before the block (0 = none, e.g. sequence start).
    """

    ratio: int
    seq_ids: Tensor
    positions: Tensor
    rope: RopeTable | None = None
    prev_seq_ids: Tensor | None = None


def window_metadata(seq_ids: Tensor, position_ids: Tensor, ratio: int) -> tuple[Tensor, Tensor]:
    """``(window_seq_ids, window_positions)`` ``[B, L // ratio]`` from token ids/positions ``[B, L]`` (section 3).

    A window's id is the tokens' document id if all ``ratio`` tokens share an id > 0, else 0; its position is
    the first token's document-local position ``// ratio`` for a valid window, else 0.
    """
    b, length = seq_ids.shape
    p = length // ratio
    ids = seq_ids[:, : p * ratio].reshape(b, p, ratio)
    first = ids[..., 0]
    valid = (first > 0) & (ids == first.unsqueeze(-1)).all(-1)
    win_seq = torch.where(valid, first, torch.zeros_like(first))
    win_pos = torch.where(valid, position_ids[:, : p * ratio : ratio] // ratio, torch.zeros_like(first))
    return win_seq, win_pos


def pool_windows(
    kv: Tensor,
    gate: Tensor,
    ape: Tensor,
    win_seq: Tensor,
    overlap: bool,
    prev_kv: Tensor | None = None,
    prev_gate: Tensor | None = None,
    prev_seq: Tensor | None = None,
) -> Tensor:
    """Softmax-pool windows per channel (fp32). Returns ``[B, P, D]``.

    Args:
        kv, gate: projections ``[B, P*r, c*D]`` of the block's complete windows (``c = 2`` if ``overlap``).
        ape: ``[r, c*D]`` added to the gate by in-window position.
        win_seq: ``[B, P]`` window ids (0 = invalid window).
        prev_kv, prev_gate: ``[B, r, 2D]`` (or just their first halves ``[B, r, D]``) projections of the window
            before the block (overlap only) or None.
        prev_seq: ``[B]`` id of that window (0 / None = no predecessor).
    """
    b, p = win_seq.shape
    r, cd = ape.shape
    kv = kv.float().reshape(b, p, r, cd)
    gate = gate.float().reshape(b, p, r, cd) + ape.float()
    valid = (win_seq > 0)[:, :, None, None]
    kv = kv.masked_fill(~valid, 0.0)
    gate = gate.masked_fill(~valid, float("-inf"))
    if overlap:
        d = cd // 2
        if prev_kv is None:
            prev_kv = kv.new_zeros(b, 1, r, cd)
            prev_gate = kv.new_zeros(b, 1, r, cd)
            prev_seq = torch.zeros(b, dtype=win_seq.dtype, device=win_seq.device)
        else:
            # only the first feature half of the previous window is pooled: accept width D or 2D
            prev_kv = prev_kv.float().reshape(b, 1, r, -1)[..., :d]
            prev_gate = prev_gate.float().reshape(b, 1, r, -1)[..., :d] + ape.float()[:, :d]
            prev_seq = torch.zeros(b, dtype=win_seq.dtype, device=win_seq.device) if prev_seq is None else prev_seq
        # Window p's predecessor: the block's previous window for p = 0, else window p - 1.
        before_kv = torch.cat((prev_kv[..., :d], kv[:, : p - 1, :, :d]), dim=1) if p > 0 else kv[..., :d]
        before_gate = torch.cat((prev_gate[..., :d], gate[:, : p - 1, :, :d]), dim=1) if p > 0 else gate[..., :d]
        before_seq = torch.cat((prev_seq.reshape(b, 1).to(win_seq.dtype), win_seq[:, : p - 1]), dim=1)[:, :p]
        keep = ((before_seq > 0) & (before_seq == win_seq))[:, :, None, None]
        before_kv = before_kv.masked_fill(~keep, 0.0)
        before_gate = before_gate.masked_fill(~keep, float("-inf"))
        kv = torch.cat((before_kv, kv[..., d:]), dim=2)  # [B, P, 2r, D]
        gate = torch.cat((before_gate, gate[..., d:]), dim=2)
    # A window with no usable slot would give softmax(-inf...) = NaN; its kv is all 0, so a zero gate yields 0.
    empty = torch.isneginf(gate).all(dim=2, keepdim=True)
    gate = gate.masked_fill(empty, 0.0)
    return (kv * torch.softmax(gate, dim=2)).sum(dim=2)


class Compressor(nn.Module):
    """Compress windows of ``ratio`` tokens of ``x [B, L, d_m]`` into ``[B, L // ratio, head_dim]`` rows."""

    def __init__(self, hidden_size: int, head_dim: int, ratio: int, eps: float = 1e-6) -> None:
        super().__init__()
        if ratio < 1:
            raise ValueError(f"Compressor: ratio must be >= 1, got {ratio}")
        self.ratio = ratio
        self.head_dim = head_dim
        self.overlap = ratio == 4
        width = (2 if self.overlap else 1) * head_dim
        self.wkv = nn.Linear(hidden_size, width, bias=False, dtype=torch.float32)
        self.wgate = nn.Linear(hidden_size, width, bias=False, dtype=torch.float32)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.norm = RMSNorm(head_dim, eps)

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor]:
        xf = x.float()
        return F.linear(xf, self.wkv.weight.float()), F.linear(xf, self.wgate.weight.float())

    def forward(
        self, x: Tensor, windows: WindowMetadata | None = None, prev_features: Tensor | None = None,
        *, boundary: bool = False,
    ) -> Tensor:
        """Pool the complete windows of the block ``x``; or, with ``boundary=True``, its boundary features.

        Args:
            x: ``[B, L, d_m]``, row 0 starts a window.
            windows: this block's window metadata for ``self.ratio`` (``seq_ids``/``positions``/``rope`` of the
                ``L // ratio`` complete windows, ``prev_seq_ids`` of the window before the block).
            prev_features: the boundary features of the block before (``[B, ratio, 2D]``, overlap mode only), or
                None at the sequence start.
            boundary: return what the next block's first window needs from this one (overlap mode):
                ``[B, ratio, 2 * head_dim]``, the first feature halves of the kv and gate projections (fp32, ape not
                added) of the last ``ratio`` rows. Under context parallelism this is the compressor's halo: the next
                rank receives it instead of raw rows. (A method call of its own would bypass the hooks of a sharded
                module, hence a forward mode.)
        Returns:
            ``[B, P, head_dim]`` in ``x.dtype``: normalised, RoPE'd compressed K=V rows.
        """
        if boundary:
            kv, gate = self._project(x[:, x.shape[1] - self.ratio :])
            return torch.cat((kv[..., : self.head_dim], gate[..., : self.head_dim]), dim=-1)
        b, length, _ = x.shape
        p = length // self.ratio
        if windows.seq_ids.shape != (b, p):
            raise ValueError(f"Compressor: window metadata {tuple(windows.seq_ids.shape)} != ({b}, {p})")
        kv, gate = self._project(x[:, : p * self.ratio])
        prev_kv = prev_gate = None
        if self.overlap and prev_features is not None:
            if prev_features.shape[1:] != (self.ratio, 2 * self.head_dim):
                raise ValueError(
                    f"Compressor: prev_features {tuple(prev_features.shape)} != [B, {self.ratio}, {2 * self.head_dim}]"
                )
            prev_kv, prev_gate = prev_features[..., : self.head_dim], prev_features[..., self.head_dim :]
        pooled = pool_windows(
            kv, gate, self.ape, windows.seq_ids, self.overlap, prev_kv, prev_gate, windows.prev_seq_ids
        )
        out = self.norm(pooled.to(x.dtype))
        if windows.rope is None:
            raise ValueError("Compressor: windows.rope (cos, sin at positions * ratio) is required")
        return apply_rope(out, windows.rope)
