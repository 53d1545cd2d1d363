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
    assert state["epoch"] == 2 and state["global_position"] == 8  # 4 indices on each of 2 replicas

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
        ({"shuffle": False}, ValueError, r"saved shuffle=False but this run has shuffle=True"),
        ({"global_position": 11}, ValueError, r"global_position 11 is outside \[0, dataset_len=10\]"),
        ({"global_position": 3}, ValueError, r"consumed 3 indices of epoch 0 .*not a multiple of this run's dp_size=2"),
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


def _global_sequence(shards: list[list[int]]) -> list[int]:
    """What ``len(shards)`` replicas consumed, in global order: step by step, rank 0 first (each rank's ``j``-th index
    is global position ``j * dp_size + rank``)."""
    assert len({len(s) for s in shards}) == 1
    return [shard[j] for j in range(len(shards[0])) for shard in shards]


def _take(samplers: list[DistributedPackedSampler], count: int | None = None) -> list[int]:
    """``count`` indices from every one of ``samplers`` (all: the rest of the epoch), in global order."""
    iters = [iter(s) for s in samplers]
    shards = [list(it) if count is None else [next(it) for _ in range(count)] for it in iters]
    return _global_sequence(shards)


def _global_order(n: int, seed: int, epoch: int) -> list[int]:
    """The uninterrupted global order of an epoch: one replica, no padding."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


@pytest.mark.parametrize("new_dp", [1, 4])
@pytest.mark.parametrize("steps", [4, 10])  # mid-epoch, and exactly at the end of the epoch (10 = 20 rows / dp 2)
def test_resume_under_another_dp_size_continues_the_global_order(new_dp, steps):
    """Saved at dp=2 after ``steps`` micro-batches of one row, loaded at dp=1 and dp=4: what the two replicas handed
    out, then what the new replicas hand out for the rest of the epoch and the whole next one, is the uninterrupted
    global order of both epochs, each index of an epoch once."""
    n, seed, epoch = 20, 7, 3
    old = [DistributedPackedSampler(n, r, 2, seed=seed) for r in range(2)]
    for s in old:
        s.set_epoch(epoch)
    before = _take(old, steps)
    state = old[0].state_dict()
    assert state == old[1].state_dict() and state["global_position"] == 2 * steps  # the same on every replica

    new = [DistributedPackedSampler(n, r, new_dp, seed=seed) for r in range(new_dp)]
    for s in new:
        s.load_state_dict(state)
        s.set_epoch(epoch)  # Lightning, at the start of the resumed epoch: keeps the position
    rest = _take(new)
    assert before + rest == _global_order(n, seed, epoch)
    for s in new:
        s.set_epoch(epoch + 1)
    assert _take(new) == _global_order(n, seed, epoch + 1)


def test_resume_under_more_replicas_pads_only_the_end_of_the_epoch():
    """22 rows, saved at dp=2 after 4 rows each, loaded at dp=4: the rest of the global order in step, then (as an
    uninterrupted dp=4 run) the epoch's first 2 indices again so that every replica gets ceil(22 / 4) = 6."""
    n, seed = 22, 5
    old = [DistributedPackedSampler(n, r, 2, seed=seed) for r in range(2)]
    before = _take(old, 4)
    new = [DistributedPackedSampler(n, r, 4, seed=seed) for r in range(4)]
    for s in new:
        s.load_state_dict(old[0].state_dict())
    order = _global_order(n, seed, 0)
    assert before + _take(new) == order + order[:2]
    assert [len(s) for s in new] == [6] * 4


def test_resume_refuses_a_position_the_new_replicas_cannot_share():
    old = DistributedPackedSampler(20, 0, 2, seed=1)
    it = iter(old)
    [next(it) for _ in range(3)]  # 3 rows on each of 2 replicas: global position 6
    new = DistributedPackedSampler(20, 0, 4, seed=1)
    with pytest.raises(ValueError, match=r"consumed 6 indices of epoch 0 \(saved with dp_size=2\), not a multiple "
                                         r"of this run's dp_size=4"):
        new.load_state_dict(old.state_dict())
    DistributedPackedSampler(20, 0, 3, seed=1).load_state_dict(old.state_dict())  # 6 = 2 x 3: fine


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
