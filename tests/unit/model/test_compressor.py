"""Compressor: window metadata, hand-computed pooling, overlap reset, packed == per document, halo input."""

import math

import pytest
import torch

from dsv4.config import FLASH_ROPE_SCALING
from dsv4.model.compressor import Compressor, WindowMetadata, pool_windows, window_metadata
from dsv4.model.rope import apply_rope, rope_inv_freq, rope_table

HIDDEN, D, ROPE = 8, 8, 4
INV = rope_inv_freq(ROPE, 160000.0, FLASH_ROPE_SCALING)


def make_compressor(ratio: int, seed: int = 0) -> Compressor:
    torch.manual_seed(seed)
    comp = Compressor(HIDDEN, D, ratio)
    with torch.no_grad():
        comp.ape.normal_()
        comp.norm.weight.uniform_(0.5, 1.5)
    return comp


def windows_for(seq_ids, pos, ratio, prev_seq=None):
    win_seq, win_pos = window_metadata(seq_ids, pos, ratio)
    prev = torch.zeros(seq_ids.shape[0], dtype=torch.long) if prev_seq is None else prev_seq
    return WindowMetadata(ratio, win_seq, win_pos, rope_table(win_pos * ratio, INV), prev)


def single_doc(length: int, batch: int = 1):
    return torch.ones(batch, length, dtype=torch.long), torch.arange(length).expand(batch, -1)


def test_window_metadata_rules():
    seq = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 3, 3, 0, 0, 0, 0, 5, 5]])
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1, 0, 0, 0, 0, 0, 1]])
    win_seq, win_pos = window_metadata(seq, pos, 4)
    # windows: [1111] [2222] [2233] (straddles) [0000] (pack padding); trailing [55] is partial -> dropped
    assert win_seq.tolist() == [[1, 2, 0, 0]]
    assert win_pos.tolist() == [[0, 0, 0, 0]]
    seq = torch.ones(1, 12, dtype=torch.long)
    assert window_metadata(seq, torch.arange(100, 112)[None], 4)[1].tolist() == [[25, 26, 27]]


def test_non_overlap_pooling_by_hand():
    # one window of r = 2 tokens, D = 2: kv tokens (1, 2) and (3, 4); gates (0, ln 3) and (ln 3, 0)
    kv = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])
    gate = torch.tensor([[[0.0, math.log(3)], [math.log(3), 0.0]]])
    ape = torch.zeros(2, 2)
    out = pool_windows(kv, gate, ape, torch.tensor([[1]]), overlap=False)
    # channel 0: softmax(0, ln3) = (1/4, 3/4) -> 1/4 + 9/4; channel 1: (3/4, 1/4) -> 6/4 + 4/4
    assert torch.allclose(out, torch.tensor([[[2.5, 2.5]]]))
    # ape is added to the gate by in-window position: ape (ln 3, 0) on slot 0 flips channel 0 to (3/4... 1/2)
    ape = torch.tensor([[math.log(3), 0.0], [0.0, 0.0]])
    out = pool_windows(kv, gate, ape, torch.tensor([[1]]), overlap=False)
    assert torch.allclose(out[0, 0, 0], torch.tensor(0.5 * 1 + 0.5 * 3))


def test_non_overlap_module_equals_hand_softmax_sum():
    comp = make_compressor(8)  # ratio != 4: no overlap
    x = torch.randn(2, 16, HIDDEN)
    seq, pos = single_doc(16, 2)
    out = comp(x, windows_for(seq, pos, 8))
    kv = (x @ comp.wkv.weight.T).view(2, 2, 8, D)
    gate = (x @ comp.wgate.weight.T).view(2, 2, 8, D) + comp.ape
    w = gate.exp() / gate.exp().sum(dim=2, keepdim=True)  # softmax over the 8 slots, per channel
    pooled = (kv * w).sum(dim=2)
    rms = pooled / pooled.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * comp.norm.weight
    expected = apply_rope(rms, rope_table(torch.tensor([[0, 8], [0, 8]]), INV))  # RoPE at window start p * r
    assert torch.allclose(out, expected, atol=1e-5)


def test_overlap_pooling_by_hand():
    # r = 4, D = 1 (projection width 2); zero gates -> uniform weights over the usable slots
    kv = torch.arange(16, dtype=torch.float32).view(1, 8, 2)  # token t: (first half 2t, second half 2t+1)
    gate = torch.zeros(1, 8, 2)
    out = pool_windows(kv, gate, torch.zeros(4, 2), torch.tensor([[1, 1]]), overlap=True)
    # window 0: no predecessor -> mean of own second halves (1, 3, 5, 7) = 4
    # window 1: mean of window 0's first halves (0, 2, 4, 6) and own second halves (9, 11, 13, 15) = 7.5
    assert torch.allclose(out.view(-1), torch.tensor([4.0, 7.5]))
    # another document before window 1 -> overlap reset: mean of (9, 11, 13, 15) = 12
    out = pool_windows(kv, gate, torch.zeros(4, 2), torch.tensor([[1, 2]]), overlap=True)
    assert torch.allclose(out.view(-1), torch.tensor([4.0, 12.0]))


def test_overlap_reset_at_document_start_equals_no_predecessor():
    comp = make_compressor(4)
    x = torch.randn(1, 16, HIDDEN)
    seq = torch.tensor([[1] * 8 + [2] * 8])
    pos = torch.cat((torch.arange(8), torch.arange(8)))[None]
    packed = comp(x, windows_for(seq, pos, 4))
    alone = comp(x[:, 8:12], windows_for(*single_doc(4), 4))  # window with no predecessor at all
    assert torch.allclose(packed[:, 2], alone[:, 0], atol=1e-6)
    continued = comp(x[:, :12], windows_for(*single_doc(12), 4))  # same tokens but one document
    assert not torch.allclose(packed[:, 2], continued[:, 2], atol=1e-3)


@pytest.mark.parametrize("ratio", [4, 8])
def test_packed_row_equals_each_document_alone(ratio):
    comp = make_compressor(ratio, seed=1)
    lengths = [2 * ratio, 3 * ratio, ratio]
    x = torch.randn(1, sum(lengths) + ratio, HIDDEN)  # + one window of pack padding (id 0)
    seq = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)] + [torch.zeros(ratio, dtype=torch.long)])
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(ratio, dtype=torch.long)])
    packed = comp(x, windows_for(seq[None], pos[None], ratio))
    start, row = 0, 0
    for n in lengths:
        alone = comp(x[:, start : start + n], windows_for(*single_doc(n), ratio))
        assert torch.allclose(packed[:, row : row + n // ratio], alone, atol=1e-5)
        start, row = start + n, row + n // ratio
    assert torch.all(packed[:, -1] == 0)  # the padding window pools nothing (norm/rope of 0 stay 0)


def test_all_masked_window_is_finite_zero_with_finite_grads():
    kv = torch.randn(1, 8, 4, requires_grad=True)
    gate = torch.randn(1, 8, 4, requires_grad=True)
    ape = torch.randn(4, 4, requires_grad=True)
    for overlap in (True, False):
        out = pool_windows(kv, gate, ape, torch.tensor([[0, 0]]), overlap=overlap)
        assert torch.equal(out, torch.zeros_like(out))
        out.sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (kv, gate, ape))


@pytest.mark.parametrize("ratio", [4, 8])
def test_block_with_previous_rows_equals_slice_of_whole(ratio):
    """A later CP rank compresses its block given the previous rank's boundary features (the compressor halo)."""
    comp = make_compressor(ratio, seed=2)
    x = torch.randn(2, 6 * ratio, HIDDEN)
    seq = torch.tensor([[1] * (6 * ratio), [1] * (3 * ratio) + [2] * (3 * ratio)])
    pos = torch.stack((torch.arange(6 * ratio), torch.cat((torch.arange(3 * ratio), torch.arange(3 * ratio)))))
    whole = comp(x, windows_for(seq, pos, ratio))
    cut = 2 * ratio
    prev_seq = window_metadata(seq[:, cut - ratio : cut], pos[:, cut - ratio : cut], ratio)[0][:, 0]
    block = comp(x[:, cut:], windows_for(seq[:, cut:], pos[:, cut:], ratio, prev_seq), prev_features=comp(x[:, :cut], boundary=True))
    assert torch.allclose(block, whole[:, 2:], atol=1e-6)
    cut = 3 * ratio  # row 1: the block starts a new document -> its first window ignores the previous rows
    prev_seq = window_metadata(seq[:, cut - ratio : cut], pos[:, cut - ratio : cut], ratio)[0][:, 0]
    block = comp(x[:, cut:], windows_for(seq[:, cut:], pos[:, cut:], ratio, prev_seq), prev_features=comp(x[:, :cut], boundary=True))
    assert torch.allclose(block, whole[:, 3:], atol=1e-6)


def test_trailing_partial_window_dropped_and_dtype_kept():
    comp = make_compressor(4)
    x = torch.randn(1, 10, HIDDEN)
    seq, pos = single_doc(10)
    out = comp(x, windows_for(seq, pos, 4))
    assert out.shape == (1, 2, D)
    assert torch.allclose(out, comp(x[:, :8], windows_for(*single_doc(8), 4)))
    assert comp(x[:, :3], windows_for(*single_doc(3), 4)).shape == (1, 0, D)
    assert comp(x.bfloat16(), windows_for(seq, pos, 4)).dtype == torch.bfloat16
    assert comp.wkv.weight.dtype == comp.ape.dtype == torch.float32
