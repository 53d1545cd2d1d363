"""Test-only callbacks for the launch tests (``tests/e2e/test_launch.py``), added to a recipe run from the command
line (``+callbacks.<name>._target_=tests.e2e.launch_probes.<Class>``; the run needs the repository root on
``PYTHONPATH``). It holds a rank at a known point so that a signal from the test lands there."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L


class WaitForSignal(L.Callback):
    """At the end of optimizer step ``step`` on global rank ``rank`` (None: every rank), before the preemption
    check of that step: create ``<marker_dir>/rank<R>.waiting`` (the test's cue to send the signal), then wait until
    the run's :class:`~dsv4.callbacks.preemption.Preemption` handler has received a signal (at once when it already
    has). That rank therefore stops after exactly ``step``, and so does every other (the flag is all-reduced)."""

    def __init__(self, step: int, marker_dir: str, rank: int | None = None) -> None:
        self.step, self.marker_dir, self.rank = int(step), Path(marker_dir), rank
        self._done = False

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        from dsv4.callbacks.preemption import Preemption

        if self._done or trainer.global_step != self.step or self.rank not in (None, trainer.global_rank):
            return
        self._done = True
        preemption = next(cb for cb in trainer.callbacks if isinstance(cb, Preemption))
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        (self.marker_dir / f"rank{trainer.global_rank}.waiting").touch()
        while preemption.received is None:  # the handler runs in this (main) thread between two sleeps
            time.sleep(0.05)

