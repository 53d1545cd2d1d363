"""aligned_packed_layout(sync_across_ranks=True): every rank gets the MAX aligned width (2 gloo ranks)."""

from __future__ import annotations

import pytest
import torch

from dsv4.packing import aligned_packed_layout
from dsv4.launch import run_on_ranks

pytestmark = pytest.mark.distributed

# rank 0: docs 1 and 3 at alignment 4 -> 4 + 4 = 8; rank 1: docs 5 and 9 -> 8 + 12 = 20
_DOCS = {0: ([1, 3], 4), 1: ([5, 9], 14)}
_FIELDS = ("source_indices", "input_positions", "position_ids", "sequence_ids")


def _body(rank: int, world_size: int) -> dict:
    lengths, width = _DOCS[rank]
    seq_lens = torch.tensor([lengths], dtype=torch.long)
    plain = aligned_packed_layout(seq_lens, (1, width), 4)
    synced = aligned_packed_layout(seq_lens, (1, width), 4, sync_across_ranks=True)
    synced_group = aligned_packed_layout(seq_lens, (1, width), 4, True, group=torch.distributed.group.WORLD)
    # plain lists: tensors put on the harness queue are shared through file descriptors that die with the rank
    return {
        "plain": {f: getattr(plain, f).tolist() for f in _FIELDS},
        "synced": {f: getattr(synced, f).tolist() for f in _FIELDS},
        "synced_group_width": synced_group.aligned_length,
    }


def test_sync_across_ranks_gives_every_rank_the_max_width():
    results = run_on_ranks(_body, world_size=2)
    results = [{k: ({f: torch.tensor(v) for f, v in r[k].items()} if isinstance(r[k], dict) else r[k])
                for k in r} for r in results]
    plain_widths = [r["plain"]["source_indices"].shape[1] for r in results]
    assert plain_widths == [8, 20]
    for rank, r in enumerate(results):
        plain, synced = r["plain"], r["synced"]
        w = plain["source_indices"].shape[1]
        assert synced["source_indices"].shape == (1, 20)
        assert r["synced_group_width"] == 20
        # same columns, only extra trailing padding
        for f in ("source_indices", "position_ids", "sequence_ids"):
            assert torch.equal(synced[f][:, :w], plain[f]), (rank, f)
        assert torch.all(synced["source_indices"][:, w:] == -1)
        assert torch.all(synced["position_ids"][:, w:] == 0)
        assert torch.all(synced["sequence_ids"][:, w:] == 0)
        assert torch.equal(synced["input_positions"], plain["input_positions"])
    assert results[0]["plain"]["source_indices"].tolist() == [[0, -1, -1, -1, 1, 2, 3, -1]]
    assert results[1]["plain"]["sequence_ids"].tolist() == [[1] * 5 + [0] * 3 + [2] * 9 + [0] * 3]
