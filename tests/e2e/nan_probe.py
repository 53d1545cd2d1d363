"""A test-only callback that puts a NaN into one parameter's gradient on one rank at one optimizer step
(``+callbacks.nan._target_=tests.e2e.nan_probe.NaNGradient``), before the module's non-finite check."""

from __future__ import annotations

import lightning as L


class NaNGradient(L.Callback):
    def __init__(self, step: int, parameter: str, rank: int) -> None:
        self.step, self.parameter, self.rank = step, parameter, rank

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step + 1 != self.step or trainer.global_rank != self.rank:
            return
        grad = dict(pl_module.model.named_parameters())[self.parameter].grad
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        local.view(-1)[0] = float("nan")  # this rank's shard
