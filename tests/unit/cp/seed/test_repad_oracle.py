"""The repad and the repad + CP cut against a plain per-document loop, on random batches and the benchmark batch.

The oracle copies each document's real tokens one by one into a Python list per row, then cuts the rows
contiguously: no tensor op of the implementation is shared with it.
"""

import copy
import re

import pytest
import torch

from dsv4.cp import SimulatedMesh, _repad_dsv4_packed_batch, make_dsv4_contiguous_shard_cp_batch_and_ctx

PAD = -1000
PER_TOKEN = ("primary", "labels", "loss_mask", "position_ids", "padding_mask", "packed_seq_ids")


def _oracle(primary, labels, loss_mask, seq_lens, seq_lens_padded, cp_size, m, pad_id):
    """Seed repad, plainly: rows of Python lists, one document at a time, one token at a time."""
    fill = [0.0] * primary.shape[2] if primary.dim() == 3 else pad_id
    rows = {k: [] for k in PER_TOKEN}
    in_pos = [[-1] * primary.shape[1] for _ in range(primary.shape[0])]
    real_rows, padded_rows = [], []
    for b in range(primary.shape[0]):
        real = [max(v, 0) for v in seq_lens[b].tolist() if v != PAD]
        padded = [max(v, 0) for v in seq_lens_padded[b].tolist() if v != PAD]
        padded += real[len(padded):]
        row = {k: [] for k in PER_TOKEN}
        prim, lab, mask = primary[b].tolist(), labels[b].tolist(), loss_mask[b].tolist()
        old = 0
        for doc, n in enumerate(real):
            aligned = -(-n // m) * m
            for i in range(aligned):
                if i < n:
                    in_pos[b][old + i] = len(row["labels"])
                    row["primary"].append(prim[old + i])
                    row["labels"].append(lab[old + i])
                    row["loss_mask"].append(mask[old + i])
                else:
                    row["primary"].append(fill)
                    row["labels"].append(-100)
                    row["loss_mask"].append(0.0)
                row["position_ids"].append(i)
                row["padding_mask"].append(i >= n)
                row["packed_seq_ids"].append(doc + 1)
            old += max(padded[doc], n)
        for k in PER_TOKEN:
            rows[k].append(row[k])
        real_rows.append(real)
        padded_rows.append([-(-n // m) * m for n in real])
    width = max(max(len(r) for r in rows["labels"]), 1)
    total = -(-width // (cp_size * m)) * (cp_size * m)
    pads = {"primary": fill, "labels": -100, "loss_mask": 0.0, "position_ids": 0, "padding_mask": True,
            "packed_seq_ids": 0}
    full = {k: torch.tensor([r + [pads[k]] * (total - len(r)) for r in rows[k]]) for k in PER_TOKEN}
    d_max = max(len(r) for r in real_rows)
    full["seq_lens"] = torch.tensor([r + [PAD] * (d_max - len(r)) for r in real_rows])
    full["seq_lens_padded"] = torch.tensor([r + [PAD] * (d_max - len(r)) for r in padded_rows])
    return full, torch.tensor(in_pos), total


def _random_batch(g, *, embeds):
    """1-4 rows of 1-8 document columns: zero lengths, sentinels anywhere, old per-document padding, a shorter
    ``seq_lens_padded``, slack at the row end, some labels -100 inside documents."""
    rows = int(torch.randint(1, 5, (1,), generator=g))
    cols = int(torch.randint(1, 9, (1,), generator=g))
    seq_lens = torch.full((rows, cols), PAD)
    spans = torch.full((rows, cols), PAD)
    for b in range(rows):
        present = torch.randperm(cols, generator=g)[: int(torch.randint(1, cols + 1, (1,), generator=g))]
        for c in sorted(present.tolist()):
            n = int(torch.randint(0, 300, (1,), generator=g)) if torch.rand(1, generator=g) > 0.15 else 0
            seq_lens[b, c], spans[b, c] = n, n + int(torch.randint(0, 9, (1,), generator=g))
        if torch.rand(1, generator=g) < 0.2:  # the last span entry missing: extended with the real length
            last = max(c for c in range(cols) if spans[b, c] != PAD)
            spans[b, last] = PAD
    strides = []
    for b in range(rows):
        real = [v for v in seq_lens[b].tolist() if v != PAD]
        span = [v for v in spans[b].tolist() if v != PAD] + real[sum(v != PAD for v in spans[b].tolist()):]
        strides.append(sum(max(s, n) for s, n in zip(span, real)))
    width = max(max(strides) + int(torch.randint(0, 20, (1,), generator=g)), 1)
    primary = torch.randn(rows, width, 3, generator=g) if embeds else torch.randint(1, 1000, (rows, width), generator=g)
    labels = torch.full((rows, width), -100)
    for b in range(rows):
        real = [v for v in seq_lens[b].tolist() if v != PAD]
        span = [v for v in spans[b].tolist() if v != PAD] + real[sum(v != PAD for v in spans[b].tolist()):]
        old = 0
        for n, s in zip(real, span):
            labels[b, old : old + n] = torch.randint(0, 5000, (n,), generator=g)
            labels[b, old : old + n][torch.rand(n, generator=g) < 0.1] = -100
            old += max(s, n)
    batch = {"inputs_embeds" if embeds else "input_ids": primary, "labels": labels, "seq_lens": seq_lens,
             "seq_lens_padded": spans, "attention_mask": torch.ones(rows, width, dtype=torch.long)}
    return batch, torch.rand(rows, width, generator=g)


def _check(batch, loss_mask, cp_size, m, pad_id):
    """The full repad and every rank's repad + cut against one run of the oracle."""
    key = "inputs_embeds" if "inputs_embeds" in batch else "input_ids"
    expected, exp_pos, total = _oracle(batch[key], batch["labels"], loss_mask, batch["seq_lens"],
                                       batch["seq_lens_padded"], cp_size, m, pad_id)
    _check_full(batch, loss_mask, cp_size, m, pad_id, expected, exp_pos)
    _check_shards(batch, loss_mask, cp_size, m, pad_id, expected, exp_pos, total)


def _check_full(batch, loss_mask, cp_size, m, pad_id, expected, exp_pos):
    key = "inputs_embeds" if "inputs_embeds" in batch else "input_ids"
    out, out_mask, in_pos = _repad_dsv4_packed_batch(copy.deepcopy(batch), cp_size=cp_size, pad_multiple=m,
                                                     padding_token_id=pad_id, loss_mask=loss_mask.clone())
    got = {**{k: out[k] for k in ("labels", "position_ids", "padding_mask", "packed_seq_ids", "seq_lens",
                                  "seq_lens_padded")}, "primary": out[key], "loss_mask": out_mask}
    for k, v in expected.items():
        assert torch.equal(got[k].to(v.dtype), v), k
    assert torch.equal(in_pos, exp_pos)
    assert out["qkv_format"] == "thd"


def _check_shards(batch, loss_mask, cp_size, m, pad_id, expected, exp_pos, total):
    key = "inputs_embeds" if "inputs_embeds" in batch else "input_ids"
    local = total // cp_size
    for rank in range(cp_size):
        _, out, layout = make_dsv4_contiguous_shard_cp_batch_and_ctx(
            SimulatedMesh(cp_size, rank), None, copy.deepcopy(batch), loss_mask=loss_mask.clone(), pad_multiple=m,
            padding_token_id=pad_id,
        )
        assert layout.padded_seq_len == total and layout.original_seq_len is None
        assert torch.equal(layout.input_token_stream_positions, exp_pos)
        got = {"primary": out[key], "labels": out["labels"], "loss_mask": out["loss_mask"],
               "position_ids": out["position_ids"], "padding_mask": out["padding_mask"],
               "packed_seq_ids": out["packed_seq_ids"]}
        for k in PER_TOKEN:
            own = expected[k][:, rank * local : (rank + 1) * local]
            assert torch.equal(got[k].to(own.dtype), own), (rank, k)
            assert got[k].is_contiguous(), k
        assert torch.equal(out["seq_lens"], expected["seq_lens"])  # global metadata on every rank
        assert torch.equal(out["seq_lens_padded"], expected["seq_lens_padded"])
        assert "attention_mask" not in out and out["qkv_format"] == "thd"


@pytest.mark.parametrize("embeds", [False, True])
def test_repad_and_shards_match_the_plain_loop_on_random_batches(embeds):
    g = torch.Generator().manual_seed(5 + embeds)
    for trial in range(30):
        batch, loss_mask = _random_batch(g, embeds=embeds)
        cp_size, m = [(2, 2), (4, 8), (3, 16), (2, 128), (4, 5)][trial % 5]
        _check(batch, loss_mask, cp_size, m, pad_id=7)


def test_benchmark_batch_matches_the_plain_loop():
    """The batch of ``benchmarks/batch_prep.py``: 8 x 16384 tokens, 64 documents per row, multiple 128, CP 4."""
    g = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randperm(16383, generator=g)[:63] + 1).values
    bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([16384])])
    lengths = (bounds[1:] - bounds[:-1]).expand(8, 64).contiguous()
    ids = torch.randint(0, 32000, (8, 16384), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone(), "seq_lens": lengths, "seq_lens_padded": lengths.clone()}
    loss_mask = torch.ones(8, 16384)
    _check(batch, loss_mask, 4, 128, pad_id=0)


def test_dropped_label_count_matches_the_plain_loop():
    """Labelled tokens outside every document raise, with the count and the first one as the loop finds them."""
    g = torch.Generator().manual_seed(9)
    raised = 0
    for _ in range(40):
        batch, loss_mask = _random_batch(g, embeds=False)
        _, in_pos, _ = _oracle(batch["input_ids"], batch["labels"], loss_mask, batch["seq_lens"],
                               batch["seq_lens_padded"], 2, 4, 0)
        stray = torch.rand(batch["labels"].shape, generator=g) < 0.05
        batch["labels"] = torch.where(stray, 11, batch["labels"])
        dropped = (in_pos < 0) & (batch["labels"] != -100)
        if not bool(dropped.any()):
            _repad_dsv4_packed_batch(copy.deepcopy(batch), cp_size=2, pad_multiple=4, padding_token_id=0)
            continue
        raised += 1
        b, i = dropped.nonzero()[0].tolist()
        message = (f"{int(dropped.sum())} labelled token(s) (label != -100) lie outside every document declared by "
                   f"`seq_lens` and would be dropped by the repad; first at row {b}, column {i} (label 11)")
        with pytest.raises(ValueError, match=re.escape(message)):
            _repad_dsv4_packed_batch(copy.deepcopy(batch), cp_size=2, pad_multiple=4, padding_token_id=0)
    assert raised > 10


def test_intra_op_thread_count_is_restored():
    threads = torch.get_num_threads()
    batch, _ = _random_batch(torch.Generator().manual_seed(1), embeds=False)
    _repad_dsv4_packed_batch(copy.deepcopy(batch), cp_size=2, pad_multiple=4, padding_token_id=0)
    assert torch.get_num_threads() == threads
    batch["labels"][:, -1] = 5  # a labelled token past every document (the random rows end in slack or a doc)
    batch["seq_lens"] = batch["seq_lens"].clamp_max(0).masked_fill(batch["seq_lens"] == PAD, PAD)
    with pytest.raises(ValueError):
        _repad_dsv4_packed_batch(batch, cp_size=2, pad_multiple=4, padding_token_id=0)
    assert torch.get_num_threads() == threads


def test_inputs_embeds_gradient_reaches_the_caller_columns():
    batch, _ = _random_batch(torch.Generator().manual_seed(3), embeds=True)
    embeds = batch["inputs_embeds"].clone().requires_grad_(True)
    batch["inputs_embeds"] = embeds
    out, _, in_pos = _repad_dsv4_packed_batch(batch, cp_size=2, pad_multiple=8, padding_token_id=0)
    weight = torch.randn(out["inputs_embeds"].shape, generator=torch.Generator().manual_seed(4))
    (out["inputs_embeds"] * weight).sum().backward()
    expected = torch.zeros_like(embeds)
    for b, i in (in_pos >= 0).nonzero().tolist():
        expected[b, i] = weight[b, in_pos[b, i]]
    assert torch.equal(embeds.grad, expected)
