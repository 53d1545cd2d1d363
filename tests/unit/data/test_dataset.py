"""dsv4.data.dataset: dp sharding, resumable sampler state, row collation and the DataLoader wiring."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from dsv4.batch import TokenBatch
from dsv4.data import DistributedPackedSampler, pack_documents


def _dataset():
    docs = [[k] * n for k, n in enumerate([5, 3, 7, 2, 1, 8, 4, 6, 2, 3, 5, 1, 7], start=1)]
    return pack_documents(docs, seq_len=8, shard_multiple=2)


@pytest.mark.parametrize("shuffle", [True, False])
def test_dp_ranks_are_disjoint_and_cover_everything(shuffle):
    samplers = [DistributedPackedSampler(12, r, 3, seed=5, shuffle=shuffle) for r in range(3)]
    shards = [list(s) for s in samplers]
    assert [len(s) for s in shards] == [4, 4, 4] == [len(s) for s in samplers]
    assert sorted(i for s in shards for i in s) == list(range(12))
    if not shuffle:
        assert shards[1] == [1, 4, 7, 10]


@pytest.mark.parametrize("drop_last, per_rank", [(False, 4), (True, 3)])
def test_every_rank_gets_the_same_number_of_rows(drop_last, per_rank):
    shards = [list(DistributedPackedSampler(10, r, 3, seed=0, drop_last=drop_last)) for r in range(3)]
    assert [len(s) for s in shards] == [per_rank] * 3
    union = {i for s in shards for i in s}
    assert union == set(range(10)) if not drop_last else len(union) == 9


def test_epochs_reshuffle_deterministically():
    s = DistributedPackedSampler(20, 0, 1, seed=3)
    first = list(s)
    assert list(s) == first  # same epoch, same order
    s.set_epoch(1)
    second = list(s)
    assert second != first and sorted(second) == list(range(20))
    assert list(DistributedPackedSampler(20, 0, 1, seed=3)) == first


def test_state_dict_round_trip_continues_with_the_next_batch():
    dataset = _dataset()
    n = len(dataset)
    reference = DistributedPackedSampler(n, 1, 2, seed=7)
    reference.set_epoch(2)
    expected = [b.input_ids for b in DataLoader(dataset, batch_size=2, sampler=reference, collate_fn=TokenBatch.stack)]

    sampler = DistributedPackedSampler(n, 1, 2, seed=7)
    sampler.set_epoch(2)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler, collate_fn=TokenBatch.stack)
    it = iter(loader)
    seen = [next(it).input_ids for _ in range(2)]
    state = sampler.state_dict()
    assert state["epoch"] == 2 and state["position"] == 4

    resumed = DistributedPackedSampler(n, 1, 2, seed=7)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # what Lightning does at the start of the resumed epoch: keeps the position
    rest = [b.input_ids for b in DataLoader(dataset, batch_size=2, sampler=resumed, collate_fn=TokenBatch.stack)]
    assert len(seen) + len(rest) == len(expected)
    assert all(torch.equal(a, b) for a, b in zip(seen + rest, expected))
    assert resumed.position == 0  # the epoch ran out
    resumed.set_epoch(3)
    assert len(list(resumed)) == len(resumed)


def test_state_dict_with_explicit_consumed_count():
    s = DistributedPackedSampler(10, 0, 2, seed=1)
    it = iter(s)
    [next(it) for _ in range(4)]  # a prefetching loader ran ahead
    state = s.state_dict(consumed=2)
    t = DistributedPackedSampler(10, 0, 2, seed=1)
    t.load_state_dict(state)
    assert list(t) == s.epoch_indices()[2:]


@pytest.mark.parametrize(
    "change, error, pattern",
    [
        ({"seed": 8}, ValueError, r"saved seed=8 but this run has seed=1"),
        ({"dataset_len": 11}, ValueError, r"saved dataset_len=11 but this run has dataset_len=10"),
        ({"dp_size": 4}, ValueError, r"saved dp_size=4 but this run has dp_size=2"),
        ({"position": 6}, ValueError, r"position 6 is outside \[0, 5\]"),
        ({"epoch": None}, KeyError, r"missing keys \['epoch'\]"),
    ],
)
def test_load_state_dict_refuses_other_setups(change, error, pattern):
    s = DistributedPackedSampler(10, 0, 2, seed=1)
    state = s.state_dict()
    for key, value in change.items():
        if value is None:
            state.pop(key)
        else:
            state[key] = value
    with pytest.raises(error, match=pattern):
        s.load_state_dict(state)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"dataset_len": 0}, "dataset_len must be positive, got 0"),
        ({"dataset_len": 4, "dp_rank": 2, "dp_size": 2}, r"dp_rank 2 is outside \[0, dp_size=2\)"),
        ({"dataset_len": 1, "dp_rank": 0, "dp_size": 2, "drop_last": True}, "1 rows cannot feed 2 dp ranks"),
    ],
)
def test_sampler_argument_errors(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        DistributedPackedSampler(**kwargs)


def test_collate_stacks_rows_into_one_batch():
    dataset = _dataset()
    rows = [dataset[i] for i in range(3)]
    batch = TokenBatch.stack(rows)
    assert isinstance(batch, TokenBatch) and batch.shard.size == 1
    for key in ("input_ids", "labels", "seq_ids", "positions"):
        assert getattr(batch, key).shape == (3, 8) and getattr(batch, key).dtype == torch.long
        assert torch.equal(getattr(batch, key), torch.cat([getattr(r, key) for r in rows])), key
    assert dataset[-1].input_ids.shape == (1, 8)
    with pytest.raises(IndexError, match=r"row 99 is out of range for \d+ rows"):
        dataset[99]


def test_collate_errors_name_the_problem():
    dataset = _dataset()
    with pytest.raises(ValueError, match="got no rows"):
        TokenBatch.stack([])
    narrow = TokenBatch(*(torch.zeros(1, 4, dtype=torch.long) for _ in range(4)))
    with pytest.raises(ValueError, match=r"whole rows of one width, got widths \[4, 8\]"):
        TokenBatch.stack([dataset[0], narrow])
