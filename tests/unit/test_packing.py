"""dsv4.packing: the V4.1 aligned packed layout against hand-worked cases, errors, autograd and a property test."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsv4.packing import SEQ_LENS_PAD as PAD
from dsv4.packing import PackedSequenceLayout, aligned_packed_layout


def _t(x):
    return torch.tensor(x, dtype=torch.long)


def _assert_layout(layout: PackedSequenceLayout, src, inp, pos, seq) -> None:
    assert torch.equal(layout.source_indices, _t(src))
    assert torch.equal(layout.input_positions, _t(inp))
    assert torch.equal(layout.position_ids, _t(pos))
    assert torch.equal(layout.sequence_ids, _t(seq))
    for t in (layout.source_indices, layout.input_positions, layout.position_ids, layout.sequence_ids):
        assert t.dtype == torch.long


# ---------------------------------------------------------------------------------------------- hand cases
def test_hand_case_spans_absent_document_and_alignment_4():
    # row 0: doc 1 = len 3 in span 4 (caller cols 0..2, col 3 is old padding), column 2 absent (0),
    #        doc 3 = len 5 in span 6 (caller cols 4..8, col 9 old padding).
    #        aligned: doc 1 at 0..2 (+1 pad), doc 3 at 4..8 (+3 pad) -> row length 12.
    # row 1: doc 1 = len 2, the rest absent (-1000).
    lengths = _t([[3, 0, 5], [2, PAD, PAD]])
    spans = _t([[4, 0, 6], [2, PAD, PAD]])
    layout = aligned_packed_layout(lengths, (2, 10), 4, seq_lens_padded=spans)
    _assert_layout(
        layout,
        src=[[0, 1, 2, -1, 4, 5, 6, 7, 8, -1, -1, -1],
             [0, 1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1]],
        inp=[[0, 1, 2, -1, 4, 5, 6, 7, 8, -1],
             [0, 1, -1, -1, -1, -1, -1, -1, -1, -1]],
        pos=[[0, 1, 2, 0, 0, 1, 2, 3, 4, 0, 0, 0],
             [0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]],
        seq=[[1, 1, 1, 0, 3, 3, 3, 3, 3, 0, 0, 0],
             [1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]],
    )
    assert layout.aligned_length == 12
    assert layout.input_length == 10
    assert layout.batch_size == 2
    assert torch.equal(layout.padding_mask, layout.sequence_ids == 0)
    assert int((~layout.padding_mask).sum()) == 3 + 5 + 2


def test_reference_worked_case_docs_1_3_9_17_alignment_2():
    layout = aligned_packed_layout(_t([1, 3, 9, 17]), (1, 30), 2)
    assert layout.aligned_length == 34  # 2 + 4 + 10 + 18
    starts_new = [0, 2, 6, 16]
    starts_old = [0, 1, 4, 13]
    exp_src = [-1] * 34
    exp_pos = [0] * 34
    exp_seq = [0] * 34
    exp_inp = [-1] * 30
    for doc_id, (n, s_new, s_old) in enumerate(zip([1, 3, 9, 17], starts_new, starts_old), start=1):
        for i in range(n):
            exp_src[s_new + i] = s_old + i
            exp_pos[s_new + i] = i
            exp_seq[s_new + i] = doc_id
            exp_inp[s_old + i] = s_new + i
    _assert_layout(layout, [exp_src], [exp_inp], [exp_pos], [exp_seq])
    # every length is odd, so each document ends with exactly one alignment slot
    assert layout.padding_mask[0].nonzero().flatten().tolist() == [1, 5, 15, 33]


def test_absent_documents_zero_and_minus_1000_leave_id_gaps():
    layout = aligned_packed_layout(_t([[2, 0, PAD, 1]]), (1, 3), 1)
    _assert_layout(layout, src=[[0, 1, 2]], inp=[[0, 1, 2]], pos=[[0, 1, 0]], seq=[[1, 1, 4]])


def test_seq_lens_padded_spans_skip_old_padding_alignment_1():
    # caller row: [a a x x | b b b x]; old padding is dropped even at alignment 1
    layout = aligned_packed_layout(_t([[2, 3]]), (1, 8), 1, seq_lens_padded=_t([[4, 4]]))
    _assert_layout(layout, src=[[0, 1, 4, 5, 6]], inp=[[0, 1, -1, -1, 2, 3, 4, -1]],
                   pos=[[0, 1, 0, 1, 2]], seq=[[1, 1, 2, 2, 2]])


def test_one_dimensional_seq_lens_equals_batch_of_one():
    a = aligned_packed_layout(_t([3, 2]), (1, 6), 4, seq_lens_padded=_t([3, 3]))
    b = aligned_packed_layout(_t([[3, 2]]), torch.Size([1, 6, 7]), 4, seq_lens_padded=_t([[3, 3]]))
    for name in ("source_indices", "input_positions", "position_ids", "sequence_ids"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert a.source_indices.tolist() == [[0, 1, 2, -1, 3, 4, -1, -1]]


def test_int32_inputs_and_minimum_length():
    layout = aligned_packed_layout(torch.tensor([[3]], dtype=torch.int32), (1, 3), 4, minimum_length=9)
    assert layout.aligned_length == 12  # max(9, 1, 4) rounded up to 4
    assert layout.source_indices.dtype == torch.long
    assert layout.source_indices.tolist() == [[0, 1, 2] + [-1] * 9]
    assert aligned_packed_layout(_t([[3]]), (1, 3), 4, minimum_length=2).aligned_length == 4
    # no documents at all: width max(1, ...) rounded up
    empty = aligned_packed_layout(_t([[0, PAD]]), (1, 5), 8)
    assert empty.aligned_length == 8
    assert empty.sequence_ids.tolist() == [[0] * 8]
    assert empty.input_positions.tolist() == [[-1] * 5]


def test_rows_share_the_widest_row_width():
    layout = aligned_packed_layout(_t([[1, PAD], [5, 5]]), (2, 10), 4)
    assert layout.aligned_length == 16  # row 1: 8 + 8
    assert layout.source_indices[0].tolist() == [0] + [-1] * 15


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "lengths, spans, width, match",
    [
        ([3], [2], 16, r"seq_lens_padded.*span 2.*shorter.*seq_lens 3.*row 0, document column 0"),
        ([33], [33], 32, r"row 0, document column 0.*caller column 0 with span 33.*ending at 33 > input width S=32"),
        ([-2], [-2], 16, r"seq_lens: negative document length -2 at row 0, document column 0"),
        ([0], [4], 16, r"absent packed document cannot have a physical span.*seq_lens 0.*seq_lens_padded 4"),
    ],
)
def test_invalid_packed_metadata_fails_before_attention(lengths, spans, width, match):
    with pytest.raises(ValueError, match=match):
        aligned_packed_layout(_t([lengths]), (1, width), 8, seq_lens_padded=_t([spans]))


def test_error_reports_first_offending_row_and_column():
    with pytest.raises(ValueError, match=r"span 4 is shorter than seq_lens 5 at row 1, document column 2"):
        aligned_packed_layout(_t([[1, 1, 1], [1, 1, 5]]), (2, 20), 2, seq_lens_padded=_t([[1, 1, 1], [1, 1, 4]]))
    with pytest.raises(ValueError, match=r"row 1, document column 1 starts at caller column 4 with span 3, "
                                         r"ending at 7 > input width S=6"):
        aligned_packed_layout(_t([[2, 2], [4, 3]]), (2, 6), 1)
    with pytest.raises(ValueError, match=r"seq_lens_padded.*row 0, document column 1.*seq_lens -1000.*"
                                         r"seq_lens_padded 3"):
        aligned_packed_layout(_t([[2, PAD]]), (1, 6), 1, seq_lens_padded=_t([[2, 3]]))


@pytest.mark.parametrize("alignment", [0, -4])
def test_alignment_below_one(alignment):
    with pytest.raises(ValueError, match=rf"alignment must be >= 1, got {alignment}"):
        aligned_packed_layout(_t([[1]]), (1, 1), alignment)


def test_non_integer_alignment():
    with pytest.raises(ValueError, match=r"alignment must be an int"):
        aligned_packed_layout(_t([[1]]), (1, 1), 2.0)


def test_float_dtypes_rejected():
    with pytest.raises(ValueError, match=r"seq_lens must have dtype int32 or int64, got torch.float32"):
        aligned_packed_layout(torch.tensor([[1.0]]), (1, 1), 1)
    with pytest.raises(ValueError, match=r"seq_lens_padded must have dtype int32 or int64, got torch.float64"):
        aligned_packed_layout(_t([[1]]), (1, 1), 1, seq_lens_padded=torch.tensor([[1.0]], dtype=torch.float64))
    with pytest.raises(ValueError, match=r"seq_lens must be an int32/int64 tensor, got list"):
        aligned_packed_layout([[1]], (1, 1), 1)


def test_shape_errors():
    with pytest.raises(ValueError, match=r"seq_lens must be \[B, D\] or \[D\], got shape \(1, 1, 1\)"):
        aligned_packed_layout(torch.ones(1, 1, 1, dtype=torch.long), (1, 1), 1)
    with pytest.raises(ValueError, match=r"seq_lens has 2 rows .* input_shape has batch size 3"):
        aligned_packed_layout(_t([[1], [1]]), (3, 4), 1)
    with pytest.raises(ValueError, match=r"seq_lens_padded has shape \(1, 3\), expected .* \(1, 2\)"):
        aligned_packed_layout(_t([[1, 1]]), (1, 4), 1, seq_lens_padded=_t([[1, 1, 1]]))
    with pytest.raises(ValueError, match=r"minimum_length must be >= 0, got -1"):
        aligned_packed_layout(_t([[1]]), (1, 1), 1, minimum_length=-1)
    with pytest.raises(ValueError, match=r"input_shape must be \(B, S, ...\)"):
        aligned_packed_layout(_t([[1]]), (1,), 1)


def test_pack_restore_shape_errors():
    layout = aligned_packed_layout(_t([[3]]), (1, 3), 4)
    with pytest.raises(ValueError, match=r"pack: values must have shape \[B, S, ...\] = \[1, 3, ...\], got \(1, 4\)"):
        layout.pack(torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"restore: values must have shape \[B, S_al, ...\] = \[1, 4, ...\], "
                                         r"got \(1, 3, 2\)"):
        layout.restore(torch.zeros(1, 3, 2))


# ---------------------------------------------------------------------------------------------- pack / restore
def _hand_layout() -> PackedSequenceLayout:
    return aligned_packed_layout(_t([[3, 0, 5], [2, PAD, PAD]]), (2, 10), 4,
                                 seq_lens_padded=_t([[4, 0, 6], [2, PAD, PAD]]))


def test_pack_values_and_fill():
    layout = _hand_layout()
    ids = torch.arange(20).reshape(2, 10) + 100
    packed = layout.pack(ids, fill=-7)
    assert packed.tolist() == [
        [100, 101, 102, -7, 104, 105, 106, 107, 108, -7, -7, -7],
        [110, 111, -7, -7, -7, -7, -7, -7, -7, -7, -7, -7],
    ]
    # labels with -100 fill; bools
    assert layout.pack(torch.ones(2, 10, dtype=torch.bool), fill=False).sum().item() == 10
    # a fill vector broadcast over the trailing dim
    x = torch.ones(2, 10, 3)
    packed = layout.pack(x, fill=torch.tensor([1.0, 2.0, 3.0]))
    assert packed[0, 3].tolist() == [1.0, 2.0, 3.0]
    assert packed[0, 4].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("trailing", [(), (5,), (4, 5)])
def test_pack_restore_round_trip_trailing_dims(trailing):
    layout = _hand_layout()
    torch.manual_seed(0)
    x = torch.randn((2, 10) + trailing)
    packed = layout.pack(x, fill=3.5)
    assert packed.shape == (2, 12) + trailing
    assert torch.all(packed[layout.padding_mask] == 3.5)
    restored = layout.restore(packed)
    assert restored.shape == x.shape
    covered = layout.input_positions >= 0
    assert torch.equal(restored[covered], x[covered])
    assert torch.all(restored[~covered] == 0)
    assert int(covered.sum()) == 10


def test_gradients_identity_on_real_tokens_zero_on_padding():
    layout = _hand_layout()
    x = torch.randn(2, 10, 3, requires_grad=True)
    w = torch.randn(2, 10, 3)
    (layout.restore(layout.pack(x, fill=1.0)) * w).sum().backward()
    covered = (layout.input_positions >= 0).unsqueeze(-1)
    assert torch.equal(x.grad, torch.where(covered, w, torch.zeros(())))
    # Jacobian of restore(pack(.)) is the identity on covered columns and 0 elsewhere
    x2 = torch.randn(2, 10, dtype=torch.double)
    jac = torch.autograd.functional.jacobian(lambda v: layout.restore(layout.pack(v)), x2)
    jac = jac.reshape(20, 20)
    expected = torch.diag((layout.input_positions >= 0).reshape(-1).double())
    assert torch.equal(jac, expected)
    # restore alone: gradient lands on the aligned slots the caller reads
    y = torch.randn(2, 12, requires_grad=True)
    layout.restore(y).sum().backward()
    assert torch.equal(y.grad, (~layout.padding_mask).to(y.dtype))
    assert torch.autograd.gradcheck(lambda v: layout.pack(v, fill=0.5), (x2.clone().requires_grad_(),))


# ---------------------------------------------------------------------------------------------- property test
@st.composite
def _batches(draw):
    alignment = draw(st.sampled_from([1, 2, 4, 8, 128]))
    batch = draw(st.integers(1, 3))
    docs = draw(st.integers(0, 5))
    rows_len, rows_span = [], []
    for _ in range(batch):
        lens, spans = [], []
        for _ in range(docs):
            kind = draw(st.sampled_from(["doc", "doc", "doc", "zero", "pad"]))
            if kind == "doc":
                n = draw(st.integers(1, 20))
                lens.append(n)
                spans.append(n + draw(st.integers(0, 3)))
            else:
                value = 0 if kind == "zero" else PAD
                lens.append(value)
                spans.append(draw(st.sampled_from([0, PAD])))
        rows_len.append(lens)
        rows_span.append(spans)
    used = max((sum(s for s in row if s > 0) for row in rows_span), default=0)
    width = used + draw(st.integers(0, 5))
    minimum = draw(st.integers(0, 40))
    use_spans = draw(st.booleans())
    return alignment, rows_len, rows_span, width, minimum, use_spans


@settings(max_examples=50, deadline=None)
@given(_batches())
def test_property_layout_invariants(case):
    alignment, rows_len, rows_span, width, minimum, use_spans = case
    batch = len(rows_len)
    lengths = torch.tensor(rows_len, dtype=torch.long).reshape(batch, -1)
    spans = torch.tensor(rows_span, dtype=torch.long).reshape(batch, -1) if use_spans else None
    layout = aligned_packed_layout(lengths, (batch, width), alignment, seq_lens_padded=spans,
                                   minimum_length=minimum)
    s_al = layout.aligned_length
    assert s_al % alignment == 0
    row_lengths = [sum(-(-n // alignment) * alignment for n in row if n > 0) for row in rows_len]
    assert s_al == -(-max([minimum, 1] + row_lengths) // alignment) * alignment

    x = torch.randn(batch, width, 2)
    restored = layout.restore(layout.pack(x, fill=9.0))
    covered = layout.input_positions >= 0
    assert torch.equal(restored[covered], x[covered])
    assert torch.all(restored[~covered] == 0)

    span_rows = rows_span if use_spans else rows_len
    for b in range(batch):
        old = 0
        seq = layout.sequence_ids[b]
        for d, (n, s) in enumerate(zip(rows_len[b], span_rows[b])):
            slots = (seq == d + 1).nonzero().flatten()
            if n <= 0:
                assert slots.numel() == 0
                continue
            start = int(slots[0])
            assert start % alignment == 0
            assert slots.tolist() == list(range(start, start + n))
            assert layout.position_ids[b, slots].tolist() == list(range(n))
            assert layout.source_indices[b, slots].tolist() == list(range(old, old + n))
            assert layout.input_positions[b, old:old + n].tolist() == list(range(start, start + n))
            old += s
        assert int(covered[b].sum()) == sum(n for n in rows_len[b] if n > 0)
        pad = layout.padding_mask[b]
        assert torch.all(layout.source_indices[b][pad] == -1)
        assert torch.all(layout.position_ids[b][pad] == 0)
