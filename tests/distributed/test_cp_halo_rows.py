"""The halo and the compressor boundary go only to the rows that need them (2 gloo ranks, tiny preset).

Two rows of 512 tokens, 256 per rank: row 0 holds two documents of 256, so rank 1's first token starts a
document; row 1 holds one document of 512 across the boundary. From first principles, per layer and direction rank 1
receives the window halo (``sliding_window - 1`` K/V rows of ``head_dim`` fp32 values) for row 1 only, and the ratio-4
compressor boundaries (main and indexer: the previous window's softmax summary, 2 fp32 values per channel) for row 1
only; rank 0 receives nothing. A batch of row 0 alone exchanges
no halo or boundary bytes at all. The logits equal the single-rank forward's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dsv4.launch import run_on_ranks

pytestmark = pytest.mark.distributed

L = 512


def _model():
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM

    torch.manual_seed(0)
    return DSV4ForCausalLM(DSV4Config.preset("tiny"))


def _rows():
    ids = torch.randint(1, 256, (2, L), generator=torch.Generator().manual_seed(7))
    seq = torch.stack([torch.cat([torch.full((256,), 1), torch.full((256,), 2)]), torch.ones(L, dtype=torch.long)])
    pos = torch.stack([torch.cat([torch.arange(256), torch.arange(256)]), torch.arange(L)])
    return ids, seq, pos


def _body(rank, world_size):
    from dsv4.cp import CPContext

    model = _model()
    ids, seq, pos = _rows()
    part = slice(rank * L // 2, (rank + 1) * L // 2)
    out = {}
    for name, rows in (("both", [0, 1]), ("starts", [0])):
        cp = CPContext(dist.new_group([0, 1]))
        logits = model(ids[rows, part], position_ids=pos[rows, part], packed_seq_ids=seq[rows, part], cp=cp).logits
        out[name] = {"logits": logits.detach(), "traffic": cp.traffic.as_dict()}
    return out


def test_only_continuing_rows_receive_the_halo_and_boundary():
    results = run_on_ranks(_body, 2)
    model = _model()
    ids, seq, pos = _rows()
    reference = model(ids, position_ids=pos, packed_seq_ids=seq).logits.detach()
    config = model.config
    layers_by_ratio = {r: config.compress_ratios[:config.num_hidden_layers].count(r) for r in (0, 4, 128)}
    for rank, res in enumerate(results):
        part = slice(rank * L // 2, (rank + 1) * L // 2)
        torch.testing.assert_close(res["both"]["logits"], reference[:, part], atol=1e-5, rtol=0)
        torch.testing.assert_close(res["starts"]["logits"], reference[[0], part], atol=1e-5, rtol=0)
    both = results[1]["both"]["traffic"]
    # every attention layer (backbone and MTP) receives one window halo of one row
    attention_layers = config.num_hidden_layers + config.num_nextn_predict_layers
    assert both["halo"]["bytes_received"] == attention_layers * (config.sliding_window - 1) * config.head_dim * 4
    # ratio 4 (overlap) compressors: the previous window's first-half softmax summary (a logsumexp and a weighted
    # mean per channel, fp32) of one row, main (head_dim channels) and indexer (index_head_dim channels)
    assert layers_by_ratio[4] == 2
    assert both["compressor_halo"]["bytes_received"] == layers_by_ratio[4] * 2 * config.head_dim * 4
    assert both["index_compressor_halo"]["bytes_received"] == layers_by_ratio[4] * 2 * config.index_head_dim * 4
    for kind in ("halo", "compressor_halo", "index_compressor_halo"):
        assert results[0]["both"]["traffic"].get(kind, {"bytes_received": 0})["bytes_received"] == 0
        starts = results[1]["starts"]["traffic"].get(kind, {"bytes_received": 0, "bytes_sent": 0})
        assert starts["bytes_received"] == 0 and starts.get("bytes_sent", 0) == 0, kind


def _bad_positions_body(rank, world_size):
    from dsv4.cp import CPContext

    model = _model()
    ids, seq, pos = _rows()
    part = slice(rank * L // 2, (rank + 1) * L // 2)
    errors = []
    # row 0's second document (rank 1's first token) counts from 128, not 0: it claims to continue a document that
    # the previous chunk does not end with; row 1's document restarts its positions at rank 1's first token
    for bad in (pos[[0]].clone() + torch.cat([torch.zeros(256, dtype=torch.long), torch.full((256,), 128)]),
                torch.cat([pos[[1], :256], pos[[1], :256] + 4], dim=1)):
        try:
            model(ids[[0], part], position_ids=bad[:, part], packed_seq_ids=seq[[0], part], cp=CPContext(dist.new_group([0, 1])))
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_positions_that_do_not_continue_fail_on_every_rank_before_any_layer():
    for errors in run_on_ranks(_bad_positions_body, 2):
        assert len(errors) == 2, errors
        assert "chunk 1 starts at document position 128 but the document does not continue there" in errors[0]
        assert "positions must count from 0 at each document's first token" in errors[1]
