"""dsv4.flops: hand-worked one-layer cases, the sparse scaling laws, Flash magnitudes and the peak table."""

from __future__ import annotations

import pytest
import torch

from dsv4.config import DSV4Config
from dsv4.flops import (
    BREAKDOWN_KEYS,
    attention_core_flops_per_token,
    attention_flops_per_token,
    compressed_keys_sum,
    dense_equivalent_attention_flops_per_token,
    forward_flops_breakdown,
    forward_flops_per_token,
    indexer_score_flops_per_token,
    peak_flops_for_device_name,
    peak_flops_per_device,
    document_training_flops,
    training_flops_per_token,
    window_keys_sum,
)


def _one_layer(**overrides) -> DSV4Config:
    """d=8, H=2, D=4, q=o=4, G=1, E=4 (k=2, 1 shared, I=6), V=10, hc=2, W=4, CSA with H_I=2, D_I=4, K=2."""
    values = dict(
        vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, head_dim=4, qk_rope_head_dim=2,
        q_lora_rank=4, o_lora_rank=4, o_groups=1, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        moe_intermediate_size=6, max_position_embeddings=64, rope_scaling=None, compress_ratios=[4],
        sliding_window=4, num_hash_layers=0, hc_mult=2, index_head_dim=4, index_n_heads=2, index_topk=2,
        num_nextn_predict_layers=0,
    )
    values.update(overrides)
    return DSV4Config(**values)


def test_key_count_sums_match_brute_force():
    for s in range(0, 300, 7):
        for w in (1, 4, 128):
            assert window_keys_sum(s, w) == sum(min(n, w) for n in range(1, s + 1))
        for r in (3, 4, 128):
            assert compressed_keys_sum(s, r) == sum(n // r for n in range(1, s + 1))
            for cap in (1, 2, 5):
                assert compressed_keys_sum(s, r, cap) == sum(min(cap, n // r) for n in range(1, s + 1))


def test_one_csa_layer_by_hand_seq8():
    cfg = _one_layer()
    s = 8
    # window keys per query (n = 1..8): 1,2,3,4,4,4,4,4 -> 26; visible compressed floor(n/4): 0,0,0,1,1,1,1,2 -> 6
    # (all <= K = 2, so the selection equals the visible set)
    expected = {
        # wq_a 2*8*4 + wq_b 2*4*(2*4) + wkv 2*8*4 + wo_a 2*(2*4)*4 + wo_b 2*(1*4)*8
        "attention_projections": 64 + 64 + 64 + 64 + 64,
        # overlap compressor: wkv + wgate, each 2 * 8 * (2*4)
        "compressor": 2 * (2 * 8 * 8),
        # index compressor 2 * (2*8*(2*4)) + wq_b^I 2*4*(2*4) + weights_proj 2*8*2
        "indexer_projections": 256 + 64 + 32,
        # 2 * H_I * (D_I + 1) = 20 per (query, visible key), 6 pairs over 8 queries
        "indexer_scores": 20 * 6 / 8,
        # 4 * H * D = 32 per (query, key); (26 window + 6 compressed) pairs over 8 queries
        "attention_core": 32 * (26 + 6) / 8,
        "router": 2 * 8 * 4,
        "moe_routed": 2 * 3 * 2 * 8 * 6,  # k * (w1, w3, w2) * 2 d I
        "moe_shared": 1 * 3 * 2 * 8 * 6,
        # per site: fn 2*hc*d*mix (mix = (2+2)*2 = 8) = 256, collapse 2*hc*d = 32, expand 2*hc*d + 2*hc^2*d = 96;
        # two sites, plus the hyper-head 2*hc*d*hc + 2*hc*d = 96
        "hyper_connections": 2 * (256 + 32 + 96) + 96,
        "mtp_projections": 0,
        "lm_head": 2 * 8 * 10,
    }
    got = forward_flops_breakdown(cfg, s)
    assert set(got) == set(BREAKDOWN_KEYS)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    assert forward_flops_per_token(cfg, s) == pytest.approx(3023)
    # indexer (352 + 15 = 367) forward only, the rest x3
    assert training_flops_per_token(cfg, s) == pytest.approx(3 * (3023 - 367) + 367)
    assert document_training_flops(cfg, s) == pytest.approx(s * 8335)  # a document of s tokens: s x the mean
    assert document_training_flops(cfg, 0) == 0.0
    cfg_trained = _one_layer(indexer_loss_coeff=0.01)
    assert training_flops_per_token(cfg_trained, s) == pytest.approx(3 * 3023)


def test_one_csa_layer_topk_cap_by_hand_seq16():
    cfg = _one_layer()
    # window: 1+2+3 + 13*4 = 58; visible floor(n/4): 4*1 + 4*2 + 4*3 + 4 = 28; selected min(2, .): 4*1 + 9*2 = 22
    assert attention_core_flops_per_token(cfg, 16, 4) == pytest.approx(32 * (58 + 22) / 16)
    assert indexer_score_flops_per_token(cfg, 16, 4) == pytest.approx(20 * 28 / 16)
    assert attention_flops_per_token(cfg, 16, 4) == pytest.approx(32 * 80 / 16 + 20 * 28 / 16)
    # HCA-style ratio 8 sees every visible compressed key: floor(n/8) -> 8*1 + 1*2 = 10, no indexer
    assert attention_flops_per_token(cfg, 16, 8) == pytest.approx(32 * (58 + 10) / 16)
    assert attention_flops_per_token(cfg, 16, 0) == pytest.approx(32 * 58 / 16)


def test_mtp_depth_by_hand():
    base, with_mtp = _one_layer(), _one_layer(num_nextn_predict_layers=1)  # the MTP layer reads ratio 0 (SWA)
    delta = forward_flops_per_token(with_mtp, 8) - forward_flops_per_token(base, 8)
    block = 320 + 32 * 26 / 8 + 64 + 576 + 288 + 2 * (256 + 32 + 96)  # projections, window core, MoE, 2 HC sites
    extra = 2 * 8 * 8 + 2 * 2 * 8 * 8 + 96 + 2 * 8 * 10  # e_proj, h_proj on 2 streams, hyper-head, lm_head
    assert delta == pytest.approx(block + extra) == pytest.approx(2760)


def _per_sequence(fn, cfg, s, *args):
    return s * fn(cfg, s, *args)


def test_sparse_attention_scaling_flash():
    cfg = DSV4Config.preset("flash")
    pair = 4 * cfg.num_attention_heads * cfg.head_dim  # 131072
    s = 8192
    # SWA: the sequence total is affine in S once S >= W (each extra token adds exactly W keys)
    t1, t2, t4 = (_per_sequence(attention_flops_per_token, cfg, n * s, 0) for n in (1, 2, 4))
    assert t4 - t2 == pytest.approx(2 * (t2 - t1))
    assert t2 - t1 == pytest.approx(pair * cfg.sliding_window * s)
    # per token: W keys minus the warm-up of the first W - 1 queries
    w = cfg.sliding_window
    assert attention_flops_per_token(cfg, s, 0) == pytest.approx(pair * (w - w * (w - 1) / (2 * s)))
    # HCA (r = 128): the compressed part per token is pair * (S / (2 r) - 1/2 + 1/r) (S a multiple of r), so it
    # grows by pair * S / (2 r) when S doubles
    r = 128

    def hca(n):
        return attention_flops_per_token(cfg, n, r) - attention_flops_per_token(cfg, n, 0)

    assert hca(s) == pytest.approx(pair * (s / (2 * r) - 0.5 + 1 / r))
    assert hca(2 * s) - hca(s) == pytest.approx(pair * s / (2 * r))
    # CSA (r = 4): the indexer scoring grows by 2 H_I (D_I + 1) S / 8 per token; the selected part saturates at K
    score_pair = 2 * cfg.index_n_heads * (cfg.index_head_dim + 1)
    assert indexer_score_flops_per_token(cfg, 2 * s, 4) - indexer_score_flops_per_token(cfg, s, 4) == pytest.approx(
        score_pair * s / 8
    )
    big = 1 << 20
    core = attention_core_flops_per_token(cfg, big, 4)
    assert pair * (w + cfg.index_topk) * 0.999 < core <= pair * (w + cfg.index_topk)
    assert attention_core_flops_per_token(cfg, 2 * big, 4) / core < 1.001
    # dense-equivalent: per token grows by pair * S / 2 when S doubles (sequence total ~ quadratic)
    d1, d2 = (dense_equivalent_attention_flops_per_token(cfg, n * s) for n in (1, 2))
    assert d2 - d1 == pytest.approx(pair * s / 2)
    td1, td2 = (_per_sequence(dense_equivalent_attention_flops_per_token, cfg, n * s) for n in (1, 2))
    assert td2 / td1 == pytest.approx(4, rel=1e-3)
    # below the window, SWA equals dense causal attention exactly
    assert attention_flops_per_token(cfg, 100, 0) == pytest.approx(dense_equivalent_attention_flops_per_token(cfg, 100))
    # and at long context the sparse layers are far cheaper than dense ones
    assert attention_flops_per_token(cfg, 65536, 4) < 0.06 * dense_equivalent_attention_flops_per_token(cfg, 65536)


def test_flash_forward_flops_about_twice_active_params():
    """Oracle: the parameters of a meta-device Flash model, routed experts counted k/E, embedding excluded."""
    from dsv4.model import DSV4ForCausalLM

    cfg = DSV4Config.preset("flash")
    with torch.device("meta"):
        model = DSV4ForCausalLM(cfg)
    total = routed = embed = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if ".experts." in name:
            routed += p.numel()
        elif "embed_tokens" in name:
            embed += p.numel()
    inactive_share = 1 - cfg.num_experts_per_tok / cfg.n_routed_experts
    active = total - embed - routed * inactive_share
    mtp_total = sum(p.numel() for p in model.mtp.parameters())
    mtp_routed = sum(p.numel() for n, p in model.mtp.named_parameters() if ".experts." in n)
    backbone_active = active - (mtp_total - mtp_routed * inactive_share)
    assert 12.5e9 < backbone_active < 14e9  # "13B activated"; the MTP depth adds ~0.4B

    s = 4096
    parts = forward_flops_breakdown(cfg, s)
    attention = parts["attention_core"] + parts["indexer_scores"]
    dense = sum(parts.values()) - attention
    # the MTP depth reuses the lm_head: one extra 2 d V without extra parameters
    reused_head = cfg.num_nextn_predict_layers * 2 * cfg.hidden_size * cfg.vocab_size
    assert dense - reused_head == pytest.approx(2 * active, rel=0.01)
    fwd = forward_flops_per_token(cfg, s)
    assert 2 * 13e9 < fwd < 2 * 15e9 + attention
    assert 0.02 < attention / fwd < 0.15


def test_peak_flops_table():
    assert peak_flops_for_device_name("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_for_device_name("NVIDIA H100 PCIe") == 756e12
    assert peak_flops_for_device_name("NVIDIA H200") == 989e12
    assert peak_flops_for_device_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_for_device_name("NVIDIA B200") == 2250e12
    assert peak_flops_for_device_name("NVIDIA L40S") == 362e12
    assert peak_flops_for_device_name("NVIDIA L4") == 121e12
    assert peak_flops_for_device_name("NVIDIA GeForce RTX 4090") is None
    assert peak_flops_per_device("cpu") is None
    assert peak_flops_per_device(torch.device("cpu")) is None


def test_cp_rank_flops_by_position_brute_force_and_balance():
    """Per-rank FLOPs of one document: the position-dependent part of each rank equals a per-query count over
    its chunks (window keys min(n, W), CSA selection min(K, n // 4) plus the indexer's n // 4 scored keys), the
    ranks sum to the whole document in both layouts, and head-tail chunks give every rank the same work."""
    from dsv4.flops import POSITION_DEPENDENT_KEYS, cp_rank_training_flops

    cfg = _one_layer()
    s, cp = 64, 4
    pair, index_pair = 4 * 2 * 4, 2 * 2 * (4 + 1)  # 4 H D per (query, key); 2 H_I (D_I + 1) per scored key
    chunks = {"none": [[0], [1], [2], [3]], "full": [[0, 7], [1, 6], [2, 5], [3, 4]]}
    for balance, held in chunks.items():
        length = s // (len(held) * len(held[0]))
        expected = []
        for rank_chunks in held:
            total = 0
            for v in rank_chunks:
                for n in range(v * length + 1, (v + 1) * length + 1):
                    # attention trains (3x forward); the frozen indexer's scoring runs forward only (1x)
                    total += 3 * pair * (min(n, 4) + min(2, n // 4)) + index_pair * (n // 4)
            expected.append(total)
        got = cp_rank_training_flops(cfg, s, cp, balance, POSITION_DEPENDENT_KEYS)
        assert got == pytest.approx(expected, rel=1e-12), balance
        whole = cp_rank_training_flops(cfg, s, cp, balance)
        assert sum(whole) == pytest.approx(document_training_flops(cfg, s), rel=1e-12)
    flash = DSV4Config.preset("flash")
    contiguous = cp_rank_training_flops(flash, 131072, 8, "none", POSITION_DEPENDENT_KEYS)
    balanced = cp_rank_training_flops(flash, 131072, 8, "full", POSITION_DEPENDENT_KEYS)
    assert contiguous == sorted(contiguous) and max(contiguous) / (sum(contiguous) / 8) > 1.5
    assert max(balanced) / (sum(balanced) / 8) < 1.01
    with pytest.raises(ValueError, match="does not split into 16 chunks"):
        cp_rank_training_flops(flash, 1000, 8, "full")
