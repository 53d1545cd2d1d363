"""Seed group helpers and gathers (``dsv4_cp_enabled/rank/size``, ``dsv4_cp_all_gather[_metadata]``) and CP meshes.

The seed names are thin wrappers over :mod:`dsv4.distributed` and :mod:`dsv4.parallel.cp.collectives` with the seed's
signatures. A *CP mesh* (what the seed sharding functions take) is a 1-D ``DeviceMesh``, a process group, ``None``,
or any object with ``size()`` (and optionally ``get_local_rank()`` / ``get_group()``), e.g. :class:`SimulatedMesh`,
which lets one process shard for every rank of a pretend group.
"""

from __future__ import annotations

from typing import Any

from dsv4.parallel.cp.collectives import all_gather, all_gather_metadata
from dsv4.distributed import ProcessGroup, group_rank, group_size, is_initialized


def dsv4_cp_enabled(cp_group: ProcessGroup | None) -> bool:
    """True when ``cp_group`` is a live process group of more than one rank."""
    return group_size(cp_group) > 1


def dsv4_cp_rank(cp_group: ProcessGroup | None) -> int:
    """This process's rank inside ``cp_group`` (0 when CP is disabled)."""
    return group_rank(cp_group) if dsv4_cp_enabled(cp_group) else 0


dsv4_cp_size = group_size  # world size of ``cp_group`` (1 when CP is disabled)
dsv4_cp_all_gather = all_gather  # differentiable, ``(tensor, dim=1, cp_group=None)``; backward sums into the owner
dsv4_cp_all_gather_metadata = all_gather_metadata  # plain all-gather of integer/bool metadata (identity without CP)


def mesh_size(cp_mesh: Any) -> int:
    """Number of ranks of a CP mesh / group / duck-typed mesh; 1 for ``None``."""
    if cp_mesh is None:
        return 1
    if isinstance(cp_mesh, ProcessGroup):
        return group_size(cp_mesh)
    return int(cp_mesh.size())


def mesh_group(cp_mesh: Any) -> ProcessGroup | None:
    """The process group behind a CP mesh (None for ``None`` or a mesh without one)."""
    if cp_mesh is None or isinstance(cp_mesh, ProcessGroup):
        return cp_mesh
    get_group = getattr(cp_mesh, "get_group", None)
    if get_group is None or not is_initialized():
        return None
    return get_group()


def mesh_rank(cp_mesh: Any) -> int:
    """This process's rank in a CP mesh (seed rule: the group rank when dist is up, else ``get_local_rank()``)."""
    if cp_mesh is None:
        return 0
    group = mesh_group(cp_mesh)
    if group is not None:
        return group_rank(group)
    get_local_rank = getattr(cp_mesh, "get_local_rank", None)
    return int(get_local_rank()) if get_local_rank is not None else 0


class SimulatedMesh:
    """A pretend 1-D CP mesh for one process: ``size()`` ranks, of which this process plays ``rank``.

    Lets single-process code (tests, benchmarks, data inspection) run the sharding of any rank without
    ``torch.distributed``; collectives over it are not possible (it has no process group).
    """

    def __init__(self, size: int, rank: int = 0) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"SimulatedMesh: rank {rank} is outside [0, {size})")
        self._size, self._rank = int(size), int(rank)

    def size(self) -> int:
        return self._size

    def get_local_rank(self) -> int:
        return self._rank

    def __repr__(self) -> str:
        return f"SimulatedMesh(size={self._size}, rank={self._rank})"
