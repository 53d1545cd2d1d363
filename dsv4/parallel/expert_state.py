"""Routed-expert tensors in a run's distributed (DCP) checkpoint: every EP slice saved at its place in the whole.

Under expert parallelism, EP rank ``e`` of ``ep`` holds experts ``[e * E / ep, (e + 1) * E / ep)`` of every
``GroupedExperts`` (:mod:`dsv4.parallel.expert_shard`), and FSDP shards that slice over the ``edp`` mesh. The
DTensor FSDP makes of such a tensor describes the slice only: global shape ``[E / ep, ...]`` on the ``edp`` mesh,
under the same name on every EP rank. Saved as it is, DCP takes the EP ranks' slices for replicas of one tensor
and writes one of them.

:class:`ExpertStateLayout` rewrites those entries of a model or optimizer state dict as DTensors of the whole
stacked tensor ``[E, ...]`` on an ``("ep", "edp")`` view of the same ranks, placements ``(Shard(0), Shard(0))``:
dimension 0 is chunked over ``ep`` first (the EP slice), then each slice over ``edp`` (FSDP's shard, the same
``torch.chunk`` split). A tensor EP-sliced but not FSDP-sharded (a kept quantized base's buffers) becomes
``(Shard(0), Replicate())``. The local tensor is the same storage (no copy), so DCP writes each rank's part at its
global offset and a load fills it in place. The checkpoint then holds every expert once, at global shapes, and
loads under any ``ep`` (DCP reshards), in the converter (``python -m dsv4.checkpoint export``) too.

Invariant: ``globalize`` changes only the tensor's description (mesh, placements, global shape), never its local
values or storage; entries that are not EP-sliced expert tensors pass through unchanged. A part that description
would misplace is a ``ValueError`` (naming the tensor or module, the ranks and the sizes), never a silent save:
``of`` refuses a module holding another slice than its EP rank's, ``globalize`` an FSDP part sharded over other
ranks (or another order) than the layout's ``edp`` row of its EP rank, or of another size than that rank's
``torch.chunk`` part (uneven splits included).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from dsv4.model.moe import GroupedExperts


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


@dataclass(frozen=True)
class ExpertStateLayout:
    """The EP-sliced expert tensors of a model: ``num_experts`` per state-dict name (module path + stacked name,
    as ``get_model_state_dict`` and ``get_optimizer_state_dict`` name them) and ``ranks``, the global ranks of the
    expert mesh as ``[ep, edp]``. The mesh of a globalized tensor has the device type of its local tensor (a
    CPU-offloaded state dict stays on the CPU)."""

    num_experts: dict[str, int]
    ranks: torch.Tensor
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False, compare=False)

    def mesh(self, device_type: str) -> DeviceMesh:
        """The ``("ep", "edp")`` view of the expert ranks for tensors on ``device_type`` (no process group)."""
        if device_type not in self._meshes:
            self._meshes[device_type] = DeviceMesh(device_type, self.ranks, mesh_dim_names=("ep", "edp"),
                                                   _init_backend=False)
        return self._meshes[device_type]

    @classmethod
    def of(cls, model: nn.Module, experts_mesh: DeviceMesh) -> "ExpertStateLayout | None":
        """The layout of ``model`` whose experts are sliced over ``experts_mesh`` (("edp", "ep"), ep innermost);
        None when no expert is EP-sliced (ep = 1: the checkpoint needs no rewrite). Raises ``ValueError`` when a
        module's slice is not the one its place in the mesh says (EP rank ``e`` holds ``[e * n, (e + 1) * n)``)."""
        sliced = [(path, m) for path, m in model.named_modules()
                  if isinstance(m, GroupedExperts) and m.num_local_experts < m.num_experts]
        if not sliced:
            return None
        if experts_mesh.mesh_dim_names != ("edp", "ep"):
            raise ValueError(f"expected the ('edp', 'ep') expert mesh, got {experts_mesh.mesh_dim_names}")
        layout = cls(num_experts={f"{path}.{name}" if path else name: m.num_experts for path, m in sliced
                                  for name in m.stacked_names()},
                     ranks=experts_mesh.mesh.transpose(0, 1).contiguous().cpu())
        ep_index = layout._coordinate(sliced[0][0])[0]
        for path, m in sliced:
            if m.expert_offset != ep_index * m.num_local_experts:
                raise ValueError(f"{path}: this rank holds experts [{m.expert_offset}, "
                                 f"{m.expert_offset + m.num_local_experts}), EP rank {ep_index} of the expert mesh "
                                 f"{layout.ranks.tolist()} ([ep, edp]) holds [{ep_index * m.num_local_experts}, "
                                 f"{(ep_index + 1) * m.num_local_experts})")
        return layout

    def _coordinate(self, name: str) -> tuple[int, int]:
        """This rank's ``(ep, edp)`` place in the expert mesh."""
        rank = torch.distributed.get_rank()
        where = (self.ranks == rank).nonzero().tolist()
        if not where:
            raise ValueError(f"{name}: rank {rank} is not in the expert mesh {self.ranks.tolist()}")
        return where[0][0], where[0][1]

    def globalize(self, name: str, tensor: Any) -> Any:
        """``tensor`` (this rank's part of expert tensor ``name``) as a DTensor of the whole ``[E, ...]`` tensor;
        anything else unchanged."""
        total = self.num_experts.get(name)
        if total is None or not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            return tensor
        ep = self.ranks.shape[0]
        if isinstance(tensor, DTensor):
            if tensor.device_mesh.ndim != 1 or tensor.placements != (Shard(0),):
                raise ValueError(f"{name}: expected an FSDP DTensor sharded on dim 0 over one mesh, got "
                                 f"{tensor.placements} on {tensor.device_mesh}")
            slice_shape, local, placements = tuple(tensor.shape), tensor.to_local(), (Shard(0), Shard(0))
            self._check_fsdp_part(name, tensor.device_mesh.mesh.flatten().tolist(), slice_shape[0], local.shape[0])
        else:
            slice_shape, local, placements = tuple(tensor.shape), tensor, (Shard(0), Replicate())
        if slice_shape[0] * ep != total:
            raise ValueError(f"{name}: {slice_shape[0]} experts per EP rank x ep={ep} != n_routed_experts={total}")
        shape = (total, *slice_shape[1:])
        return DTensor.from_local(local, self.mesh(local.device.type), placements, run_check=False, shape=torch.Size(shape),
                                  stride=_contiguous_stride(shape))

    def _check_fsdp_part(self, name: str, fsdp_ranks: list[int], slice_rows: int, local_rows: int) -> None:
        """The (Shard(0), Shard(0)) description holds for this rank's FSDP part of an EP slice: FSDP shards the
        slice over this rank's edp row of the layout, in that order, and this rank holds that row's
        ``torch.chunk`` part (else DCP would write the part at another place, or a part of another size, silently)."""
        rank = torch.distributed.get_rank()
        ep_index, edp_index = self._coordinate(name)
        row = self.ranks[ep_index].tolist()
        if fsdp_ranks != row:
            raise ValueError(f"{name}: FSDP shards EP rank {ep_index}'s slice over ranks {fsdp_ranks}, the expert "
                             f"mesh's edp ranks of that slice are {row}")
        chunks = torch.empty(slice_rows, 0).chunk(len(row))
        rows = chunks[edp_index].shape[0] if edp_index < len(chunks) else 0
        if local_rows != rows:
            raise ValueError(f"{name}: rank {rank} holds {local_rows} of EP rank {ep_index}'s {slice_rows} experts, "
                             f"torch.chunk over edp={len(row)} gives edp rank {edp_index} {rows}")

    def model_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """A model state dict (``get_model_state_dict``) with every expert entry globalized (a new dict)."""
        return {name: self.globalize(name, value) for name, value in state.items()}

    def optimizer_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """An optimizer state dict (``get_optimizer_state_dict``: ``{"state": {name: {key: tensor}},
        "param_groups": [...]}``) with every expert parameter's state tensors globalized (a new dict; the scalar
        ``step`` and the param groups unchanged)."""
        per_param = {name: {key: self.globalize(name, value) for key, value in entry.items()}
                     for name, entry in state.get("state", {}).items()}
        return {**state, "state": per_param}
