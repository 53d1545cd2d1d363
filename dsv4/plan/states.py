"""Per-rank bytes of the training state: parameters, gradients, optimizer state and FSDP's gathered buffers.

The model is built on ``meta`` and expert-sharded for EP rank 0 (:func:`dsv4.parallel.expert_shard.shard_experts`,
the real code); the FSDP units are :func:`dsv4.parallel.wrap.fsdp_units`, the list ``apply_fsdp`` shards. FSDP2
splits every parameter along dim 0 into ``mesh size`` chunks of ``ceil(dim0 / size)`` rows (the last padded), so a
rank holds ``ceil(dim0 / size) * numel / dim0`` elements of it; the mesh is ``dp x cp`` ranks, or ``edp = world /
ep`` for routed experts.

* parameters: the fp32 shards (master weights) of trainable parameters, frozen ones (a LoRA base) in the dtype they
  are stored in (their unit's compute dtype), and the buffers (unsharded; a kept FP8 / FP4 LoRA base is buffers);
* gradients: fp32 shards of the trainable parameters (frozen ones, ``requires_grad=False``, have none);
* optimizer: bytes per trainable shard element (:func:`optimizer_profile` measures them on the configured
  optimizer: AdamW keeps two fp32 moments, 8 bytes), and the step's temporary (its ``foreach`` / ``fused``);
* communication buffers: the gathered parameters of the two largest units in their compute dtype (the running
  unit and the one FSDP prefetches), the root unit's (gathered once and kept until backward ends), and the fp32
  reduce-scatter input of the unit with the most trainable elements (the root's reduce comes after the others).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from dsv4.parallel.wrap import FsdpUnit, fsdp_units


@dataclass
class StateBytes:
    """Per-rank bytes: ``parameters``, ``gradients``, ``optimizer``, ``gathered`` (largest units' gathered
    parameters, two at a time), ``root_gathered`` (kept all step), ``reduce_buffer`` (fp32 gradient
    reduce-scatter input), ``step_temporary`` (what the optimizer step allocates); ``largest_unit``: the class of
    the largest FSDP unit (for the report)."""

    parameters: int
    gradients: int
    optimizer: int
    gathered: int
    root_gathered: int
    reduce_buffer: int
    largest_unit: str
    step_temporary: int = 0

    @property
    def communication(self) -> int:
        return self.gathered + self.root_gathered + self.reduce_buffer


def shard_elements(p: torch.Tensor, mesh_size: int) -> int:
    """Elements of ``p`` one rank holds when FSDP2 shards it over ``mesh_size`` ranks (dim 0, padded chunks)."""
    if p.dim() == 0:
        return 1
    rows = p.shape[0]
    return math.ceil(rows / mesh_size) * (p.numel() // rows if rows else 0)


def parameter_owners(model: nn.Module, units: list[FsdpUnit]) -> dict[nn.Parameter, FsdpUnit]:
    """The FSDP unit that owns each parameter (the first unit in ``units`` whose module contains it)."""
    owners: dict[nn.Parameter, FsdpUnit] = {}
    for unit in units:
        for p in unit.module.parameters():
            owners.setdefault(p, unit)
    return owners


@dataclass(frozen=True)
class OptimizerProfile:
    """What the optimizer keeps and what its step allocates, per trainable fp32 element: ``state_bytes`` (kept
    between steps) and ``step_temporary``: ``"all"`` (a multi-tensor update: one fp32 value per element at once,
    torch's ``foreach`` default on GPUs), ``"per_tensor"`` (one tensor at a time: two fp32 copies of the largest
    shard) or ``"none"`` (a fused kernel)."""

    state_bytes: float = 8.0
    step_temporary: str = "all"


def optimizer_profile(build_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> OptimizerProfile:
    """Measure the state: one step of the optimizer on a probe parameter, then the bytes of its per-element state
    tensors (step counters and other scalars are not per element). The step's temporary follows the optimizer's
    ``fused`` / ``foreach`` settings."""
    probe = nn.Parameter(torch.zeros(64, 4))
    optimizer = build_optimizer([probe])
    probe.grad = torch.full_like(probe, 1e-3)
    optimizer.step()
    state = optimizer.state.get(probe, {})
    per_element = [t for t in state.values() if isinstance(t, torch.Tensor) and t.numel() == probe.numel()]
    defaults = optimizer.defaults
    if not per_element or defaults.get("fused"):
        temporary = "none"
    elif defaults.get("foreach") is False:
        temporary = "per_tensor"
    else:
        temporary = "all"
    return OptimizerProfile(float(sum(t.element_size() for t in per_element)), temporary)


def gradient_shard_bytes(modules: list[nn.Module], owners: dict[nn.Parameter, FsdpUnit], mesh_size: dict[str, int],
                         skip: FsdpUnit | None = None) -> int:
    """fp32 gradient shard bytes of the trainable parameters of ``modules`` (units other than ``skip``)."""
    seen, total = set(), 0
    for module in modules:
        for p in module.parameters():
            unit = owners[p]
            if p.requires_grad and unit is not skip and p not in seen:
                seen.add(p)
                total += shard_elements(p, mesh_size[unit.mesh]) * 4
    return total


def state_bytes(model: nn.Module, *, world: int, ep: int, compute_dtype: torch.dtype,
                optimizer: OptimizerProfile = OptimizerProfile()) -> StateBytes:
    """The state terms of the module docstring for ``model`` (on ``meta``, experts already sharded for EP)."""
    units = fsdp_units(model, compute_dtype)
    owners = parameter_owners(model, units)
    mesh_size = {"dp_cp": world, "edp": world // ep}
    master, trainable, largest_shard = 0, 0, 0
    gathered: dict[int, int] = {}
    reduced: dict[int, int] = {}  # per unit: the trainable elements its gradient reduce-scatter takes in
    for p, unit in owners.items():
        local = shard_elements(p, mesh_size[unit.mesh])
        master += local * p.element_size()
        if p.requires_grad:
            trainable += local
            largest_shard = max(largest_shard, local)
            reduced[id(unit)] = reduced.get(id(unit), 0) + local * mesh_size[unit.mesh]
        gathered[id(unit)] = gathered.get(id(unit), 0) + local * mesh_size[unit.mesh] * unit.param_dtype.itemsize
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    root = units[-1]
    by_unit = sorted(((gathered.get(id(u), 0), u) for u in units[:-1]), key=lambda t: t[0], reverse=True)
    two_largest = sum(b for b, _ in by_unit[:2])
    _, largest = by_unit[0] if by_unit else (0, root)
    return StateBytes(
        parameters=master + buffers,
        gradients=trainable * 4,
        optimizer=int(trainable * optimizer.state_bytes),
        step_temporary={"all": trainable, "per_tensor": 2 * largest_shard, "none": 0}[optimizer.step_temporary] * 4,
        gathered=two_largest,
        root_gathered=gathered.get(id(root), 0),
        reduce_buffer=max((n for key, n in reduced.items() if key != id(root)), default=0) * 4,
        largest_unit=type(largest.module).__name__,
    )
