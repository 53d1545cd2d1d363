"""`DSV4DataModule`: documents -> packed rows -> a dp-sharded, resumable DataLoader of ``TokenBatch`` es.

With ``cache_dir`` the rows are prepared once on disk and memory-mapped (:mod:`dsv4.data.prepared`; every later
start and every rank maps the same directory read-only); without it every rank tokenizes and packs in memory.
Either way every rank has the same packed rows (deterministic), then reads only its data-parallel share; the ranks of
one CP group get identical rows (the strategy shards them along the sequence). The data position (epoch, rows
consumed) is saved in Lightning checkpoints through ``state_dict`` / ``load_state_dict`` (the same on every dp
rank, so rank 0's copy restores all of them).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from torch.utils.data import DataLoader

from dsv4.batch import TokenBatch
from dsv4.data.dataset import DistributedPackedSampler, build_packed_dataset
from dsv4.data.packer import PackedRows
from dsv4.data.prepared import PreparedRows, prepare_dataset
from dsv4.data.sources import build_documents


class DSV4DataModule(L.LightningDataModule):
    """Args: ``source`` (keyword arguments of :func:`~dsv4.data.sources.build_documents`), ``seq_len``,
    ``shard_multiple`` (the model's), ``micro_batch_size``, ``cp_size``, ``seed``, ``pad_id``, ``overlong``
    (documents longer than a row, :data:`~dsv4.data.packer.OVERLONG`), ``cache_dir`` (prepared datasets; None:
    in memory) and ``num_proc`` (tokenizing processes of a prepare)."""

    def __init__(
        self,
        source: dict[str, Any],
        seq_len: int,
        shard_multiple: int,
        micro_batch_size: int = 1,
        cp_size: int = 1,
        seed: int = 0,
        pad_id: int = 0,
        shuffle: bool = True,
        overlong: str = "split",
        cache_dir: str | None = None,
        num_proc: int = 1,
    ) -> None:
        super().__init__()
        self.source = dict(source)
        self.seq_len, self.shard_multiple, self.cp_size = seq_len, shard_multiple, cp_size
        self.micro_batch_size, self.seed, self.pad_id, self.shuffle = micro_batch_size, seed, pad_id, shuffle
        self.overlong, self.cache_dir, self.num_proc = overlong, cache_dir, num_proc
        self.dataset: PackedRows | PreparedRows | None = None
        self.sampler: DistributedPackedSampler | None = None
        self._pending_state: dict | None = None

    def build_dataset(self) -> PackedRows | PreparedRows:
        """Tokenize and pack, or map the prepared copy (validates the data: raises before training starts)."""
        if self.dataset is None and self.cache_dir is not None:
            self.dataset = prepare_dataset(
                self.source, self.seq_len, self.shard_multiple, self.cache_dir, cp_size=self.cp_size,
                overlong=self.overlong, pad_id=self.pad_id, num_proc=self.num_proc,
            )
        if self.dataset is None:
            documents = build_documents(**self.source)
            self.dataset = build_packed_dataset(
                documents, self.seq_len, self.shard_multiple, pad_id=self.pad_id, cp_size=self.cp_size,
                overlong=self.overlong,
            )
        return self.dataset

    def setup(self, stage: str | None = None) -> None:
        dataset = self.build_dataset()
        dp_rank, dp_size = 0, 1
        if self.trainer is not None:
            kwargs = self.trainer.strategy.distributed_sampler_kwargs or {}
            dp_rank, dp_size = kwargs.get("rank", 0), kwargs.get("num_replicas", 1)
        self.sampler = DistributedPackedSampler(len(dataset), dp_rank, dp_size, seed=self.seed, shuffle=self.shuffle)
        if self._pending_state is not None:
            self.sampler.load_state_dict(self._pending_state)
            self._pending_state = None

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.dataset, batch_size=self.micro_batch_size, sampler=self.sampler, collate_fn=TokenBatch.stack,
            num_workers=0, drop_last=True,
        )

    def state_dict(self) -> dict[str, Any]:
        if self.sampler is None:
            return {}
        consumed = None
        if self.trainer is not None:  # the loader prefetches one batch: save what training actually consumed
            batches = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
            consumed = min(batches * self.micro_batch_size, len(self.sampler))
        return {"sampler": self.sampler.state_dict(consumed=consumed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "sampler" not in state:
            return
        if self.sampler is None:
            self._pending_state = state["sampler"]
        else:
            self.sampler.load_state_dict(state["sampler"])
