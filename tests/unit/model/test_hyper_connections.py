"""Hyper-connections (spec 5.1): Sinkhorn, one site, the final hyper-head — against hand-computed numbers."""

import math

import torch

from dsv4.model.hyper_connections import HyperConnection, HyperHead, sinkhorn


def test_sinkhorn_doubly_stochastic():
    torch.manual_seed(0)
    a = sinkhorn(torch.randn(64, 4, 4), iters=20, eps=1e-6)
    assert torch.all(a > 0)
    # The last step normalises columns; rows converge after 20 rounds for O(1) logits.
    torch.testing.assert_close(a.sum(-2), torch.ones(64, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(a.sum(-1), torch.ones(64, 4), atol=1e-3, rtol=0)


def test_sinkhorn_hand_case_2x2():
    # K = [[4, 1], [1, 1]]: the doubly-stochastic limit is [[a, 1-a], [1-a, a]] with a^2/(1-a)^2 = 4 -> a = 2/3.
    z = torch.tensor([[math.log(4.0), 0.0], [0.0, 0.0]])
    a = sinkhorn(z, iters=20, eps=1e-6)
    expected = torch.tensor([[2 / 3, 1 / 3], [1 / 3, 2 / 3]])
    torch.testing.assert_close(a, expected, atol=1e-5, rtol=0)
    # Zero logits: uniform 1/n.
    torch.testing.assert_close(sinkhorn(torch.zeros(3, 3), 20, 1e-6), torch.full((3, 3), 1 / 3), atol=1e-5, rtol=0)


def test_site_with_zero_fn_is_hand_computable():
    # fn = 0 -> m = 0: pre = 1/2 + eps, post = 2 * sigmoid(0) = 1, comb = uniform 1/hc.
    hc, d = 4, 3
    site = HyperConnection(hc, d, sinkhorn_iters=20, hc_eps=1e-6)
    torch.nn.init.zeros_(site.fn)
    x = torch.randn(2, 5, hc, d)
    out = site(x, lambda h: 3.0 * h)
    y = 3.0 * (0.5 + 1e-6) * x.sum(dim=2)
    expected = (y.unsqueeze(2) + x.mean(dim=2, keepdim=True)).expand_as(x)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_site_matches_explicit_formula():
    torch.manual_seed(1)
    hc, d = 3, 4
    site = HyperConnection(hc, d, sinkhorn_iters=7, hc_eps=1e-6, norm_eps=1e-6, init_std=0.5)
    with torch.no_grad():
        site.base.normal_()
        site.scale.copy_(torch.tensor([0.5, 2.0, 1.5]))
    x = torch.randn(1, 2, hc, d)
    w = torch.randn(d, d)
    out = site(x, lambda h: h @ w)
    for t in range(2):
        flat = x[0, t].reshape(-1)
        flat = flat / torch.sqrt(flat.pow(2).mean() + 1e-6)
        m = site.fn @ flat
        pre = torch.sigmoid(m[:hc] * 0.5 + site.base[:hc]) + 1e-6
        post = 2 * torch.sigmoid(m[hc : 2 * hc] * 2.0 + site.base[hc : 2 * hc])
        comb = sinkhorn((m[2 * hc :] * 1.5 + site.base[2 * hc :]).view(hc, hc), 7, 1e-6)
        y = sum(pre[i] * x[0, t, i] for i in range(hc)) @ w
        for j in range(hc):
            expected = post[j] * y + sum(comb[i, j] * x[0, t, i] for i in range(hc))
            torch.testing.assert_close(out[0, t, j], expected, atol=1e-5, rtol=1e-5)


def test_site_keeps_dtype_and_head_collapses():
    hc, d = 4, 8
    head = HyperHead(hc, d, hc_eps=1e-6)
    torch.nn.init.zeros_(head.hc_fn)
    x = torch.randn(2, 3, hc, d)
    torch.testing.assert_close(head(x), (0.5 + 1e-6) * x.sum(dim=2), atol=1e-6, rtol=1e-6)
    site = HyperConnection(hc, d)
    xb = x.to(torch.bfloat16)
    assert site(xb, lambda h: h).dtype == torch.bfloat16
    assert head(xb).dtype == torch.bfloat16
    assert site.fn.dtype == torch.float32 and site.fn.shape == ((2 + hc) * hc, hc * d)
