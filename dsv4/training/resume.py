"""Resuming a run's distributed checkpoint under another layout: dp, cp, ep, micro-batch size.

Every checkpoint records the layout that wrote it (:class:`RunLayout` under ``meta.pt``'s :data:`LAYOUT_KEY`). The
tensors need nothing from it: DCP reshards the FSDP shards over any dp x cp, and the routed experts are saved at
their global place (:mod:`dsv4.parallel.expert_state`), so they load under any ep. The data position is global
(:class:`~dsv4.data.dataset.DistributedPackedSampler`: the rows of the epoch's global order all replicas consumed).
What depends on the layout is Lightning's count of this epoch's micro-batches (``epoch_loop.batch_progress``): one
micro-batch is ``micro_batch_size x dp`` rows over all replicas, and Lightning decides from that count where an
optimizer step ends (every ``accumulation`` micro-batches) and where the epoch ends. :func:`adapt_to_layout`
rewrites it, before Lightning restores its loops, to the same rows counted in this run's micro-batches.

Invariants after :func:`adapt_to_layout`: the micro-batches this epoch counts times this run's
``micro_batch_size x dp`` equal the rows the data position says were consumed (or, when the saved epoch was
exhausted, the count is this layout's whole epoch); the count is a whole number of this run's optimizer steps. With
the same ``global_batch_size`` (rows per optimizer step over all replicas) every later optimizer step reads exactly
the rows the saving layout would have read, so the first resumed step's loss is the uninterrupted run's (up to the
order of floating-point reductions), except at the end of an epoch, where which rows pad it or are dropped depends
on the layout.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("dsv4")

LAYOUT_KEY = "dsv4_layout"
DATAMODULE_KEY = "DSV4DataModule"  # where Lightning keeps the datamodule's state in meta.pt (its class name)
_BATCH_PROGRESS = "epoch_loop.batch_progress"


@dataclass(frozen=True)
class RunLayout:
    """How a run is laid out over its ranks: ``dp`` data-parallel replicas, ``cp`` context-parallel ranks per
    sequence, ``ep`` expert-parallel group size, ``micro_batch_size`` rows per replica per forward,
    ``accumulation`` micro-batches per optimizer step."""

    dp: int = 1
    cp: int = 1
    ep: int = 1
    micro_batch_size: int = 1
    accumulation: int = 1

    @property
    def rows_per_micro_batch(self) -> int:
        """Rows of one micro-batch over all replicas."""
        return self.micro_batch_size * self.dp

    @property
    def global_batch_size(self) -> int:
        """Rows per optimizer step over all replicas."""
        return self.rows_per_micro_batch * self.accumulation

    def describe(self) -> str:
        return (f"dp={self.dp} cp={self.cp} ep={self.ep} (micro_batch_size={self.micro_batch_size}, "
                f"global_batch_size={self.global_batch_size})")

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> "RunLayout":
        missing = [k for k in ("dp", "cp", "ep", "micro_batch_size", "accumulation") if k not in state]
        if missing:
            raise KeyError(f"checkpoint layout {state!r}: missing keys {missing}")
        return cls(**{k: int(state[k]) for k in ("dp", "cp", "ep", "micro_batch_size", "accumulation")})


def check_resume(path: str | Path, now: RunLayout) -> RunLayout:
    """Raise what resuming the checkpoint directory ``path`` under ``now`` would raise (:func:`adapt_to_layout` on
    a copy of its ``meta.pt``, silently), so that a refusal comes before any rank starts; returns the saved layout."""
    import torch

    from dsv4.training.checkpoint_writer import META_FILE

    meta = torch.load(Path(path) / META_FILE, map_location="cpu", weights_only=False)
    return adapt_to_layout(meta, now, source=str(path), quiet=True)


AUTOMATIC = "epoch_loop.automatic_optimization.optim_progress"  # the loop's optimizer steps (Lightning's loop)
MANUAL = "epoch_loop.manual_optimization.optim_step_progress"  # or the module's own (manual optimization)


def carry_optimizer_steps(checkpoint: dict[str, Any], manual: bool) -> None:
    """A run in pipeline stages steps its optimizer itself (Lightning's manual optimization), a run without them lets
    Lightning's loop do it (automatic): each counts its optimizer steps, the trainer's ``global_step``, in its own
    progress record of ``meta.pt``'s loops. Rewrite ``checkpoint`` (in place) so that the record this run reads
    (``manual`` or not) holds the saved count when the other one does: a checkpoint resumes across ``pp``."""
    loop = checkpoint.get("loops", {}).get("fit_loop", {})
    if AUTOMATIC not in loop or MANUAL not in loop:
        return
    automatic, by_hand = loop[AUTOMATIC]["optimizer"]["step"], loop[MANUAL]
    source, target = (automatic, by_hand) if manual else (by_hand, automatic)
    if target["total"]["completed"] >= source["total"]["completed"]:
        return
    for part in ("total", "current"):
        for key in ("ready", "completed"):
            target[part][key] = source[part][key]
    if not manual:  # the loop's zero_grad record goes with its steps
        zero = loop[AUTOMATIC]["optimizer"]["zero_grad"]
        for part in ("total", "current"):
            for key in ("ready", "started", "completed"):
                zero[part][key] = source[part]["completed"]


def adapt_to_layout(checkpoint: dict[str, Any], now: RunLayout, source: str = "the checkpoint",
                    quiet: bool = False) -> RunLayout:
    """Rewrite ``checkpoint`` (``meta.pt``'s contents, in place) for a resume under ``now``; returns the saved layout.

    Logs (unless ``quiet``) one INFO line naming both layouts when they differ, and a WARNING when the global batch
    size differs (the data goes on from the same row, but the optimizer steps group the rows differently from the
    saving run).
    ``ValueError`` naming the numbers, before anything is restored, when the rows consumed this epoch are not a
    whole number of this run's optimizer steps (only possible with another ``global_batch_size``), or when the loop's
    count and the data position disagree; ``KeyError`` when ``checkpoint`` has no layout record."""
    if LAYOUT_KEY not in checkpoint:
        raise KeyError(f"{source} has no `{LAYOUT_KEY}` entry in its meta.pt (the layout that wrote it), so it cannot "
                       "be resumed; it was not written by dsv4's strategy")
    saved = RunLayout.from_dict(checkpoint[LAYOUT_KEY])
    if saved == now:
        return saved
    if not quiet:
        log.info("resuming %s, written under %s, under %s", source, saved.describe(), now.describe())
    if saved.global_batch_size != now.global_batch_size and not quiet:
        log.warning("global_batch_size %d in %s, %d now: the data continues from the same row, but each optimizer "
                    "step now reads %d rows (the loss trajectory differs from the saving run's)",
                    saved.global_batch_size, source, now.global_batch_size, now.global_batch_size)
    progress = checkpoint["loops"]["fit_loop"][_BATCH_PROGRESS]
    batches = int(progress["current"]["processed"])
    rows = batches * saved.rows_per_micro_batch
    data = (checkpoint.get(DATAMODULE_KEY) or {}).get("sampler")
    exhausted = data is not None and int(data["global_position"]) >= int(data["dataset_len"])
    if data is not None and not exhausted and int(data["global_position"]) != rows:
        raise ValueError(f"{source}: the data position says {data['global_position']} rows of epoch "
                         f"{data['epoch']} were consumed, the loop counts {batches} micro-batches of "
                         f"{saved.rows_per_micro_batch} rows = {rows}; the checkpoint is inconsistent")
    if exhausted:  # this layout's whole epoch: Lightning starts the next one
        from dsv4.data.dataset import DistributedPackedSampler

        per_replica = DistributedPackedSampler.samples_per_replica(int(data["dataset_len"]), now.dp,
                                                                  bool(data["drop_last"]))
        resumed = per_replica // now.micro_batch_size
    else:
        if rows % now.global_batch_size:
            raise ValueError(
                f"{source} stopped after {rows} rows of its epoch, not a whole number of optimizer steps of "
                f"global_batch_size={now.global_batch_size} (micro_batch_size {now.micro_batch_size} x dp {now.dp} "
                f"x accumulation {now.accumulation}); resume with the saved global_batch_size="
                f"{saved.global_batch_size} or one dividing {rows}")
        resumed = rows // now.rows_per_micro_batch
    delta = resumed - batches
    for counts in (progress["current"], progress["total"]):  # shift every counter: their differences are the stage
        for key in ("ready", "started", "processed", "completed"):  # Lightning restarts at
            counts[key] = int(counts[key]) + delta
    return saved
