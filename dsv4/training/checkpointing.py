"""Distributed checkpoints of a run: every ``checkpoint.every_n_steps`` steps and always at the last step.

:class:`StepCheckpoint` is Lightning's ``ModelCheckpoint`` (``step<N>.ckpt`` every ``every_n_steps`` optimizer
steps plus ``last.ckpt``) that also saves when the run reaches ``trainer.max_steps``, whatever the interval, so no
trained step is lost. With ``best_of="val/loss"`` (``checkpoint.monitor``) it also keeps ``best.ckpt``: after a
validation whose ``val/loss`` is lower than every earlier one it saves the run there (a distributed checkpoint like
the others, written by every rank), before the step's ``step<N>.ckpt`` / ``last.ckpt``, so those hold the new best
score too. The best score, step and path are part of the callback's state in every checkpoint and come back on
resume. :func:`checkpoint_step` reads the optimizer step a checkpoint directory was saved at (its
``meta.pt``) without loading any tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint

META_FILE = "meta.pt"
BEST_NAME = "best.ckpt"


class StepCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint(dirpath, filename="step{step}", save_last=True, every_n_train_steps=every_n_steps)`` that
    also checkpoints the step that reaches ``trainer.max_steps`` (``every_n_steps`` 0: only that one) and, with
    ``best_of`` (``"val/loss"``), keeps ``best.ckpt`` (see the module docstring). It reads the validation from the
    module's ``last_validation`` (:class:`~dsv4.training.validation.ValidationResult`), fresh when its step is the
    trainer's ``global_step``. Invariant: ``best_score`` is the lowest ``val/loss`` of the run's trajectory so far,
    ``best_step`` its step, ``best_path`` the checkpoint saved then (None before the first validation)."""

    def __init__(self, dirpath: str | Path, every_n_steps: int, best_of: str | None = None) -> None:
        super().__init__(dirpath=str(dirpath), filename="step{step}", save_last=True, save_top_k=-1,
                         every_n_train_steps=max(int(every_n_steps), 0),
                         save_on_train_epoch_end=False, auto_insert_metric_name=False,
                         enable_version_counter=False)  # a resumed run overwrites last.ckpt, never last-v1.ckpt
        if best_of not in (None, "val/loss"):
            raise ValueError(f"`checkpoint.monitor`={best_of!r} must be null or val/loss")
        self.best_of = best_of
        self.best_score: float | None = None
        self.best_step: int | None = None
        self.best_path: str | None = None
        self._judged_step: int | None = None  # the step whose validation was compared (once, not per micro-batch)

    def _keep_best(self, trainer: Any, pl_module: Any) -> None:
        """Save ``best.ckpt`` when this step's validation is the lowest so far (decided on rank 0, every rank saves)."""
        result = getattr(pl_module, "last_validation", None)
        if self.best_of is None or result is None or result.step != trainer.global_step:
            return
        if result.step == self._judged_step:
            return
        self._judged_step = result.step
        better = result.loss == result.loss and (self.best_score is None or result.loss < self.best_score)
        if not trainer.strategy.broadcast(better, src=0):
            return
        self.best_score, self.best_step = float(result.loss), int(result.step)
        self.best_path = str(Path(self.dirpath) / BEST_NAME)
        trainer.save_checkpoint(self.best_path)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(),
                "best": {"monitor": self.best_of, "score": self.best_score, "step": self.best_step,
                         "path": self.best_path}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        best = state.pop("best", None) or {}
        super().load_state_dict(state)
        if self.best_of is not None and best.get("monitor") == self.best_of:
            self.best_score, self.best_step, self.best_path = best["score"], best["step"], best["path"]

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._keep_best(trainer, pl_module)
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
