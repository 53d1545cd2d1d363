"""Offline drafter training data: the documents of a capture directory (``recipes/capture_dspark.py``) packed into
rows as fine-tuning packs its documents, each row carrying its documents' captured target features.

:class:`FeatureDataModule` is the fine-tuning data module (:class:`~dsv4.data.datamodule.DSV4DataModule`: the
dp-sharded, resumable sampler, the held-out split by ``data.val_fraction`` and the run's seed, the validation shards)
whose documents are the capture's, in document order, with the token ids and supervision masks stored beside their
features, packed by :func:`~dsv4.data.packer.pack_documents` with the run's ``seq_len`` and the model's shard
multiple: the same documents give the same rows as an online run over the data source they were captured from. A
row is a :class:`~dsv4.speculative.dspark_step.FeatureBatch`: its ``features`` / ``last_hidden`` hold each
document's captured rows at the slots the document occupies (zeros on padding), read from the shards on access.

A captured document is whole (its features were computed over all of it), so every document must fit a row:
longer ones are refused (``ValueError`` naming the document and ``seq_len``) instead of being split or cut, which
would pair a piece with features that saw the rest of its document.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from dsv4.data.datamodule import DSV4DataModule
from dsv4.data.packer import PackedRows, pack_documents
from dsv4.data.sources import Document
from dsv4.data.validation import ValidationShard, split_documents
from dsv4.speculative.dspark_step import FeatureBatch

TARGET_FILE = "target.safetensors"


class CaptureReader:
    """The documents of a finished capture directory and their tensors (shards opened lazily, kept open)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        index_file = self.path / "index.json"
        if not index_file.is_file():
            raise ValueError(f"`features`={str(path)!r}: no index.json (an unfinished or foreign capture directory)")
        self.index = json.loads(index_file.read_text())
        self.entries = sorted(self.index["documents"], key=lambda e: e["document_id"])
        self._files: dict[str, Any] = {}

    def _tensor(self, entry: dict, name: str) -> torch.Tensor:
        from safetensors import safe_open

        shard = entry["shard"]
        if shard not in self._files:
            self._files[shard] = safe_open(str(self.path / shard), framework="pt")
        key = f"{entry['document_id']}.{name}"
        if key not in self._files[shard].keys():
            raise ValueError(f"`features`={str(self.path)!r}: {shard} holds no {key!r} (captured before drafter "
                             "training read token ids and masks: capture again)")
        return self._files[shard].get_tensor(key)

    def documents(self) -> list[Document]:
        """Every captured document (ids and supervision mask), in document order."""
        return [Document(self._tensor(e, "input_ids").tolist(), self._tensor(e, "loss_mask").tolist(),
                         e.get("source", "")) for e in self.entries]

    def features(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden_states [len, n * d], last_hidden_state [len, d])`` of the ``position``-th document, fp32."""
        entry = self.entries[position]
        return self._tensor(entry, "hidden_states").float(), self._tensor(entry, "last_hidden_state").float()

    def target_weights(self) -> dict[str, torch.Tensor]:
        """The target's ``embed.weight`` and ``head.weight`` the capture stored."""
        from safetensors.torch import load_file

        file = self.path / TARGET_FILE
        if not file.is_file():
            raise ValueError(f"`features`={str(self.path)!r}: no {TARGET_FILE} (the target's embedding and head)")
        return load_file(str(file))


class FeatureRows(Dataset):
    """Packed rows of captured documents; item ``i`` is row ``i`` as a one-row :class:`FeatureBatch`."""

    def __init__(self, rows: PackedRows, reader: CaptureReader, positions: list[int]) -> None:
        self.rows, self.reader, self.positions = rows, reader, positions
        self.stats = rows.stats
        self.width = reader.index.get("hidden_size")

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def batch(self):
        """Every row's tokens (one :class:`~dsv4.batch.TokenBatch`)."""
        return self.rows.batch

    def __getitem__(self, index: int) -> FeatureBatch:
        tokens = self.rows[index]
        seq_ids = tokens.seq_ids[0]
        features = last = None
        for k, (document, first, length) in enumerate(self.rows.pieces[index % len(self.rows)]):
            hidden, final = self.reader.features(self.positions[document])
            if features is None:
                features = hidden.new_zeros(1, seq_ids.numel(), hidden.shape[-1])
                last = final.new_zeros(1, seq_ids.numel(), final.shape[-1])
            slots = (seq_ids == k + 1).nonzero().squeeze(-1)
            features[0, slots] = hidden[first:first + length]
            last[0, slots] = final[first:first + length]
        return FeatureBatch(tokens, features, last)


class FeatureDataModule(DSV4DataModule):
    """:class:`~dsv4.data.datamodule.DSV4DataModule` over a capture directory (module docstring)."""

    def __init__(self, features: str, **kwargs) -> None:
        super().__init__(source={}, **kwargs)
        self.reader = CaptureReader(features)

    @classmethod
    def from_spec(cls, spec: Any) -> "FeatureDataModule":
        validation = spec.validation
        if validation.source is not None:
            raise ValueError("`data.val`: offline drafter training holds out captured documents with "
                             "data.val_fraction (a second source has no captured features)")
        return cls(spec.dspark.features, seq_len=spec.seq_len, shard_multiple=spec.model.shard_multiple,
                   micro_batch_size=spec.micro_batch_size, cp_size=spec.parallel.chunks, seed=spec.seed,
                   overlong="error", val_fraction=validation.fraction)

    def _rows(self, positions: list[int], documents: list[Document]) -> FeatureRows:
        too_long = [(self.reader.entries[p]["document_id"], len(d)) for p, d in zip(positions, documents)
                    if len(d) > self.seq_len]
        if too_long:
            raise ValueError(f"`features`: captured document {too_long[0][0]} has {too_long[0][1]} tokens, more than "
                             f"seq_len={self.seq_len} ({len(too_long)} such); offline rows hold whole documents: "
                             "raise seq_len or capture with max_document_tokens <= seq_len")
        return FeatureRows(pack_documents(documents, self.seq_len, self.shard_multiple, pad_id=self.pad_id,
                                          overlong="error"), self.reader, positions)

    def build_dataset(self) -> FeatureRows:
        if self.dataset is None:
            documents = self.reader.documents()
            positions = list(range(len(documents)))
            if self.val_fraction is not None:
                train, held = split_documents(list(zip(positions, documents)), self.val_fraction, self.seed)
                self.val_dataset = self._rows([p for p, _ in held], [d for _, d in held])
            else:
                train = list(zip(positions, documents))
            self.dataset = self._rows([p for p, _ in train], [d for _, d in train])
        return self.dataset

    def build_val_dataset(self) -> FeatureRows | None:
        if self.val_fraction is not None:
            self.build_dataset()
        return self.val_dataset

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset, batch_size=self.micro_batch_size, sampler=self.sampler,
                          collate_fn=FeatureBatch.stack, num_workers=0, drop_last=True)

    def validation_dataloader(self) -> DataLoader:
        shard = ValidationShard(self.build_val_dataset(), *self._dp, micro_batch_size=self.micro_batch_size)
        return DataLoader(shard, batch_size=self.micro_batch_size, shuffle=False, collate_fn=FeatureBatch.stack,
                          num_workers=0)
