"""One training step's model call: :func:`forward_step` (this rank's loss sum and label count) and
:func:`forward_outputs` (the whole model output)."""

from __future__ import annotations

import torch

from dsv4.batch import TokenBatch


def forward_step(model: torch.nn.Module, batch: TokenBatch, cp=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the model on this rank's ``batch``; return ``(loss_sum, label_count)`` (reduce them over dp x cp)."""
    out = forward_outputs(model, batch, cp)
    return out.loss_sum, out.label_count


def forward_outputs(model: torch.nn.Module, batch: TokenBatch, cp=None):
    """Run the model on this rank's ``batch`` (the chunked loss, no logits); return its ``DSV4Output`` (loss sum,
    label count, the indexer loss sum when it trains).

    ``cp`` is the ``CPContext`` of the group the batch was cut for (None for a whole row); a mismatch between the
    batch's shard and the context raises ``ValueError`` before the forward.
    """
    size, rank, balance = (cp.size, cp.rank, cp.balance) if cp is not None else (1, 0, "none")
    if (batch.shard.size, batch.shard.rank) != (size, rank):
        raise ValueError(f"the batch is CP shard {batch.shard.rank} of {batch.shard.size} but the forward runs as "
                         f"rank {rank} of a CP group of {size}")
    if size > 1 and batch.shard.balance != balance:
        raise ValueError(f"the batch was cut with cp_balance={batch.shard.balance!r} but the CPContext runs "
                         f"cp_balance={balance!r}")
    return model(batch.input_ids, position_ids=batch.positions, packed_seq_ids=batch.seq_ids,
                 padding_mask=batch.padding, labels=batch.labels, cp=cp, return_logits=False)
