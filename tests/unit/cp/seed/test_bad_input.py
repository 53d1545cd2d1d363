"""Malformed batches raise ValueError/KeyError naming the key and the numbers, before the batch is touched."""

import copy

import pytest
import torch

from dsv4.cp import PrePackedBatchError, make_dsv4_contiguous_shard_cp_batch_and_ctx
from tests.conftest import FakeMesh


def _batch():
    ids = torch.arange(1, 13).view(1, 12)
    labels = ids.clone()
    labels[0, 10:] = -100
    return {
        "input_ids": ids,
        "labels": labels,
        "seq_lens": torch.tensor([[4, 6]]),
        "seq_lens_padded": torch.tensor([[4, 6]]),
        "attention_mask": torch.ones(1, 12, dtype=torch.long),
    }


def _expect_untouched(batch, exc, match):
    before = copy.deepcopy(batch)
    with pytest.raises(exc, match=match):
        make_dsv4_contiguous_shard_cp_batch_and_ctx(FakeMesh(2, 0), None, batch, pad_multiple=4)
    assert batch.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(batch[k], v) if isinstance(v, torch.Tensor) else batch[k] == v, k


def test_seq_lens_exceed_row():
    b = _batch()
    b["seq_lens"] = torch.tensor([[4, 9]])
    b["seq_lens_padded"] = torch.tensor([[4, 9]])
    _expect_untouched(b, ValueError, r"row 0 document 1 spans \[4, 13\) but the row has 12 tokens")


def test_negative_length():
    b = _batch()
    b["seq_lens"] = torch.tensor([[4, -3]])
    _expect_untouched(b, ValueError, r"`seq_lens`\[0, 1\] = -3 is negative")


def test_labelled_token_outside_documents_would_be_dropped():
    b = _batch()
    b["labels"][0, 11] = 7  # beyond the declared documents (4 + 6 = 10 tokens)
    _expect_untouched(b, ValueError, r"1 labelled token\(s\) .* row 0, column 11 \(label 7\)")


def test_labelled_token_in_old_document_padding_would_be_dropped():
    b = _batch()
    b["seq_lens"] = torch.tensor([[3, 6]])  # doc 1 is 3 real tokens in a span of 4: column 3 is old padding
    _expect_untouched(b, ValueError, r"row 0, column 3 \(label 4\)")


@pytest.mark.parametrize("keys", [("input_ids", "inputs_embeds"), ()])
def test_both_or_neither_primary(keys):
    b = _batch()
    if keys:
        b["inputs_embeds"] = torch.zeros(1, 12, 4)
    else:
        del b["input_ids"]
    _expect_untouched(b, ValueError, "exactly one of `input_ids` and `inputs_embeds`")


def test_missing_labels():
    b = _batch()
    del b["labels"]
    _expect_untouched(b, KeyError, "requires `labels`")


def test_missing_seq_lens_on_thd_batch():
    b = _batch()
    del b["seq_lens"], b["seq_lens_padded"]
    b["qkv_format"] = "thd"
    _expect_untouched(b, KeyError, "requires `seq_lens`")


def test_cu_seqlens_without_seq_lens_under_cp():
    b = _batch()
    del b["seq_lens"], b["seq_lens_padded"]
    b["cu_seqlens"] = torch.tensor([0, 4, 10])
    _expect_untouched(b, PrePackedBatchError, "`cu_seqlens` without `seq_lens`")
    assert issubclass(PrePackedBatchError, KeyError) and issubclass(PrePackedBatchError, NotImplementedError)


def test_non_integer_lengths():
    b = _batch()
    b["seq_lens"] = torch.tensor([[4.0, 6.0]])
    _expect_untouched(b, ValueError, r"`seq_lens` must have an integer dtype .*float32")


def test_label_shape_mismatch():
    b = _batch()
    b["labels"] = b["labels"][:, :10]
    _expect_untouched(b, ValueError, r"`labels` has shape \(1, 10\) but `input_ids` has \(1, 12\)")


def test_seq_lens_rows_mismatch():
    b = _batch()
    b["seq_lens"] = torch.tensor([[4, 6], [4, 6]])
    b["seq_lens_padded"] = b["seq_lens"]
    _expect_untouched(b, ValueError, r"`seq_lens` has 2 rows but the batch has 1")


def test_non_packed_missing_labels():
    b = _batch()
    del b["labels"], b["seq_lens"], b["seq_lens_padded"]
    _expect_untouched(b, KeyError, "CP requires `labels`")
