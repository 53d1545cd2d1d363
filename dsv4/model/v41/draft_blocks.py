"""Where a DSpark drafter's blocks sit in a row, and what each slot reads and predicts: index arithmetic on the
anchors, shared by the drafter's forward (:mod:`dsv4.model.v41.drafter`) and its loss
(:mod:`dsv4.speculative.dspark_loss`).

A row of ``S`` target positions carries ``N`` block slots, each anchored at a position ``a`` (``anchors [B, N]``,
int64). A block has ``K`` (``dspark_block_size``) draft slots:

* inputs: slot 0 reads the anchor token ``x[a]``, slots ``1 .. K-1`` the noise token (``dspark_noise_token_id``);
* positions: slot ``k`` sits at ``p[a] + k`` (``p`` the row's positions, ``arange(S)`` by default);
* context: every slot of the block sees the target features of the ``W`` (``sliding_window``) positions before
  the anchor, ``a - W <= j < a`` (``j >= 0``; with document ids only ``j`` of the anchor's document), and every
  slot of its own block (bidirectional); never another block;
* labels: slot ``k`` predicts ``x[a + k + 1]``; its teacher is the target's distribution at ``a + k`` (the
  final-norm output there through the target's head); the Markov bias reads the previous token, teacher-forced:
  ``x[a]`` for slot 0, then the true tokens ``x[a + 1 .. a + K - 1]``.

``-1`` marks an unused slot. It is computed like NeMo Automodel 0.7.0's padding blocks (the reference the tests
compare against): a block anchored at 0 whose slots all read the noise token and see only their own block; every
loss term and estimate masks it out. An anchor may be ``0`` (no context) up to ``S - 1`` (labels past the row end
are masked; at decoding the anchor is the last token).

Supervision (:meth:`DraftBlocks.eval_mask`): slot ``k`` counts while ``a + k + 1 < S``, ``loss_mask[a + k + 1]``
holds and every earlier slot of the block counts (a cumulative product along ``k``); with document ids also
while ``a + k + 1`` stays in the anchor's document.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DraftBlocks:
    """The blocks of a batch: ``anchors [B, N]`` (unused slots set to 0), ``keep [B, N]`` (False = unused),
    ``block_size`` K and the row length ``length`` S. Build with :meth:`from_anchors`."""

    anchors: Tensor
    keep: Tensor
    block_size: int
    length: int

    @classmethod
    def from_anchors(cls, anchors: Tensor, block_size: int, length: int) -> "DraftBlocks":
        """Check ``anchors [B, N]`` (int, ``-1`` or ``0 <= a < length``; ``ValueError`` naming the bad values) and
        build the blocks. Anchors on ``meta`` (the memory plan's trace: shapes, no values) skip the value check."""
        if anchors.dim() != 2 or anchors.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"anchors: expected an integer tensor [B, N], got {anchors.dtype} of shape "
                             f"{list(anchors.shape)}")
        if block_size < 1:
            raise ValueError(f"dspark_block_size must be >= 1, got {block_size}")
        bad = (anchors < -1) | (anchors >= length)
        if not anchors.is_meta and bad.any():
            where = bad.nonzero()[:5].tolist()
            raise ValueError(f"anchors: every entry must be -1 (no block) or a position in [0, {length}) of the row; "
                             f"got {[int(anchors[r, c]) for r, c in where]} at (row, slot) {where}")
        anchors = anchors.long()
        keep = anchors >= 0
        return cls(torch.where(keep, anchors, torch.zeros_like(anchors)), keep, int(block_size), int(length))

    @property
    def offsets(self) -> Tensor:
        """``arange(K)`` on the anchors' device."""
        return torch.arange(self.block_size, device=self.anchors.device)

    def label_index(self) -> Tensor:
        """``[B, N, K]``: the position slot ``k`` predicts, ``a + k + 1`` (may pass the row end)."""
        return self.anchors[..., None] + 1 + self.offsets

    def safe_label_index(self) -> Tensor:
        """:meth:`label_index` clamped into the row, 0 for unused slots: a position every gather may read."""
        index = self.label_index().clamp(max=self.length - 1)
        return torch.where(self.keep[..., None], index, torch.zeros_like(index))

    def targets(self, input_ids: Tensor) -> Tensor:
        """``[B, N, K]``: the token each slot predicts (garbage where :meth:`eval_mask` is False)."""
        return _gather_rows(input_ids, self.safe_label_index())

    def anchor_tokens(self, input_ids: Tensor) -> Tensor:
        """``[B, N]``: the anchor token of each block (``x[0]`` for unused slots)."""
        return input_ids.gather(1, self.anchors)

    def previous_tokens(self, input_ids: Tensor) -> Tensor:
        """``[B, N, K]``: the teacher-forced previous token of each slot: the anchor token, then the true tokens."""
        targets = self.targets(input_ids)
        return torch.cat((self.anchor_tokens(input_ids)[..., None], targets[..., :-1]), dim=-1)

    def input_tokens(self, input_ids: Tensor, noise_token_id: int) -> Tensor:
        """``[B, N * K]``: what each slot reads: the anchor token in slot 0 of a used block, else the noise token."""
        b, n = self.anchors.shape
        tokens = torch.full((b, n, self.block_size), noise_token_id, dtype=torch.long, device=input_ids.device)
        tokens[..., 0] = torch.where(self.keep, self.anchor_tokens(input_ids), tokens[..., 0])
        return tokens.view(b, n * self.block_size)

    def slot_positions(self, position_ids: Tensor) -> Tensor:
        """``[B, N * K]``: slot ``k`` of the block at ``a`` sits at ``position_ids[a] + k``."""
        base = position_ids.gather(1, self.anchors)
        return (base[..., None] + self.offsets).flatten(1)

    def teacher_index(self) -> Tensor:
        """``[B, N, K]``: the target position whose final-norm output gives slot ``k``'s teacher, ``a + k``
        (clamped into the row)."""
        return (self.safe_label_index() - 1).clamp(min=0)

    def context_index(self, window: int) -> tuple[Tensor, Tensor]:
        """``(rows [B, N, W], valid [B, N, W])``: the context positions ``a - W .. a - 1`` of each block (clamped
        to 0) and which of them exist (``>= 0``, used block)."""
        rows = self.anchors[..., None] - window + torch.arange(window, device=self.anchors.device)
        valid = (rows >= 0) & self.keep[..., None]
        return rows.clamp(min=0), valid

    def eval_mask(self, loss_mask: Tensor, packed_seq_ids: Tensor | None = None) -> Tensor:
        """``[B, N, K]`` bool: which slots are supervised (see the module docstring)."""
        label = self.label_index()
        safe = self.safe_label_index()
        mask = (label < self.length) & _gather_rows(loss_mask.bool(), safe) & self.keep[..., None]
        if packed_seq_ids is not None:
            anchor_doc = packed_seq_ids.gather(1, self.anchors)[..., None]
            mask = mask & (_gather_rows(packed_seq_ids, safe) == anchor_doc)
        return mask.to(torch.int32).cumprod(dim=-1).bool()


def _gather_rows(values: Tensor, index: Tensor) -> Tensor:
    """``values [B, S]`` at ``index [B, N, K]`` -> ``[B, N, K]``."""
    b, n, k = index.shape
    return values.gather(1, index.reshape(b, n * k)).view(b, n, k)
