"""Held-out data: the document split is a function of (documents, fraction, seed), disjoint from training and
complete; a bad fraction names itself; every dp rank evaluates each held-out row once, in equal batch counts."""

from __future__ import annotations

import json

import pytest
import torch

from dsv4.batch import IGNORE_INDEX
from dsv4.data import build_packed_dataset
from dsv4.data.datamodule import DSV4DataModule
from dsv4.data.validation import ValidationShard, held_out_indices, split_documents


def test_the_split_is_deterministic_by_seed_disjoint_and_complete():
    held = held_out_indices(50, 0.2, seed=7)
    assert held == held_out_indices(50, 0.2, seed=7) and len(held) == 10 and held == sorted(held)
    assert held != held_out_indices(50, 0.2, seed=8)
    docs = [f"doc{i}" for i in range(50)]
    train, val = split_documents(docs, 0.2, seed=7)
    assert val == [docs[i] for i in held]
    assert not set(train) & set(val) and sorted(train + val) == sorted(docs)
    assert train == [d for d in docs if d not in val]  # the training documents keep their order


@pytest.mark.parametrize("fraction", [0, 0.0, 1, 1.0, 1.5, -0.1, True])
def test_a_fraction_outside_the_open_interval_is_refused_with_its_value(fraction):
    with pytest.raises(ValueError, match=rf"`data.val_fraction`={fraction!r} must be a number in \(0, 1\)"):
        held_out_indices(10, fraction, seed=0)


@pytest.mark.parametrize("n, fraction, held, trained", [(3, 0.1, 0, 3), (4, 0.9, 4, 0)])
def test_a_split_without_a_held_out_or_a_training_document_names_the_counts(n, fraction, held, trained):
    with pytest.raises(ValueError, match=f"of {n} documents holds out {held} and trains on {trained}"):
        held_out_indices(n, fraction, seed=0)


def _jsonl(tmp_path, n=20):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} " + "x" * (40 + 7 * i)}) + "\n" for i in range(n)))
    return path


def test_the_datamodule_trains_on_the_rest_and_packs_the_held_out_documents_alike(tmp_path):
    source = {"kind": "jsonl", "path": str(_jsonl(tmp_path))}
    common = dict(seq_len=256, shard_multiple=128, micro_batch_size=2, seed=3)
    whole = DSV4DataModule(source, **common).build_dataset()
    split = DSV4DataModule(source, val_fraction=0.25, **common)
    train, val = split.build_dataset(), split.build_val_dataset()
    assert split.has_validation and val.stats.num_documents == 5 and train.stats.num_documents == 15
    # every supervised token of the source is in exactly one of the two
    assert train.stats.supervised_tokens + val.stats.supervised_tokens == whole.stats.supervised_tokens
    again = DSV4DataModule(source, val_fraction=0.25, **common)
    assert torch.equal(again.build_val_dataset().batch.input_ids, val.batch.input_ids)
    assert DSV4DataModule(source, **common).build_val_dataset() is None


def test_a_second_source_is_read_for_validation_and_both_at_once_is_refused(tmp_path):
    source = {"kind": "jsonl", "path": str(_jsonl(tmp_path))}
    other = tmp_path / "val.jsonl"
    other.write_text(json.dumps({"text": "held out " * 20}) + "\n")
    module = DSV4DataModule(source, seq_len=256, shard_multiple=128, val_source={**source, "path": str(other)})
    assert module.build_val_dataset().stats.num_documents == 1
    assert module.build_dataset().stats.num_documents == 20  # the training source is untouched
    with pytest.raises(ValueError, match="`data.val` and `data.val_fraction` are both set"):
        DSV4DataModule(source, seq_len=256, shard_multiple=128, val_source=source, val_fraction=0.5)


@pytest.mark.parametrize("dp, micro", [(1, 1), (2, 2), (3, 2)])
def test_every_rank_evaluates_each_row_once_in_the_same_number_of_batches(dp, micro):
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, 200, (int(n),), generator=g).tolist() for n in (200, 180, 150, 120, 230)]
    rows = build_packed_dataset(docs, 256, 128)
    assert len(rows) == 5
    shards = [ValidationShard(rows, r, dp, micro) for r in range(dp)]
    assert len({len(s) for s in shards}) == 1 and len(shards[0]) % micro == 0
    seen = []
    for shard in shards:
        for i in range(len(shard)):
            item = shard[i]
            if i < len(shard.indices):
                seen.append(shard.indices[i])
                assert torch.equal(item.input_ids, rows[shard.indices[i]].input_ids)
            else:  # a filler: a real row without a single label
                assert bool((item.labels == IGNORE_INDEX).all())
    assert sorted(seen) == list(range(5))
