"""DSV4ForCausalLM: packed rows equal separate documents (logits, loss, grads), defaults, meta-device counts."""

from __future__ import annotations

import math

import pytest
import torch

from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM, parameter_counts

MULTIPLE = 128  # lcm over the tiny preset's ratios (4 counted as 8, 128) = the CP repad multiple
DOC_LENGTHS = [100, 128 + 40, 37, 1]
TAIL = 128  # row tail (pack padding, seq id 0)


def _tiny() -> DSV4Config:
    cfg = DSV4Config.preset("tiny")
    assert cfg.compress_ratios == [0, 4, 128, 4] and cfg.num_hash_layers >= 1
    assert cfg.hc_mult == 4 and cfg.num_nextn_predict_layers >= 1 and cfg.shard_multiple == MULTIPLE
    return cfg


def _doc_labels(tokens: torch.Tensor, padded: int) -> torch.Tensor:
    """Labels shifted inside the document; last real token and pad slots are -100."""
    labels = torch.full((padded,), -100, dtype=torch.long)
    labels[: len(tokens) - 1] = tokens[1:]
    return labels


def _packed_row(docs: list[torch.Tensor]):
    """One row like the CP repad builds it: each document padded to MULTIPLE, doc-local positions, ids."""
    ids, pos, seq, pad, labels, spans = [], [], [], [], [], []
    start = 0
    for k, doc in enumerate(docs, start=1):
        n = len(doc)
        padded = math.ceil(n / MULTIPLE) * MULTIPLE
        ids.append(torch.cat([doc, torch.zeros(padded - n, dtype=torch.long)]))
        pos.append(torch.arange(padded))
        seq.append(torch.full((padded,), k))
        pad.append(torch.arange(padded) >= n)
        labels.append(_doc_labels(doc, padded))
        spans.append((start, padded, n))
        start += padded
    ids.append(torch.zeros(TAIL, dtype=torch.long))
    pos.append(torch.arange(TAIL))
    seq.append(torch.zeros(TAIL, dtype=torch.long))
    pad.append(torch.ones(TAIL, dtype=torch.bool))
    labels.append(torch.full((TAIL,), -100))
    row = [torch.cat(t).unsqueeze(0) for t in (ids, pos, seq, pad, labels)]
    return row, spans


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_packed_equals_separate_documents():
    cfg = _tiny()
    torch.manual_seed(0)
    model = DSV4ForCausalLM(cfg).train()
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, cfg.vocab_size, (n,), generator=g) for n in DOC_LENGTHS]
    (ids, pos, seq, pad, labels), spans = _packed_row(docs)

    out = model(ids, position_ids=pos, packed_seq_ids=seq, padding_mask=pad, labels=labels)
    total_count = out.label_count
    assert total_count.item() == sum(n - 1 for n in DOC_LENGTHS)
    out.loss.backward()
    packed_grads = _grads(model)
    model.zero_grad(set_to_none=True)

    loss_sum = 0.0
    for doc, (start, padded, n) in zip(docs, spans):
        sl = slice(start, start + padded)
        alone = model(ids[:, sl], position_ids=pos[:, sl], padding_mask=pad[:, sl], labels=labels[:, sl])
        torch.testing.assert_close(out.logits[:, sl], alone.logits, atol=1e-5, rtol=1e-5)
        for d in range(cfg.num_nextn_predict_layers):
            torch.testing.assert_close(out.mtp_logits[d][:, sl], alone.mtp_logits[d], atol=1e-5, rtol=1e-5)
        (alone.loss_sum / total_count).backward()
        loss_sum = loss_sum + alone.loss_sum.detach()

        # The same document unpadded (no padding_mask at all) gives the same real-token logits: pads never leak.
        with torch.no_grad():
            bare = model(doc.unsqueeze(0))
        torch.testing.assert_close(out.logits[:, start : start + n], bare.logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.mtp_logits[0][:, start : start + n - 1], bare.mtp_logits[0][:, :-1],
                                   atol=1e-5, rtol=1e-5)

    torch.testing.assert_close(out.loss.detach(), loss_sum / total_count, atol=1e-6, rtol=1e-6)
    sep_grads = _grads(model)
    assert packed_grads.keys() == sep_grads.keys() and len(packed_grads) > 50
    for name, g_packed in packed_grads.items():
        g_sep = sep_grads[name]
        denom = g_sep.norm().clamp_min(1e-12)
        rel = ((g_packed - g_sep).norm() / denom).item()
        assert rel < 1e-4 or (g_packed - g_sep).abs().max() < 1e-9, f"{name}: relative grad error {rel:.2e}"


def test_defaults_loss_and_mtp_targets():
    cfg = DSV4Config.preset("tiny", num_hidden_layers=2, compress_ratios=[0, 128])
    torch.manual_seed(0)
    model = DSV4ForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 128))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100
    labels[1, :10] = -100
    out = model(ids, labels=labels)
    explicit = model(ids, position_ids=torch.arange(128).expand(2, 128), packed_seq_ids=torch.ones_like(ids),
                     labels=labels)
    torch.testing.assert_close(out.logits, explicit.logits)
    assert out.logits.dtype == torch.float32 and out.logits.shape == (2, 128, cfg.vocab_size)
    assert len(out.mtp_logits) == cfg.num_nextn_predict_layers == len(out.mtp_loss_sums)

    ce = torch.nn.functional.cross_entropy(out.logits.reshape(-1, cfg.vocab_size), labels.reshape(-1),
                                           ignore_index=-100, reduction="sum")
    # MTP depth 0 target at i is labels[i + 1] (ignored past the row end).
    mtp_labels = torch.roll(labels, -1, dims=1)
    mtp_labels[:, -1] = -100
    mtp = torch.nn.functional.cross_entropy(out.mtp_logits[0].reshape(-1, cfg.vocab_size),
                                            mtp_labels.reshape(-1), ignore_index=-100, reduction="sum")
    count = (labels != -100).sum()
    assert out.label_count == count and out.mtp_label_counts[0] == (mtp_labels != -100).sum()
    torch.testing.assert_close(out.ce_loss_sum, ce)
    torch.testing.assert_close(out.loss_sum, ce + cfg.mtp_loss_weight * mtp)
    torch.testing.assert_close(out.loss, (ce + cfg.mtp_loss_weight * mtp) / count)
    assert model(ids).loss is None

    with pytest.raises(ValueError, match="padding_mask"):
        model(ids, padding_mask=torch.zeros(2, 64, dtype=torch.bool))


def test_flash_builds_on_meta_with_positive_counts():
    cfg = DSV4Config.preset("flash")
    with torch.device("meta"):
        model = DSV4ForCausalLM(cfg)
    counts = parameter_counts(model)
    assert counts["total"] > counts["active"] > 0
    assert model.num_parameters() == counts["total"] and model.num_parameters(active_only=True) == counts["active"]
    # Order of magnitude of the released Flash model (~284B total, ~13B active).
    assert 1e11 < counts["total"] < 1e12 and 5e9 < counts["active"] < 5e10
