"""Learning-rate schedules (``conf/scheduler``): factories ``optimizer -> LRScheduler`` stepped every optimizer step."""

from __future__ import annotations

import math

import torch


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(max(step - warmup_steps, 0) / max(total_steps - warmup_steps, 1), 1.0)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def warmup_cosine_schedule(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1
) -> torch.optim.lr_scheduler.LambdaLR:
    """:func:`warmup_cosine` as a ``LambdaLR`` (ValueError for negative steps or a ratio outside [0, 1])."""
    if warmup_steps < 0 or total_steps < 1:
        raise ValueError(f"warmup_steps must be >= 0 and total_steps >= 1, got {warmup_steps} and {total_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, warmup_steps, total_steps, min_lr_ratio)
    )
