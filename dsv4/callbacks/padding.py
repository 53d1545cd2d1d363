"""Padding fractions: pack padding and compression alignment padding, per step and cumulative.

Reads only ``pl_module.last_step_stats`` (:class:`dsv4.training.stats.StepStats`); without stats it does nothing;
each optimizer step (``stats.step``) is counted once. The token counts are global (every rank holds the same
values), so every rank logs them without a sync.

Metrics (fractions of the step's token slots ``rows * seq_len``):

* ``data/padding_fraction``: ``(pack_padding + alignment_padding) / slots`` of this step;
* ``data/pack_padding_fraction``: ``pack_padding / slots`` (slots that belong to no document);
* ``data/alignment_padding_fraction``: ``alignment_padding / slots`` (documents padded to the compression / CP
  alignment multiple);
* ``data/padding_fraction_cumulative``, ``data/pack_padding_fraction_cumulative``,
  ``data/alignment_padding_fraction_cumulative``: the same over every step since the start of training (the
  sums are kept in the callback's state, so they survive a checkpoint resume);
* ``data/tokens_per_step``: global real tokens of the step; ``data/label_tokens_per_step``: global label tokens.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import Callback


class PaddingCallback(Callback):
    """Logs ``data/*padding_fraction*`` from ``pl_module.last_step_stats`` (see the module docstring)."""

    def __init__(self) -> None:
        self._last_step: int | None = None
        self.total_slots = 0
        self.total_pack_padding = 0
        self.total_alignment_padding = 0

    @staticmethod
    def _fractions(slots: int, pack: int, align: int, suffix: str = "") -> dict[str, float]:
        slots = max(int(slots), 1)
        return {
            f"data/padding_fraction{suffix}": (pack + align) / slots,
            f"data/pack_padding_fraction{suffix}": pack / slots,
            f"data/alignment_padding_fraction{suffix}": align / slots,
        }

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        stats = getattr(pl_module, "last_step_stats", None)
        if stats is None or stats.step == self._last_step:
            return
        self._last_step = stats.step
        self.total_slots += stats.slots
        self.total_pack_padding += stats.pack_padding
        self.total_alignment_padding += stats.alignment_padding
        metrics = self._fractions(stats.slots, stats.pack_padding, stats.alignment_padding)
        metrics.update(
            self._fractions(self.total_slots, self.total_pack_padding, self.total_alignment_padding, "_cumulative")
        )
        metrics["data/tokens_per_step"] = float(stats.real_tokens)
        metrics["data/label_tokens_per_step"] = float(stats.label_tokens)
        for name, value in metrics.items():
            pl_module.log(
                name, value, on_step=True, on_epoch=False, logger=True, prog_bar=False, sync_dist=False,
                rank_zero_only=False, batch_size=1,
            )

    def state_dict(self) -> dict[str, int]:
        return {
            "total_slots": self.total_slots,
            "total_pack_padding": self.total_pack_padding,
            "total_alignment_padding": self.total_alignment_padding,
        }

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self.total_slots = int(state_dict.get("total_slots", 0))
        self.total_pack_padding = int(state_dict.get("total_pack_padding", 0))
        self.total_alignment_padding = int(state_dict.get("total_alignment_padding", 0))
