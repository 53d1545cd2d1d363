"""One training step's model call: :func:`forward_outputs`, the model on this rank's typed batch (loss sum, label
count, the indexer loss sum)."""

from __future__ import annotations

import torch

from dsv4.batch import TokenBatch
from dsv4.model.context_parallel import ContextParallel


def forward_outputs(model: torch.nn.Module, batch: TokenBatch, cp: ContextParallel | None = None):
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
