"""Parallel layout and expert parallelism.

* ``mesh.py``: ``ParallelDims`` and the dp x cp (+ ep borrowing ranks) device meshes.
* ``dispatch.py``: the MoE token dispatchers selected by ``dispatcher=`` (the registry
  :data:`~dsv4.parallel.dispatch.TOKEN_DISPATCHERS`; built in: ``local``, ``alltoall``, ``allgather``,
  ``deepep``), :func:`~dsv4.parallel.dispatch.build_dispatcher` and the start-up checks.
* ``expert_shard.py``: :func:`~dsv4.parallel.expert_shard.shard_experts` (keep this rank's slice of every
  ``GroupedExperts``) and its inverse for saving.

Submodules are imported explicitly (``from dsv4.parallel.dispatch import build_dispatcher``); this package
imports nothing so that ``torch.distributed`` stays out of ``dsv4.model``.
"""
