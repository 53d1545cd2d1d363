"""MoE (spec 5.2): clamped SwiGLU, hash routing, noaux_tc selection, bias update, padding, dispatcher."""

import math

import torch
import torch.nn.functional as F

from dsv4.config import DSV4Config
from dsv4.model.dispatch import ExpertGroup, LocalDispatcher, TokenDispatcher
from dsv4.model.moe import MoE, MoEGate, clamped_swiglu, set_dispatcher, update_load_balancing_bias


def _cfg(**kw):
    base = dict(n_routed_experts=4, num_experts_per_tok=2, hidden_size=4, num_hash_layers=1, vocab_size=16)
    base.update(kw)
    return DSV4Config.preset("tiny", **base)


def _silu(v: float) -> float:
    return v / (1 + math.exp(-v))


def test_clamped_swiglu_worked_numbers():
    gate = torch.tensor([2.0, 10.0, 12.0, -20.0, 50.0])
    up = torch.tensor([3.0, -10.0, 15.0, -12.0, -0.5])
    out = clamped_swiglu(gate, up, 10.0)
    expected = torch.tensor([
        _silu(2.0) * 3.0,  # inside the limits: 5.2848
        _silu(10.0) * -10.0,  # exactly at both limits: unchanged, -99.9955
        _silu(10.0) * 10.0,  # gate 12 -> 10, up 15 -> 10: 99.9955
        _silu(-20.0) * -10.0,  # gate has no lower clamp; up -12 -> -10
        _silu(10.0) * -0.5,  # gate 50 -> 10
    ])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-6)
    assert abs(out[2].item() - 99.99546) < 1e-4
    # No limit -> plain SwiGLU.
    torch.testing.assert_close(clamped_swiglu(gate, up, None), F.silu(gate) * up)
    # bf16 in, fp32 math, bf16 out.
    assert clamped_swiglu(gate.bfloat16(), up.bfloat16(), 10.0).dtype == torch.bfloat16


def _gate_with_logits(layer_idx, **kw):
    """A gate whose router logits equal the input (hidden = n_experts, W = I)."""
    cfg = _cfg(**kw)
    gate = MoEGate(cfg, layer_idx)
    with torch.no_grad():
        gate.weight.copy_(torch.eye(cfg.n_routed_experts))
    return gate


def _s(v):
    return math.sqrt(math.log1p(math.exp(v)))


def test_noaux_tc_bias_changes_selection_not_weights():
    gate = _gate_with_logits(1, routed_scaling_factor=1.5)
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    ids, w = gate(x)
    assert sorted(ids[0].tolist()) == [0, 1]
    s0, s1, s2 = _s(2.0), _s(1.0), _s(0.0)
    got = dict(zip(ids[0].tolist(), w[0].tolist()))
    assert abs(got[0] - 1.5 * s0 / (s0 + s1)) < 1e-6 and abs(got[1] - 1.5 * s1 / (s0 + s1)) < 1e-6
    with torch.no_grad():
        gate.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))
    ids, w = gate(x)
    assert sorted(ids[0].tolist()) == [0, 2]
    got = dict(zip(ids[0].tolist(), w[0].tolist()))
    # Weights come from the unbiased scores.
    assert abs(got[0] - 1.5 * s0 / (s0 + s2)) < 1e-6 and abs(got[2] - 1.5 * s2 / (s0 + s2)) < 1e-6
    # Without norm_topk_prob: raw scores times the scale.
    gate.norm_topk_prob = False
    ids, w = gate(x)
    got = dict(zip(ids[0].tolist(), w[0].tolist()))
    assert abs(got[2] - 1.5 * s2) < 1e-6


def test_hash_routing_uses_tid2eid():
    gate = _gate_with_logits(0)
    assert gate.is_hash and gate.e_score_correction_bias is None
    # Default table: top_k distinct experts per token id.
    assert all(len(set(row)) == 2 for row in gate.tid2eid.tolist())
    with torch.no_grad():
        gate.tid2eid[5] = torch.tensor([3, 1])
        gate.tid2eid[7] = torch.tensor([0, 2])
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0], [2.0, 1.0, 0.0, -1.0]])
    ids, w = gate(x, torch.tensor([5, 7]))
    assert ids.tolist() == [[3, 1], [0, 2]]
    s = [_s(v) for v in (2.0, 1.0, 0.0, -1.0)]
    expected = [[1.5 * s[3] / (s[3] + s[1]), 1.5 * s[1] / (s[3] + s[1])],
                [1.5 * s[0] / (s[0] + s[2]), 1.5 * s[2] / (s[0] + s[2])]]
    torch.testing.assert_close(w, torch.tensor(expected))


def test_bias_update_direction():
    gate = _gate_with_logits(1)
    gate.train()
    gate.update_bias(torch.tensor([10.0, 0.0, 5.0, 5.0]), rate=1e-3)
    # Over-loaded expert 0 goes down, idle expert 1 goes up, mean-loaded unchanged.
    torch.testing.assert_close(gate.e_score_correction_bias, torch.tensor([-1e-3, 1e-3, 0.0, 0.0]))
    # Accumulated loads through forward + the model-level helper with a reduce (e.g. an all-reduce SUM).
    gate.e_score_correction_bias.zero_()
    gate(torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 3))
    assert gate.expert_load.tolist() == [3.0, 3.0, 0.0, 0.0]
    seen = []
    update_load_balancing_bias(gate, rate=0.1, reduce=lambda t: seen.append(t.shape) or t * 2)
    assert seen == [torch.Size([1, 4])]
    torch.testing.assert_close(gate.e_score_correction_bias, torch.tensor([-0.1, -0.1, 0.1, 0.1]))
    assert gate.expert_load.sum() == 0


def _reference_moe(moe, x, input_ids):
    """Per-token loop: sum_k w_k expert_k(x) + shared(x)."""
    flat, ids = x.reshape(-1, x.shape[-1]), input_ids.reshape(-1)
    topk, w = moe.gate(flat, ids)
    out = []
    ex = moe.experts
    for n in range(flat.shape[0]):
        acc = moe.shared_experts(flat[n])
        for j in range(topk.shape[1]):
            e = topk[n, j]
            h = clamped_swiglu(flat[n] @ ex.w1[e].t(), flat[n] @ ex.w3[e].t(), moe.experts.swiglu_limit)
            acc = acc + w[n, j] * (h @ ex.w2[e].t())
        out.append(acc)
    return torch.stack(out).reshape(x.shape)


def test_moe_matches_per_token_reference_and_skips_padding():
    torch.manual_seed(0)
    cfg = _cfg(hidden_size=8, n_routed_experts=6, num_experts_per_tok=2, moe_intermediate_size=5, vocab_size=32)
    for layer_idx in (0, 1):  # hash, then noaux_tc
        moe = MoE(cfg, layer_idx).train()
        x = torch.randn(2, 7, 8)
        ids = torch.randint(0, 32, (2, 7))
        torch.testing.assert_close(moe(x, ids), _reference_moe(moe, x, ids), atol=1e-5, rtol=1e-5)

        pad = torch.zeros(2, 7, dtype=torch.bool)
        pad[0, 5:] = True
        pad[1, 0] = True
        ref = _reference_moe(moe, x, ids)
        if moe.gate.expert_load is not None:
            moe.gate.expert_load.zero_()
        out = moe(x, ids, pad)
        assert torch.all(out[pad] == 0)
        torch.testing.assert_close(out[~pad], ref[~pad], atol=1e-5, rtol=1e-5)
        if moe.gate.expert_load is not None:  # pads not counted: 11 real tokens x top-2
            assert moe.gate.expert_load.sum().item() == 11 * 2


def test_dispatcher_is_pluggable():
    class CountingDispatcher:
        def __init__(self):
            self.inner, self.calls = LocalDispatcher(), 0

        def run(self, experts, x, topk_ids, topk_weights):
            self.calls += 1
            assert isinstance(experts, ExpertGroup)
            return self.inner.run(experts, x, topk_ids, topk_weights)

    cfg = _cfg(hidden_size=8, n_routed_experts=6, moe_intermediate_size=5)
    moe = MoE(cfg, 1)
    x = torch.randn(1, 4, 8)
    ref = moe(x)
    d = CountingDispatcher()
    assert isinstance(d, TokenDispatcher)
    set_dispatcher(moe, d)
    torch.testing.assert_close(moe(x), ref)
    assert d.calls == 1
