"""What host offload (``trainer.offload=optimizer``, FSDP2's ``CPUOffloadPolicy``) moves off the device, per rank.

With the policy every FSDP unit keeps its sharded parameters in host memory (fp32 masters of trainable parameters;
a LoRA base's frozen shards in their stored compute dtype), the gradient shards land there after each reduce-scatter,
so the optimizer state is created there and the optimizer step runs on the host. Buffers stay on the device. What
the device holds for it, briefly (:attr:`OffloadBytes.device_staging`):

* ``gather_staging``: before a unit's all-gather FSDP copies each of its shards to the device (and casts the copy to
  the unit's compute dtype when that differs); the largest unit's copies, freed once they are in the all-gather
  buffer (which the plan's ``gathered`` term already counts); ``gather_cast``: the cast copies alone, the largest
  unit's (all that stays when host and device are one memory, where the copy to the device is the shard itself);
* ``reduce_staging``: a reduce-scatter's fp32 output (the unit's gradient shard) before its copy to the host; the
  largest unit's.

Traffic between host and device per optimizer step (one micro-batch): every unit's shards host -> device once per
all-gather (twice for a unit resharded after forward: forward and backward; the root once; ``gathers``: each unit's
traced count, :func:`dsv4.plan.comm.unit_gathers`), every gradient shard device -> host once.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from dsv4.parallel.wrap import FsdpUnit
from dsv4.plan.states import StateBytes, shard_elements


@dataclass(frozen=True)
class OffloadBytes:
    """Per-rank bytes. Host: ``parameters`` (sharded parameters, every unit), ``gradients`` and ``optimizer`` (as
    :class:`~dsv4.plan.states.StateBytes`), ``step_temporary`` (the optimizer step's, on the host). Device:
    ``gather_staging``, ``gather_cast`` and ``reduce_staging`` (module docstring). Traffic per step: ``host_to_device``,
    ``device_to_host``."""

    parameters: int
    gradients: int
    optimizer: int
    step_temporary: int
    gather_staging: int
    reduce_staging: int
    host_to_device: int
    device_to_host: int
    gather_cast: int = 0

    @property
    def host(self) -> int:
        """What lives in host memory between steps and during backward: shards, gradients, optimizer state."""
        return self.parameters + self.gradients + self.optimizer

    @property
    def device_staging(self) -> int:
        return self.gather_staging + self.reduce_staging


def offload_bytes(units: list[FsdpUnit], owners: dict[nn.Parameter, FsdpUnit], mesh_size: dict[str, int],
                  states: StateBytes, gathers: dict[int, int] | None = None) -> OffloadBytes:
    """The offloaded terms of a model sharded like ``units`` (parameters on ``meta`` in their stored dtype;
    ``owners`` from :func:`~dsv4.plan.states.parameter_owners`); gradients, optimizer state and the step's
    temporary are ``states``' own terms, all of which move to the host. ``gathers``: how often each unit (by ``id``)
    is gathered per step (None: twice, the root once)."""
    shard = {id(u): 0 for u in units}  # stored bytes of each unit's shards
    staged = {id(u): 0 for u in units}  # what a unit's all-gather copies to the device (with the compute-dtype cast)
    cast = {id(u): 0 for u in units}  # the compute-dtype cast copies alone
    grads = {id(u): 0 for u in units}  # fp32 gradient shard bytes of each unit
    for p, unit in owners.items():
        local = shard_elements(p, mesh_size[unit.mesh])
        shard[id(unit)] += local * p.element_size()
        cast[id(unit)] += local * unit.param_dtype.itemsize if p.dtype != unit.param_dtype else 0
        staged[id(unit)] += local * p.element_size()
        if p.requires_grad:
            grads[id(unit)] += local * 4
    if gathers is None:
        gathers = {id(u): 1 if u is units[-1] or not u.reshard_after_forward else 2 for u in units}
    return OffloadBytes(
        parameters=sum(shard.values()),
        gradients=states.gradients - states.table_gradients,  # a trainable Engram table's stay on the device
        optimizer=states.optimizer - states.table_optimizer,
        step_temporary=states.step_temporary,
        gather_staging=max((staged[k] + cast[k] for k in staged), default=0),
        gather_cast=max(cast.values(), default=0),
        reduce_staging=max(grads.values(), default=0),
        host_to_device=sum(shard[k] * gathers[k] for k in shard),
        device_to_host=sum(grads.values()),
    )
