"""Lightning indexer: top-k validity, k = min(topk, P), dense-score oracle, packed documents, frozen params."""

import pytest
import torch

from dsv4.config import DSV4Config
from dsv4.model.attention_metadata import build_attention_metadata
from dsv4.model.indexer import Indexer
from dsv4.model.rope import apply_rope
from dsv4.model.sparse_attention import compressed_key_allowed


def make(chunk: int = 5, **overrides):
    config = DSV4Config.preset("tiny", attention_chunk_size=chunk, **overrides)
    torch.manual_seed(0)
    indexer = Indexer(config)
    with torch.no_grad():
        indexer.compressor.ape.normal_()
    return config, indexer


def run(config, indexer, length, seq_ids=None, pos=None, batch=1):
    torch.manual_seed(1)
    x = torch.randn(batch, length, config.hidden_size)
    q_lat = torch.randn(batch, length, config.q_lora_rank)
    pos = torch.arange(length).expand(batch, -1) if pos is None else pos
    meta = build_attention_metadata(config, pos, seq_ids)
    w4 = meta.windows[4]
    keys = indexer.keys(x, w4)
    idx = indexer(x, q_lat, meta.rope_compress, meta.seq_ids, meta.position_ids, keys, w4.seq_ids, w4.positions)
    return x, q_lat, meta, keys, idx


def test_compressed_causal_rule_at_window_edges():
    # query q sees window p iff p < (q + 1) // r
    for r in (4, 128):
        q = torch.arange(3 * r)[None]
        p = torch.arange(3)[None]
        allowed = compressed_key_allowed(torch.ones_like(q), q, torch.ones_like(p), p, r)[0]
        for qi in range(3 * r):
            assert allowed[qi].tolist() == [pi < (qi + 1) // r for pi in range(3)]
        assert not allowed[r - 2].any() and allowed[r - 1].tolist() == [True, False, False]
        assert allowed[2 * r - 2].tolist() == [True, False, False] and allowed[2 * r - 1, 1]
    # other document, invalid window (id 0) and pack-padding queries (id 0) never match
    qs, qp = torch.tensor([[1, 2, 0]]), torch.tensor([[7, 7, 7]])
    ks, kp = torch.tensor([[1, 0]]), torch.tensor([[0, 0]])
    assert compressed_key_allowed(qs, qp, ks, kp, 4)[0].tolist() == [[True, False], [False, False], [False, False]]


def test_topk_validity_and_k():
    config, indexer = make()
    length = 45  # P = 11 windows, topk 8, chunk 5 does not divide 45
    *_, idx = run(config, indexer, length, batch=2)
    assert idx.shape == (2, length, 8) and idx.dtype == torch.long
    for b in range(2):
        for q in range(length):
            row = idx[b, q].tolist()
            n_valid = min(8, (q + 1) // 4)
            valid = [i for i in row if i >= 0]
            assert len(valid) == n_valid and row.count(-1) == 8 - n_valid
            assert len(set(valid)) == n_valid and all(i < (q + 1) // 4 for i in valid)
    *_, idx = run(config, indexer, 13)  # P = 3 < topk -> k = 3
    assert idx.shape == (1, 13, 3)
    *_, idx = run(config, indexer, 3)  # no complete window -> k = 0
    assert idx.shape == (1, 3, 0)


@pytest.mark.parametrize("chunk", [5, 64])
def test_selection_matches_dense_score_oracle(chunk):
    config, indexer = make(chunk)
    length = 40
    x, q_lat, meta, keys, idx = run(config, indexer, length)
    # oracle: I[s, p] = D_I^-0.5 sum_h w[s, h] relu(q_I[s, h] . K_I[p]), -inf where not allowed
    q = indexer.wq_b(q_lat).view(1, length, config.index_n_heads, config.index_head_dim)
    q = apply_rope(q, meta.rope_compress)
    w = indexer.weights_proj(x) * config.index_n_heads**-0.5
    scores = torch.einsum("blhd,bpd->blhp", q, keys).relu()
    scores = torch.einsum("blhp,blh->blp", scores, w) * config.index_head_dim**-0.5
    for s in range(length):
        visible = (s + 1) // 4
        row = scores[0, s].tolist()
        # highest scores first; equal scores (all heads ReLU'd to 0) go to the lowest window index
        expected = sorted(range(visible), key=lambda p: (-row[p], p))[: min(8, visible)]
        assert [i for i in idx[0, s].tolist() if i >= 0] == expected


def test_packed_selections_stay_in_document():
    config, indexer = make()
    lengths = [16, 24]
    seq = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)] + [torch.zeros(8, dtype=torch.long)])
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(8, dtype=torch.long)])
    _, _, meta, _, idx = run(config, indexer, 48, seq[None], pos[None])
    win_seq, win_pos = meta.windows[4].seq_ids[0], meta.windows[4].positions[0]
    for q in range(48):
        valid = [i for i in idx[0, q].tolist() if i >= 0]
        if seq[q] == 0:
            assert valid == []  # pack padding selects nothing
            continue
        assert all(win_seq[i] == seq[q] and win_pos[i] < (pos[q] + 1) // 4 for i in valid)
        n_doc = min(8, (int(pos[q]) + 1) // 4)
        assert len(valid) == n_doc


def test_params_frozen_unless_the_indexer_loss_trains_them():
    _, indexer = make()
    assert all(not p.requires_grad for p in indexer.parameters())
    _, trainable = make(indexer_loss_coeff=0.01)
    assert all(p.requires_grad for p in trainable.parameters())


def test_no_graph_when_frozen():
    config, indexer = make()
    x = torch.randn(1, 16, config.hidden_size, requires_grad=True)
    q_lat = torch.randn(1, 16, config.q_lora_rank, requires_grad=True)
    meta = build_attention_metadata(config, torch.arange(16)[None])
    w4 = meta.windows[4]
    keys = indexer.keys(x, w4)
    assert not keys.requires_grad
    idx = indexer(x, q_lat, meta.rope_compress, meta.seq_ids, meta.position_ids, keys, w4.seq_ids, w4.positions)
    assert idx.grad_fn is None


@pytest.mark.parametrize("chunk", [5, 16])
def test_causal_prefix_selects_exactly_what_the_full_scoring_selects(chunk):
    """With ``local_windows`` a chunk scores only the windows before its last query: the same selections (and
    order), packed documents and earlier (CP-style) windows included."""
    config, indexer = make(chunk=chunk)
    lengths = [16, 28]
    seq = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)] + [torch.zeros(4, dtype=torch.long)])
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(4, dtype=torch.long)])
    x, q_lat, meta, keys, full = run(config, indexer, 48, seq[None], pos[None])
    w4 = meta.windows[4]
    args = (x, q_lat, meta.rope_compress, meta.seq_ids, meta.position_ids)
    prefix = indexer(*args, keys, w4.seq_ids, w4.positions, local_windows=w4.seq_ids.shape[1])
    assert torch.equal(prefix, full)
    # three earlier windows of another document in front (what CP prepends): still the same selections
    earlier = (torch.randn(1, 3, keys.shape[-1]), torch.full((1, 3), 9), torch.arange(3)[None])
    cat = [torch.cat((e, k), 1) for e, k in zip(earlier, (keys, w4.seq_ids, w4.positions))]
    full_cp = indexer(*args, *cat)
    assert torch.equal(indexer(*args, *cat, local_windows=w4.seq_ids.shape[1]), full_cp)
    assert torch.equal(torch.where(full_cp >= 0, full_cp - 3, -1), full)


def test_selected_scores_from_the_chunk_rows_equal_every_row():
    """``with_scores`` on a packed row: bounded by ``local_windows`` each chunk gathers its selected keys from the
    rows of its documents up to the causal prefix; the selection, the scores and their gradients equal the run over
    every key (the scores also equal a dense computation picked at the selection)."""
    config, indexer = make(chunk=5, indexer_loss_coeff=0.01)
    lengths = [16, 24]
    seq = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)] + [torch.zeros(8, dtype=torch.long)])
    pos = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(8, dtype=torch.long)])
    meta = build_attention_metadata(config, pos[None], seq[None])
    w4 = meta.windows[4]
    torch.manual_seed(2)
    x, q_lat = torch.randn(1, 48, config.hidden_size), torch.randn(1, 48, config.q_lora_rank, requires_grad=True)
    results = []
    for local in (None, w4.seq_ids.shape[1]):
        indexer.zero_grad()
        keys = indexer.keys(x, w4)
        keys.retain_grad()
        idx, scores = indexer(x, q_lat, meta.rope_compress, meta.seq_ids, meta.position_ids, keys, w4.seq_ids,
                              w4.positions, local_windows=local, with_scores=True)
        weight = torch.linspace(-1, 1, scores.numel()).reshape(scores.shape)
        scores.masked_fill(torch.isinf(scores), 0).mul(weight).sum().backward()
        results.append((idx, scores.detach(), keys.grad.clone(), indexer.wq_b.weight.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    q = apply_rope(indexer.wq_b(q_lat).view(1, 48, config.index_n_heads, config.index_head_dim), meta.rope_compress)
    w = indexer.weights_proj(x) * config.index_n_heads**-0.5
    dense = torch.einsum("blhp,blh->blp", torch.einsum("blhd,bpd->blhp", q, indexer.keys(x, w4)).relu(), w)
    dense = dense * config.index_head_dim**-0.5
    idx, scores = results[1][:2]
    picked = dense.gather(-1, idx.clamp(min=0)).masked_fill(idx < 0, float("-inf"))
    torch.testing.assert_close(scores, picked.detach(), rtol=1e-5, atol=1e-5)
