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


def meta(seq, pad, next_rows=None):
    """The attention-metadata fields DocumentShift reads: the local rows' ids and padding and, under CP, which rows
    continue into the next chunk."""
    return SimpleNamespace(seq_ids=seq, padding=pad, routes=None if next_rows is None else SimpleNamespace(next="next"),
                           next_rows=next_rows)


def test_shift_stays_inside_documents():
    shift = DocumentShift(meta(SEQ, PAD))
    # s = 1: doc 1 tokens 10,11 see 11,12; 12 would see a pad slot; doc 2 stops at its end; pads/tail -> fill.
    assert shift(IDS, 1, fill=0).tolist() == [[11, 12, 0, 0, 21, 22, 0, 0]]
    assert shift(IDS, 2, fill=-100).tolist() == [[12, -100, -100, -100, 22, -100, -100, -100]]
    # No packing metadata: one document, only the row end is cut.
    plain = DocumentShift(meta(torch.ones(1, 4, dtype=torch.long), None))
    assert plain(torch.tensor([[1, 2, 3, 4]]), 1, fill=-1).tolist() == [[2, 3, 4, -1]]


class _FakeCP:
    """A CP group whose exchange along ``routes.next`` hands each local row (global columns ``cols``) what the next
    chunk of the whole row sends: its first values while they stay in its first document, unpadded, else ``fill``."""

    size = 2

    def __init__(self, cols, values, fill) -> None:
        self.cols, self.values, self.fill = cols, values, fill

    def halo_exchange(self, t, rows, dim=1, kind="halo", route=None):
        assert kind == "mtp_metadata" and route == "next" and t.dtype == torch.int32 and t.shape[1] == rows
        out = torch.zeros(self.cols.shape[0], rows, dtype=torch.int32)
        for i, last in enumerate(self.cols[:, -1].tolist()):
            for j in range(rows):
                col = last + 1 + j
                if col < SEQ.shape[1]:
                    same = SEQ[0, col] == SEQ[0, last + 1] and SEQ[0, col] > 0 and not PAD[0, col]
                    out[i, j] = int(self.values[0, col]) if same else self.fill
        return out


def test_shift_under_cp_matches_the_global_slice():
    # contiguous halves, and the head-tail layout of 2 ranks (4 chunks of 2: rank 0 holds 0 and 3, rank 1: 1 and 2)
    layouts = {"none": [[0], [1]], "full": [[0, 3], [1, 2]]}
    for fill in (0, -100):
        expected = {s: DocumentShift(meta(SEQ, PAD))(IDS, s, fill=fill) for s in (1, 2)}
        for balance, chunks in layouts.items():
            width = 8 // sum(len(c) for c in chunks)
            for rank in (0, 1):
                cols = torch.stack([torch.arange(v * width, (v + 1) * width) for v in chunks[rank]])
                last, after = SEQ[0, cols[:, -1]], SEQ[0, (cols[:, -1] + 1).clamp(max=7)]
                continues = (cols[:, -1] + 1 < 8) & (last > 0) & (last == after)  # the document goes on
                shift = DocumentShift(meta(SEQ[0, cols], PAD[0, cols], continues), cp=_FakeCP(cols, IDS, fill))
                for s in (1, 2):
                    got = shift(IDS[0, cols], s, fill=fill)
                    assert torch.equal(got, expected[s][0, cols]), (balance, rank, s, fill)


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
