"""Balanced CP (``cp_balance="full"``, head-tail chunks) equals one process: logits, MTP logits, loss, every gradient.

Tiny preset (ratio 0, 4 and 128 layers, hash layers, MTP), fp32, on 2 and 4 gloo ranks. Rank r holds chunks r and
2C-1-r of every row as two local rows, so its halo comes from two neighbours (or from its own other row, for the
middle pair) and its compressed rows from chunks held anywhere. Rows: the packer's rows (several documents, one
across chunk boundaries, padding) and one 1024-token document (every chunk continues it). With the indexer loss
on, its value and the indexer's gradients match too; with the exchanges' overlap off (each waited for where it
starts) the numbers are the same.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dsv4.launch import run_on_ranks
from tests.distributed.grads import assert_rank_grads_sum_to

pytestmark = pytest.mark.distributed

WIDTH = 1024


def _model(indexer_loss: bool):
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM

    torch.manual_seed(0)
    return DSV4ForCausalLM(DSV4Config.preset("tiny", indexer_loss_coeff=0.01 if indexer_loss else 0.0))


def _batch():
    """The packer's rows (documents on multiples of 128, padding = id 0) and one row of a single document."""
    from dsv4.batch import TokenBatch
    from dsv4.config import DSV4Config
    from dsv4.data import pack_documents

    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(1, 256, (n,), generator=g).tolist() for n in (200, 37, 5, 400, 60, 700, 3, 250)]
    rows = pack_documents(docs, WIDTH, DSV4Config.preset("tiny").shard_multiple)
    ids = torch.randint(1, 256, (1, WIDTH), generator=g)
    labels = torch.roll(ids, -1, 1)
    labels[:, -1] = -100
    long_doc = TokenBatch(ids, labels, torch.ones_like(ids), torch.arange(WIDTH)[None])
    return TokenBatch.stack([rows[i] for i in range(len(rows))] + [long_doc])


def _body(rank, world_size, indexer_loss, overlap):
    from dsv4.cp import CPContext
    from dsv4.training.loss import reduce_token_loss

    group = dist.new_group(list(range(world_size)))
    model = _model(indexer_loss)
    batch = _batch()
    local = batch.cut(rank, world_size, model.config.shard_multiple, balance="full")
    cp = CPContext(group, balance="full", overlap=overlap)
    out = model(local.input_ids, position_ids=local.positions, packed_seq_ids=local.seq_ids,
                padding_mask=local.padding, labels=local.labels, cp=cp)
    loss = reduce_token_loss(out.loss_sum, out.label_count, group)
    loss.loss.backward()
    return {
        "logits": out.logits.detach(), "mtp": out.mtp_logits[0].detach(), "loss": loss.value,
        "indexer": None if out.indexer_loss_sum is None else reduce_token_loss(
            out.indexer_loss_sum.detach(), out.label_count, group).value,
        "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
        "traffic": cp.traffic.as_dict(),
    }


@pytest.mark.parametrize("world_size, indexer_loss, overlap", [(2, False, False), (4, False, True), (4, True, True)])
def test_balanced_cp_matches_single_rank(world_size, indexer_loss, overlap):
    from dsv4.parallel.cp.layout import CPLayout

    results = run_on_ranks(_body, world_size, args=(indexer_loss, overlap))
    torch.set_num_threads(1)
    model = _model(indexer_loss)
    batch = _batch()
    real = ~batch.padding
    out = model(batch.input_ids, position_ids=batch.positions, packed_seq_ids=batch.seq_ids,
                padding_mask=batch.padding, labels=batch.labels)
    (out.loss_sum / out.label_count).backward()
    layout = CPLayout(world_size, "full")
    for key, ref in (("logits", out.logits), ("mtp", out.mtp_logits[0])):
        got = layout.assemble(torch.stack([r[key] for r in results]))
        torch.testing.assert_close(got[real], ref.detach()[real], atol=1e-5, rtol=0)
    for res in results:
        torch.testing.assert_close(res["loss"], (out.loss_sum / out.label_count).detach(), atol=1e-6, rtol=0)
        if indexer_loss:
            torch.testing.assert_close(res["indexer"], (out.indexer_loss_sum / out.label_count).detach(),
                                       atol=1e-7, rtol=1e-5)
    assert_rank_grads_sum_to({n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                             [r["grads"] for r in results])
    # every rank holds a chunk that continues the long document from another rank or its own other row: rank 0's
    # tail chunk receives a halo from rank 1, and the last rank's chunks C-1 and C meet locally (no message)
    assert results[0]["traffic"]["halo"]["bytes_received"] > 0
    assert all(r["traffic"]["compressed_gather"]["bytes_received"] > 0 for r in results)
