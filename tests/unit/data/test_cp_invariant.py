"""Packed batches from dsv4.data go through the CP sharder without growing and without dropping a labelled token."""

from __future__ import annotations

import random

import pytest
import torch

from dsv4.cp import SimulatedMesh, build_packed_seq_ids, make_dsv4_contiguous_shard_cp_batch_and_ctx
from dsv4.data import IGNORE_INDEX, build_packed_dataset, collate_packed


def _batch(cp_size: int, alignment: int, seed: int):
    rng = random.Random(seed)
    seq_len = cp_size * alignment * 3
    docs = [[rng.randrange(1, 256) for _ in range(rng.randint(1, 2 * seq_len))] for _ in range(12)]
    dataset = build_packed_dataset(docs, seq_len, alignment, cp_size=cp_size)
    return seq_len, collate_packed([dataset[i] for i in range(len(dataset))])


def _copy(batch):
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("alignment", [2, 4, 8])
def test_cp_repad_keeps_row_width_and_every_label(cp_size, alignment):
    seq_len, batch = _batch(cp_size, alignment, seed=cp_size * 10 + alignment)
    labels = batch["labels"]
    assert int(labels.ne(IGNORE_INDEX).sum()) > 0
    local_labels = []
    for rank in range(cp_size):
        _, local, layout = make_dsv4_contiguous_shard_cp_batch_and_ctx(
            SimulatedMesh(cp_size, rank), None, _copy(batch), pad_multiple=alignment
        )
        # some row is full (long documents are split into seq_len chunks), so no growth means equality
        assert layout.padded_seq_len == seq_len
        assert local["input_ids"].shape == (labels.shape[0], seq_len // cp_size)
        local_labels.append(local["labels"])
    full = torch.cat(local_labels, dim=1)
    # every labelled token lands where the input-position map says, with its label
    positions = layout.input_token_stream_positions
    kept = labels != IGNORE_INDEX
    assert bool((positions[kept] >= 0).all())
    assert torch.equal(full.gather(1, positions.clamp(min=0))[kept], labels[kept])
    assert int(full.ne(IGNORE_INDEX).sum()) == int(kept.sum())


def test_cp_repad_of_short_rows_never_exceeds_seq_len():
    docs = [[1, 2, 3], [4, 5], [6]]
    dataset = build_packed_dataset(docs, 32, 4, cp_size=2)
    batch = collate_packed([dataset[i] for i in range(len(dataset))])
    _, _, layout = make_dsv4_contiguous_shard_cp_batch_and_ctx(SimulatedMesh(2, 0), None, batch, pad_multiple=4)
    assert layout.padded_seq_len <= 32


def test_cp1_document_ids_from_metadata():
    # the single-rank path derives document ids from seq_lens_padded; trailing pack padding gets id 0
    dataset = build_packed_dataset([[1, 2, 3], [4, 5, 6, 7, 8]], 16, 4)
    batch = collate_packed([dataset[0]])
    ids = build_packed_seq_ids(batch["seq_lens_padded"], seq_len=16)
    assert ids.tolist() == [[1] * 8 + [2] * 4 + [0] * 4]


def test_build_packed_dataset_checks_cp_sizes():
    with pytest.raises(ValueError, match=r"seq_len 24 is not a multiple of cp_size \* alignment = 4 \* 4 = 16"):
        build_packed_dataset([[1, 2]], 24, 4, cp_size=4)
    with pytest.raises(ValueError, match=r"cp_size 2 with alignment 1"):
        build_packed_dataset([[1, 2]], 24, 1, cp_size=2)
