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


def meta(seq, pad, full_seq=None, full_pad=None):
    """The four attention-metadata fields DocumentShift reads (local and whole-row document ids and padding)."""
    return SimpleNamespace(seq_ids=seq, padding=pad, full_seq_ids=seq if full_seq is None else full_seq,
                           full_padding=pad if full_pad is None else full_pad)


def test_shift_stays_inside_documents():
    shift = DocumentShift(meta(SEQ, PAD))
    # s = 1: doc 1 tokens 10,11 see 11,12; 12 would see a pad slot; doc 2 stops at its end; pads/tail -> fill.
    assert shift(IDS, 1, fill=0).tolist() == [[11, 12, 0, 0, 21, 22, 0, 0]]
    assert shift(IDS, 2, fill=-100).tolist() == [[12, -100, -100, -100, 22, -100, -100, -100]]
    # No packing metadata: one document, only the row end is cut.
    plain = DocumentShift(meta(torch.ones(1, 4, dtype=torch.long), None))
    assert plain(torch.tensor([[1, 2, 3, 4]]), 1, fill=-1).tolist() == [[2, 3, 4, -1]]


class _FakeCP:
    """Rank ``rank`` of a 2-way split of the full row; the metadata all-gather returns the full tensor."""

    def __init__(self, rank: int, full: dict[int, torch.Tensor]) -> None:
        self.rank, self.size, self.enabled, self.full = rank, 2, True, full

    def all_gather_metadata(self, t, dim=1, kind="metadata"):
        for full in self.full.values():
            if torch.equal(full[:, self.rank * 4 : (self.rank + 1) * 4], t) and full.dtype == t.dtype:
                return full
        raise AssertionError("unexpected tensor")


def test_shift_under_cp_matches_the_global_slice():
    full = {2: IDS}  # ids are gathered per depth; document ids and padding come from the metadata
    expected = DocumentShift(meta(SEQ, PAD))(IDS, 1, fill=0)
    for rank in (0, 1):
        sl = slice(rank * 4, (rank + 1) * 4)
        shift = DocumentShift(meta(SEQ[:, sl], PAD[:, sl], SEQ, PAD), cp=_FakeCP(rank, full))
        assert torch.equal(shift(IDS[:, sl], 1, fill=0), expected[:, sl])


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
