"""Shard multiple, length helpers and packed document ids of the seed API."""

from types import SimpleNamespace

import pytest
import torch

from dsv4.cp import (
    _SEQ_LENS_PADDING_VALUE,
    _lcm,
    _pad_1d,
    _pad_length,
    _valid_packed_lengths,
    build_packed_seq_ids,
    dsv4_cp_enabled,
    dsv4_cp_local_seq_multiple,
    dsv4_cp_rank,
    dsv4_cp_size,
)


def test_lcm_seed_rules():
    assert _lcm(0, 5) == 5
    assert _lcm(0, 0) == 0
    assert _lcm(-4, 6) == 12
    assert _lcm(4, 6) == 12
    assert _lcm(8, 128) == 128


@pytest.mark.parametrize(
    "ratios, expected",
    [
        ([0, 0, 4, 128], 128),  # Flash-like: 4 counts as 8, lcm(8, 128) = 128
        ([0] * 2 + [4, 128] * 20 + [4], 128),
        ([4], 8),
        ([4, 0, 4], 8),
        ([2, 1], 2),  # V4.1: active {2, 1}
        ([3, 4], 24),  # lcm(3, 8)
        ([128], 128),
        ([0, 0], 1),
        ([], 1),
        (None, 1),
        (["4", 2.0], 8),  # int() of every entry
    ],
)
def test_local_seq_multiple(ratios, expected):
    config = SimpleNamespace(compress_ratios=ratios)
    assert dsv4_cp_local_seq_multiple(config) == expected
    # anything with `.config` works too
    assert dsv4_cp_local_seq_multiple(SimpleNamespace(config=config)) == expected


def test_pad_length_and_pad_1d():
    assert _pad_length(12, 8) == 16
    assert _pad_length(16, 8) == 16
    assert _pad_length(0, 8) == 0
    assert _pad_length(5, 0) == 5  # multiple clamps to 1
    assert _pad_1d([3, 4], 4).tolist() == [3, 4, -1000, -1000]
    assert _pad_1d([3, 4, 5], 2).tolist() == [3, 4, 5]  # never truncates
    assert _pad_1d([1], 2).dtype == torch.int64


def test_valid_packed_lengths():
    assert _valid_packed_lengths(torch.tensor([3, -1000, 0, 5, -1000])) == [3, 0, 5]
    assert _SEQ_LENS_PADDING_VALUE == -1000


def test_group_helpers_without_distributed():
    assert not dsv4_cp_enabled(None)
    assert dsv4_cp_rank(None) == 0
    assert dsv4_cp_size(None) == 1


def _loop_oracle(seq_lens_padded, seq_len):
    """Seed algorithm 2.3 written as the plain per-document loop (test oracle)."""
    rows = seq_lens_padded if seq_lens_padded.dim() == 2 else seq_lens_padded.unsqueeze(0)
    out = torch.zeros(rows.shape[0], seq_len, dtype=torch.long)
    for b, row in enumerate(rows.tolist()):
        offset, doc = 0, 1
        for entry in row:
            if entry == -1000:
                continue
            n = max(entry, 0)
            if n == 0:
                doc += 1
                continue
            out[b, offset : min(offset + n, seq_len)] = doc
            offset += n
            doc += 1
            if offset >= seq_len:
                break
    return out


def test_packed_seq_ids_hand_case():
    ids = build_packed_seq_ids(torch.tensor([[2, 0, 3, -1000], [1, -1000, 2, 0]]), seq_len=7)
    assert ids.tolist() == [[1, 1, 3, 3, 3, 0, 0], [1, 2, 2, 0, 0, 0, 0]]
    one_d = build_packed_seq_ids(torch.tensor([2, 2]), seq_len=5)
    assert one_d.tolist() == [[1, 1, 2, 2, 0]]
    assert one_d.dtype == torch.int64


def test_packed_seq_ids_matches_loop_oracle_on_random_rows():
    g = torch.Generator().manual_seed(3)
    for _ in range(50):
        d = int(torch.randint(1, 7, (1,), generator=g))
        lens = torch.randint(0, 6, (3, d), generator=g)
        lens[torch.rand(3, d, generator=g) < 0.2] = -1000
        width = int(torch.where(lens == -1000, 0, lens).sum(1).max()) + int(torch.randint(0, 4, (1,), generator=g))
        assert torch.equal(build_packed_seq_ids(lens, seq_len=width), _loop_oracle(lens, width))


def test_packed_seq_ids_rejects_bad_lengths():
    with pytest.raises(ValueError, match=r"row 0 covers 9 tokens but seq_len is 8"):
        build_packed_seq_ids(torch.tensor([4, 5]), seq_len=8)
    with pytest.raises(ValueError, match=r"`seq_lens_padded`\[0, 1\] = -2 is negative"):
        build_packed_seq_ids(torch.tensor([4, -2]), seq_len=8)
    with pytest.raises(ValueError, match="integer dtype"):
        build_packed_seq_ids(torch.tensor([4.0, 2.0]), seq_len=8)
