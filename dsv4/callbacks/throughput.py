"""Throughput: tokens/s (global and per device), label tokens/s, TFLOP/s per device and MFU.

Reads only ``pl_module.last_step_stats`` (a :class:`dsv4.training.stats.StepStats` set by the LightningModule
before the callbacks' ``on_train_batch_end``) and the device; without stats it does nothing. Each optimizer step
(``stats.step``) is counted once, with every row of its global batch (all micro-batches under gradient
accumulation) and the wall time from its first micro-batch to its optimizer step.

Metrics (averaged over the last ``window`` steps as ratios of sums, e.g. ``sum(real_tokens) / sum(step_time_s)``;
the first ``warmup_steps`` steps seen are skipped):

* ``perf/tokens_per_s``: global real (non-padding) tokens per second; also on the progress bar.
* ``perf/tokens_per_s_per_device``: the same divided by ``world_size`` (= dp x cp; a CP group shares its tokens).
* ``perf/label_tokens_per_s``: global tokens with a label (what the loss averages over) per second.
* ``perf/step_time_s``: mean step wall time over the window.
* ``perf/tflops_per_device``: model training FLOPs per second per device, / 1e12: ``stats.model_flops``, the sum
  over the step's documents of ``dsv4.flops.document_training_flops`` at each document's own length (sparse
  attention, real tokens only), computed by the module from the batch.
* ``perf/mfu``: ``tflops_per_device * 1e12 / peak``, only when the peak is known (``peak_flops`` argument, or looked
  up from the CUDA device name by ``dsv4.flops.peak_flops_per_device``: bf16 dense, no sparsity; None on CPU).

Step time is this rank's wall time, so the values differ slightly between ranks; every rank logs (no sync), the
logger records rank 0's.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.callbacks import Callback

from dsv4.flops import peak_flops_per_device


@dataclass
class _Sample:
    real_tokens: int
    label_tokens: int
    step_time_s: float
    flops: float | None
    world_size: int


class ThroughputCallback(Callback):
    """Logs ``perf/*`` throughput metrics from ``pl_module.last_step_stats`` (see the module docstring).

    Args:
        window: number of most recent steps averaged (>= 1).
        warmup_steps: steps skipped at the start (compilation, allocator warm-up).
        peak_flops: peak FLOP/s per device for MFU; ``"auto"`` looks it up from the device, None disables MFU.
        prog_bar: show ``perf/tokens_per_s`` on the progress bar.
    """

    def __init__(
        self,
        window: int = 10,
        warmup_steps: int = 1,
        peak_flops: float | str | None = "auto",
        prog_bar: bool = True,
    ) -> None:
        if window < 1:
            raise ValueError(f"ThroughputCallback: window must be >= 1, got {window}")
        if warmup_steps < 0:
            raise ValueError(f"ThroughputCallback: warmup_steps must be >= 0, got {warmup_steps}")
        if isinstance(peak_flops, str) and peak_flops != "auto":
            raise ValueError(f"ThroughputCallback: peak_flops must be a number, None or 'auto', got {peak_flops!r}")
        self.window = window
        self.warmup_steps = warmup_steps
        self.peak_flops = peak_flops
        self.prog_bar = prog_bar
        self._samples: deque[_Sample] = deque(maxlen=window)
        self._seen = 0
        self._last_step: int | None = None

    # ------------------------------------------------------------------ helpers
    def _peak(self, pl_module: Any) -> float | None:
        if self.peak_flops == "auto":
            self.peak_flops = peak_flops_per_device(getattr(pl_module, "device", "cpu"))
        return self.peak_flops  # type: ignore[return-value]

    def metrics(self, pl_module: Any) -> dict[str, float]:
        """The current window's metric values (empty before the first step after warm-up)."""
        samples = list(self._samples)
        elapsed = sum(s.step_time_s for s in samples)
        if not samples or elapsed <= 0:
            return {}
        world = samples[-1].world_size
        tokens_per_s = sum(s.real_tokens for s in samples) / elapsed
        out = {
            "perf/tokens_per_s": tokens_per_s,
            "perf/tokens_per_s_per_device": tokens_per_s / world,
            "perf/label_tokens_per_s": sum(s.label_tokens for s in samples) / elapsed,
            "perf/step_time_s": elapsed / len(samples),
        }
        if all(s.flops is not None for s in samples):
            flops_per_device_per_s = sum(s.flops / s.world_size for s in samples) / elapsed  # type: ignore[operator]
            out["perf/tflops_per_device"] = flops_per_device_per_s / 1e12
            peak = self._peak(pl_module)
            if peak:
                out["perf/mfu"] = flops_per_device_per_s / peak
        return out

    # ------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._samples.clear()
        self._seen = 0
        self._last_step = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        stats = getattr(pl_module, "last_step_stats", None)
        if stats is None or stats.step == self._last_step:
            return
        self._last_step = stats.step
        self._seen += 1
        if self._seen <= self.warmup_steps:
            return
        self._samples.append(
            _Sample(stats.real_tokens, stats.label_tokens, float(stats.step_time_s), stats.model_flops,
                    max(int(stats.world_size), 1))
        )
        for name, value in self.metrics(pl_module).items():
            pl_module.log(
                name, value, on_step=True, on_epoch=False, logger=True, sync_dist=False, rank_zero_only=False,
                prog_bar=self.prog_bar and name == "perf/tokens_per_s", batch_size=1,
            )
