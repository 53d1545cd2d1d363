"""Gradient clipping across meshes, single-process case: the same numbers as torch's clip_grad_norm_."""

import torch

from dsv4.parallel.wrap import clip_grad_norm_


def test_matches_torch_clip_grad_norm():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(3, 4)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        g = torch.randn_like(p) * 3
        p.grad, q.grad = g.clone(), g.clone()
    ours = clip_grad_norm_(a, 1.0)
    ref = torch.nn.utils.clip_grad_norm_(b, 1.0)
    torch.testing.assert_close(ours, ref)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad, q.grad)
    assert abs(torch.sqrt(sum(p.grad.pow(2).sum() for p in a)).item() - 1.0) < 1e-5


def test_small_gradients_are_left_alone_and_none_grads_skipped():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([0.3, 0.4])
    q = torch.nn.Parameter(torch.zeros(2))  # no grad
    assert abs(clip_grad_norm_([p, q], 1.0).item() - 0.5) < 1e-7
    assert p.grad.tolist() == [0.30000001192092896, 0.4000000059604645]
