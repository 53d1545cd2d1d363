"""Block recompute with the MTP depths recomputed, chunked routed experts and the hyper-connection / SwiGLU autograd
functions give the loss and every parameter gradient of the plain autograd path (kept here as the oracle), fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM
from dsv4.model import dispatch as dispatch_module
from dsv4.model import moe as moe_module
from dsv4.model.dispatch import weighted_sum
from dsv4.model.hyper_connections import HyperConnection
from dsv4.model.moe import clamped_swiglu


def _reference_collapse(x, pre):
    xf = x.float()
    out = pre[..., 0, None] * xf[..., 0, :]
    for i in range(1, x.shape[-2]):
        out = out + pre[..., i, None] * xf[..., i, :]
    return out.to(x.dtype)


def _reference_expand(x, y, post, comb):
    xf = x.float()
    out = post.unsqueeze(-1) * y.float().unsqueeze(-2)
    for i in range(x.shape[-2]):
        out = out + comb[..., i, :, None] * xf[..., i, None, :]
    return out.to(x.dtype)


def _reference_swiglu(gate, up, limit):
    g, u = gate.float(), up.float()
    if limit:
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
    return (F.silu(g) * u).to(gate.dtype)


def _reference_weighted_sum(rows, index, y, weights):
    out = torch.zeros(rows, y.shape[-1], dtype=torch.float32, device=y.device)
    return out.index_add_(0, index, y.float() * weights.float().unsqueeze(-1))


def _run(monkeypatch=None, **overrides):
    """Loss and gradients of one forward + backward of the tiny model (MTP depth 2, hash layer, ratios 0/4/128)."""
    if monkeypatch is not None:  # the plain autograd path
        monkeypatch.setattr(HyperConnection, "collapse", staticmethod(_reference_collapse))
        monkeypatch.setattr(HyperConnection, "expand", staticmethod(_reference_expand))
        monkeypatch.setattr(moe_module, "clamped_swiglu", _reference_swiglu)
        monkeypatch.setattr(dispatch_module, "weighted_sum", _reference_weighted_sum)
    torch.manual_seed(0)
    config = DSV4Config.preset("tiny", num_nextn_predict_layers=2, swiglu_limit=0.05, **overrides)
    assert {0, 4, 128} <= set(config.compress_ratios) and config.num_hash_layers >= 1
    model = DSV4ForCausalLM(config).train()
    ids = torch.randint(1, 256, (2, 256), generator=torch.Generator().manual_seed(1))
    out = model(ids, labels=torch.roll(ids, -1, 1), return_logits=False)
    out.loss.backward()
    if monkeypatch is not None:
        monkeypatch.undo()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_recompute_and_chunked_experts_equal_the_autograd_path(monkeypatch):
    ref_loss, ref_grads = _run(monkeypatch, activation_checkpointing="none")
    assert any(n.startswith("mtp.layers.1.") for n in ref_grads)  # two MTP depths, both trained
    for overrides in ({"activation_checkpointing": "none"}, {"activation_checkpointing": "block"},
                      {"activation_checkpointing": "block", "moe_chunk_tokens": 96},
                      {"activation_checkpointing": "none", "moe_chunk_tokens": 1000}):
        loss, grads = _run(**overrides)
        assert torch.equal(loss, ref_loss), overrides
        assert grads.keys() == ref_grads.keys(), overrides
        for name, g in grads.items():  # the same arithmetic in the same order: chunks never split an expert
            assert torch.equal(g, ref_grads[name]), (overrides, name, (g - ref_grads[name]).abs().max().item())


def _grads(fn, inputs):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    out.backward(torch.linspace(-2, 2, out.numel()).view_as(out).to(out.dtype))
    return [out.detach()] + [t.grad for t in inputs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_autograd_functions_equal_the_autograd_path(dtype):
    """collapse / expand / clamped_swiglu / the experts' weighted sum against the plain autograd code, streams in ``dtype``, mixing fp32."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 4, 16, generator=g).to(dtype)
    y = torch.randn(2, 3, 16, generator=g).to(dtype)
    pre, post, comb = torch.rand(2, 3, 4, generator=g), torch.rand(2, 3, 4, generator=g), torch.rand(2, 3, 4, 4, generator=g)
    gate, up = (torch.randn(64, 32, generator=g) * 2).to(dtype), (torch.randn(64, 32, generator=g) * 2).to(dtype)
    gate[0, :4] = up[0, :4] = 1.0  # exactly at the clamp bound (torch's clamp passes the gradient there)
    up[0, 4:8] = -1.0
    assert (gate > 1).any() and (up.abs() > 1).any()  # both clamps cut something
    index = torch.randint(0, 40, (5000,), generator=g)  # more pairs than one step of the combine's backward
    ys, w = torch.randn(5000, 16, generator=g).to(dtype), torch.rand(5000, generator=g)
    cases = [(lambda a, b: weighted_sum(40, index, a, b), lambda a, b: _reference_weighted_sum(40, index, a, b), (ys, w)),
             (HyperConnection.collapse, _reference_collapse, (x, pre)),
             (HyperConnection.expand, _reference_expand, (x, y, post, comb)),
             (lambda a, b: clamped_swiglu(a, b, 1.0), lambda a, b: _reference_swiglu(a, b, 1.0), (gate, up)),
             (lambda a, b: clamped_swiglu(a, b, None), lambda a, b: _reference_swiglu(a, b, None), (gate, up))]
    for fn, ref, inputs in cases:
        for got, want in zip(_grads(fn, inputs), _grads(ref, inputs)):
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_moe_chunk_tokens_is_validated():
    with pytest.raises(ValueError, match=r"moe_chunk_tokens: must be an integer >= 0, got -1"):
        DSV4Config.preset("tiny", moe_chunk_tokens=-1)


def test_expert_chunks_group_whole_experts_up_to_the_chunk_size():
    from dsv4.model.moe import expert_chunks

    assert expert_chunks([3, 4, 2, 0, 9, 1], 7) == [(0, 2), (2, 4), (4, 5), (5, 6)]  # 7, 2, 9 (alone: > 7), 1
    assert expert_chunks([0, 0, 0], 4) == [(0, 3)]
    assert expert_chunks([5, 5], 100) == [(0, 2)]
