"""Held-out validation data: a seeded document split and every dp rank's equal share of the held-out rows.

* :func:`held_out_indices` / :func:`split_documents`: ``data.val_fraction`` of the DOCUMENTS (``round(n x
  fraction)`` of them) chosen by ``torch.randperm(n)`` seeded with the run's seed; the rest, in their original order,
  are the training documents. The split is a function of ``(n, fraction, seed)`` only, the two parts are disjoint
  and together are every document; a split that leaves no held-out or no training document is a ValueError naming
  the counts.
* :class:`ValidationShard`: the rows a dp rank evaluates, ``r, r + dp, ...`` of the packed held-out rows, in order
  and never repeated. Every rank gets the same number of rows (``ceil(rows / dp)`` rounded up to whole
  micro-batches), because each forward is collective (FSDP, CP, EP); the slots past a rank's real rows hold a copy
  of row 0 with every label ``-100``, which adds no token to the loss.
"""

from __future__ import annotations

import math
from typing import Sequence, TypeVar

import torch
from torch.utils.data import Dataset

from dsv4.batch import TokenBatch
from dsv4.data.packer import PackedRows

T = TypeVar("T")


def check_val_fraction(fraction: float) -> float:
    """``fraction`` as a float in (0, 1), else ValueError naming ``data.val_fraction`` and the number."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < float(fraction) < 1.0:
        raise ValueError(f"`data.val_fraction`={fraction!r} must be a number in (0, 1): the fraction of the documents "
                         "held out for validation")
    return float(fraction)


def held_out_indices(num_documents: int, fraction: float, seed: int) -> list[int]:
    """The sorted indices of the held-out documents: the first ``round(num_documents x fraction)`` of
    ``torch.randperm(num_documents)`` seeded with ``seed``. ValueError when that holds out no document or all of
    them (naming both counts)."""
    fraction = check_val_fraction(fraction)
    held = round(num_documents * fraction)
    if held < 1 or held >= num_documents:
        raise ValueError(f"`data.val_fraction`={fraction} of {num_documents} documents holds out {held} and trains on "
                         f"{num_documents - held}: both need at least one document (use more documents or another "
                         "fraction, or a separate source with data.val)")
    order = torch.randperm(num_documents, generator=torch.Generator().manual_seed(int(seed)))
    return sorted(order[:held].tolist())


def split_documents(documents: Sequence[T], fraction: float, seed: int) -> tuple[list[T], list[T]]:
    """``(training documents, held-out documents)``, each in the original order (:func:`held_out_indices`)."""
    held = set(held_out_indices(len(documents), fraction, seed))
    train = [doc for i, doc in enumerate(documents) if i not in held]
    return train, [documents[i] for i in sorted(held)]


class ValidationShard(Dataset):
    """Dp rank ``dp_rank``'s held-out rows (see the module docstring): ``len(self)`` is the same on every rank, a
    multiple of ``micro_batch_size``; items past the rank's real rows are row 0 with no label."""

    def __init__(self, rows: PackedRows, dp_rank: int = 0, dp_size: int = 1, micro_batch_size: int = 1) -> None:
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"ValidationShard: dp_rank {dp_rank} is outside [0, dp_size={dp_size})")
        if micro_batch_size < 1:
            raise ValueError(f"ValidationShard: micro_batch_size must be >= 1, got {micro_batch_size}")
        if len(rows) < 1:
            raise ValueError("ValidationShard: no held-out rows")
        self.rows = rows
        self.indices = list(range(dp_rank, len(rows), dp_size))
        per_rank = math.ceil(len(rows) / dp_size)
        self.length = math.ceil(per_rank / micro_batch_size) * micro_batch_size

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> TokenBatch:
        if index < len(self.indices):
            return self.rows[self.indices[index]]
        if not 0 <= index < self.length:
            raise IndexError(f"ValidationShard: index {index} is outside [0, {self.length})")
        return self.rows[0].without_labels()
