"""`DSV4DataModule`: documents -> packed rows -> a dp-sharded, resumable DataLoader of ``TokenBatch`` es.

With ``cache_dir`` the rows are prepared once on disk and memory-mapped (:mod:`dsv4.data.prepared`; every later
start and every rank maps the same directory read-only), the held-out rows too (``val_fraction``: one prepared
split of the training source; ``val_source``: that source prepared on its own); without it every rank tokenizes and
packs in memory. Either way every rank has the same packed rows (deterministic), then reads only its data-parallel
share; the ranks of one CP group get identical rows (the strategy shards them along the sequence). The data position
(epoch, rows consumed) is saved in Lightning checkpoints through ``state_dict`` / ``load_state_dict`` (the same on
every dp rank, so rank 0's copy restores all of them).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from torch.utils.data import DataLoader

from dsv4.batch import TokenBatch
from dsv4.data.dataset import DistributedPackedSampler, build_packed_dataset
from dsv4.data.packer import PackedRows
from dsv4.data.prepared import PreparedRows, prepare_dataset, prepare_split_dataset
from dsv4.data.sources import build_documents
from dsv4.data.validation import ValidationShard, split_documents


class DSV4DataModule(L.LightningDataModule):
    """Args: ``source`` (keyword arguments of :func:`~dsv4.data.sources.build_documents`), ``seq_len``,
    ``shard_multiple`` (the model's), ``micro_batch_size``, ``cp_size``, ``seed``, ``pad_id``, ``overlong``
    (documents longer than a row, :data:`~dsv4.data.packer.OVERLONG`); ``val_source`` / ``val_fraction`` (at most
    one): the held-out data (see the module docstring); ``cache_dir`` (prepared datasets; None: in memory) and
    ``num_proc`` (tokenizing processes of a prepare). With ``cache_dir`` the held-out rows are prepared like the
    training rows; the rows are the same as without it."""

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
        val_source: dict[str, Any] | None = None,
        val_fraction: float | None = None,
        cache_dir: str | None = None,
        num_proc: int = 1,
    ) -> None:
        super().__init__()
        self.source = dict(source)
        self.seq_len, self.shard_multiple, self.cp_size = seq_len, shard_multiple, cp_size
        self.micro_batch_size, self.seed, self.pad_id, self.shuffle = micro_batch_size, seed, pad_id, shuffle
        self.train_batch_rows = micro_batch_size  # rows per training batch (a pipeline's step: every microbatch)
        self.overlong, self.cache_dir, self.num_proc = overlong, cache_dir, num_proc
        self.dataset: PackedRows | PreparedRows | None = None
        self.sampler: DistributedPackedSampler | None = None
        self._pending_state: dict | None = None
        if val_source is not None and val_fraction is not None:
            raise ValueError("`data.val` and `data.val_fraction` are both set: hold out documents of the training "
                             "source or read a second source, not both")
        self.val_source = dict(val_source) if val_source is not None else None
        self.val_fraction = val_fraction
        self.val_dataset: PackedRows | PreparedRows | None = None
        self._val_documents: list | None = None
        self._dp = (0, 1)  # (dp rank, dp size), set in setup

    @classmethod
    def from_spec(cls, spec: Any) -> DSV4DataModule:
        """The data module of a resolved run (:class:`~dsv4.training.spec.RunSpec`): the recipe and ``python -m
        dsv4.data prepare`` build it here, so both reach the same prepared directories."""
        validation = spec.validation
        return cls(source=dict(spec.data), seq_len=spec.seq_len, shard_multiple=spec.model.shard_multiple,
                   micro_batch_size=spec.micro_batch_size, cp_size=spec.parallel.chunks, seed=spec.seed,
                   overlong=spec.overlong,
                   val_source=dict(validation.source) if validation.source is not None else None,
                   val_fraction=validation.fraction, cache_dir=spec.data_cache_dir, num_proc=spec.data_num_proc)

    @property
    def has_validation(self) -> bool:
        """Whether held-out data is configured."""
        return self.val_source is not None or self.val_fraction is not None

    def _pack(self, documents: list) -> PackedRows:
        return build_packed_dataset(documents, self.seq_len, self.shard_multiple, pad_id=self.pad_id,
                                    cp_size=self.cp_size, overlong=self.overlong)

    def _prepared(self, source: dict[str, Any]) -> PreparedRows:
        return prepare_dataset(source, self.seq_len, self.shard_multiple, self.cache_dir, cp_size=self.cp_size,
                               overlong=self.overlong, pad_id=self.pad_id, num_proc=self.num_proc)

    def build_dataset(self) -> PackedRows | PreparedRows:
        """Tokenize and pack, or map the prepared copy (validates the data: raises before training starts); with
        ``val_fraction`` the held-out documents are left out (and packed or prepared as the held-out rows)."""
        if self.dataset is None and self.cache_dir is not None:
            if self.val_fraction is not None:
                self.dataset, self.val_dataset = prepare_split_dataset(
                    self.source, self.seq_len, self.shard_multiple, self.cache_dir, val_fraction=self.val_fraction,
                    seed=self.seed, cp_size=self.cp_size, overlong=self.overlong, pad_id=self.pad_id,
                    num_proc=self.num_proc)
            else:
                self.dataset = self._prepared(self.source)
        if self.dataset is None:
            documents = build_documents(**self.source)
            if self.val_fraction is not None:
                documents, self._val_documents = split_documents(documents, self.val_fraction, self.seed)
            self.dataset = self._pack(documents)
        return self.dataset

    def build_val_dataset(self) -> PackedRows | PreparedRows | None:
        """The packed (or prepared) held-out rows (None without validation data); raises on bad data like
        :meth:`build_dataset`."""
        if self.val_dataset is None and self.has_validation:
            if self.val_source is not None:
                self.val_dataset = (self._prepared(self.val_source) if self.cache_dir is not None
                                    else self._pack(build_documents(**self.val_source)))
            else:
                self.build_dataset()
                if self.val_dataset is None:
                    self.val_dataset = self._pack(self._val_documents)
        return self.val_dataset

    def setup(self, stage: str | None = None) -> None:
        dataset = self.build_dataset()
        dp_rank, dp_size = 0, 1
        if self.trainer is not None:
            kwargs = self.trainer.strategy.distributed_sampler_kwargs or {}
            dp_rank, dp_size = kwargs.get("rank", 0), kwargs.get("num_replicas", 1)
        self._dp = (dp_rank, dp_size)
        self.build_val_dataset()
        self.sampler = DistributedPackedSampler(len(dataset), dp_rank, dp_size, seed=self.seed, shuffle=self.shuffle)
        if self._pending_state is not None:
            self.sampler.load_state_dict(self._pending_state)
            self._pending_state = None

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            self.dataset, batch_size=self.train_batch_rows, sampler=self.sampler, collate_fn=TokenBatch.stack,
            num_workers=0, drop_last=True,
        )

    def validation_dataloader(self) -> DataLoader:
        """This dp rank's held-out rows in order, in micro-batches (the same count on every rank). Not Lightning's
        ``val_dataloader`` hook: the module runs it itself after optimizer steps (:mod:`dsv4.training.validation`)."""
        rows = self.build_val_dataset()
        if rows is None:
            raise ValueError("no validation data: set data.val_fraction or data.val")
        shard = ValidationShard(rows, *self._dp, micro_batch_size=self.micro_batch_size)
        return DataLoader(shard, batch_size=self.micro_batch_size, shuffle=False, collate_fn=TokenBatch.stack,
                          num_workers=0)

    def state_dict(self) -> dict[str, Any]:
        if self.sampler is None:
            return {}
        consumed = None
        if self.trainer is not None:  # the loader prefetches one batch: save what training actually consumed
            batches = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
            consumed = min(batches * self.train_batch_rows, len(self.sampler))
            if len(self.sampler) - consumed < self.train_batch_rows:  # the loader drops what no whole micro-batch
                consumed = len(self.sampler)  # fills: the epoch is over, under any layout it resumes with
        return {"sampler": self.sampler.state_dict(consumed=consumed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "sampler" not in state:
            return
        if self.sampler is None:
            self._pending_state = state["sampler"]
        else:
            self.sampler.load_state_dict(state["sampler"])
