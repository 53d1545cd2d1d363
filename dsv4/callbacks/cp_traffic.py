"""Context-parallel traffic: bytes exchanged per optimizer step, in total and per exchange kind.

Reads only ``pl_module.last_step_stats.cp_traffic`` (``{kind: {"calls", "bytes_sent", "bytes_received"}}``, this
rank's forward + backward exchanges of the step, see :class:`dsv4.training.stats.StepStats`); without stats it
does nothing; each optimizer step (``stats.step``) is counted once. With ``cp = 1`` the values are 0.

Metrics:

* ``cp/bytes_received_per_step``: bytes received over all kinds;
* ``cp/bytes_sent_per_step``: bytes sent over all kinds;
* ``cp/<kind>_bytes``: bytes received for one kind (``halo``, ``compressed_gather``, ``index_key_gather``, ...).

Ranks differ (rank 0 of a CP group receives no halo), so with ``reduce="max"`` (default) each value is the MAX
over all ranks (one small ``all_gather_object`` per step when ``torch.distributed`` is initialised with more than
one rank; maxima of different metrics may come from different ranks) and every rank logs the same numbers. With
``reduce="local"`` each rank logs its own and the logger records rank 0's.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback

REDUCTIONS = ("max", "local")


def traffic_metrics(cp_traffic: dict[str, dict[str, int]]) -> dict[str, float]:
    """``cp/*`` metric values of one rank's per-step traffic dictionary."""
    out = {
        "cp/bytes_received_per_step": float(sum(int(r.get("bytes_received", 0)) for r in cp_traffic.values())),
        "cp/bytes_sent_per_step": float(sum(int(r.get("bytes_sent", 0)) for r in cp_traffic.values())),
    }
    for kind, record in sorted(cp_traffic.items()):
        out[f"cp/{kind}_bytes"] = float(int(record.get("bytes_received", 0)))
    return out


def max_over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """Per-key maximum of ``metrics`` over every rank of the default group (a key missing on a rank counts 0).

    Identity when ``torch.distributed`` is not initialised or has one rank. Collective: every rank must call it.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return dict(metrics)
    gathered: list[dict[str, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, metrics)
    keys = sorted({k for m in gathered if m for k in m})
    return {k: max(float((m or {}).get(k, 0.0)) for m in gathered) for k in keys}


class CPTrafficCallback(Callback):
    """Logs ``cp/*`` byte counts from ``pl_module.last_step_stats`` (see the module docstring).

    Args:
        reduce: ``"max"`` (max over ranks, one small collective per step) or ``"local"`` (this rank's).
    """

    def __init__(self, reduce: str = "max") -> None:
        if reduce not in REDUCTIONS:
            raise ValueError(f"CPTrafficCallback: reduce must be one of {REDUCTIONS}, got {reduce!r}")
        self.reduce = reduce
        self._last_step: int | None = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        stats = getattr(pl_module, "last_step_stats", None)
        if stats is None or stats.step == self._last_step:
            return
        self._last_step = stats.step
        metrics = traffic_metrics(stats.cp_traffic or {})
        if self.reduce == "max":
            metrics = max_over_ranks(metrics)
        for name, value in metrics.items():
            pl_module.log(
                name, value, on_step=True, on_epoch=False, logger=True, prog_bar=False, sync_dist=False,
                rank_zero_only=False, batch_size=1,
            )
