"""Anchor sampling for drafter training (dsv4/speculative/anchors.py), on hand-made packed rows.

Asserted: the supervised tokens of shifted labels; the candidates (a supervised token followed by a supervised one of
its document); drawn anchors are distinct candidates, ascending, ``-1`` after a row's last; the draw depends on the
seed, the step and the row's contents only (the same row alone or beside another, on another rank, gets the same
anchors), and another step draws others.
"""

from __future__ import annotations

import torch

from dsv4.speculative.anchors import anchor_candidates, sample_anchors, supervised_tokens


def _row():
    # two documents (ids 1, 2) and padding; labels shifted inside each document, the second's first half unsupervised
    seq = torch.tensor([[1, 1, 1, 1, 0, 0, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0]])
    ids = torch.arange(16).view(1, 16) + 10
    labels = torch.full((1, 16), -100)
    labels[0, 0:3] = ids[0, 1:4]  # document 1: every next token supervised
    labels[0, 8:11] = ids[0, 9:12]  # document 2: only its tokens 9.. are targets
    return ids, labels, seq


def test_supervised_tokens_and_candidates_by_hand():
    ids, labels, seq = _row()
    mask = supervised_tokens(labels, seq)
    assert mask[0].nonzero().flatten().tolist() == [1, 2, 3, 9, 10, 11]
    assert anchor_candidates(mask, seq)[0].nonzero().flatten().tolist() == [1, 2, 9, 10]


def test_anchors_are_distinct_sorted_candidates_padded_with_minus_one():
    ids, labels, seq = _row()
    mask = supervised_tokens(labels, seq)
    anchors = sample_anchors(mask, seq, ids, 6, seed=0, step=0)
    assert anchors.shape == (1, 6) and anchors[0, 4:].tolist() == [-1, -1]
    assert anchors[0, :4].tolist() == [1, 2, 9, 10]  # all four candidates, ascending
    two = sample_anchors(mask, seq, ids, 2, seed=0, step=0)[0].tolist()
    assert len(set(two)) == 2 and two == sorted(two) and set(two) <= {1, 2, 9, 10}


def test_the_draw_depends_on_seed_step_and_the_row_only():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (3, 64), generator=gen)
    seq = torch.ones(3, 64, dtype=torch.long)
    mask = torch.ones(3, 64, dtype=torch.bool)
    batch = sample_anchors(mask, seq, ids, 8, seed=5, step=3)
    for row in range(3):  # the same row on its own (another rank, another micro-batch) draws the same anchors
        alone = sample_anchors(mask[row:row + 1], seq[row:row + 1], ids[row:row + 1], 8, seed=5, step=3)
        assert torch.equal(alone[0], batch[row])
    assert not torch.equal(batch, sample_anchors(mask, seq, ids, 8, seed=5, step=4))
    assert not torch.equal(batch, sample_anchors(mask, seq, ids, 8, seed=6, step=3))
    assert not torch.equal(batch[0], batch[1])
