"""Distributed checkpoints of a run: every ``checkpoint.every_n_steps`` steps and always at the last step.

:class:`StepCheckpoint` is Lightning's ``ModelCheckpoint`` (``step<N>.ckpt`` every ``every_n_steps`` optimizer
steps, ``last.ckpt`` a symbolic link to the newest) that also saves when the run reaches ``trainer.max_steps``,
whatever the interval, so no trained step is lost. Retention: each time a checkpoint is committed, global rank 0
deletes the periodic checkpoints beyond the newest ``keep_last``, except those of steps divisible by
``keep_every_n_steps`` and the one ``last.ckpt`` names; each deletion is logged.

With ``best_of="val/loss"`` (``checkpoint.monitor``) it also keeps ``best.ckpt``: after a validation whose
``val/loss`` is lower than every earlier one it saves the run there (a distributed checkpoint like the others,
written by every rank), before the step's ``step<N>.ckpt`` / ``last.ckpt``, so those hold the new best score too.
The best score, step and path are part of the callback's state in every checkpoint and come back on resume.

A checkpoint directory is complete when it holds ``meta.pt`` and DCP's ``.metadata``. Every rank writes into
``<name>.partial`` and global rank 0 renames it into place only after all ranks finished
(:mod:`dsv4.training.checkpoint_writer`; with ``checkpoint.async_save`` in the background, committed by the next
save or the end of training), so a save interrupted at any point leaves no
``*.ckpt`` that looks complete: :func:`complete_checkpoints` lists what a resume may use.
:func:`checkpoint_step` reads the optimizer step a checkpoint directory was saved at (its ``meta.pt``) without
loading any tensor.
"""

from __future__ import annotations

import logging
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint

from dsv4.training.checkpoint_writer import META_FILE, PARTIAL_SUFFIX

log = logging.getLogger(__name__)
BEST_NAME = "best.ckpt"
_STEP_NAME = re.compile(r"^step(\d+)\.ckpt$")


def is_complete(path: str | Path) -> bool:
    """``path`` is a checkpoint directory every rank finished writing (``meta.pt`` and DCP's ``.metadata``)."""
    path = Path(path)
    return (path / META_FILE).is_file() and (path / ".metadata").is_file()


def complete_checkpoints(ckpt_dir: str | Path) -> tuple[list[Path], list[Path]]:
    """The complete ``*.ckpt`` directories of ``ckpt_dir`` and the incomplete ones (a save interrupted before its
    rename leaves ``*.ckpt.partial``, never a ``*.ckpt``; a dangling ``last.ckpt`` link counts as incomplete)."""
    complete, incomplete = [], []
    for path in sorted(Path(ckpt_dir).glob("*.ckpt*")):
        if path.name.endswith(".ckpt") and is_complete(path):
            complete.append(path)
        elif path.name.endswith((".ckpt", ".ckpt" + PARTIAL_SUFFIX)):
            incomplete.append(path)
    return complete, incomplete


def newest_complete(complete: list[Path]) -> Path | None:
    """The newest of ``complete`` checkpoint directories (by ``meta.pt``'s time; ``last.ckpt`` wins a tie), or None:
    the one ``checkpoint.resume=auto`` takes."""
    if not complete:
        return None
    return max(complete, key=lambda d: ((d / META_FILE).stat().st_mtime, d.name == "last.ckpt"))


class StepCheckpoint(ModelCheckpoint):
    """``ModelCheckpoint(dirpath, filename="step{step}", save_last="link", every_n_train_steps=every_n_steps)``
    that also checkpoints the step that reaches ``trainer.max_steps`` (``every_n_steps`` 0: only that one), keeps
    the newest ``keep_last`` periodic checkpoints (None: all) plus those of steps divisible by
    ``keep_every_n_steps`` and, with ``best_of`` (``"val/loss"``), keeps ``best.ckpt`` (see the module docstring).
    It reads the validation from the module's ``last_validation``
    (:class:`~dsv4.training.validation.ValidationResult`), fresh when its step is the trainer's ``global_step``.
    Invariant: ``best_score`` is the lowest ``val/loss`` of the run's trajectory so far, ``best_step`` its step,
    ``best_path`` the checkpoint saved then (None before the first validation)."""

    def __init__(self, dirpath: str | Path, every_n_steps: int, keep_last: int | None = 3,
                 keep_every_n_steps: int | None = None, best_of: str | None = None) -> None:
        super().__init__(dirpath=str(dirpath), filename="step{step}", save_last="link", save_top_k=-1,
                         every_n_train_steps=max(int(every_n_steps), 0),
                         save_on_train_epoch_end=False, auto_insert_metric_name=False,
                         enable_version_counter=False)  # a resumed run overwrites last.ckpt, never last-v1.ckpt
        self.keep_last, self.keep_every_n_steps = keep_last, keep_every_n_steps
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

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        """Apply the retention each time a checkpoint is committed (the strategy's writer calls back on rank 0)."""
        super().setup(trainer, pl_module, stage)
        writer = getattr(trainer.strategy, "checkpoint_writer", None)
        if writer is not None:
            writer.on_commit = lambda path: self.retain()

    def retain(self) -> list[Path]:
        """Delete the complete periodic checkpoints beyond the newest ``keep_last``, except milestones
        (``keep_every_n_steps``) and the target of ``last.ckpt``; returns what was deleted. Called on global rank 0
        right after a commit, before the next save writes anything, so the directory holds at most ``keep_last``
        complete periodic checkpoints and the one being written."""
        removed: list[Path] = []
        if self.keep_last is None:
            return removed
        root = Path(self.dirpath)
        last = root / "last.ckpt"
        pinned = last.resolve() if last.exists() else None
        steps = sorted((int(m.group(1)), p) for p in root.glob("step*.ckpt")
                       if (m := _STEP_NAME.match(p.name)) and not p.is_symlink() and is_complete(p))
        for step, path in steps[: max(len(steps) - self.keep_last, 0)]:
            if (self.keep_every_n_steps and step % self.keep_every_n_steps == 0) or path.resolve() == pinned:
                continue
            shutil.rmtree(path)
            removed.append(path)
            log.info("checkpoint retention: deleted %s (checkpoint.keep_last=%d)", path, self.keep_last)
        return removed

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """Commit an asynchronous save still in flight (its retention follows)."""
        super().on_train_end(trainer, pl_module)
        finish = getattr(trainer.strategy, "finish_checkpoint", None)
        if finish is not None:
            finish()

    def save_now(self, trainer: Any) -> None:
        """Save ``step<N>.ckpt`` and ``last.ckpt`` of the current step (every rank), unless this step is saved
        already: the last step, and a preemption stop (:class:`dsv4.callbacks.preemption.Preemption`)."""
        if not self._should_skip_saving_checkpoint(trainer):
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._keep_best(trainer, pl_module)
        with warnings.catch_warnings():  # a pipeline step (manual optimization) saves its state after the update, as
            # every dsv4 checkpoint does; Lightning's warning about a pre-optimization state does not apply
            warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        final = trainer.max_steps is not None and 0 < trainer.max_steps <= trainer.global_step
        if final:
            self.save_now(trainer)


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
