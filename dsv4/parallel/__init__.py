"""Parallel layout and expert parallelism.

* ``mesh.py``: ``ParallelDims`` and the dp x cp (+ ep borrowing ranks) device meshes.
* ``dispatch.py``: the MoE token dispatchers selected by ``dispatcher=`` (the registry
  :data:`~dsv4.parallel.dispatch.TOKEN_DISPATCHERS`; built in: ``local``, ``alltoall``, ``allgather``,
  ``deepep``), :func:`~dsv4.parallel.dispatch.build_dispatcher` and the start-up checks.
* ``expert_shard.py``: :func:`~dsv4.parallel.expert_shard.shard_experts` (keep this rank's slice of every
  ``GroupedExperts``) and its inverse for saving.
* ``engram_table.py``: DeepSeek-V4.1's Engram tables row-sharded over a 1-D mesh
  (:func:`~dsv4.parallel.engram_table.shard_engram_tables`), looked up with one all-to-all round trip per layer.

Submodules are imported explicitly (``from dsv4.parallel.dispatch import build_dispatcher``); this package
imports nothing so that ``torch.distributed`` stays out of ``dsv4.model``.
"""
