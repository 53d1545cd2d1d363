"""Hyper-connections: ``hc_mult`` residual streams mixed by a Sinkhorn matrix.

The residual state of a DSV4 block is ``X`` of shape ``[B, L, hc, d]`` (``hc = hc_mult`` streams of width
``d = hidden_size``); the embeddings are copied into every stream. Every sub-layer site (attention, FFN) owns one
:class:`HyperConnection`; the model ends with one :class:`HyperHead` that collapses the streams.

Per site and per token (all in fp32):

* ``m = RMSNorm_noweight(flatten(X)) @ fn.T``, ``m`` has ``mix = (2 + hc) * hc`` entries;
* ``pre_i = sigmoid(m_i * scale_0 + base_i) + hc_eps`` (``i < hc``);
* ``post_i = 2 * sigmoid(m_{hc+i} * scale_1 + base_{hc+i})``;
* ``comb = sinkhorn(m_{2hc:}.view(hc, hc) * scale_2 + base_{2hc:})`` — approximately doubly stochastic;
* site output: ``y = f(sum_i pre_i X_i)`` and ``X'_j = post_j * y + sum_i comb[i, j] X_i``.

The caller applies its own weighted RMSNorm inside ``f`` (``f = attn(attn_norm(.))``). Everything is per token,
so hyper-connections need no context-parallel communication. ``X'`` is returned in ``X.dtype``.

Memory: the mixing coefficients (norm, projection, Sinkhorn) are recomputed in backward (activation
checkpoint), so a site saves no fp32 copy of the flattened streams and none of the ~``4 * iters`` Sinkhorn
intermediates. ``collapse`` and ``expand`` are autograd functions that save their inputs as given (``X`` in its
own dtype, one storage shared with the mixing checkpoint, the sub-layer output ``y [B, L, d]`` and the small
``pre/post/comb``) and form the fp32 products again in backward, one stream ``[B, L, d]`` at a time: a site keeps
no fp32 copy of ``X [B, L, hc, d]``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Sinkhorn normalisation of ``logits [..., n, n]`` (fp32) into an approximately doubly-stochastic matrix.

    ``A = softmax_row(Z) + eps``; ``A /= (column sums + eps)``; then ``iters - 1`` rounds of row-normalise then
    column-normalise, each dividing by ``(sum + eps)``. The last step normalises columns, so column sums are 1 up
    to ``eps``; row sums converge to 1.
    """
    a = torch.softmax(logits.float(), dim=-1) + eps
    a = a / (a.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        a = a / (a.sum(dim=-1, keepdim=True) + eps)
        a = a / (a.sum(dim=-2, keepdim=True) + eps)
    return a


def _normed_projection(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm_noweight(flatten(x)) @ fn.T`` in fp32, as ``(flat @ fn.T) * rsqrt(mean(flat^2) + eps)``: the norm
    is one scalar per token, so the normalised ``[B, L, hc*d]`` copy is never materialised."""
    flat = x.flatten(-2).float()
    inv_rms = torch.rsqrt(flat.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (flat @ fn.float().t()) * inv_rms


class HyperConnection(nn.Module):
    """One hyper-connection site (attention or FFN). Parameters ``fn [mix, hc*d]``, ``base [mix]``, ``scale [3]``.

    Args:
        hc_mult: number of residual streams ``hc``.
        hidden_size: stream width ``d``.
        sinkhorn_iters: Sinkhorn iterations (the released models use 20).
        hc_eps: the epsilon added to ``pre`` and inside Sinkhorn.
        norm_eps: epsilon of the weight-less RMSNorm over the flattened streams.
        init_std: std of the normal init of ``fn``.
    """

    def __init__(
        self,
        hc_mult: int,
        hidden_size: int,
        sinkhorn_iters: int = 20,
        hc_eps: float = 1e-6,
        norm_eps: float = 1e-6,
        init_std: float = 0.02,
    ) -> None:
        super().__init__()
        self.hc = hc_mult
        self.sinkhorn_iters = sinkhorn_iters
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        self.init_std = init_std
        mix = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.empty(mix, hc_mult * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(mix, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.fn, std=self.init_std)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)

    def mixing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x [B, L, hc, d]`` -> ``pre [B, L, hc]``, ``post [B, L, hc]``, ``comb [B, L, hc, hc]`` (fp32)."""
        if torch.is_grad_enabled():
            # Recompute in backward: keeps only x (already saved by the site) instead of fp32 copies of the
            # flattened streams and ~4 * iters Sinkhorn intermediates.
            return checkpoint(self._mixing, x, use_reentrant=False)
        return self._mixing(x)

    def _mixing(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hc = self.hc
        m = _normed_projection(x, self.fn, self.norm_eps)
        base, scale = self.base.float(), self.scale.float()
        pre = torch.sigmoid(m[..., :hc] * scale[0] + base[:hc]) + self.hc_eps
        post = 2.0 * torch.sigmoid(m[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
        z = m[..., 2 * hc :] * scale[2] + base[2 * hc :]
        comb = sinkhorn(z.unflatten(-1, (hc, hc)), self.sinkhorn_iters, self.hc_eps)
        return pre, post, comb

    @staticmethod
    def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """``sum_i pre_i X_i``: ``[B, L, hc, d]`` x ``[B, L, hc]`` -> ``[B, L, d]`` in ``x.dtype`` (fp32 math)."""
        return _Collapse.apply(x, pre)

    @staticmethod
    def expand(x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """``X'_j = post_j * y + sum_i comb[i, j] X_i``; returns ``[B, L, hc, d]`` in ``x.dtype`` (fp32 math)."""
        return _Expand.apply(x, y, post, comb)

    def forward(self, x: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Apply ``sublayer`` ([B, L, d] -> [B, L, d]) at this site: ``X -> X'`` (both ``[B, L, hc, d]``)."""
        pre, post, comb = self.mixing(x)
        y = sublayer(self.collapse(x, pre))
        return self.expand(x, y, post, comb)

    def extra_repr(self) -> str:
        return f"hc_mult={self.hc}, sinkhorn_iters={self.sinkhorn_iters}, hc_eps={self.hc_eps}"


class HyperHead(nn.Module):
    """Final stream collapse: ``pre = sigmoid(RMSNorm_noweight(flat X) @ hc_fn.T * hc_scale + hc_base) + hc_eps``,
    ``h = sum_i pre_i X_i``. ``[B, L, hc, d] -> [B, L, d]`` (``X.dtype``); the final RMSNorm is the caller's.
    """

    def __init__(
        self, hc_mult: int, hidden_size: int, hc_eps: float = 1e-6, norm_eps: float = 1e-6, init_std: float = 0.02
    ) -> None:
        super().__init__()
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        self.init_std = init_std
        self.hc_fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.empty(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.empty(1, dtype=torch.float32))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.hc_fn, std=self.init_std)
        nn.init.zeros_(self.hc_base)
        nn.init.ones_(self.hc_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = _normed_projection(x, self.hc_fn, self.norm_eps)
        pre = torch.sigmoid(m * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps
        return HyperConnection.collapse(x, pre)


class _Collapse(torch.autograd.Function):
    """``out = sum_i pre_i X_i`` in fp32, cast to ``X.dtype``. Saves ``X`` (its dtype) and ``pre``; backward:
    ``dX_i = pre_i g`` and ``dpre_i = <g, X_i>`` (fp32, per stream)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, pre)
        # An explicit sum over the (few) streams: cheaper on CPU than a batched [hc]-sized matmul.
        out = pre[..., 0, None] * x[..., 0, :].float()
        for i in range(1, x.shape[-2]):
            out = out + pre[..., i, None] * x[..., i, :].float()
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, pre = ctx.saved_tensors
        g = grad.float()
        dx = dpre = None
        if ctx.needs_input_grad[0]:
            dx = torch.empty_like(x)
            for i in range(x.shape[-2]):
                dx[..., i, :] = pre[..., i, None] * g
        if ctx.needs_input_grad[1]:
            dpre = torch.stack([(g * x[..., i, :].float()).sum(-1) for i in range(x.shape[-2])], dim=-1)
            dpre = dpre.to(pre.dtype)
        return dx, dpre


class _Expand(torch.autograd.Function):
    """``X'_j = post_j y + sum_i comb[i, j] X_i`` in fp32, cast to ``X.dtype``. Saves ``X``, ``y`` (their dtypes),
    ``post``, ``comb``; backward (fp32): ``dy = sum_j post_j g_j``, ``dpost_j = <g_j, y>``,
    ``dcomb[i, j] = <g_j, X_i>``, ``dX_i = sum_j comb[i, j] g_j``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, y, post, comb)
        out = post.unsqueeze(-1) * y.float().unsqueeze(-2)
        for i in range(x.shape[-2]):
            out = out + comb[..., i, :, None] * x[..., i, None, :].float()
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, y, post, comb = ctx.saved_tensors
        g = grad.float()
        need_x, need_y, need_post, need_comb = ctx.needs_input_grad
        dx = dy = dpost = dcomb = None
        if need_y:
            dy = (post.unsqueeze(-1) * g).sum(-2).to(y.dtype)
        if need_post:
            dpost = (g * y.float().unsqueeze(-2)).sum(-1).to(post.dtype)
        if need_x:
            dx = torch.empty_like(x)
            for i in range(x.shape[-2]):
                dx[..., i, :] = (comb[..., i, :, None] * g).sum(-2)
        if need_comb:
            dcomb = torch.stack([(g * x[..., i, None, :].float()).sum(-1) for i in range(x.shape[-2])], dim=-2)
            dcomb = dcomb.to(comb.dtype)
        return dx, dy, dpost, dcomb
