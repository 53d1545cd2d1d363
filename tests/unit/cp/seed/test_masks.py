"""The seed's dense masks, single process: hand-built expectations."""

import pytest
import torch

from dsv4.cp import build_dsv4_cp_causal_padding_mask, build_dsv4_cp_packed_causal_padding_mask

NEG = torch.finfo(torch.float32).min


def _allowed(mask):
    assert mask.dim() == 4 and mask.shape[1] == 1
    values = set(mask.unique().tolist())
    assert values <= {0.0, NEG}
    return (mask[:, 0] == 0).int().tolist()


def test_causal_mask_window_and_padding():
    mask = build_dsv4_cp_causal_padding_mask(
        position_ids=torch.tensor([0, 1, 2, 3]),
        key_len=4,
        dtype=torch.float32,
        device="cpu",
        cp_group=None,
        padding_mask=torch.tensor([[False, True, False, False]]),
        sliding_window=2,
    )
    assert mask.shape == (1, 1, 4, 4)
    assert _allowed(mask) == [
        [[1, 0, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]  # key 1 is padding; window 2
    ]


def test_causal_mask_local_queries_global_keys():
    # rank 1 of 2 holds global positions 2, 3 of a 4-token row; keys are all 4 columns
    mask = build_dsv4_cp_causal_padding_mask(
        position_ids=torch.tensor([[2, 3]]), key_len=4, dtype=torch.bfloat16, device="cpu", cp_group=None
    )
    assert mask.dtype == torch.bfloat16
    assert (mask[0, 0] == 0).int().tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert float(mask.min()) == float(torch.finfo(torch.bfloat16).min)


def test_packed_mask_documents_positions_and_pack_padding():
    ids = torch.tensor([[1, 1, 1, 2, 2, 0]])
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    pad = torch.tensor([[False, False, True, False, False, True]])
    mask = build_dsv4_cp_packed_causal_padding_mask(
        position_ids=pos, packed_seq_ids=ids, dtype=torch.float32, device="cpu", cp_group=None, padding_mask=pad,
        sliding_window=2,
    )
    assert _allowed(mask) == [
        [
            [1, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0],
            [0, 1, 0, 0, 0, 0],  # padded query of doc 1 still sees doc 1's real keys (window 2), not itself
            [0, 0, 0, 1, 0, 0],
            [0, 0, 0, 1, 1, 0],
            [0, 0, 0, 0, 0, 0],  # pack padding (id 0) has no allowed key
        ]
    ]


def test_masks_reject_integer_dtype():
    with pytest.raises(TypeError):
        build_dsv4_cp_causal_padding_mask(
            position_ids=torch.arange(4), key_len=4, dtype=torch.int64, device="cpu", cp_group=None
        )
