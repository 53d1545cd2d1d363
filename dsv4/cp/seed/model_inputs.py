"""``model(**batch)`` for a batch the seed sharder (or Megatron-Bridge's THD partition) cut.

Registered with :func:`dsv4.model.inputs.register_batch_key` when :mod:`dsv4.cp` is imported (which the sharder's
users do), so the model accepts these keys without knowing them: ``_dsv4_cp_group`` names the CP group, which
becomes the forward's :class:`~dsv4.parallel.cp.CPContext` when no context is passed and must have the passed
context's size otherwise; ``qkv_format`` and ``cp_partition_mode`` describe the batch and are ignored, as in the
seed.
"""

from __future__ import annotations

from typing import Any

from dsv4.model.context_parallel import ContextParallel
from dsv4.model.inputs import register_batch_key
from dsv4.parallel.cp.context import CPContext

GROUP_KEY = "_dsv4_cp_group"
FORMAT_KEYS = ("qkv_format", "cp_partition_mode")


def cp_from_group(group: Any, cp: ContextParallel | None) -> ContextParallel | None:
    """The context of a forward given the batch's group and the explicitly passed ``cp`` (None: from the group;
    ValueError naming both sizes when they differ)."""
    from_batch = CPContext(group)
    if cp is None:
        return from_batch if from_batch.size > 1 else None
    if cp.size != from_batch.size:
        raise ValueError(
            f"the batch was sharded for a CP group of {from_batch.size} ranks but the forward got a CPContext of "
            f"{cp.size} ranks; build the CPContext from the same group as the sharder's mesh"
        )
    return cp


register_batch_key(GROUP_KEY, cp_from_group)
for _key in FORMAT_KEYS:
    register_batch_key(_key)
