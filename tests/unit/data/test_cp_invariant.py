"""Packed rows from dsv4.data cut into CP slices without growing, without losing a label, on window boundaries;
the packer's rows equal what the seed repad makes of the same documents."""

from __future__ import annotations

import random

import pytest
import torch

from dsv4.batch import TokenBatch
from dsv4.cp import _repad_dsv4_packed_batch
from dsv4.data import IGNORE_INDEX, build_packed_dataset


def _dataset(cp_size: int, multiple: int, seed: int):
    rng = random.Random(seed)
    seq_len = cp_size * multiple * 3
    docs = [[rng.randrange(1, 256) for _ in range(rng.randint(1, 2 * seq_len))] for _ in range(12)]
    return seq_len, build_packed_dataset(docs, seq_len, multiple, cp_size=cp_size)


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("multiple", [1, 2, 8])
def test_cp_slices_reassemble_the_rows_on_window_boundaries(cp_size, multiple):
    seq_len, dataset = _dataset(cp_size, multiple, seed=cp_size * 10 + multiple)
    batch = TokenBatch.stack([dataset[i] for i in range(len(dataset))])
    assert int(batch.label_count()) > 0
    slices = [batch.cut(rank, cp_size, multiple) for rank in range(cp_size)]
    for rank, local in enumerate(slices):
        assert local.width == seq_len // cp_size and local.shard.start == rank * seq_len // cp_size
        assert local.shard.start % multiple == 0
    for name in ("input_ids", "labels", "seq_ids", "positions"):
        assert torch.equal(torch.cat([getattr(s, name) for s in slices], dim=1), getattr(batch, name)), name
    assert sum(int(s.label_count()) for s in slices) == int(batch.label_count())
    starts = (batch.positions == 0) & (batch.seq_ids > 0)  # every document starts on a multiple
    assert bool((starts.nonzero()[:, 1] % multiple == 0).all())


@pytest.mark.parametrize("multiple", [1, 4, 8])
def test_packed_rows_equal_the_seed_repad_of_their_documents(multiple):
    """Oracle: the seed API's repad of the same documents laid back to back (the seed keeps document ids and
    positions on alignment pad slots; the training batch marks every pad slot with id 0)."""
    seq_len, dataset = _dataset(4, multiple, seed=multiple)  # rows of 12 x multiple slots
    rows = dataset
    for r in range(len(rows)):
        lengths = [n for _, _, n in rows.pieces[r]]
        real = rows.batch.input_ids[r][rows.batch.seq_ids[r] > 0]
        ids = torch.zeros(1, seq_len, dtype=torch.long)
        ids[0, : real.numel()] = real
        labels = torch.full((1, seq_len), IGNORE_INDEX)
        labels[0, : real.numel()] = rows.batch.labels[r][rows.batch.seq_ids[r] > 0]
        seed = {"input_ids": ids, "labels": labels, "seq_lens": torch.tensor([lengths])}
        _repad_dsv4_packed_batch(seed, cp_size=1, pad_multiple=multiple, padding_token_id=0)
        width = seed["input_ids"].shape[1]
        assert width <= seq_len
        assert torch.equal(seed["input_ids"][0], rows.batch.input_ids[r, :width])
        assert torch.equal(seed["labels"][0], rows.batch.labels[r, :width])
        pad = seed["padding_mask"][0]
        assert torch.equal(torch.where(pad, 0, seed["packed_seq_ids"][0]), rows.batch.seq_ids[r, :width])
        assert torch.equal(torch.where(pad, 0, seed["position_ids"][0]), rows.batch.positions[r, :width])
        assert bool((rows.batch.seq_ids[r, width:] == 0).all())


def test_build_packed_dataset_checks_cp_sizes():
    with pytest.raises(ValueError, match=r"`seq_len`=24 must be a positive multiple of cp x shard multiple = "
                                         r"4 x 4 = 16"):
        build_packed_dataset([[1, 2]], 24, 4, cp_size=4)
    assert isinstance(build_packed_dataset([[1, 2]], 24, 1, cp_size=2)[0], TokenBatch)
