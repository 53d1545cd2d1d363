"""The compatible context-parallel batch API: code written against NeMo Automodel's DSV4 CP functions and
Megatron-Bridge's THD partition runs on dsv4 unchanged.

* The seed names (:mod:`dsv4.cp.seed`, re-exported here with the seed's signatures and semantics): batch-dict
  sharding into per-rank batch dicts that ``model(**batch)`` accepts.
* :mod:`dsv4.cp.thd`: Megatron-Bridge's contiguous THD partition with global ``cu_seqlens``.
* :class:`CPContext` (the runtime object the model runs with) and the runtime's exchange functions, re-exported from
  :mod:`dsv4.parallel.cp`, where dsv4's own training path takes them from.

This package is an edge: it is built on the core (:mod:`dsv4.parallel.cp`, :mod:`dsv4.packing`,
:mod:`dsv4.batch`) and nothing in the core imports it.
"""

from dsv4.cp.seed import *  # noqa: F403 - the seed names are part of this package's public contract
from dsv4.cp.seed import __all__ as _seed_names
from dsv4.distributed import all_reduce_max
from dsv4.parallel.cp import CPContext, TrafficCounter
from dsv4.parallel.cp.collectives import all_gather, all_gather_metadata, halo_exchange

__all__ = [
    "CPContext",
    "TrafficCounter",
    "all_gather",
    "all_gather_metadata",
    "all_reduce_max",
    "halo_exchange",
    *_seed_names,
]
