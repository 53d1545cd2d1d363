"""Test-only callbacks for the launch tests (``tests/e2e/test_launch.py``), added to a recipe run from the command
line (``+callbacks.<name>._target_=tests.e2e.launch_probes.<Class>``; the run needs the repository root on
``PYTHONPATH``). They hold a rank at a known point so that a signal or a kill from the test lands there."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning as L


class WaitForSignal(L.Callback):
    """At the end of optimizer step ``step`` on global rank ``rank`` (None: every rank), before the preemption
    check of that step: create ``<marker_dir>/rank<R>.waiting`` (the test's cue to send the signal), then wait until
    the run's :class:`~dsv4.callbacks.preemption.Preemption` handler has received a signal (at once when it already
    has). That rank therefore stops after exactly ``step``, and so does every other (the flag is all-reduced).
    ``world_size``: hold only in a run of that many ranks (one job of a sweep over ``cp``). A run that finds its
    marker there already (the same command run again, e.g. a requeued job) is not held."""

    def __init__(self, step: int, marker_dir: str, rank: int | None = None, world_size: int | None = None) -> None:
        self.step, self.marker_dir, self.rank, self.world_size = int(step), Path(marker_dir), rank, world_size
        self._done = False

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        from dsv4.callbacks.preemption import Preemption

        if self._done or trainer.global_step != self.step or self.rank not in (None, trainer.global_rank):
            return
        if self.world_size not in (None, trainer.world_size):
            return
        self._done = True
        preemption = next(cb for cb in trainer.callbacks if isinstance(cb, Preemption))
        marker = self.marker_dir / f"rank{trainer.global_rank}.waiting"
        if marker.exists():  # a rerun of the same command (a requeued job): held once only
            return
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        marker.touch()
        while preemption.received is None:  # the handler runs in this (main) thread between two sleeps
            time.sleep(0.05)


class StallInsideSave(L.Callback):
    """On global rank ``rank``, the first synchronous save of checkpoint ``name`` (e.g. ``step4.ckpt``) never
    returns: ``torch.distributed.checkpoint.save`` is wrapped for the run, so the rank stops after
    ``<name>.partial`` was created (the writer's start barrier passed) and before it writes anything, until the
    process is killed. It leaves ``<name>.stalled`` beside the checkpoint first (the test's cue to kill); a save of
    ``<name>`` that finds that file goes on (the run after torchrun restarted the workers)."""

    def __init__(self, name: str, rank: int) -> None:
        self.name, self.rank = str(name), int(rank)
        self._original: Any = None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        import torch.distributed.checkpoint as dcp

        if trainer.global_rank != self.rank or self._original is not None:
            return
        original = self._original = dcp.save

        def save(state_dict: Any, *args: Any, checkpoint_id: Any = None, **kwargs: Any) -> Any:
            partial = Path(str(checkpoint_id)) if checkpoint_id is not None else None
            if partial is not None and partial.name == self.name + ".partial":
                marker = partial.with_name(self.name + ".stalled")
                if not marker.exists():
                    marker.touch()
                    while True:
                        time.sleep(1)
            return original(state_dict, *args, checkpoint_id=checkpoint_id, **kwargs)

        dcp.save = save

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self._original is not None:
            import torch.distributed.checkpoint as dcp

            dcp.save, self._original = self._original, None
