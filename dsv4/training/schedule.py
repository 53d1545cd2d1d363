"""Learning-rate schedules (``conf/scheduler``): factories ``optimizer -> LRScheduler`` stepped every optimizer step.

:class:`WarmupCosineLR` is a function of the step that never jumps on resume. Its checkpointed state holds the
schedule it ran with; a resumed run whose ``total_steps`` (``trainer.max_steps``), ``min_lr_ratio`` or warm-up
differ continues from the learning rate the checkpoint was at: the cosine goes on from that value's phase down
to the new ``min_lr_ratio`` at the new ``total_steps`` (a schedule that had already ended stays at its floor).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch

log = logging.getLogger("dsv4")


def warmup_cosine(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier: linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio`` at ``total_steps``."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(max(step - warmup_steps, 0) / max(total_steps - warmup_steps, 1), 1.0)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def continued_cosine(step: int, anchor_step: int, anchor_phase: float, total_steps: int, min_lr_ratio: float) -> float:
    """LR multiplier from ``anchor_step`` on: the cosine phase moves linearly from ``anchor_phase`` (radians) to pi
    at ``total_steps``, ``min_lr_ratio + (1 - min_lr_ratio) (1 + cos phase) / 2``."""
    span = max(total_steps - anchor_step, 1)
    phase = anchor_phase + (math.pi - anchor_phase) * min(max(step - anchor_step, 0) / span, 1.0)
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(phase))


def cosine_phase(multiplier: float, min_lr_ratio: float) -> float:
    """The phase in [0, pi] at which the cosine to ``min_lr_ratio`` has the value ``multiplier`` (clamped)."""
    if min_lr_ratio >= 1.0:
        return math.pi
    x = 2 * (multiplier - min_lr_ratio) / (1 - min_lr_ratio) - 1
    return math.acos(min(max(x, -1.0), 1.0))


class WarmupCosineLR(torch.optim.lr_scheduler.LRScheduler):
    """Linear warm-up, then cosine decay to ``min_lr_ratio`` x the base LR at ``total_steps`` (see the module
    docstring for resuming under a different schedule)."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int,
                 min_lr_ratio: float = 0.1, last_epoch: int = -1) -> None:
        if warmup_steps < 0 or total_steps < 1:
            raise ValueError(f"warmup_steps must be >= 0 and total_steps >= 1, got {warmup_steps} and {total_steps}")
        if not 0.0 <= min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
        self.warmup_steps, self.total_steps, self.min_lr_ratio = int(warmup_steps), int(total_steps), min_lr_ratio
        self.anchor: tuple[int, float] | None = None  # (step, cosine phase) a resumed schedule continues from
        super().__init__(optimizer, last_epoch)

    def multiplier(self, step: int) -> float:
        """The factor on the base learning rate at ``step``."""
        if self.anchor is not None and step >= self.anchor[0]:
            return continued_cosine(step, self.anchor[0], self.anchor[1], self.total_steps, self.min_lr_ratio)
        return warmup_cosine(step, self.warmup_steps, self.total_steps, self.min_lr_ratio)

    def get_lr(self) -> list[float]:
        factor = self.multiplier(self.last_epoch)
        return [base * factor for base in self.base_lrs]

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "optimizer"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the position; when the saved schedule differs from this one, continue from the saved learning
        rate at the saved step (no jump) down to this schedule's floor at its ``total_steps``."""
        configured = (self.warmup_steps, self.total_steps, self.min_lr_ratio)
        if "total_steps" not in state_dict:  # a state without its schedule: restore the position only
            self.__dict__.update({k: v for k, v in state_dict.items() if k != "lr_lambdas"})
            return
        saved = WarmupCosineLR.__new__(WarmupCosineLR)
        saved.__dict__.update(state_dict)
        saved.__dict__.setdefault("anchor", None)
        self.__dict__.update({k: v for k, v in state_dict.items() if k not in ("warmup_steps", "total_steps",
                                                                             "min_lr_ratio", "anchor")})
        self.anchor = saved.anchor
        if (saved.warmup_steps, saved.total_steps, saved.min_lr_ratio) == configured:
            return
        step = self.last_epoch
        if step < self.warmup_steps == saved.warmup_steps and saved.anchor is None:
            return  # still warming up the same way: the new schedule does not jump
        before = saved.multiplier(step)
        self.anchor = (step, cosine_phase(before, self.min_lr_ratio))
        after = self.multiplier(step)
        log.info("LR schedule changed on resume (warmup_steps, total_steps, min_lr_ratio %s -> %s): at step %d the "
                 "learning rate stays at %.4g x base (from %.4g), then follows the cosine down to %.4g x base at step "
                 "%d", (saved.warmup_steps, saved.total_steps, saved.min_lr_ratio), configured, step, after, before,
                 self.min_lr_ratio, self.total_steps)
        # the optimizer's learning rate of the next step (restored with the optimizer) is this schedule's
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            if isinstance(group["lr"], torch.Tensor):  # an optimizer that keeps it as a tensor (torchao's AdamW8bit)
                group["lr"].fill_(float(base * after))
            else:
                group["lr"] = base * after
        self._last_lr = [float(group["lr"]) for group in self.optimizer.param_groups]


def warmup_cosine_schedule(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1
) -> WarmupCosineLR:
    """:class:`WarmupCosineLR` (ValueError for negative steps or a ratio outside [0, 1])."""
    return WarmupCosineLR(optimizer, warmup_steps, total_steps, min_lr_ratio)
