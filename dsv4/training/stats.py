"""Per-step batch statistics the LightningModule publishes for callbacks (throughput, padding, CP traffic).

After every training step ``DSV4LightningModule.last_step_stats`` holds a :class:`StepStats` for the step just
run. Token counts are GLOBAL (summed over the data-parallel replicas, each token of a CP group counted once);
``cp_traffic`` is this rank's CP exchange bytes for the step (forward and backward).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepStats:
    """Statistics of one optimizer step.

    Attributes:
        step: global step index (after the optimizer step).
        seq_len: padded row length the model ran on (global, before CP slicing).
        rows: rows per step over all dp replicas (global batch size).
        slots: ``rows * seq_len`` token slots processed (global).
        real_tokens: slots holding real document tokens.
        label_tokens: slots with a label != -100 (what the loss is averaged over).
        pack_padding: slots belonging to no document (trailing row padding).
        alignment_padding: slots padding a document to the compression alignment multiple.
        cp: context-parallel size; dp: data-parallel size; world_size: total ranks.
        cp_traffic: ``{kind: {"calls", "bytes_sent", "bytes_received"}}`` of this rank for the step.
        step_time_s: wall time of the step on this rank (forward, backward, optimizer).
    """

    step: int
    seq_len: int
    rows: int
    slots: int
    real_tokens: int
    label_tokens: int
    pack_padding: int
    alignment_padding: int
    cp: int
    dp: int
    world_size: int
    step_time_s: float
    cp_traffic: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def padding_fraction(self) -> float:
        return (self.pack_padding + self.alignment_padding) / max(self.slots, 1)
