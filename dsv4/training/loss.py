"""Token-weighted loss over data x context parallel ranks, every label counted once.

Each rank computes ``loss_sum`` (sum of per-token CE over its local labels != -100) and ``label_count``. The
global loss is ``sum_ranks(loss_sum) / sum_ranks(label_count)`` — the mean over every labelled token of the
global batch, exactly what a single process computes on the unsharded batch. Ranks with no labelled token
(e.g. a CP rank holding only pack padding) contribute 0 and never divide by zero.

Gradient contract: :func:`reduce_token_loss` returns ``loss_for_backward = loss_sum / global_count`` per rank.
Summing parameter gradients over the participating ranks (what FSDP2/DDP do with a SUM reduction) gives the
gradient of the global token mean.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.distributed import all_reduce_sum


@dataclass
class TokenLoss:
    """``loss``: this rank's share to backpropagate; ``value``: the global loss (detached, identical on every
    rank)."""

    loss: torch.Tensor
    value: torch.Tensor


def _all_reduce_sum(t: torch.Tensor, group) -> torch.Tensor:
    return t if group is False else all_reduce_sum(t, group)


def reduce_token_loss(
    loss_sum: torch.Tensor,
    label_count: torch.Tensor | int,
    group=None,
) -> TokenLoss:
    """Reduce a per-rank (CE sum, label count) pair over ``group`` (the dp x cp ranks; WORLD when None).

    Args:
        loss_sum: scalar, differentiable sum of token losses on this rank.
        label_count: scalar number of labelled tokens on this rank.
        group: process group to reduce over; ``False`` (or no ``torch.distributed``) = this rank only.
    """
    count = torch.as_tensor(label_count, device=loss_sum.device).detach().to(torch.float64)
    global_count = _all_reduce_sum(count, group)
    denom = global_count.clamp_min(1).to(loss_sum.dtype)
    loss = loss_sum / denom
    value = _all_reduce_sum(loss.detach(), group)
    return TokenLoss(loss=loss, value=value)
