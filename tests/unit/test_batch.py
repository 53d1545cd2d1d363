"""TokenBatch: validation before any work, contiguous CP cuts, stacking, moving, document lengths."""

from __future__ import annotations

import pytest
import torch

from dsv4.batch import Shard, TokenBatch


def _batch(rows=2, width=16):
    seq = torch.tensor([[1] * 5 + [0] * 3 + [2] * 6 + [0] * 2, [1] * 16])[:rows, :width]
    pos = torch.where(seq > 0, torch.arange(width), 0)
    pos[0, 8:14] = torch.arange(6)
    ids = torch.arange(rows * width).view(rows, width) + 1
    labels = torch.where(seq > 0, ids + 100, -100)
    return TokenBatch(ids, labels, seq, pos)


def test_fields_padding_and_counts():
    batch = _batch()
    assert batch.shard == Shard(0, 1, 16) and (batch.num_rows, batch.width) == (2, 16)
    assert batch.padding.sum().item() == 5 and batch.label_count().item() == 27
    assert batch.document_lengths() == [5, 6, 16]


@pytest.mark.parametrize("size", [2, 4])
def test_cut_is_the_contiguous_slice_and_reassembles(size):
    batch = _batch()
    parts = [batch.cut(r, size, multiple=4) for r in range(size)]
    for r, part in enumerate(parts):
        assert part.shard == Shard(r, size, 16) and part.shard.start == r * 16 // size
        assert torch.equal(part.input_ids, batch.input_ids[:, part.shard.start:part.shard.stop])
    assert torch.equal(torch.cat([p.labels for p in parts], 1), batch.labels)
    assert batch.cut(0, 1) is batch


def test_bad_batches_and_cuts_name_the_problem():
    ids = torch.zeros(2, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"TokenBatch.labels has shape \(2, 7\), expected \(2, 8\)"):
        TokenBatch(ids, ids[:, :7], ids, ids)
    with pytest.raises(ValueError, match=r"TokenBatch.seq_ids must be an integer tensor, got torch.float32"):
        TokenBatch(ids, ids, ids.float(), ids)
    with pytest.raises(ValueError, match=r"input_ids must be \[B, L\], got shape \(8,\)"):
        TokenBatch(ids[0], ids[0], ids[0], ids[0])
    with pytest.raises(ValueError, match=r"has 8 columns but its shard .* holds 4"):
        TokenBatch(ids, ids, ids, ids, shard=Shard(0, 4, 16))
    batch = _batch()
    with pytest.raises(ValueError, match=r"`batch width`=16 must be a positive multiple of cp x shard multiple = "
                                         r"2 x 16 = 32"):
        batch.cut(0, 2, multiple=16)
    with pytest.raises(ValueError, match=r"rank 2 is outside \[0, 2\)"):
        batch.cut(2, 2)
    with pytest.raises(ValueError, match="already CP shard"):
        batch.cut(0, 2).cut(0, 2)


def test_stack_and_to():
    batch = _batch()
    rows = [TokenBatch(*(getattr(batch, f)[i:i + 1] for f in ("input_ids", "labels", "seq_ids", "positions")))
            for i in range(2)]
    stacked = TokenBatch.stack(rows)
    assert all(torch.equal(getattr(stacked, f), getattr(batch, f)) for f in ("input_ids", "labels", "seq_ids"))
    moved = batch.to("cpu")
    assert moved is not batch and torch.equal(moved.positions, batch.positions) and moved.shard == batch.shard
    with pytest.raises(ValueError, match="whole rows"):
        TokenBatch.stack([batch.cut(0, 2), batch.cut(1, 2)])
