"""Chunk summaries: the one int32 per chunk that CP ranks exchange instead of the row's token metadata."""

from __future__ import annotations

import pytest
import torch

from dsv4.model.chunk_summary import FIELD, FLAG, chunk_summaries, row_runs

M = 4  # shard multiple of these hand cases (ratio 4 active)


def _summaries(seq, pos, pad=None, chunks=2):
    """Cut one whole row into ``chunks`` and summarise each chunk: ``[[int]]`` as the gather delivers it."""
    seq, pos = torch.tensor([seq]), torch.tensor([pos])
    pad = torch.zeros_like(seq, dtype=torch.bool) if pad is None else torch.tensor([pad])
    width = seq.shape[1] // chunks
    parts = [chunk_summaries(seq[:, v * width:(v + 1) * width], pos[:, v * width:(v + 1) * width],
                             pad[:, v * width:(v + 1) * width], [4], M) for v in range(chunks)]
    return [[int(p[0]) for p in parts]], width


def test_fields_by_hand():
    # chunk 0: doc 1 (positions 0..7); chunk 1: doc 1 goes on (8..11), then doc 2 (0..3)
    codes, width = _summaries([1] * 12 + [2] * 4, list(range(12)) + list(range(4)))
    fields = [[(code >> shift) & (FIELD - 1) for shift in (0, 16, 32, 48)] for code in codes[0]]
    assert fields[0] == [0, 8 // M, 1, 1]  # starts fresh; its last token (position 7) ends at 8; doc 1 to doc 1
    assert fields[1] == [8 // M + 1, 4 // M, 1, 2]  # continues at position 8; doc 2 ends at 4; doc 1 to doc 2
    runs = row_runs(codes, width, [4], M)
    assert runs.start == [[None, 0]] and runs.need(0, 1, 4) == 0 and runs.need(0, 0, 4) == 0
    assert not runs.caller_padding


def test_padding_and_fresh_starts_need_nothing():
    # chunk 1 starts with pack padding (id 0), then a document; chunk 2 starts a document at position 0
    seq = [1] * 8 + [0] * 4 + [2] * 4 + [3] * 8
    pos = list(range(8)) + [0] * 4 + list(range(4)) + list(range(8))
    codes, width = _summaries(seq, pos, chunks=3)
    runs = row_runs(codes, width, [4], M)
    assert runs.start == [[None, None, None]]
    assert [runs.need(0, v, 4) for v in range(3)] == [0, 2, 4]  # each chunk's own first window: nothing earlier


def test_caller_padding_flag_and_padding_only_run():
    # chunk 1 holds only the caller's padding of document 1 (id kept): nothing there continues the document
    seq, pos = [1] * 16, list(range(16))
    pad = [False] * 8 + [True] * 8
    codes, width = _summaries(seq, pos, pad)
    runs = row_runs(codes, width, [4], M)
    assert runs.caller_padding and runs.start == [[None, None]]


@pytest.mark.parametrize("seq, pos, message", [
    ([1] * 16, list(range(8)) + list(range(12, 20)), "chunk 1 starts at document position 12 but the document does "
                                                    "not continue there"),  # a jump at the chunk boundary
    ([1] * 16, list(range(6)) + list(range(7, 17)), "positions must count from 0"),  # a jump inside chunk 0
    ([1] * 8 + [2] * 8, list(range(8)) + list(range(4, 12)), "positions must count from 0"),  # doc 2 from 4
    # doc 2 numbers its positions on from doc 1's, exactly at the chunk boundary: its id gives it away
    ([1] * 8 + [2] * 8, list(range(16)), "it ends with document 1 at position 7"),
])
def test_untrustworthy_positions_raise(seq, pos, message):
    codes, width = _summaries(seq, pos)
    with pytest.raises(ValueError, match=message):
        row_runs(codes, width, [4], M)
    assert FLAG == 1 << 15
