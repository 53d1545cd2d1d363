"""One training step's data handling: ``get_batch`` (CP partition) and ``forward_step`` (loss sum and count).

``get_batch(batch, parallel)`` dispatches on ``cp_partition_mode``. DSV4's compressed attention needs each rank
to hold a contiguous span of the row (compressor windows and the previous-window overlap must not be split), so
``contiguous`` is the only valid mode; ``zigzag`` / load-balanced layouts are rejected with that reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dsv4.cp.contiguous import contiguous_local_indices
from dsv4.cp.sharder import ContextParallelSharder

VALID_PARTITION_MODES = ("contiguous",)


@dataclass
class ParallelConfig:
    """What ``get_batch`` needs: the CP mesh (or group / SimulatedMesh), the sharder factory and the mode."""

    cp_mesh: Any
    shard_batch: Any
    cp_partition_mode: str = "contiguous"


def check_partition_mode(mode: str) -> None:
    if mode not in VALID_PARTITION_MODES:
        raise ValueError(
            f"cp_partition_mode={mode!r} is not supported for DSV4: compressed attention (CSA/HCA) pools windows "
            "of consecutive tokens and overlaps each window with the previous one, so every CP rank must own one "
            f"contiguous span of the row; use cp_partition_mode='contiguous' (valid: {list(VALID_PARTITION_MODES)})"
        )


def get_batch(batch: dict, parallel: ParallelConfig) -> tuple[dict, ContextParallelSharder]:
    """Shard one microbatch (caller coordinates, identical on every rank of a CP group) for this CP rank.

    Returns the local batch (keys as in ``make_dsv4_contiguous_shard_cp_batch_and_ctx``, plus
    ``cp_partition_mode``) and the sharder, whose ``shard_layout`` maps per-token tensors back to the caller.
    """
    mode = batch.pop("cp_partition_mode", parallel.cp_partition_mode)
    check_partition_mode(mode)
    sharder = ContextParallelSharder(
        shard_batch=parallel.shard_batch, device_mesh=parallel.cp_mesh, local_token_global_indices=contiguous_local_indices
    )
    _, local = sharder.shard(batch)
    local["cp_partition_mode"] = mode
    return local, sharder


def forward_step(model: torch.nn.Module, batch: dict, cp=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the model on a local batch; return this rank's ``(loss_sum, label_count)`` (reduce them over dp x cp)."""
    out = model(**batch, cp=cp)
    if out.loss_sum is None:
        raise KeyError("forward_step needs `labels` in the batch")
    return out.loss_sum, out.label_count
