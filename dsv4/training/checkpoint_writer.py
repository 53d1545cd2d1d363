"""Atomic, optionally asynchronous writes of a run's distributed (DCP) checkpoints.

:meth:`CheckpointWriter.save` writes the tensors of every rank into ``<path>.partial`` with
``torch.distributed.checkpoint``; :meth:`CheckpointWriter.finish` then (global rank 0) writes ``meta.pt`` (the
loops, scheduler, data position, RNG: serialised at ``save`` time) and renames the directory to ``<path>``. A save
killed at any point therefore leaves ``<path>`` as it was or complete (:func:`dsv4.training.checkpointing.is_complete`),
never half-written.

Asynchronous (``async_save=True``): ``save`` returns once DCP has staged this rank's tensors in host memory (a copy:
training may change the parameters right after); a background thread writes them. At most one save is in flight:
the next ``save``, or ``finish`` (the end of training), waits for it first. DCP coordinates the background write
over ``process_group`` (a gloo group of its own, so the training's collectives never interleave with it). Rank 0's
write finishes only after DCP gathered every rank's write results and wrote ``.metadata``, so rank 0 commits without
waiting for the others.

Every rank calls ``save`` and ``finish`` in the same order (they hold barriers).
"""

from __future__ import annotations

import io
import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

META_FILE = "meta.pt"
PARTIAL_SUFFIX = ".partial"


@dataclass
class _Pending:
    future: Future | None
    partial: Path
    path: Path
    meta: bytes | None


class CheckpointWriter:
    """Args: ``rank`` (global), ``barrier`` (every rank; a name for the log), ``async_save``, ``process_group``
    for DCP's background coordination (asynchronous saves only; None: the default group)."""

    def __init__(self, rank: int, barrier: Callable[[str], None], async_save: bool = False,
                 process_group: Any = None) -> None:
        self.rank, self.barrier, self.async_save, self.process_group = rank, barrier, async_save, process_group
        self._pending: _Pending | None = None
        self.on_commit: Callable[[Path], None] | None = None  # rank 0, after each rename (e.g. retention)

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def save(self, state: dict[str, Any], meta: dict[str, Any] | None, path: str | Path) -> None:
        """Start writing ``state`` (DCP: every rank its shards) to ``path``; ``meta`` (rank 0's) goes to
        ``meta.pt``. Synchronous: committed on return. Asynchronous: committed by the next ``save`` or ``finish``."""
        import torch.distributed.checkpoint as dcp

        self.finish()
        path = Path(path)
        partial = path.with_name(path.name + PARTIAL_SUFFIX)
        if self.rank == 0:
            if partial.exists():
                shutil.rmtree(partial)  # left by a save that was killed
            partial.mkdir(parents=True)
        self.barrier("dsv4-checkpoint-start")
        blob = None
        if self.rank == 0:
            buffer = io.BytesIO()
            torch.save(meta or {}, buffer)
            blob = buffer.getvalue()
        if self.async_save:
            future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self.process_group)
            self._pending = _Pending(future, partial, path, blob)
        else:
            dcp.save(state, checkpoint_id=str(partial))
            self._pending = _Pending(None, partial, path, blob)
            self.finish()

    def finish(self) -> None:
        """Wait for the save in flight (if any) and commit it: rank 0 writes ``meta.pt`` and renames the directory."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.future is not None:
            pending.future.result()
        if self.rank == 0:
            (pending.partial / META_FILE).write_bytes(pending.meta or b"")
            replace_directory(pending.partial, pending.path)
            if self.on_commit is not None:
                self.on_commit(pending.path)
        self.barrier("dsv4-checkpoint-committed")


def replace_directory(new: Path, path: Path) -> None:
    """Put directory ``new`` at ``path`` (a link or file there is removed; an old directory is moved aside first
    and deleted after, so ``path`` is at every moment absent, the old checkpoint or the new one)."""
    old = path.with_name(path.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        path.rename(old)
    new.rename(path)
    if old.exists():
        shutil.rmtree(old)
