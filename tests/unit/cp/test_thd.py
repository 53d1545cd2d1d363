"""dsv4.cp.thd: contiguous THD partition with global metadata (Megatron-Bridge deepseek_v4_step semantics)."""

from __future__ import annotations

import pytest
import torch

from dsv4.cp.thd import packed_metadata_for_forward, partition_packed_batch_contiguous


def _batch() -> dict:
    tokens = torch.arange(8).reshape(1, 8) + 10
    return {
        "tokens": tokens,
        "labels": torch.arange(8).reshape(1, 8) + 20,
        "loss_mask": torch.tensor([[1, 1, 1, 0, 1, 1, 0, 0]]),
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]),
        "padding_mask": torch.tensor([[False] * 6 + [True] * 2]),
        "hidden": torch.arange(16.0).reshape(1, 8, 2),
        "attention_mask": torch.ones(1, 1, 8, 8, dtype=torch.bool),
        "cu_seqlens": torch.tensor([0, 4, 8], dtype=torch.int32),
        "cu_seqlens_argmin": torch.tensor(3),
        "max_seqlen": torch.tensor(4),
        "token_count": torch.tensor([8]),
        "doc_weights": torch.tensor([0.5, 2.0]),  # 1-D, no token dimension
        "name": "pack-0",
    }


def test_cp2_slices_token_tensors_and_keeps_global_metadata():
    batch = _batch()
    r0 = partition_packed_batch_contiguous(batch, 2, 0)
    r1 = partition_packed_batch_contiguous(batch, 2, 1)
    assert r0["tokens"].tolist() == [[10, 11, 12, 13]]
    assert r1["tokens"].tolist() == [[14, 15, 16, 17]]
    assert r0["labels"].tolist() == [[20, 21, 22, 23]]
    assert r1["labels"].tolist() == [[24, 25, 26, 27]]
    assert r0["loss_mask"].tolist() == [[1, 1, 1, 0]]
    assert r1["loss_mask"].tolist() == [[1, 1, 0, 0]]
    assert r0["position_ids"].tolist() == [[0, 1, 2, 3]]
    assert r1["position_ids"].tolist() == [[0, 1, 2, 3]]
    assert r1["padding_mask"].tolist() == [[False, False, True, True]]
    assert r1["hidden"].tolist() == [[[8.0, 9.0], [10.0, 11.0], [12.0, 13.0], [14.0, 15.0]]]
    for r in (r0, r1):
        assert r["cu_seqlens"].tolist() == [0, 4, 8]
        assert r["cu_seqlens_argmin"].item() == 3
        assert r["max_seqlen"].item() == 4
        assert r["token_count"].tolist() == [8]
        assert r["attention_mask"].shape == (1, 1, 8, 8)
        assert r["attention_mask"] is batch["attention_mask"]
        assert r["doc_weights"] is batch["doc_weights"]
        assert r["name"] == "pack-0"
        assert r["cp_partition_mode"] == "contiguous"
    # the input dict is not modified
    assert "cp_partition_mode" not in batch
    assert batch["tokens"].shape == (1, 8)


def test_cp4_windows_concatenate_to_the_global_batch():
    batch = {"input_ids": torch.arange(16).reshape(2, 8), "cu_seqlens_q": torch.tensor([0, 3, 8, 16])}
    parts = [partition_packed_batch_contiguous(batch, 4, r) for r in range(4)]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts], 1), batch["input_ids"])
    assert parts[2]["input_ids"].tolist() == [[4, 5], [12, 13]]
    assert all(p["cu_seqlens_q"].tolist() == [0, 3, 8, 16] for p in parts)


def test_length_key_preference():
    # tokens (L=8) wins over input_ids (L=4): only size-8 tensors are sliced
    batch = {"tokens": torch.zeros(1, 8), "input_ids": torch.zeros(1, 4), "labels": torch.zeros(1, 8)}
    out = partition_packed_batch_contiguous(batch, 2, 1)
    assert out["tokens"].shape == (1, 4) and out["labels"].shape == (1, 4)
    assert out["input_ids"].shape == (1, 4) and out["input_ids"] is batch["input_ids"]
    # labels alone defines L
    out = partition_packed_batch_contiguous({"labels": torch.arange(6).reshape(1, 6)}, 3, 2)
    assert out["labels"].tolist() == [[4, 5]]
    with pytest.raises(KeyError, match=r"none of the keys \['tokens', 'input_ids', 'labels'\].*\['loss_mask'\]"):
        partition_packed_batch_contiguous({"loss_mask": torch.ones(1, 8)}, 2, 0)
    with pytest.raises(ValueError, match=r"batch\['tokens'\] must be \[B, L, ...\].*got shape \(8,\)"):
        partition_packed_batch_contiguous({"tokens": torch.ones(8)}, 2, 0)


def test_a_batch_of_metadata_only_comes_back_unchanged():
    """A middle pipeline stage has no token tensors: nothing to slice, nothing to raise (Megatron-Bridge)."""
    batch = {"cu_seqlens": torch.tensor([0, 4, 8]), "max_seqlen": 4, "total_tokens": torch.tensor(8)}
    out = partition_packed_batch_contiguous(batch, 4, 3)
    assert out.keys() == {*batch, "cp_partition_mode"} and out["cp_partition_mode"] == "contiguous"
    assert all(out[k] is v for k, v in batch.items())


def test_indivisible_length_error_names_length_cp_size_and_fix():
    batch = {"tokens": torch.zeros(1, 10, dtype=torch.long)}
    with pytest.raises(ValueError) as err:
        partition_packed_batch_contiguous(batch, 4, 0)
    msg = str(err.value)
    assert "L=10" in msg and "cp_size=4" in msg
    assert "packed_sequence_size" in msg and "multiple of cp_size" in msg and "e.g. 12" in msg


@pytest.mark.parametrize("cp_size, cp_rank, match", [
    (0, 0, r"cp_size must be >= 1, got 0"),
    (-2, 0, r"cp_size must be >= 1, got -2"),
    (2, 2, r"cp_rank must be in \[0, cp_size\) = \[0, 2\), got 2"),
    (2, -1, r"cp_rank must be in \[0, cp_size\) = \[0, 2\), got -1"),
    (2.0, 0, r"cp_size must be an int"),
])
def test_rank_bounds(cp_size, cp_rank, match):
    with pytest.raises(ValueError, match=match):
        partition_packed_batch_contiguous(_batch(), cp_size, cp_rank)


def test_cp1_returns_contents_unchanged_plus_mode():
    batch = _batch()
    out = partition_packed_batch_contiguous(batch, 1, 0)
    assert out is not batch
    assert set(out) == set(batch) | {"cp_partition_mode"}
    assert all(out[k] is batch[k] for k in batch)
    assert out["cp_partition_mode"] == "contiguous"
    # odd length and no length key are fine at CP 1 (nothing to slice)
    assert partition_packed_batch_contiguous({"x": torch.ones(1, 7)}, 1, 0)["x"].shape == (1, 7)


def test_metadata_current_key_set_keeps_padding_mask():
    pm = torch.tensor([[False, True]])
    batch = {
        "cu_seqlens_q": torch.tensor([0, 2]), "cu_seqlens_kv": torch.tensor([0, 2]),
        "cu_seqlens_q_padded": torch.tensor([0, 4]), "cu_seqlens_kv_padded": torch.tensor([0, 4]),
        "max_seqlen_q": 2, "max_seqlen_kv": 2,
        "cu_seqlens": torch.tensor([0, 9]),  # legacy key ignored when cu_seqlens_q is present
        "total_tokens": 2, "cp_partition_mode": "contiguous", "padding_mask": pm,
        "tokens": torch.zeros(1, 2), "labels": torch.zeros(1, 2), "attention_mask": torch.ones(1, 2),
    }
    meta = packed_metadata_for_forward(batch)
    assert set(meta) == {"cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded", "cu_seqlens_kv_padded",
                         "max_seqlen_q", "max_seqlen_kv", "total_tokens", "cp_partition_mode", "padding_mask"}
    assert meta["padding_mask"] is pm
    assert meta["cu_seqlens_q_padded"].tolist() == [0, 4]
    assert meta["max_seqlen_kv"] == 2


def test_metadata_legacy_key_set_and_missing_keys_omitted():
    batch = {
        "cu_seqlens": torch.tensor([0, 4, 8, -1]), "cu_seqlens_argmin": torch.tensor(3), "max_seqlen": 4,
        "padding_mask": torch.zeros(1, 8, dtype=torch.bool), "cu_seqlens_unpadded": None,
        "max_seqlen_q": 99, "tokens": torch.zeros(1, 8),
    }
    meta = packed_metadata_for_forward(batch)
    assert set(meta) == {"cu_seqlens", "cu_seqlens_argmin", "max_seqlen", "padding_mask"}
    assert meta["cu_seqlens"].tolist() == [0, 4, 8, -1]


def test_metadata_without_packing_keys_returns_only_extra_keys():
    assert packed_metadata_for_forward({"tokens": torch.zeros(1, 4), "max_seqlen": 4}) == {}
    pm = torch.zeros(1, 4, dtype=torch.bool)
    meta = packed_metadata_for_forward({"tokens": torch.zeros(1, 4), "padding_mask": pm, "total_tokens": 4})
    assert set(meta) == {"padding_mask", "total_tokens"} and meta["padding_mask"] is pm


def test_partition_then_metadata_round_trip():
    out = partition_packed_batch_contiguous(_batch(), 2, 1)
    meta = packed_metadata_for_forward(out)
    assert set(meta) == {"cu_seqlens", "cu_seqlens_argmin", "max_seqlen", "cp_partition_mode", "padding_mask"}
    assert meta["cu_seqlens"].tolist() == [0, 4, 8]
    assert meta["padding_mask"].tolist() == [[False, False, True, True]]
