"""Distributed checkpoints of a run: every ``checkpoint.every_n_steps`` steps and always at the last step.

:class:`StepCheckpoint` is Lightning's ``ModelCheckpoint`` (``step<N>.ckpt`` every ``every_n_steps`` optimizer
steps plus ``last.ckpt``) that also saves when the run reaches ``trainer.max_steps``, whatever the interval, so no
trained step is lost. :func:`checkpoint_step` reads the optimizer step a checkpoint directory was saved at (its
``meta.pt``) without loading any tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint

META_FILE = "meta.pt"


class StepCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint(dirpath, filename="step{step}", save_last=True, every_n_train_steps=every_n_steps)`` that
    also checkpoints the step that reaches ``trainer.max_steps`` (``every_n_steps`` 0: only that one)."""

    def __init__(self, dirpath: str | Path, every_n_steps: int) -> None:
        super().__init__(dirpath=str(dirpath), filename="step{step}", save_last=True, save_top_k=-1,
                         every_n_train_steps=max(int(every_n_steps), 0),
                         save_on_train_epoch_end=False, auto_insert_metric_name=False,
                         enable_version_counter=False)  # a resumed run overwrites last.ckpt, never last-v1.ckpt

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        final = trainer.max_steps is not None and 0 < trainer.max_steps <= trainer.global_step
        if final and not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)


def checkpoint_step(path: str | Path) -> int | None:
    """The global (optimizer) step a distributed checkpoint directory was saved at; None when unreadable."""
    import torch

    meta = Path(path) / META_FILE
    if not meta.is_file():
        return None
    try:
        state = torch.load(meta, map_location="cpu", weights_only=False)
    except Exception:  # noqa: BLE001 - a partial or foreign file: no step
        return None
    step = state.get("global_step") if isinstance(state, dict) else None
    return int(step) if step is not None else None
