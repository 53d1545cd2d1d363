"""MTP: in-document shift of inputs/targets (hand case, CP slices) and the causal reach per depth."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM
from dsv4.model.mtp import DocumentShift


SEQ = torch.tensor([[1, 1, 1, 1, 2, 2, 2, 0]])
PAD = torch.tensor([[False, False, False, True, False, False, False, True]])
IDS = torch.tensor([[10, 11, 12, 99, 20, 21, 22, 0]])


def meta(seq, pad, full_seq=None, full_pad=None, columns=None):
    """The attention-metadata fields DocumentShift reads: local and whole-row document ids and padding, and each
    local token's global column (``columns [R, L]``; one whole row per local row by default)."""
    if columns is None:
        columns = torch.arange(seq.shape[1]).expand(seq.shape[0], -1)
    row_batch = torch.zeros(columns.shape[0], dtype=torch.long) if full_seq is not None else torch.arange(seq.shape[0])
    return SimpleNamespace(seq_ids=seq, padding=pad, full_seq_ids=seq if full_seq is None else full_seq,
                           full_padding=pad if full_pad is None else full_pad, columns=columns, row_batch=row_batch)


def test_shift_stays_inside_documents():
    shift = DocumentShift(meta(SEQ, PAD))
    # s = 1: doc 1 tokens 10,11 see 11,12; 12 would see a pad slot; doc 2 stops at its end; pads/tail -> fill.
    assert shift(IDS, 1, fill=0).tolist() == [[11, 12, 0, 0, 21, 22, 0, 0]]
    assert shift(IDS, 2, fill=-100).tolist() == [[12, -100, -100, -100, 22, -100, -100, -100]]
    # No packing metadata: one document, only the row end is cut.
    plain = DocumentShift(meta(torch.ones(1, 4, dtype=torch.long), None))
    assert plain(torch.tensor([[1, 2, 3, 4]]), 1, fill=-1).tolist() == [[2, 3, 4, -1]]


class _FakeCP:
    """Rank ``rank`` of a CP group whose metadata gather returns the whole row of the tensor it is handed."""

    def __init__(self, rank: int, full: torch.Tensor) -> None:
        self.rank, self.size, self.enabled, self.full = rank, 2, True, full

    def gather_rows(self, t, kind="metadata"):
        assert kind == "mtp_metadata" and t.dtype == self.full.dtype
        return self.full


def test_shift_under_cp_matches_the_global_slice():
    expected = DocumentShift(meta(SEQ, PAD))(IDS, 1, fill=0)
    # contiguous halves, and the head-tail layout of 2 ranks (4 chunks of 2: rank 0 holds 0 and 3, rank 1: 1 and 2)
    layouts = {"none": [[0], [1]], "full": [[0, 3], [1, 2]]}
    for balance, chunks in layouts.items():
        width = 8 // sum(len(c) for c in chunks)
        for rank in (0, 1):
            cols = torch.stack([torch.arange(v * width, (v + 1) * width) for v in chunks[rank]])
            local = lambda t: t[0, cols]  # noqa: E731 - one local row per chunk
            shift = DocumentShift(meta(local(SEQ), local(PAD), SEQ, PAD, columns=cols), cp=_FakeCP(rank, IDS))
            assert torch.equal(shift(local(IDS), 1, fill=0), expected[0, cols]), (balance, rank)


def test_mtp_depths_see_exactly_their_inputs():
    cfg = DSV4Config.preset("tiny", num_hidden_layers=1, compress_ratios=[0], num_hash_layers=1,
                            num_nextn_predict_layers=2)
    torch.manual_seed(0)
    model = DSV4ForCausalLM(cfg).eval()
    ids = torch.randint(1, cfg.vocab_size, (1, 48))
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    with torch.no_grad():
        out = model(ids, labels=labels)
        j = 30
        changed = ids.clone()
        changed[0, j] = (ids[0, j] + 1) % cfg.vocab_size
        out2 = model(changed, labels=labels)
    assert len(out.mtp_logits) == 2
    # Depth d at position i reads tokens <= i + d + 1: positions < j - d - 1 are untouched, j - d - 1 is not.
    for d in range(2):
        torch.testing.assert_close(out.mtp_logits[d][:, : j - d - 1], out2.mtp_logits[d][:, : j - d - 1])
        assert not torch.allclose(out.mtp_logits[d][:, j - d - 1], out2.mtp_logits[d][:, j - d - 1])
    torch.testing.assert_close(out.logits[:, :j], out2.logits[:, :j])
    # Depth d targets labels[i + d + 1]: 47 - (d + 1) valid targets in a row of 47 labels.
    assert [c.item() for c in out.mtp_label_counts] == [46, 45]
    expected = out.ce_loss_sum + cfg.mtp_loss_weight * (out.mtp_loss_sums[0] + out.mtp_loss_sums[1]) / 2
    torch.testing.assert_close(out.loss_sum, expected)
