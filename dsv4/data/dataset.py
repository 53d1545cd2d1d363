"""Packed rows as a map-style dataset and a resumable data-parallel sampler.

* :func:`build_packed_dataset`: packed rows (:class:`~dsv4.data.packer.PackedRows`, a map-style dataset whose item
  ``i`` is row ``i`` as a one-row :class:`~dsv4.batch.TokenBatch`); ``DataLoader(collate_fn=TokenBatch.stack)``
  stacks rows into batches.
* :class:`DistributedPackedSampler`: shards row indices by the **data-parallel** rank only; every rank of a CP group
  passes the same ``dp_rank`` and so sees the same rows. The epoch's **global order** depends only on ``seed``,
  ``epoch`` and the dataset length: ``torch.randperm(n)`` seeded with ``seed + epoch`` (or ``0..n-1`` without
  shuffling), never on ``dp_size``. Rank ``r`` takes positions ``r, r + dp_size, ...`` of it, so after every rank
  handed out ``p`` indices the replicas together consumed exactly global positions ``[0, p * dp_size)``. Every dp
  rank gets ``len(sampler)`` indices (``ceil(n / dp_size)`` with ``drop_last=False``, the order extended with its
  first indices to a multiple of ``dp_size``; ``n // dp_size`` with ``drop_last=True``), hence the same number of
  batches.
* Resuming: ``state_dict()`` holds the epoch and the **global** position (``position * dp_size``: the global-order
  indices all replicas consumed; ``n`` once this rank's epoch is exhausted). ``load_state_dict`` continues from that
  global position under any ``dp_size`` whose multiple it is: each new replica takes its strided share of the rest of
  the same global order, so no index of the order is repeated or skipped. Only the end of the epoch depends on the
  layout (which indices pad it to a multiple of ``dp_size``, or are dropped), as in an uninterrupted run.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

import torch
from torch.utils.data import Sampler

from dsv4.config import check_cp_length
from dsv4.data.packer import PackedRows, pack_documents
from dsv4.data.sources import Document


class DistributedPackedSampler(Sampler[int]):
    """Row indices for one data-parallel rank; resumable (see the module docstring).

    ``__iter__`` yields the rest of the current epoch from the saved position and advances it as indices are
    handed out; exhausting the epoch resets the position to 0 (call :meth:`set_epoch` for a new order, as
    Lightning does). With ``DataLoader(num_workers=0)`` the position equals the rows consumed; with workers the
    loader prefetches, so pass the consumed count to :meth:`state_dict` explicitly.
    """

    def __init__(
        self,
        dataset_len: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        if dataset_len <= 0:
            raise ValueError(f"DistributedPackedSampler: dataset_len must be positive, got {dataset_len}")
        if dp_size <= 0 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"DistributedPackedSampler: dp_rank {dp_rank} is outside [0, dp_size={dp_size})")
        if drop_last and dataset_len < dp_size:
            raise ValueError(
                f"DistributedPackedSampler: {dataset_len} rows cannot feed {dp_size} dp ranks with drop_last=True "
                "(every rank would get 0 rows); use more data or drop_last=False"
            )
        self.dataset_len = int(dataset_len)
        self.dp_rank = int(dp_rank)
        self.dp_size = int(dp_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.num_samples = self.samples_per_replica(self.dataset_len, self.dp_size, self.drop_last)
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        return self.num_samples

    def epoch_indices(self, epoch: int | None = None) -> list[int]:
        """This rank's full index list for ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        n, total = self.dataset_len, self.num_samples * self.dp_size
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        while len(order) < total:
            order.extend(order[: total - len(order)])
        return order[self.dp_rank:total:self.dp_size]

    def __iter__(self) -> Iterator[int]:
        indices = self.epoch_indices()
        while self.position < len(indices):
            index = indices[self.position]
            self.position += 1
            yield index
        self.position = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the order of ``epoch``; a different epoch restarts at position 0, the same one keeps it."""
        if int(epoch) != self.epoch:
            self.position = 0
        self.epoch = int(epoch)

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """``epoch`` and ``global_position`` (see the module docstring) of ``position`` indices handed out by this
        rank this epoch (``consumed`` when given), plus the settings a restore must match and ``dp_size`` (the layout
        it was saved under, for the record)."""
        position = self.position if consumed is None else int(consumed)
        if not 0 <= position <= self.num_samples:
            raise ValueError(f"DistributedPackedSampler: position {position} is outside [0, {self.num_samples}]")
        return {
            "epoch": self.epoch,
            "global_position": self.dataset_len if position == self.num_samples else position * self.dp_size,
            "seed": self.seed,
            "dataset_len": self.dataset_len,
            "dp_size": self.dp_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the saved epoch from its global position under this sampler's ``dp_size`` (any, when the
        position is a multiple of it or the epoch is exhausted); KeyError / ValueError if ``state`` is incomplete,
        from another data setup, or its position cannot be split evenly over this run's replicas."""
        missing = [k for k in ("epoch", "global_position", "seed", "dataset_len", "shuffle", "drop_last")
                   if k not in state]
        if missing:
            raise KeyError(f"DistributedPackedSampler.load_state_dict: missing keys {missing}")
        for key in ("seed", "dataset_len", "shuffle", "drop_last"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"DistributedPackedSampler.load_state_dict: saved {key}={state[key]!r} but this run has "
                    f"{key}={getattr(self, key)!r}; the data order would not continue where it stopped"
                )
        consumed = int(state["global_position"])
        if not 0 <= consumed <= self.dataset_len:
            raise ValueError(f"DistributedPackedSampler.load_state_dict: global_position {consumed} is outside "
                             f"[0, dataset_len={self.dataset_len}]")
        if consumed == self.dataset_len:
            position = self.num_samples
        elif consumed % self.dp_size:
            raise ValueError(
                f"DistributedPackedSampler.load_state_dict: the checkpoint consumed {consumed} indices of epoch "
                f"{state['epoch']} (saved with dp_size={state.get('dp_size')}), not a multiple of this run's "
                f"dp_size={self.dp_size}: the replicas cannot continue in step; resume with a dp_size dividing "
                f"{consumed}"
            )
        else:
            position = consumed // self.dp_size
        self.epoch = int(state["epoch"])
        self.position = position

    @staticmethod
    def samples_per_replica(dataset_len: int, dp_size: int, drop_last: bool = False) -> int:
        """``len()`` of a sampler of ``dataset_len`` rows on ``dp_size`` replicas."""
        return dataset_len // dp_size if drop_last else -(-dataset_len // dp_size)


def build_packed_dataset(
    documents: Sequence[Document | Sequence[int]],
    seq_len: int,
    shard_multiple: int = 1,
    *,
    pad_id: int = 0,
    split_long: bool = True,
    cp_size: int = 1,
    overlong: str | None = None,
) -> PackedRows:
    """Pack ``documents`` into rows every CP rank can cut on a window boundary (``seq_len`` a multiple of
    ``cp_size * shard_multiple``, else ValueError naming the numbers); ``overlong``: see
    :func:`~dsv4.data.packer.pack_documents`."""
    check_cp_length(seq_len, cp_size, shard_multiple)
    return pack_documents(documents, seq_len, shard_multiple, split_long=split_long, pad_id=pad_id, overlong=overlong)
