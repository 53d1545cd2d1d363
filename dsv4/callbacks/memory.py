"""Memory: peak device memory per step on CUDA, resident set size on CPU.

Reads only the module's device (``pl_module.device``, default CPU); it does not need ``last_step_stats`` and
logs after every training batch. Values are this rank's (every rank logs, the logger records rank 0's).

Metrics:

* CUDA: ``mem/max_allocated_gib`` and ``mem/max_reserved_gib`` (peaks since the previous batch end: the peak
  counters are reset after each log), ``mem/num_alloc_retries`` (cumulative cudaMalloc retries, a sign of
  fragmentation under memory pressure).
* CPU (Linux): ``mem/rss_gib`` (current resident set size, ``/proc/self/statm``) and ``mem/peak_rss_gib``
  (process lifetime peak, ``resource.getrusage(RUSAGE_SELF).ru_maxrss``).

GiB = 2**30 bytes.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

GIB = float(2**30)


def current_rss_bytes() -> int | None:
    """Resident set size of this process from ``/proc/self/statm`` (None where there is no /proc)."""
    try:
        with open("/proc/self/statm") as f:
            resident_pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int | None:
    """Lifetime peak resident set size of this process (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def memory_metrics(device: torch.device) -> dict[str, float]:
    """Current ``mem/*`` values for ``device`` (CUDA peaks are NOT reset here)."""
    if device.type == "cuda" and torch.cuda.is_available():
        stats = torch.cuda.memory_stats(device)
        return {
            "mem/max_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
            "mem/max_reserved_gib": torch.cuda.max_memory_reserved(device) / GIB,
            "mem/num_alloc_retries": float(stats.get("num_alloc_retries", 0)),
        }
    out: dict[str, float] = {}
    rss, peak = current_rss_bytes(), peak_rss_bytes()
    if rss is not None:
        out["mem/rss_gib"] = rss / GIB
    if peak is not None:
        out["mem/peak_rss_gib"] = max(peak, rss or 0) / GIB
    return out


class MemoryCallback(Callback):
    """Logs ``mem/*`` after every training batch (see the module docstring)."""

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        device = torch.device(getattr(pl_module, "device", "cpu"))
        for name, value in memory_metrics(device).items():
            pl_module.log(
                name, value, on_step=True, on_epoch=False, logger=True, prog_bar=False, sync_dist=False,
                rank_zero_only=False, batch_size=1,
            )
        if device.type == "cuda" and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats(device)
