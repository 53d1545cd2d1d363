"""The ``checkpoint`` group: the distributed checkpoints a run writes and resumes from
(:mod:`dsv4.training.checkpointing`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

MONITORS = ("val/loss",)


@dataclass(frozen=True)
class CheckpointSpec:
    """``every_n_steps``: distributed checkpoint cadence (0 = only at the end); ``resume``: ``auto`` | ``none`` | a
    checkpoint directory; ``keep_last``: how many periodic ``step<N>.ckpt`` to keep (None: all);
    ``keep_every_n_steps``: periodic checkpoints of steps divisible by it are always kept (None: none);
    ``async_save``: write in the background (the step waits only for the host copy); ``monitor``: ``val/loss``
    also keeps ``best.ckpt``, the checkpoint of the lowest one (None: no best checkpoint)."""

    every_n_steps: int = 50
    resume: str = "auto"
    keep_last: int | None = 3
    keep_every_n_steps: int | None = None
    async_save: bool = True
    monitor: str | None = None


def check_cadence_and_resume(ckpt: Any) -> None:
    """``checkpoint.every_n_steps`` >= 0 and an explicit ``checkpoint.resume`` directory that exists."""
    if ckpt.every_n_steps < 0:
        raise ValueError(f"`checkpoint.every_n_steps` must be >= 0, got {ckpt.every_n_steps}")
    if ckpt.resume not in ("auto", "none") and not Path(ckpt.resume).exists():
        raise ValueError(f"`checkpoint.resume`={ckpt.resume!r}: no such checkpoint")


def checkpoint_monitor(ckpt: Any, validation_enabled: bool) -> str | None:
    """``checkpoint.monitor``: null, or one of :data:`MONITORS` (``val/loss`` needs held-out data)."""
    monitor = ckpt.get("monitor")
    if monitor is not None and monitor not in MONITORS:
        raise ValueError(f"`checkpoint.monitor`={monitor!r} must be null or one of {list(MONITORS)}")
    if monitor == "val/loss" and not validation_enabled:
        raise ValueError("`checkpoint.monitor`=val/loss needs held-out data: set data.val_fraction or data.val")
    return monitor


def checkpoint_spec(ckpt: Any, monitor: str | None = None) -> CheckpointSpec:
    """The ``checkpoint`` group as a :class:`CheckpointSpec`; a count below 1 is refused, naming its key."""
    keep_last, keep_every = ckpt.get("keep_last", 3), ckpt.get("keep_every_n_steps")
    for key, value in (("keep_last", keep_last), ("keep_every_n_steps", keep_every)):
        if value is not None and int(value) < 1:
            raise ValueError(f"`checkpoint.{key}`={value} must be at least 1 (or null: "
                             f"{'keep every periodic checkpoint' if key == 'keep_last' else 'no milestones'})")
    return CheckpointSpec(every_n_steps=int(ckpt.every_n_steps), resume=ckpt.resume,
                          keep_last=None if keep_last is None else int(keep_last),
                          keep_every_n_steps=None if keep_every is None else int(keep_every),
                          async_save=bool(ckpt.get("async_save", True)), monitor=monitor)
