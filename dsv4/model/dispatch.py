"""Token dispatchers: how routed tokens reach their experts and come back (the MoE's only seam to EP).

The MoE layer (``dsv4/model/moe.py``) decides *which* experts see a token (``topk_ids [N, k]``) and *how much*
each contributes (``topk_weights [N, k]``, fp32). A :class:`TokenDispatcher` decides *where* the expert math
runs. It calls an :class:`ExpertGroup` on a token matrix sorted by local expert id:

    y_sorted = experts(x_sorted [T, d], tokens_per_expert [E_local] (int64, CPU or device))

Segment ``e`` of ``x_sorted`` (``tokens_per_expert[e]`` rows, in order) belongs to local expert ``e``, i.e.
global expert ``experts.expert_offset + e``. The dispatcher returns ``sum_j topk_weights[n, j] *
expert_{topk_ids[n, j]}(x[n])`` for every token ``n``, shape ``[N, d]`` in ``x.dtype`` (accumulated in fp32).

:class:`LocalDispatcher` is the single-rank implementation (all experts local, ``expert_offset == 0``).
Expert-parallel dispatchers (all-to-all, all-gather + reduce-scatter) implement the same ``run`` and live in
``dsv4/parallel/dispatch.py``: they exchange the (token, expert) pairs, call their rank's ``ExpertGroup`` on
the rows they received, and send the results back, without any change to ``moe.py``. Model code never imports
``torch.distributed``; a distributed dispatcher is injected with :func:`dsv4.model.moe.set_dispatcher`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class ExpertGroup(Protocol):
    """The experts held by this rank: global ids ``[expert_offset, expert_offset + num_local_experts)``."""

    num_experts: int
    num_local_experts: int
    expert_offset: int

    def __call__(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class TokenDispatcher(Protocol):
    """Runs routed experts for ``N`` tokens; see the module docstring for the exact contract. A dispatcher may
    declare ``needs_uniform_tokens = True`` when every rank must route the same number of tokens (callers pad)."""

    def run(
        self, experts: ExpertGroup, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor: ...


def expert_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``counts[e]`` = occurrences of ``e`` in ``ids`` (int64 ``[num_experts]``; ids in ``[0, num_experts)``).

    A scatter-add into a fixed-size vector: unlike ``torch.bincount``, whose output size depends on the data,
    it never waits for the device."""
    flat = ids.reshape(-1)
    return torch.zeros(num_experts, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group the ``N*k`` (token, expert) pairs by expert.

    Returns ``order [N*k]`` (indices into the flattened ``topk_ids``, stable within an expert),
    ``token_idx [N*k]`` (``order // k``, the source token of each sorted pair) and
    ``tokens_per_expert [num_experts]`` (int64).
    """
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_idx = order // topk_ids.shape[-1]
    tokens_per_expert = expert_counts(flat, num_experts)
    return order, token_idx, tokens_per_expert


def weighted_sum(rows: int, index: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``out[index[j]] += weights[j] * y[j]`` into fp32 ``[rows, d]``: expert outputs summed per token.

    The fp32 products are formed :data:`COMBINE_ROWS` pairs at a time (in pair order, so each token's sum is
    accumulated in the same order as one ``index_add_``), in forward and in backward, which forms
    ``dy[j] = weights[j] grad[index[j]]`` and ``dweights[j] = <grad[index[j]], y[j]>``: no fp32 ``[T, d]`` copy
    exists, and ``y`` is saved in its own dtype."""
    return _WeightedSum.apply(rows, index, y, weights)


COMBINE_ROWS = 4096  # pairs per step of the combine, forward and backward: its fp32 temporaries are [4096, d]


class _WeightedSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: int, index: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index, y, weights)
        out = torch.zeros(rows, y.shape[-1], dtype=torch.float32, device=y.device)
        w = weights.float().unsqueeze(-1)
        for start in range(0, y.shape[0], COMBINE_ROWS):
            stop = min(start + COMBINE_ROWS, y.shape[0])
            out.index_add_(0, index[start:stop], y[start:stop].float() * w[start:stop])
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        index, y, weights = ctx.saved_tensors
        need_y, need_w = ctx.needs_input_grad[2], ctx.needs_input_grad[3]
        dy = torch.empty_like(y) if need_y else None
        dw = torch.empty(weights.shape, dtype=torch.float32, device=weights.device) if need_w else None
        w = weights.float()
        for start in range(0, y.shape[0], COMBINE_ROWS):
            stop = min(start + COMBINE_ROWS, y.shape[0])
            g = grad.index_select(0, index[start:stop])
            if need_y:
                dy[start:stop] = g * w[start:stop].unsqueeze(-1)
            if need_w:
                dw[start:stop] = (g * y[start:stop].float()).sum(-1)
        return None, None, dy, None if dw is None else dw.to(weights.dtype)


class LocalDispatcher:
    """Every expert lives on this rank: sort pairs by expert, run each expert on its contiguous segment, and
    scatter-add the weighted results back to their tokens. No Python loop over tokens."""

    needs_uniform_tokens = False

    def run(
        self, experts: ExpertGroup, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if experts.num_local_experts != experts.num_experts:
            raise ValueError(
                f"LocalDispatcher needs all experts on this rank, got {experts.num_local_experts} of "
                f"{experts.num_experts}; use an expert-parallel dispatcher"
            )
        order, token_idx, tokens_per_expert = sort_by_expert(topk_ids, experts.num_experts)
        y = experts(x.index_select(0, token_idx), tokens_per_expert)
        w = topk_weights.reshape(-1).index_select(0, order)
        return weighted_sum(x.shape[0], token_idx, y, w).to(x.dtype)
