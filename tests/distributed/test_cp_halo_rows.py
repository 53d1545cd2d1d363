"""The halo and the compressor boundary go only to the rows that need them, and each row only the rows its queries
read.

Tiny preset, 2 gloo ranks: two rows of 512 tokens, 256 per rank: row 0 holds two documents of 256, so rank 1's first
token starts a document; row 1 holds one document of 512 across the boundary. From first principles, per layer and
direction rank 1 receives the window halo (``sliding_window - 1`` K/V rows of ``head_dim`` fp32 values) for row 1
only, and the ratio-4 compressor boundaries (main and indexer: the previous window's softmax summary, 2 fp32 values per
channel) for row 1 only; rank 0 receives nothing. A batch of row 0 alone exchanges no halo or boundary bytes at all.
The logits equal the single-rank forward's.

v41_tiny (shard multiple 2, so a document may begin a few tokens before a chunk boundary), 4 gloo ranks, windows 4
and 16, contiguous and balanced: a chunk whose document began ``d`` columns before it receives ``min(d,
sliding_window - 1)`` window keys per layer and ``min(d, engram_max_ngram_size - 1)`` Engram token ids, never rows of
an earlier document; the keys' gradients return as many bytes. Logits, loss and every gradient equal one process.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from dsv4.launch import run_on_ranks
from tests.distributed.grads import assert_rank_grads_sum_to

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


# v41_tiny at CP=4: whole rows of 128 columns (contiguous chunks of 32, balanced chunks of 16). Row 0's documents
# begin DEPTH[c] columns before each boundary c of the balanced cut (the contiguous cut's boundaries 32, 64, 96 see
# 2, 4 and 8: fewer, more and many more than Engram's 3 and the window-4 halo's 3); row 1 is one document.
V41_WIDTH = 128
DEPTH = {16: 4, 32: 2, 48: 8, 64: 4, 80: 2, 96: 8, 112: 2}
V41_CASES = [(window, balance) for window in (4, 16) for balance in ("none", "full")]


def _v41_model(window):
    from dsv4.config import DSV4Config
    from dsv4.data.tokenizers import ByteTokenizer
    from dsv4.model import build_causal_lm

    torch.manual_seed(0)
    return build_causal_lm(DSV4Config.preset("v41_tiny", sliding_window=window), tokenizer=ByteTokenizer())


def _v41_batch():
    from dsv4.batch import TokenBatch

    begins = [0] + [c - d for c, d in sorted(DEPTH.items())] + [V41_WIDTH]
    seq, pos = torch.zeros(2, V41_WIDTH, dtype=torch.long), torch.zeros(2, V41_WIDTH, dtype=torch.long)
    for k, (a, b) in enumerate(itertools.pairwise(begins)):
        seq[0, a:b], pos[0, a:b] = k + 1, torch.arange(b - a)
    seq[1], pos[1] = 1, torch.arange(V41_WIDTH)
    ids = torch.randint(1, 256, seq.shape, generator=torch.Generator().manual_seed(11))
    labels = torch.where(torch.roll(seq, -1, 1) == seq, torch.roll(ids, -1, 1), -100)
    labels[:, -1] = -100
    return TokenBatch(ids, labels, seq, pos)


def _v41_body(rank, world_size):
    from dsv4.parallel.cp import CPContext
    from dsv4.training.loss import reduce_token_loss

    group = dist.new_group(list(range(world_size)))
    out = {}
    for window, balance in V41_CASES:
        model = _v41_model(window)
        local = _v41_batch().cut(rank, world_size, model.config.shard_multiple, balance)
        cp = CPContext(group, balance=balance)
        res = model(local.input_ids, position_ids=local.positions, packed_seq_ids=local.seq_ids,
                    padding_mask=local.padding, labels=local.labels, cp=cp)
        loss = reduce_token_loss(res.loss_sum, res.label_count, group)
        loss.loss.backward()
        out[window, balance] = {"logits": res.logits.detach(), "loss": loss.value, "traffic": cp.traffic.as_dict(),
                                "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}
    return out


def _read_rows(batch, layout, rank, reach):
    """From first principles, the rows rank ``rank``'s queries read from other ranks' chunks (of ``reach`` rows
    before each chunk), and the rows its own chunks' queries on other ranks read from it: per continuing chunk
    whose predecessor lives on another rank, the columns of the continued document among the ``reach`` before it."""
    length = batch.width // layout.num_chunks
    received = returned = 0
    for v in range(1, layout.num_chunks):
        to, source = layout.owner(v)[0], layout.owner(v - 1)[0]
        if to == source:
            continue
        c = v * length
        for b in range(batch.num_rows):
            if batch.seq_ids[b, c] > 0 and batch.seq_ids[b, c] == batch.seq_ids[b, c - 1]:
                rows = min(reach, int(batch.positions[b, c]))  # the document began positions[c] columns before
                received += rows * (to == rank)
                returned += rows * (source == rank)
    return received, returned


@pytest.fixture(scope="module")
def v41_runs():
    return run_on_ranks(_v41_body, 4)


@pytest.mark.parametrize("window, balance", V41_CASES)
def test_v41_halos_carry_only_the_rows_of_the_continued_document(v41_runs, window, balance):
    from dsv4.parallel.cp.layout import CPLayout

    model = _v41_model(window)
    config = model.config
    batch = _v41_batch()
    out = model(batch.input_ids, position_ids=batch.positions, packed_seq_ids=batch.seq_ids,
                padding_mask=batch.padding, labels=batch.labels)
    loss = out.loss_sum / out.label_count
    loss.backward()
    layout = CPLayout(4, balance)
    results = [r[window, balance] for r in v41_runs]
    got = layout.assemble(torch.stack([r["logits"] for r in results]))
    torch.testing.assert_close(got, out.logits.detach(), atol=1e-5, rtol=0)
    for res in results:
        torch.testing.assert_close(res["loss"], loss.detach(), atol=1e-6, rtol=0)
    assert_rank_grads_sum_to({n: p.grad for n, p in model.named_parameters() if p.grad is not None},
                             [r["grads"] for r in results])

    key_bytes = config.num_hidden_layers * config.head_dim * 4  # one fp32 K=V row in every layer
    reach = config.engram_max_ngram_size - 1
    assert reach == 3 and config.engram_layer_ids and config.num_hidden_layers == 12
    for rank, res in enumerate(results):
        received = {kind: record["bytes_received"] for kind, record in res["traffic"].items()}
        keys_in, keys_out = _read_rows(batch, layout, rank, window - 1)
        ids_in, _ = _read_rows(batch, layout, rank, reach)
        assert received.get("halo", 0) == keys_in * key_bytes, (rank, received)
        assert received.get("halo.backward", 0) == keys_out * key_bytes, (rank, received)  # the keys' gradients
        assert received.get("engram_ids", 0) == ids_in * 4, (rank, received)  # int32 token ids, no gradient
    # the case is what it says: a chunk on another rank than its predecessor continues a document that began fewer
    # columns before it than the window and Engram reach
    length = V41_WIDTH // layout.num_chunks
    depths = [int(batch.positions[0, v * length]) for v in range(1, layout.num_chunks)
              if layout.owner(v)[0] != layout.owner(v - 1)[0]]
    assert min(depths) < reach <= window - 1
