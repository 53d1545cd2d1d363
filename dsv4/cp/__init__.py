"""Context parallelism: the runtime the model uses, and the seed batch API.

Runtime (what the model sees, through one object): :class:`CPContext` and its exchange verbs
(:mod:`dsv4.cp.collectives`: ``halo_exchange``, ``gather_preceding``, differentiable and metadata all-gathers),
with per-kind byte counts (:class:`TrafficCounter`).

Seed API (:mod:`dsv4.cp.seed`, re-exported here with the seed's names and signatures): batch-dict sharding for
code written against NeMo Automodel's DSV4 CP functions. ``dsv4.cp.thd``: Megatron-Bridge's contiguous THD
partition.
"""

from dsv4.cp.collectives import all_gather, all_gather_metadata, gather_preceding, halo_exchange
from dsv4.cp.context import CPContext
from dsv4.cp.seed import *  # noqa: F403 - the seed names are part of this package's public contract
from dsv4.cp.seed import __all__ as _seed_names
from dsv4.cp.traffic import TrafficCounter
from dsv4.distributed import all_reduce_max

__all__ = [
    "CPContext",
    "TrafficCounter",
    "all_gather",
    "all_gather_metadata",
    "all_reduce_max",
    "gather_preceding",
    "halo_exchange",
    *_seed_names,
]
