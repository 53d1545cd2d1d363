"""dsv4.data.packer: first-fit-decreasing placement, shifted labels, splitting, stats and errors, by hand."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.data import IGNORE_INDEX, Document, pack_documents

X = IGNORE_INDEX


def _t(rows):
    return torch.tensor(rows, dtype=torch.long)


def _docs_5_3_7_2():
    return [list(range(10, 15)), list(range(20, 23)), list(range(30, 37)), [40, 41]]


def test_ffd_hand_case_lengths_5_3_7_2_seq_len_8_alignment_2():
    # aligned lengths 6, 4, 8, 2; decreasing order: doc2 (8), doc0 (6), doc1 (4), doc3 (2)
    # doc2 fills row 0; doc0 opens row 1 (2 free); doc1 (4) does not fit there -> row 2; doc3 (2) fills row 1.
    rows = pack_documents(_docs_5_3_7_2(), seq_len=8, shard_multiple=2, pad_id=0)
    assert torch.equal(rows.batch.input_ids, _t([
        [30, 31, 32, 33, 34, 35, 36, 0],
        [10, 11, 12, 13, 14, 0, 40, 41],
        [20, 21, 22, 0, 0, 0, 0, 0],
    ]))
    assert torch.equal(rows.batch.labels, _t([
        [31, 32, 33, 34, 35, 36, X, X],
        [11, 12, 13, 14, X, X, 41, X],
        [21, 22, X, X, X, X, X, X],
    ]))
    assert torch.equal(rows.batch.positions, _t([
        [0, 1, 2, 3, 4, 5, 6, 0],
        [0, 1, 2, 3, 4, 0, 0, 1],
        [0, 1, 2, 0, 0, 0, 0, 0],
    ]))
    # one padding convention: every slot without a real token (pack or alignment padding) has document id 0
    assert torch.equal(rows.batch.seq_ids, _t([
        [1, 1, 1, 1, 1, 1, 1, 0],
        [1, 1, 1, 1, 1, 0, 2, 2],
        [1, 1, 1, 0, 0, 0, 0, 0],
    ]))
    assert rows.pieces == [[(2, 0, 7)], [(0, 0, 5), (3, 0, 2)], [(1, 0, 3)]]
    for t in (rows.batch.input_ids, rows.batch.labels, rows.batch.positions, rows.batch.seq_ids):
        assert t.dtype == torch.long
    s = rows.stats
    assert (s.num_rows, s.real_tokens, s.alignment_padding, s.pack_padding) == (3, 17, 3, 4)
    assert s.total_slots == 24 and s.supervised_tokens == 17 - 4
    assert s.padding_fraction == pytest.approx(7 / 24)


def test_alignment_counts_inside_budget_and_pad_id():
    # alignment 4, seq_len 8: lengths 3 and 5 take 4 and 8 slots -> two rows although 3 + 5 = 8 tokens
    rows = pack_documents([[1, 2, 3], [4, 5, 6, 7, 8]], seq_len=8, shard_multiple=4, pad_id=9)
    assert torch.equal(rows.batch.input_ids, _t([[4, 5, 6, 7, 8, 9, 9, 9], [1, 2, 3, 9, 9, 9, 9, 9]]))
    assert torch.equal(rows.batch.seq_ids, _t([[1] * 5 + [0] * 3, [1] * 3 + [0] * 5]))
    # alignment 1: both in one row
    one = pack_documents([[1, 2, 3], [4, 5, 6, 7, 8]], seq_len=8, shard_multiple=1)
    assert torch.equal(one.batch.input_ids, _t([[4, 5, 6, 7, 8, 1, 2, 3]]))
    assert torch.equal(one.batch.labels, _t([[5, 6, 7, 8, X, 2, 3, X]]))


def test_ties_are_broken_by_document_order():
    rows = pack_documents([[1, 1], [2, 2], [3, 3], [4, 4]], seq_len=4)
    assert rows.pieces == [[(0, 0, 2), (1, 0, 2)], [(2, 0, 2), (3, 0, 2)]]
    again = pack_documents([[1, 1], [2, 2], [3, 3], [4, 4]], seq_len=4)
    assert torch.equal(rows.batch.input_ids, again.batch.input_ids)


def test_loss_mask_marks_targets():
    # loss_mask[j] is about token j as a target: label[i] = ids[i+1] only where mask[i+1]
    doc = Document([10, 11, 12, 13, 14], [False, False, True, True, False], "d")
    rows = pack_documents([doc], seq_len=6)
    assert torch.equal(rows.batch.labels, _t([[X, 12, 13, X, X, X]]))
    assert rows.stats.supervised_tokens == 2


def test_split_long_document_loses_no_target():
    ids = list(range(100, 119))  # 19 tokens, seq_len 8 -> chunks 8, 8, 3
    rows = pack_documents([ids, [1, 2]], seq_len=8, shard_multiple=2)
    assert rows.stats.num_split_documents == 1 and rows.stats.num_pieces == 4
    assert rows.pieces == [[(0, 0, 8)], [(0, 8, 8)], [(0, 16, 3), (1, 0, 2)]]
    assert torch.equal(rows.batch.input_ids[0], _t(list(range(100, 108))))
    # the last label of a chunk is the first token of the next chunk
    assert torch.equal(rows.batch.labels[0], _t(list(range(101, 109))))
    assert torch.equal(rows.batch.labels[1], _t(list(range(109, 117))))
    assert torch.equal(rows.batch.labels[2], _t([117, 118, X, X, 2, X, X, X]))
    # each chunk is its own document for attention: positions restart
    assert torch.equal(rows.batch.positions[1], torch.arange(8))
    assert torch.equal(rows.batch.seq_ids[2], _t([1, 1, 1, 0, 2, 2, 0, 0]))
    # labelled tokens: unsplit 18 + 1, packed the same
    assert rows.stats.supervised_tokens == (19 - 1) + (2 - 1)
    assert int((rows.batch.labels != X).sum()) == 19


def test_split_long_false_refuses_and_names_document():
    with pytest.raises(ValueError, match=r"document 1 \(document 1\) has 9 tokens, more than seq_len 8"):
        pack_documents([[1, 2], list(range(9))], seq_len=8, split_long=False)
    with pytest.raises(ValueError, match=r"document 1 \(document 1\) has 9 tokens, more than seq_len 8, and "
                                         r"data.overlong=error"):
        pack_documents([[1, 2], list(range(9))], seq_len=8, overlong="error")
    with pytest.raises(ValueError, match=r"`data.overlong`='cut' must be one of split, truncate_left, drop, error"):
        pack_documents([[1, 2]], seq_len=8, overlong="cut")


def _chat(prompt: int, answer: int, base: int) -> Document:
    """A prompt of ``prompt`` tokens, then an answer of ``answer`` supervised tokens."""
    return Document(list(range(base, base + prompt + answer)), [False] * prompt + [True] * answer, f"chat {base}")


def test_overlong_split_leaves_out_chunks_without_a_target():
    # a 20-token chat whose answer is its last 3 tokens, seq_len 8: chunks [0, 8) and [8, 16) hold prompt only (no
    # target: left out, they would be rows with loss 0), [16, 20) holds the answer; plus a short chat
    rows = pack_documents([_chat(17, 3, 100), _chat(3, 2, 200)], seq_len=8, overlong="split")
    assert rows.pieces == [[(0, 16, 4), (1, 0, 5)]] or rows.pieces == [[(1, 0, 5)], [(0, 16, 4)]]
    s = rows.stats
    assert (s.num_split_documents, s.num_unsupervised_pieces, s.rows_without_labels) == (1, 2, 0)
    assert s.unused_tokens == 16 and s.supervised_tokens == 3 + 2  # every answer token is a target
    assert bool(((rows.batch.labels != X).sum(dim=1) > 0).all())


def test_overlong_truncate_left_keeps_the_answer_and_its_context():
    rows = pack_documents([_chat(17, 3, 100), _chat(3, 2, 200)], seq_len=8, overlong="truncate_left")
    assert sorted(p for row in rows.pieces for p in row) == [(0, 12, 8), (1, 0, 5)]
    first = [r for r, row in enumerate(rows.pieces) if row[0][0] == 0][0]
    assert rows.batch.input_ids[first].tolist() == list(range(112, 120))
    assert rows.batch.labels[first].tolist() == [X, X, X, X, 117, 118, 119, X]  # targets 117-119: the answer
    s = rows.stats
    assert (s.num_truncated_documents, s.num_split_documents, s.unused_tokens, s.supervised_tokens) == (1, 0, 12, 5)
    assert "1 truncated to their last 8 tokens" in s.summary() and "rows without labels: 0" in s.summary()


def test_overlong_drop_and_nothing_supervised_left():
    rows = pack_documents([_chat(17, 3, 100), _chat(3, 2, 200)], seq_len=8, overlong="drop")
    assert rows.pieces == [[(1, 0, 5)]] and rows.stats.num_dropped_documents == 1 and rows.stats.unused_tokens == 20
    with pytest.raises(ValueError, match="no supervised token to train on: 2 documents of up to 8 tokens"):
        pack_documents([_chat(17, 3, 100), _chat(5, 0, 200)], seq_len=8, overlong="drop")


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"seq_len": 10, "shard_multiple": 4}, r"seq_len 10 is not a multiple of the shard multiple 4"),
        ({"seq_len": 0}, r"seq_len must be a positive int, got 0"),
        ({"seq_len": 8, "shard_multiple": 0}, r"shard_multiple must be a positive int, got 0"),
    ],
)
def test_bad_sizes_raise_before_packing(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        pack_documents([[1, 2, 3]], **kwargs)


def test_empty_input_raises():
    with pytest.raises(ValueError, match="no documents to pack"):
        pack_documents([], seq_len=8)
    with pytest.raises(ValueError, match="all 2 documents are empty"):
        pack_documents([[], []], seq_len=8)


def test_empty_documents_are_skipped_and_counted():
    rows = pack_documents([[], [5, 6], []], seq_len=4)
    assert rows.stats.num_empty_documents == 2 and rows.pieces == [[(1, 0, 2)]]


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 40), min_size=1, max_size=25),
    alignment=st.sampled_from([1, 2, 4]),
    rows_of=st.integers(1, 6),
)
def test_property_every_token_once_and_metadata_consistent(lengths, alignment, rows_of):
    seq_len = 4 * alignment * rows_of
    if not any(lengths):
        lengths = lengths + [1]
    if all(n < 2 for n in lengths):
        lengths = lengths + [2]
    docs = [[(7 * k + j) % 251 + 1 for j in range(n)] for k, n in enumerate(lengths)]
    rows = pack_documents(docs, seq_len, alignment, pad_id=0)
    # a chunk (of seq_len tokens) is packed when it holds a target: it is not a document's last, lone token
    packed = {k: [start + j for start in range(0, n, seq_len) for j in range(min(seq_len, n - start))
                  if n - start >= 2] for k, n in enumerate(lengths)}
    s = rows.stats
    assert s.total_slots == s.real_tokens + s.alignment_padding + s.pack_padding
    assert s.real_tokens == sum(map(len, packed.values()))
    assert s.supervised_tokens == sum(max(n - 1, 0) for n in lengths)  # every target once
    assert s.rows_without_labels == 0
    seen = {k: [None] * n for k, n in enumerate(lengths)}
    for r, pieces in enumerate(rows.pieces):
        offset = 0
        for d, (k, start, n) in enumerate(pieces):
            assert offset % alignment == 0  # documents start on the multiple, in placement order
            assert rows.batch.positions[r, offset:offset + n].tolist() == list(range(n))
            assert bool((rows.batch.seq_ids[r, offset:offset + n] == d + 1).all())
            for j in range(n):
                assert seen[k][start + j] is None
                seen[k][start + j] = int(rows.batch.input_ids[r, offset + j])
            offset += -(-n // alignment) * alignment
        assert offset <= seq_len
        pad = rows.batch.seq_ids[r] == 0
        assert int((~pad).sum()) == sum(n for _, _, n in pieces)
        assert bool((rows.batch.labels[r][pad] == X).all()) and bool((rows.batch.input_ids[r][pad] == 0).all())
        assert bool((rows.batch.positions[r][pad] == 0).all())
    for k, doc in enumerate(docs):
        assert [i for i, v in enumerate(seen[k]) if v is not None] == packed[k]
        assert all(seen[k][i] == doc[i] for i in packed[k])
