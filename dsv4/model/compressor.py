"""KV compressor: pools every window of ``r`` tokens into one compressed K=V row.

Shapes: input block ``x [B, L, d_m]`` (window-aligned: row 0 starts a window), output ``[B, P, D]`` with
``P = L // r`` (a trailing partial window is dropped).

* Non-overlap (``r != 4``): ``pooled_p = sum_i kv[p, i] * softmax_i(gate[p, i] + ape[i])`` per channel.
* Overlap (``r == 4``, projections of width ``2D``): window ``p`` pools ``2r`` slots, slots ``r..2r-1`` are the
  second feature half of its own tokens, slots ``0..r-1`` the first feature half of window ``p-1``'s tokens.
  Missing/other-document previous window -> kv 0 / gate -inf; a gate that is -inf in every slot becomes 0.
  The ``r`` previous slots enter as ONE slot per channel, their softmax summary: gate ``logsumexp_i g_i`` and kv
  ``sum_i softmax(g)_i kv_i`` (the same softmax over the ``2r`` slots, regrouped). That summary ``[2, D]`` is the
  smallest exact state a window passes to the next, and what the next CP chunk receives.
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


def softmax_summary(kv: Tensor, gate: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """The slots along ``dim`` as one softmax slot per channel: ``(logsumexp(gate), sum softmax(gate) * kv)``;
    slots whose gates are all -inf give ``(-inf, 0)`` with finite gradients."""
    empty = torch.isneginf(gate).all(dim=dim, keepdim=True)
    safe = gate.masked_fill(empty, 0.0)
    mean = (kv * torch.softmax(safe, dim=dim)).sum(dim=dim).masked_fill(empty.squeeze(dim), 0.0)
    return torch.logsumexp(safe, dim=dim).masked_fill(empty.squeeze(dim), float("-inf")), mean


def pool_windows(
    kv: Tensor,
    gate: Tensor,
    ape: Tensor,
    win_seq: Tensor,
    overlap: bool,
    prev_summary: Tensor | None = None,
    prev_seq: Tensor | None = None,
) -> Tensor:
    """Softmax-pool windows per channel (fp32). Returns ``[B, P, D]``.

    Args:
        kv, gate: projections ``[B, P*r, c*D]`` of the block's complete windows (``c = 2`` if ``overlap``).
        ape: ``[r, c*D]`` added to the gate by in-window position.
        win_seq: ``[B, P]`` window ids (0 = invalid window).
        prev_summary: ``[B, 2, D]``: the softmax summary (gate, kv; :func:`softmax_summary`) of the first feature
            halves of the window before the block (overlap only: ``Compressor(..., boundary=True)``) or None.
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
        own_gate, own_kv = softmax_summary(kv[..., :d], gate[..., :d], dim=2)  # [B, P, D]: each window's first half
        if prev_summary is None:
            prev_gate = own_gate.new_full((b, 1, d), float("-inf"))
            prev_kv = own_kv.new_zeros(b, 1, d)
            prev_seq = torch.zeros(b, dtype=win_seq.dtype, device=win_seq.device)
        else:
            prev_gate, prev_kv = prev_summary.float()[:, 0:1], prev_summary.float()[:, 1:2]
            prev_seq = torch.zeros(b, dtype=win_seq.dtype, device=win_seq.device) if prev_seq is None else prev_seq
        # Window p's predecessor: the block's previous window for p = 0, else window p - 1.
        before_gate = torch.cat((prev_gate, own_gate[:, : p - 1]), dim=1)[:, :p]
        before_kv = torch.cat((prev_kv, own_kv[:, : p - 1]), dim=1)[:, :p]
        before_seq = torch.cat((prev_seq.reshape(b, 1).to(win_seq.dtype), win_seq[:, : p - 1]), dim=1)[:, :p]
        keep = ((before_seq > 0) & (before_seq == win_seq))[:, :, None]
        before_kv = before_kv.masked_fill(~keep, 0.0)
        before_gate = before_gate.masked_fill(~keep, float("-inf"))
        kv = torch.cat((before_kv[:, :, None], kv[..., d:]), dim=2)  # [B, P, 1 + r, D]
        gate = torch.cat((before_gate[:, :, None], gate[..., d:]), dim=2)
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
            prev_features: the boundary features of the block before (``[B, 1, 2D]``, overlap mode only), or
                None at the sequence start.
            boundary: return what the next block's first window needs from this one (overlap mode):
                ``[B, 1, 2 * head_dim]`` fp32, the softmax summary (:func:`softmax_summary`: the gates'
                logsumexp, then the softmax-weighted kv) of the first feature halves of the last window (``ape``
                added): the smallest exact state, a quarter of the window's ``ratio`` rows of kv and gate halves.
                Under context parallelism this is the compressor's halo: the next chunk receives it instead of raw
                rows. (A method call of its own would bypass the hooks of a sharded module, hence a forward mode.)
        Returns:
            ``[B, P, head_dim]`` in ``x.dtype``: normalised, RoPE'd compressed K=V rows.
        """
        if boundary:
            kv, gate = self._project(x[:, x.shape[1] - self.ratio :])
            d = self.head_dim
            summary_gate, summary_kv = softmax_summary(kv[..., :d], gate[..., :d] + self.ape.float()[:, :d], dim=1)
            return torch.stack((summary_gate, summary_kv), dim=1).reshape(x.shape[0], 1, 2 * d)
        b, length, _ = x.shape
        p = length // self.ratio
        if windows.seq_ids.shape != (b, p):
            raise ValueError(f"Compressor: window metadata {tuple(windows.seq_ids.shape)} != ({b}, {p})")
        kv, gate = self._project(x[:, : p * self.ratio])
        prev_summary = None
        if self.overlap and prev_features is not None:
            if prev_features.shape[1:] != (1, 2 * self.head_dim):
                raise ValueError(
                    f"Compressor: prev_features {tuple(prev_features.shape)} != [B, 1, {2 * self.head_dim}]"
                )
            prev_summary = prev_features.reshape(b, 2, self.head_dim)
        pooled = pool_windows(kv, gate, self.ape, windows.seq_ids, self.overlap, prev_summary, windows.prev_seq_ids)
        out = self.norm(pooled.to(x.dtype))
        if windows.rope is None:
            raise ValueError("Compressor: windows.rope (cos, sin at positions * ratio) is required")
        return apply_rope(out, windows.rope)
