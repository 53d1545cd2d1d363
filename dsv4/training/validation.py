"""Validation: the token-weighted loss of the held-out rows, evaluated after optimizer steps.

The schedule is in optimizer steps, not in Lightning's training batches (which differ under gradient accumulation,
and whose count per epoch need not be a multiple of it): :func:`validation_due` is true after every
``trainer.val_check_interval``-th optimizer step and after the last one (``trainer.max_steps``). It depends on the
step number only, so a resumed run validates at exactly the steps of an uninterrupted one.

:func:`evaluate_token_loss` runs the training forward (this CP rank's slice of every row, the strategy's
``CPContext``, :func:`~dsv4.training.step.forward_outputs`) without backward, sums (CE sum, label count) over the
rank's batches and reduces both over dp x cp once: ``val/loss`` is the mean over every supervised token of the
held-out rows, exactly what one process computes on all of them (not a mean of per-batch means). The caller puts
the model in eval mode: the MoE gates count expert loads (the bias update's input) in training mode only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

from dsv4.batch import TokenBatch
from dsv4.distributed import all_reduce_sum
from dsv4.training.step import forward_outputs
from dsv4.training.strategy import ParallelState


@dataclass(frozen=True)
class ValidationResult:
    """``val/loss`` (``loss``, the same on every rank) of the model after optimizer step ``step``, over ``tokens``
    supervised tokens (all ranks)."""

    step: int
    loss: float
    tokens: int


def validation_due(step: int, every_n_steps: int | None, max_steps: int) -> bool:
    """Whether to validate after optimizer step ``step`` (1-based): every ``every_n_steps`` steps (None: never on a
    schedule) and at ``max_steps`` (the last step; ``max_steps < 1``: unknown)."""
    if every_n_steps is not None and step % every_n_steps == 0:
        return True
    return 0 < max_steps == step


def batch_limit(num_batches: int, limit: int | float | None) -> int:
    """Micro-batches each rank evaluates out of ``num_batches``: all (None), at most ``limit`` (an int), or
    ``floor(num_batches x limit)`` but at least one (a float in (0, 1])."""
    if limit is None:
        return num_batches
    if isinstance(limit, float):
        return min(num_batches, max(1, math.floor(num_batches * limit)))
    return min(num_batches, int(limit))


@torch.no_grad()
def evaluate_token_loss(model: torch.nn.Module, batches: Iterable[TokenBatch], parallel: ParallelState,
                        shard_multiple: int, device: torch.device | str, limit: int | None = None,
                        ) -> tuple[float, int]:
    """``(token-mean loss, supervised tokens)`` of ``batches`` (this dp replica's whole rows) over dp x cp.

    Every rank of the loss group must pass the same number of batches (each forward is collective); ``limit``
    stops after that many. A rank with no label contributes 0; no label anywhere gives ``nan``.
    """
    balance = parallel.cp.balance if parallel.cp is not None else "none"
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    for index, batch in enumerate(batches):
        if limit is not None and index >= limit:
            break
        local = batch.to(device).cut(parallel.cp_rank, parallel.cp_size, shard_multiple, balance)
        out = forward_outputs(model, local, cp=parallel.cp)
        count = torch.as_tensor(out.label_count, device=device)
        sums += torch.stack([out.loss_sum.detach().to(torch.float64), count.to(torch.float64)])
    if parallel.loss_group is not None:
        sums = all_reduce_sum(sums, parallel.loss_group)
    total, tokens = float(sums[0]), int(sums[1])
    return (total / tokens if tokens else float("nan")), tokens
