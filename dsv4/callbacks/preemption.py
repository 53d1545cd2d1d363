"""Preemption: on a configured signal every rank finishes its optimizer step, a complete checkpoint is written and
the job exits with ``preemption.exit_code`` (see docs/training.md#preemption-and-restarts).

* The handler only sets a flag (no collective, no I/O inside a signal handler). It is installed at
  ``on_train_start``, after Lightning registered its own SIGTERM handler (``_SignalConnector``), so it replaces
  Lightning's for the configured signals: Lightning's would broadcast inside the handler and stop the loop without a
  checkpoint. Lightning restores the previous handlers at teardown.
* At each optimizer-step boundary (the first ``on_train_batch_end`` after ``global_step`` moved) the flag is
  all-reduced (max) over the world: every rank decides on the same step, whichever rank(s) got the signal.
* Stopping: the step is saved through the run's :class:`~dsv4.training.checkpointing.StepCheckpoint`
  (``save_now``: atomic ``<name>.partial`` renamed by rank 0; already saved when the step was a periodic one),
  ``trainer.should_stop`` ends the fit and ``StepCheckpoint.on_train_end`` commits an asynchronous save still in
  flight. :func:`dsv4.training.run.run_finetune` then exits with ``exit_code``.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any, Iterable

import torch
from lightning.pytorch.callbacks import Callback

log = logging.getLogger("dsv4")

UNCATCHABLE = ("SIGKILL", "SIGSTOP")


def signal_of(name: str) -> signal.Signals:
    """The signal named ``name`` (``SIGTERM``, ``SIGUSR1``, ...); ValueError for an unknown or uncatchable one."""
    sig = getattr(signal.Signals, str(name), None)
    if sig is None or name in UNCATCHABLE:
        raise ValueError(f"{name!r} is not a catchable signal name (e.g. SIGTERM, SIGUSR1)")
    return sig


class Preemption(Callback):
    """Args: ``signals`` (names), ``exit_code`` (the process status after a preemption stop). After ``fit``,
    :attr:`stopped_at` is the step the run stopped and checkpointed at (None: no preemption)."""

    def __init__(self, signals: Iterable[str] = ("SIGTERM", "SIGUSR1", "SIGUSR2"), exit_code: int = 143) -> None:
        self.signals = tuple(signal_of(s) for s in signals)
        self.exit_code = int(exit_code)
        self.received: signal.Signals | None = None
        self.stopped_at: int | None = None
        self._checked_step: int | None = None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._checked_step = trainer.global_step
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                signal.signal(sig, self._handle)

    def _anyone_signalled(self, trainer: Any) -> bool:
        flag = torch.tensor([1 if self.received is not None else 0], device=trainer.strategy.root_device)
        if torch.distributed.is_available() and torch.distributed.is_initialized() and trainer.world_size > 1:
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.signals or trainer.global_step == self._checked_step:  # inside an accumulation: not a boundary
            return
        self._checked_step = trainer.global_step
        if not self._anyone_signalled(trainer):
            return
        step = trainer.global_step
        log.warning("preemption (%s on rank %d%s): stopping after step %d with a checkpoint", 
                    self.received.name if self.received else "a signal", trainer.global_rank,
                    "" if self.received else " via another rank", step)
        checkpoint = trainer.checkpoint_callback
        if checkpoint is not None and hasattr(checkpoint, "save_now"):
            checkpoint.save_now(trainer)
        self.stopped_at = step
        trainer.should_stop = True
