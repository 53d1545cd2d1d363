"""The preemption callback in one process: a signal only sets a flag; the run stops (and saves) at the next
optimizer-step boundary, never inside a gradient accumulation."""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest
import torch

from dsv4.callbacks.preemption import Preemption, signal_of


class _Checkpoint:
    def __init__(self) -> None:
        self.saved: list[int] = []

    def save_now(self, trainer) -> None:
        self.saved.append(trainer.global_step)


def _trainer(step: int = 0):
    return SimpleNamespace(global_step=step, global_rank=0, world_size=1, should_stop=False,
                           strategy=SimpleNamespace(root_device=torch.device("cpu")), checkpoint_callback=_Checkpoint())


def test_a_signal_stops_at_the_next_step_boundary_with_a_checkpoint():
    previous = signal.getsignal(signal.SIGUSR1)
    callback, trainer = Preemption(["SIGUSR1"], exit_code=99), _trainer(step=3)
    try:
        callback.on_train_start(trainer, None)
        trainer.global_step = 4
        callback.on_train_batch_end(trainer, None, None, None, 0)  # no signal yet: goes on
        assert not trainer.should_stop and callback.stopped_at is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert callback.received == signal.SIGUSR1
        callback.on_train_batch_end(trainer, None, None, None, 1)  # same step (accumulating): not a boundary
        assert not trainer.should_stop
        trainer.global_step = 5
        callback.on_train_batch_end(trainer, None, None, None, 2)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert trainer.should_stop and callback.stopped_at == 5 and trainer.checkpoint_callback.saved == [5]
    assert callback.exit_code == 99


@pytest.mark.parametrize("name", ["SIGKILL", "SIGSTOP", "SIGNOPE", "sigterm"])
def test_uncatchable_or_unknown_signals_are_refused(name):
    with pytest.raises(ValueError, match=name):
        signal_of(name)
