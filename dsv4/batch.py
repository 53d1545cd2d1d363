"""`TokenBatch`: the one batch type of the training path, from the packer to the model.

    packer -> TokenBatch.stack (the DataLoader's collate_fn) -> .to(device) -> .cut(cp rank) -> model(...)

Fields (``B`` rows, ``L`` columns of this batch; all int64):

* ``input_ids [B, L]``: token ids, ``pad_id`` on padding;
* ``labels [B, L]``: the target of each position (already shifted inside each document), -100 = no target;
* ``seq_ids [B, L]``: 1-based document id within the row; **0 = padding**: a slot holding no real token (pack
  padding after the row's last document and alignment padding after a document). This is the only padding
  convention: :attr:`padding` is ``seq_ids == 0``;
* ``positions [B, L]``: document-local position (RoPE, compressor windows); 0 on padding;
* ``shard``: which part of the full rows this batch is (:class:`Shard`; ``rank 0 of 1`` = the whole row). Under
  ``cp_balance="full"`` a rank holds two chunks of every row, as two local rows (:class:`~dsv4.parallel.cp.layout.CPLayout`).

Invariants the packer guarantees and the model relies on: every document starts on a multiple of the model's
shard multiple with position 0, its tokens are contiguous, and a padding slot never carries a label. A full row's
width is a multiple of ``cp x shard multiple`` (:func:`dsv4.config.check_cp_length`), so :meth:`cut` gives every CP
rank a window-aligned slice. Nothing here needs the host except :meth:`document_lengths` (statistics).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from dsv4.config import check_cp_length
from dsv4.parallel.cp.layout import CPLayout

IGNORE_INDEX = -100

_TOKEN_FIELDS = ("input_ids", "labels", "seq_ids", "positions")


@dataclass(frozen=True)
class Shard:
    """The part of a row a batch holds: CP rank ``rank`` of ``size`` under ``balance`` (:class:`~dsv4.parallel.cp.layout.
    CPLayout`): chunks of ``local_length`` columns of rows of ``length``; contiguous (``"none"``): columns
    ``[start, stop)``."""

    rank: int = 0
    size: int = 1
    length: int = 0
    balance: str = "none"

    @property
    def layout(self):
        """This shard's :class:`~dsv4.parallel.cp.layout.CPLayout`."""
        return CPLayout(self.size, self.balance)

    @property
    def local_length(self) -> int:
        return self.length // self.layout.num_chunks

    @property
    def start(self) -> int:
        if self.layout.chunks_per_rank != 1:
            raise ValueError(f"Shard.start: {self} holds {self.layout.chunks_per_rank} chunks, not one column range")
        return self.rank * self.local_length

    @property
    def stop(self) -> int:
        return self.start + self.local_length


@dataclass
class TokenBatch:
    """One microbatch of packed rows (see the module docstring)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    seq_ids: torch.Tensor
    positions: torch.Tensor
    shard: Shard = field(default_factory=Shard)

    def __post_init__(self) -> None:
        shape = tuple(self.input_ids.shape)
        if len(shape) != 2:
            raise ValueError(f"TokenBatch.input_ids must be [B, L], got shape {shape}")
        for name in _TOKEN_FIELDS:
            t = getattr(self, name)
            if tuple(t.shape) != shape:
                raise ValueError(f"TokenBatch.{name} has shape {tuple(t.shape)}, expected {shape} (input_ids)")
            if t.dtype.is_floating_point or t.dtype == torch.bool:
                raise ValueError(f"TokenBatch.{name} must be an integer tensor, got {t.dtype}")
        if self.shard.length == 0:
            self.shard = Shard(0, 1, shape[1])
        if self.shard.local_length != shape[1]:
            raise ValueError(f"TokenBatch has {shape[1]} columns but its shard {self.shard} holds "
                             f"{self.shard.local_length}")

    # ------------------------------------------------------------------ views
    @property
    def padding(self) -> torch.Tensor:
        """``[B, L]`` bool, True on slots that hold no real token."""
        return self.seq_ids == 0

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def width(self) -> int:
        """Columns of this batch (the local length under CP)."""
        return int(self.input_ids.shape[1])

    def label_count(self) -> torch.Tensor:
        """Labelled positions (label != -100), a 0-dim tensor."""
        return (self.labels != IGNORE_INDEX).sum()

    def document_lengths(self) -> list[int]:
        """Real tokens of every document, row by row (one host read)."""
        real = self.seq_ids > 0
        if not bool(real.any()):
            return []
        keyed = self.seq_ids + torch.arange(self.num_rows, device=self.seq_ids.device).unsqueeze(1) * (
            int(self.seq_ids.max()) + 1)
        _, counts = torch.unique_consecutive(keyed[real], return_counts=True)
        return counts.tolist()

    # ------------------------------------------------------------------ transforms
    def to(self, device: torch.device | str, non_blocking: bool = False) -> "TokenBatch":
        """The batch on ``device`` (Lightning moves batches through this method)."""
        moved = {name: getattr(self, name).to(device, non_blocking=non_blocking) for name in _TOKEN_FIELDS}
        return replace(self, **moved)

    def without_labels(self) -> "TokenBatch":
        """The same rows with every label ``-100`` (a slot that adds nothing to any loss)."""
        return replace(self, labels=torch.full_like(self.labels, IGNORE_INDEX))

    def select(self, rows: slice) -> "TokenBatch":
        """The whole-row batch of ``rows`` (a slice of the row axis)."""
        if self.shard.size != 1:
            raise ValueError(f"TokenBatch.select: this batch is CP shard {self.shard}; select from whole rows")
        return TokenBatch(*(getattr(self, name)[rows] for name in _TOKEN_FIELDS))

    def cut(self, rank: int, size: int, multiple: int = 1, balance: str = "none") -> "TokenBatch":
        """CP rank ``rank`` of ``size``'s part of the rows: contiguous (``balance="none"``), columns
        ``[rank * L / size, (rank + 1) * L / size)``; ``"full"``, chunks ``rank`` and ``2 size - 1 - rank`` of ``2
        size`` as two local rows each (``[2 B, L / (2 size)]``, slot-major; :class:`~dsv4.parallel.cp.layout.CPLayout`).

        Only a whole row can be cut; its width must be a multiple of ``chunks * multiple`` (ValueError otherwise).
        ``size == 1`` returns the batch itself.
        """
        if self.shard.size != 1:
            raise ValueError(f"TokenBatch.cut: this batch is already CP shard {self.shard}; cut whole rows only")
        if not 0 <= rank < size:
            raise ValueError(f"TokenBatch.cut: rank {rank} is outside [0, {size})")
        if size == 1:
            return self
        shard = Shard(rank, size, self.width, balance)
        layout = shard.layout
        check_cp_length(self.width, layout.num_chunks, multiple, what="batch width")
        return TokenBatch(*(layout.cut(getattr(self, name), rank) for name in _TOKEN_FIELDS), shard=shard)

    @classmethod
    def stack(cls, rows: Sequence["TokenBatch"]) -> "TokenBatch":
        """Concatenate whole-row batches of one width along the rows (``DataLoader(collate_fn=TokenBatch.stack)``)."""
        if not rows:
            raise ValueError("TokenBatch.stack: got no rows")
        widths = sorted({row.width for row in rows})
        if len(widths) > 1 or any(row.shard.size != 1 for row in rows):
            raise ValueError(f"TokenBatch.stack: rows must be whole rows of one width, got widths {widths}")
        return cls(*(torch.cat([getattr(row, name) for row in rows]) for name in _TOKEN_FIELDS))
