"""Process-group helpers of the seed CP API.

A "CP group" is a ``torch.distributed`` process group, or ``None`` for the single-rank path. A group of size 1
is the single-rank path too. The sharding functions also take a *CP mesh*: a 1-D ``DeviceMesh``, a process
group, ``None``, or any object with ``size()`` (and optionally ``get_local_rank()`` / ``get_group()``), which is
how single-process tests shard for every rank of a pretend group.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

ProcessGroup = dist.ProcessGroup


def dsv4_cp_enabled(cp_group: ProcessGroup | None) -> bool:
    """True when ``cp_group`` is a live process group of more than one rank."""
    return (
        cp_group is not None
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size(group=cp_group) > 1
    )


def dsv4_cp_rank(cp_group: ProcessGroup | None) -> int:
    """This process's rank inside ``cp_group`` (0 when CP is disabled)."""
    return dist.get_rank(group=cp_group) if dsv4_cp_enabled(cp_group) else 0


def dsv4_cp_size(cp_group: ProcessGroup | None) -> int:
    """World size of ``cp_group`` (1 when CP is disabled)."""
    return dist.get_world_size(group=cp_group) if dsv4_cp_enabled(cp_group) else 1


def mesh_size(cp_mesh: Any) -> int:
    """Number of ranks of a CP mesh / group / duck-typed mesh; 1 for ``None``."""
    if cp_mesh is None:
        return 1
    if isinstance(cp_mesh, ProcessGroup):
        return dist.get_world_size(group=cp_mesh) if dist.is_initialized() else 1
    return int(cp_mesh.size())


def mesh_group(cp_mesh: Any) -> ProcessGroup | None:
    """The process group behind a CP mesh (None for ``None`` or a mesh without one)."""
    if cp_mesh is None or isinstance(cp_mesh, ProcessGroup):
        return cp_mesh
    get_group = getattr(cp_mesh, "get_group", None)
    if get_group is None or not (dist.is_available() and dist.is_initialized()):
        return None
    return get_group()


def mesh_rank(cp_mesh: Any) -> int:
    """This process's rank in a CP mesh (seed rule: the group rank when dist is up, else ``get_local_rank()``)."""
    if cp_mesh is None:
        return 0
    group = mesh_group(cp_mesh)
    if group is not None and dist.is_initialized():
        return dist.get_rank(group=group)
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
