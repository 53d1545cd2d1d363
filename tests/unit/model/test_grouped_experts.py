"""Routed experts as grouped GEMMs: equal to the per-expert loop, and no host sync per MoE layer."""

import pytest
import torch

from dsv4.config import DSV4Config
from dsv4.model.dispatch import expert_counts
from dsv4.model.model import DSV4ForCausalLM
from dsv4.model.moe import GroupedExperts, MoE, grouped_mm_supported


def _experts(dtype=torch.float32, hidden=16, inter=32, n=4):
    torch.manual_seed(0)
    return GroupedExperts(n, hidden, inter, swiglu_limit=7.0, init_std=0.2).to(dtype)


def _run(experts, x, counts, loop: bool):
    """Output and gradients of x and the three weights, through the grouped path or the loop."""
    x = x.clone().requires_grad_(True)
    for w in experts.parameters():
        w.grad = None
    y = experts._expert_loop(x, counts) if loop else experts(x, counts)
    y.backward(torch.linspace(-1, 1, y.numel()).reshape(y.shape).to(y.dtype))  # a full, non-expanded gradient
    return y.detach(), x.grad, [w.grad.clone() for w in (experts.w1, experts.w3, experts.w2)]


@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [10, 0, 0, 0], [0, 0, 0, 7], [1, 1, 1, 1]])
def test_grouped_equals_loop_fp32(counts):
    experts = _experts()
    assert grouped_mm_supported(torch.empty(1, 16), experts.w1, experts.w2)
    counts = torch.tensor(counts)
    x = torch.randn(int(counts.sum()), 16)
    y, gx, gw = _run(experts, x, counts, loop=False)
    y_ref, gx_ref, gw_ref = _run(experts, x, counts, loop=True)
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-6)
    for g, g_ref in zip(gw, gw_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)
    empty = [e for e, c in enumerate(counts.tolist()) if c == 0]
    assert all(torch.all(g[empty] == 0) for g in gw)  # an expert with no rows gets a zero gradient


def test_grouped_bf16_matches_fp32_of_the_same_inputs():
    """bf16 grouped GEMMs (CPU kernel) against the loop in fp32 on the same bf16-rounded values: bf16 keeps 8
    mantissa bits, so intermediate roundings give relative errors of a few 2^-8."""
    experts = _experts(torch.bfloat16)
    counts = torch.tensor([4, 0, 6, 6])
    x = torch.randn(16, 16).bfloat16()
    y = experts(x, counts)
    assert y.dtype == torch.bfloat16
    ref = _experts(torch.bfloat16).float()._expert_loop(x.float(), counts)
    torch.testing.assert_close(y.float(), ref, rtol=3e-2, atol=3e-2)


def test_no_rows_and_unsupported_shapes():
    experts = _experts()
    assert experts(torch.empty(0, 16), torch.zeros(4, dtype=torch.long)).shape == (0, 16)
    odd = GroupedExperts(2, 6, 10, swiglu_limit=None)  # 6 * 4 bytes is not a multiple of 16: the loop runs
    assert not grouped_mm_supported(torch.empty(1, 6), odd.w1, odd.w2)
    assert not grouped_mm_supported(torch.empty(1, 16, dtype=torch.bfloat16), experts.w1, experts.w2)  # dtypes
    x, counts = torch.randn(5, 6), torch.tensor([2, 3])
    ref = torch.cat([odd._expert_loop(x[:2], torch.tensor([2, 0])), odd._expert_loop(x[2:], torch.tensor([0, 3]))])
    torch.testing.assert_close(odd(x, counts), ref)


def test_expert_counts():
    ids = torch.tensor([[0, 3], [3, 1], [3, 0]])
    assert expert_counts(ids, 5).tolist() == [2, 1, 0, 3, 0]


class _SyncCounter:
    """Counts the calls that copy device data to the host (``tolist``, ``item``, ``cpu``, ``nonzero``, bool())."""

    NAMES = ("tolist", "item", "cpu", "nonzero", "__bool__")

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)

            def counted(self_, *args, _name=name, _original=original, **kwargs):
                self.calls.append(_name)
                return _original(self_, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)
        original_nonzero = torch.nonzero

        def counted_nonzero(*args, **kwargs):
            self.calls.append("torch.nonzero")
            return original_nonzero(*args, **kwargs)

        monkeypatch.setattr(torch, "nonzero", counted_nonzero)


def test_moe_layer_makes_no_host_sync(monkeypatch):
    cfg = DSV4Config.preset("tiny")
    moe = MoE(cfg, 1).train()  # score-routed (layer 0 is a hash layer)
    x = torch.randn(2, 24, cfg.hidden_size, requires_grad=True)
    pad = torch.zeros(2, 24, dtype=torch.bool)
    pad[1, 20:] = True
    real = (~pad.reshape(-1)).nonzero().squeeze(-1)
    assert grouped_mm_supported(x, moe.experts.w1, moe.experts.w2)
    counter = _SyncCounter(monkeypatch)
    y = moe(x, real_tokens=real)
    y.backward(torch.ones_like(y))
    assert counter.calls == []
    assert moe.gate.expert_load.sum().item() == 44 * cfg.num_experts_per_tok  # real tokens only


def _model_syncs(monkeypatch, layers: int) -> list[str]:
    torch.manual_seed(0)
    cfg = DSV4Config.preset("tiny", num_hidden_layers=layers, compress_ratios=[0, 4, 128, 4][:layers],
                            num_hash_layers=1)
    model = DSV4ForCausalLM(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (1, 256))
    pad = torch.zeros(1, 256, dtype=torch.bool)
    pad[0, 250:] = True
    with monkeypatch.context() as patch:
        counter = _SyncCounter(patch)
        out = model(input_ids=ids, labels=ids, padding_mask=pad, return_logits=False)
        out.loss.backward()
    return counter.calls


def test_model_host_syncs_do_not_grow_with_moe_layers(monkeypatch):
    """Forward + backward of 2 and 4 layers (each with a MoE) make the same host syncs: none per layer."""
    assert _model_syncs(monkeypatch, 2) == _model_syncs(monkeypatch, 4)
