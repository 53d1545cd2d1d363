"""Structural memory bound: no tensor of a forward+backward of the tiny model is quadratic in S.

A ``TorchDispatchMode`` records the element count of every tensor an aten op produces (outputs of views and
factory calls included, so the bound is conservative). At S = 4096 we assert

    max numel <= C * S * (sliding_window + index_topk),   and   max numel < S * S.

C = 16: the widest per-token tensors of the tiny preset are the fp32 logits (vocab = 256 columns) and the
hyper-connection streams (hc_mult * hidden = 4 * 64 = 256), i.e. 256 / (16 + 8) = 10.7 per key slot; the
attention intermediates are only ``[chunk, heads, W + k]``. A dense ``[S, S]`` mask (16.8M) or a dense indexer
score matrix ``[S, S/4]`` (4.2M) would exceed C * S * (W + k) = 1.57M.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM

C = 16
S = 4096


class NumelRecorder(TorchDispatchMode):
    """Remembers the largest tensor produced by any aten op while active (and which op made it)."""

    def __init__(self) -> None:
        super().__init__()
        self.max_numel = 0
        self.max_op = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() > self.max_numel:
                self.max_numel = t.numel()
                self.max_op = f"{func} -> {tuple(t.shape)}"
        return out


def test_forward_backward_has_no_quadratic_tensor():
    cfg = DSV4Config.preset("tiny")
    assert {0, 4, 128} <= set(cfg.compress_ratios)
    torch.manual_seed(0)
    model = DSV4ForCausalLM(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, S))
    labels = torch.roll(ids, -1, dims=1)
    labels[:, -1] = -100

    with NumelRecorder() as rec:
        out = model(ids, labels=labels)
        out.loss.backward()

    bound = C * S * (cfg.sliding_window + cfg.index_topk)
    assert rec.max_numel <= bound, f"largest tensor {rec.max_numel} > {bound}: {rec.max_op}"
    assert rec.max_numel < S * S, rec.max_op
    assert model.lm_head.weight.grad is not None
