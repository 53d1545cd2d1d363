"""upcast_linear: the fp32 product of a bf16 head, its input gradient, and no fp32 copy of the whole weight."""

import pytest
import torch
import torch.nn.functional as F

from dsv4.model.upcast_linear import upcast_linear
from dsv4.plan.trace import AllocationTracer


def _case():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, 64, generator=gen).to(torch.bfloat16)  # 1000 rows: chunks of 32 leave a remainder
    x = torch.randn(2, 1, 64, generator=gen).to(torch.bfloat16)
    return x, weight


def test_equals_the_fp32_linear_and_its_input_gradient():
    x, weight = _case()
    x = x.float()  # fp32 gradients to compare (a bf16 input gets its gradient in bf16: below)
    grad = torch.randn(2, 1, 1000, generator=torch.Generator().manual_seed(1))
    a = x.clone().requires_grad_(True)
    got = upcast_linear(a, weight, chunk=32)
    got.backward(grad)
    b = x.clone().requires_grad_(True)
    want = F.linear(b.float(), weight.float())
    want.backward(grad)
    assert got.dtype == torch.float32
    # fp32 sums in another order (the gradient sums the rows block by block): within 1e-5 of the largest entry
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    assert ((a.grad - b.grad).abs().max() / b.grad.abs().max()).item() < 1e-5
    half = _case()[0].requires_grad_(True)
    upcast_linear(half, weight, chunk=32).sum().backward()
    assert half.grad.dtype == torch.bfloat16


def test_holds_no_fp32_copy_of_the_whole_weight():
    """At most one block of ``chunk`` rows in fp32 at a time, in forward and in backward; nothing of the weight is
    kept for backward but the weight itself."""
    x, weight = _case()
    x.requires_grad_(True)
    whole = weight.numel() * 4
    with AllocationTracer(untracked=[weight, x]) as t:
        out = upcast_linear(x, weight, chunk=32)
        assert t.saved == 0
        forward_peak = t.peak
        out.backward(torch.ones_like(out))
        peak = t.peak
    assert forward_peak < whole / 8 and peak < whole / 8  # a full fp32 copy would be ``whole``


def test_a_trainable_weight_is_refused():
    x, weight = _case()
    with pytest.raises(ValueError, match=r"upcast_linear: the weight \[1000, 64\] requires a gradient"):
        upcast_linear(x, weight.float().requires_grad_(True))
