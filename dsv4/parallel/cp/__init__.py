"""Context parallelism at run time: what the model's :class:`~dsv4.model.context_parallel.ContextParallel` view is
made of.

* ``context.py``: :class:`CPContext`, the implementation of that view over a process group (the strategy builds one
  per step and hands it to the model).
* ``layout.py``: :class:`CPLayout`, which chunks of a row each rank holds (contiguous or head-tail balanced).
* ``routes.py``: which rows travel where (halo, causal gather of compressed rows, the multi-token prediction's
  next-chunk heads), planned from the per-row document runs the model resolves.
* ``collectives.py``: the differentiable exchanges that run those plans (point to point, overlappable).
* ``traffic.py``: per-kind byte counts of every exchange.

The compatible batch API (NeMo Automodel's names, Megatron-Bridge's THD partition) lives in :mod:`dsv4.cp` and is
built on this package; nothing here knows about it.
"""

from dsv4.parallel.cp.context import CPContext
from dsv4.parallel.cp.layout import CPLayout, check_balance, cp_chunks
from dsv4.parallel.cp.traffic import TrafficCounter

__all__ = ["CPContext", "CPLayout", "TrafficCounter", "check_balance", "cp_chunks"]
