"""Per-step batch statistics the LightningModule publishes for callbacks (throughput, padding, CP traffic).

:func:`batch_statistics` reads one dp replica's whole batch (before the CP cut); the module sums the vector over
the data-parallel ranks after the step and publishes a :class:`StepStats` as ``last_step_stats``. Token counts
are GLOBAL (summed over the data-parallel replicas, each token of a CP group counted once); ``cp_traffic`` is this
rank's CP exchange bytes for the step (forward and backward).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable

import torch

from dsv4.batch import TokenBatch
from dsv4.config import DSV4Config
from dsv4.flops import document_training_flops

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
        pack_padding: padding slots in shard-multiple groups without a real token (the row's unused tail).
        alignment_padding: padding slots that complete a document's last shard-multiple group.
        cp: context-parallel size; dp: data-parallel size; world_size: total ranks.
        cp_traffic: ``{kind: {"calls", "bytes_sent", "bytes_received"}}`` of this rank for the step.
        step_time_s: wall time of the step on this rank (forward, backward, optimizer).
        model_flops: training FLOPs of the step's documents (:func:`dsv4.flops.document_training_flops` of each
            document's own length, summed over the global batch); None without a model config.
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
    model_flops: float | None = None

    @property
    def padding_fraction(self) -> float:
        return (self.pack_padding + self.alignment_padding) / max(self.slots, 1)


def document_flops(config: DSV4Config) -> Callable[[list[int]], float]:
    """``lengths -> training FLOPs`` of documents of those lengths (:func:`document_training_flops`, cached)."""
    per_document = functools.cache(functools.partial(document_training_flops, config))
    return lambda lengths: sum(map(per_document, lengths))


def batch_statistics(batch: TokenBatch, shard_multiple: int, flops: Callable[[list[int]], float] | None = None,
                     ) -> torch.Tensor:
    """``[rows, slots, real, labelled, pack padding, alignment padding, model FLOPs]`` (float64) of a whole batch.

    Padding is split by shard-multiple groups: a padding slot in a group that also holds a real token completes a
    document's last group (alignment padding); one in an all-padding group is pack padding.
    """
    if batch.shard.size != 1:
        raise ValueError(f"batch_statistics needs the whole rows, got CP shard {batch.shard}")
    rows, width = batch.num_rows, batch.width
    pad = batch.padding.reshape(rows, width // shard_multiple, shard_multiple)
    real_group = ~pad.all(dim=-1, keepdim=True)
    counts = torch.stack([(~pad).sum(), batch.label_count(), (pad & ~real_group).sum(), (pad & real_group).sum()])
    real, labelled, pack, align = counts.tolist()
    model_flops = flops(batch.document_lengths()) if flops is not None else float("nan")
    return torch.tensor([rows, rows * width, real, labelled, pack, align, model_flops], dtype=torch.float64)


def step_stats_from(values: torch.Tensor, **fields) -> StepStats:
    """A :class:`StepStats` from a (dp-summed) :func:`batch_statistics` vector plus the other fields."""
    rows, slots, real, labelled, pack, align, model_flops = values.tolist()
    return StepStats(
        seq_len=int(slots) // max(int(rows), 1), rows=int(rows), slots=int(slots), real_tokens=int(real),
        label_tokens=int(labelled), pack_padding=int(pack), alignment_padding=int(align),
        model_flops=None if model_flops != model_flops else model_flops, **fields,
    )
