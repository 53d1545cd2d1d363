"""Process-group helpers: the one set of rank / size queries and plain collectives every module uses.

A *group* is a ``torch.distributed`` process group or ``None``. ``None`` (or no initialised process group) is the
single-process case: size 1, rank 0, and every collective below is an identity. Expert parallelism, which treats
``None`` as "the default group", resolves it first with :func:`resolve_group`.

The tensor collectives have one spelling each here (:func:`all_gather_into`, :func:`reduce_scatter_into` and the
differentiable :func:`all_gather_autograd`, :func:`reduce_scatter_autograd`); they use torch's ``*_single`` names
where torch has them (2.13) and the older names with the same semantics otherwise (2.8 - 2.12).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

ProcessGroup = dist.ProcessGroup

_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_ALL_GATHER_AUTOGRAD = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
_REDUCE_SCATTER_AUTOGRAD = (getattr(funcol, "reduce_scatter_single_autograd", None)
                            or funcol.reduce_scatter_tensor_autograd)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 ``DTensor`` shard (a collective: every rank calls it); a plain tensor as is.
    A shard in host memory (``trainer.offload=optimizer``) is gathered on its mesh's device (NCCL takes no host
    tensors); the result is on that device."""
    if not hasattr(t, "full_tensor"):
        return t
    if t.device.type != t.device_mesh.device_type:
        t = t.to(t.device_mesh.device_type)
    return t.full_tensor()


def is_initialized() -> bool:
    """True when ``torch.distributed`` is available and a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def group_size(group: ProcessGroup | None) -> int:
    """Ranks in ``group``; 1 for ``None`` or without an initialised process group."""
    return dist.get_world_size(group=group) if group is not None and is_initialized() else 1


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank in ``group``; 0 for ``None`` or without an initialised process group."""
    return dist.get_rank(group=group) if group is not None and is_initialized() else 0


class GroupMember:
    """Mixin for objects that act within ``self.group``: this rank's ``rank`` and the group's ``size``."""

    group: ProcessGroup | None

    @property
    def rank(self) -> int:
        return group_rank(self.group)

    @property
    def size(self) -> int:
        return group_size(self.group)


def resolve_group(group: ProcessGroup | DeviceMesh | None) -> ProcessGroup | None:
    """A process group from a group, a 1-D ``DeviceMesh`` or ``None`` (the default group when initialised)."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"expected a 1-D device mesh, got dims {group.mesh_dim_names}")
        return group.get_group()
    if group is None:
        return dist.group.WORLD if is_initialized() else None
    return group


def all_gather_into(out: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Plain all-gather of ``tensor`` into ``out`` (``group_size`` times its dim-0 length), in rank order."""
    _ALL_GATHER(out, tensor, group=group)
    return out


def reduce_scatter_into(out: torch.Tensor, tensor: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Plain SUM reduce-scatter of ``tensor`` (dim 0 split in rank order) into ``out``."""
    _REDUCE_SCATTER(out, tensor, group=group)
    return out


def all_gather_autograd(tensor: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Differentiable all-gather along ``dim`` (backward: reduce-scatter of the gradient)."""
    return _ALL_GATHER_AUTOGRAD(tensor, dim, group)


def reduce_scatter_autograd(tensor: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Differentiable SUM reduce-scatter along ``dim`` (backward: all-gather of the gradient)."""
    return _REDUCE_SCATTER_AUTOGRAD(tensor, "sum", dim, group)


def reduce_device(group: ProcessGroup | None) -> torch.device:
    """Where a small tensor for a collective over ``group`` must live: the current CUDA device under NCCL."""
    if is_initialized() and "nccl" in str(dist.get_backend(group)).lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_max(value: int, group: ProcessGroup | None = None, device: Any = None) -> int:
    """MAX of a Python int over ``group`` (WORLD when None); the value itself without a process group."""
    if not is_initialized():
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=device if device is not None else reduce_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


def all_reduce_sum(t: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """SUM of ``t`` over ``group`` (WORLD when None) as a new tensor; ``t`` itself without a process group."""
    if not is_initialized():
        return t
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t
