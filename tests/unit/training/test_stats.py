"""Step statistics of a batch, worked out by hand."""

from __future__ import annotations

import pytest
import torch

from dsv4.batch import TokenBatch
from dsv4.config import DSV4Config
from dsv4.flops import document_training_flops
from dsv4.training.stats import batch_statistics, document_flops, step_stats_from


def test_hand_case_padding_split_and_flops():
    # multiple 4, width 16: document 1 (3 tokens) at 0, document 2 (5 tokens) at 4, then pack padding
    seq = torch.tensor([[1, 1, 1, 0, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0]])
    pos = torch.tensor([[0, 1, 2, 0, 0, 1, 2, 3, 4, 0, 0, 0, 0, 0, 0, 0]])
    labels = torch.tensor([[7, 7, -100, -100, 7, 7, 7, 7, -100] + [-100] * 7])
    batch = TokenBatch(torch.ones_like(seq), labels, seq, pos)
    config = DSV4Config.preset("tiny")
    stats = step_stats_from(batch_statistics(batch, 4, document_flops(config)), step=3, cp=1, dp=1, world_size=1,
                            step_time_s=1.0)
    assert (stats.rows, stats.seq_len, stats.slots, stats.real_tokens, stats.label_tokens) == (1, 16, 16, 8, 6)
    assert (stats.alignment_padding, stats.pack_padding) == (4, 4)  # 1 + 3 slots complete groups; 1 empty group
    assert stats.model_flops == pytest.approx(document_training_flops(config, 3) + document_training_flops(config, 5))
    assert step_stats_from(batch_statistics(batch, 4), step=1, cp=1, dp=1, world_size=1,
                           step_time_s=1.0).model_flops is None
    with pytest.raises(ValueError, match="needs the whole rows"):
        batch_statistics(batch.cut(0, 2), 4)
