"""A plain text progress line every N optimizer steps, for logs that are not a terminal (batch jobs).

Lightning's progress bar (rich or tqdm) redraws one terminal line; written to a file it shows nothing useful until
the run ends. :class:`TextProgressCallback` logs, through the ``dsv4`` logger (the console and the run's log file
under Hydra), every ``every_n_steps`` optimizer steps and at the last one, on global rank 0::

    step 20/150 | loss 3.4121 | lr 2.912e-03 | 5,210 tokens/s | ETA 0:03:12

``loss`` and ``lr`` are the step's logged ``train/loss`` and ``train/lr``; tokens/s counts the global batch's real
tokens (:class:`~dsv4.training.stats.StepStats`) over the steps since the previous line; the ETA extrapolates the
mean wall time per step since training started to ``trainer.max_steps``.
"""

from __future__ import annotations

import datetime
import logging
import sys
import time
from typing import Any, Callable

from lightning.pytorch.callbacks import Callback

log = logging.getLogger("dsv4")

WHEN = ("auto", "always", "never")


def _value(metrics: dict, name: str) -> float | None:
    value = metrics.get(name)
    return None if value is None else float(value)


class TextProgressCallback(Callback):
    """Args: ``every_n_steps`` (>= 1); ``when``: ``auto`` (only when stdout is not a terminal, where the progress bar
    shows), ``always`` or ``never``; ``clock``: the wall clock (seconds)."""

    def __init__(self, every_n_steps: int = 10, when: str = "auto",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"TextProgressCallback: every_n_steps must be an integer >= 1, got {every_n_steps!r}")
        if when not in WHEN:
            raise ValueError(f"TextProgressCallback: when={when!r} must be one of {', '.join(WHEN)}")
        self.every_n_steps, self.when, self.clock = every_n_steps, when, clock
        self._reset(0)

    def _reset(self, step: int) -> None:
        self._start_time: float | None = None
        self._start_step = step
        self._last_step: int | None = None
        self._tokens = 0
        self._seconds = 0.0

    @property
    def enabled(self) -> bool:
        return self.when == "always" or (self.when == "auto" and not sys.stdout.isatty())

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._reset(int(trainer.global_step))
        self._start_time = self.clock()

    def line(self, trainer: Any, step: int) -> str:
        """The progress line after ``step`` optimizer steps."""
        metrics = trainer.callback_metrics
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        parts = [f"step {step}/{total}" if total else f"step {step}"]
        loss, lr = _value(metrics, "train/loss"), _value(metrics, "train/lr")
        if loss is not None:
            parts.append(f"loss {loss:.4f}")
        if lr is not None:
            parts.append(f"lr {lr:.3e}")
        if self._seconds > 0:
            parts.append(f"{self._tokens / self._seconds:,.0f} tokens/s")
        done = step - self._start_step
        if total and done > 0 and self._start_time is not None:
            remaining = (self.clock() - self._start_time) / done * max(total - step, 0)
            parts.append(f"ETA {datetime.timedelta(seconds=round(remaining))}")
        return " | ".join(parts)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        stats = getattr(pl_module, "last_step_stats", None)
        if not self.enabled or stats is None or stats.step == self._last_step:
            return
        self._last_step = stats.step
        self._tokens += stats.real_tokens
        self._seconds += float(stats.step_time_s)
        last = bool(trainer.max_steps and trainer.max_steps > 0 and stats.step >= trainer.max_steps)
        if stats.step % self.every_n_steps and not last:
            return
        if trainer.is_global_zero:
            log.info("%s", self.line(trainer, stats.step))
        self._tokens, self._seconds = 0, 0.0
