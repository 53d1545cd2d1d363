"""Per-rank bytes of the training state: parameters, gradients, optimizer state and FSDP's gathered buffers.

The model is built on ``meta`` and expert-sharded for EP rank 0 (:func:`dsv4.parallel.expert_shard.shard_experts`,
the real code); the FSDP units are :func:`dsv4.parallel.wrap.fsdp_units`, the list ``apply_fsdp`` shards. FSDP2
splits every parameter along dim 0 into ``mesh size`` chunks of ``ceil(dim0 / size)`` rows (the last padded), so a
rank holds ``ceil(dim0 / size) * numel / dim0`` elements of it; the mesh is ``dp x cp`` ranks, or ``edp = world /
ep`` for routed experts.

* parameters: the fp32 shards (master weights) of trainable parameters, frozen ones (a LoRA base) in the dtype they
  are stored in (their unit's compute dtype), and the buffers (unsharded; a kept FP8 / FP4 LoRA base is buffers);
  DeepSeek-V4.1's Engram tables are no FSDP unit's: row-sharded over the ``dp x cp`` ranks
  (:mod:`dsv4.parallel.engram_table`), a rank holds ``ceil(rows / world)`` rows of each, in its stored form (fp32,
  or the release's FP8 with one e8m0 scale per row and 32 columns), and nothing of them is ever gathered;
* gradients: fp32 shards of the trainable parameters (frozen ones, ``requires_grad=False``, have none; a trainable
  Engram table's gradient is dense over the rank's rows, zero where nothing was looked up);
* optimizer: the real state bytes of each trainable shard, measured on the configured optimizer at that shard's
  element count (:func:`optimizer_profile`: AdamW's two moments are 8 bytes per element in fp32, 4 in bf16, ~2.03 in
  8 bits, small tensors staying fp32; plus a step counter per tensor), and the step's temporary: what one step
  allocates, measured on the same optimizer per element count (:class:`StateMeter`), for the largest shard when the
  update runs one tensor at a time, for every shard at once under ``foreach``, none under ``fused``;
* communication buffers: the gathered parameters of the two largest units in their compute dtype (the running
  unit and the one FSDP prefetches), the root unit's (gathered once and kept until backward ends), and the fp32
  reduce-scatter input of the unit with the most trainable elements (the root's reduce comes after the others).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from dsv4.model.v41.engram_table import LocalEngramTable
from dsv4.parallel.wrap import FsdpUnit, fsdp_units, table_parameters


@dataclass
class StateBytes:
    """Per-rank bytes: ``parameters``, ``gradients``, ``optimizer``, ``gathered`` (largest units' gathered
    parameters, two at a time), ``root_gathered`` (kept all step), ``reduce_buffer`` (fp32 gradient
    reduce-scatter input), ``step_temporary`` (what the optimizer step allocates); ``largest_unit``: the class of
    the largest FSDP unit (for the report). ``tables``, ``table_gradients``, ``table_optimizer``: the Engram tables'
    part of ``parameters``, ``gradients`` and ``optimizer`` (row-sharded, never offloaded)."""

    parameters: int
    gradients: int
    optimizer: int
    gathered: int
    root_gathered: int
    reduce_buffer: int
    largest_unit: str
    step_temporary: int = 0
    tables: int = 0
    table_gradients: int = 0
    table_optimizer: int = 0
    pipeline_buffers: int = 0  # a pipeline rank's receive buffers (dsv4.plan.stages)

    @property
    def communication(self) -> int:
        return self.gathered + self.root_gathered + self.reduce_buffer + self.pipeline_buffers


def shard_elements(p: torch.Tensor, mesh_size: int) -> int:
    """Elements of ``p`` one rank holds when FSDP2 shards it over ``mesh_size`` ranks (dim 0, padded chunks)."""
    if p.dim() == 0:
        return 1
    rows = p.shape[0]
    return math.ceil(rows / mesh_size) * (p.numel() // rows if rows else 0)


def parameter_owners(model: nn.Module, units: list[FsdpUnit]) -> dict[nn.Parameter, FsdpUnit]:
    """The FSDP unit that owns each parameter (the first unit in ``units`` whose module contains it); the Engram
    tables' parameters have none (:func:`dsv4.parallel.wrap.table_parameters`)."""
    tables = table_parameters(model)
    owners: dict[nn.Parameter, FsdpUnit] = {}
    for unit in units:
        for p in unit.module.parameters():
            if p not in tables:
                owners.setdefault(p, unit)
    return owners


def table_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor of ``model``'s Engram tables: the float ``weight`` parameter, or the FP8 ``weight`` and ``scale``
    buffers."""
    return [t for m in model.modules() if isinstance(m, LocalEngramTable)
            for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]]


def engram_table_bytes(model: nn.Module, world: int) -> int:
    """The bytes of ``model``'s Engram tables one rank holds when they are row-sharded over ``world`` ranks (the
    first rank's ``ceil(rows / world)`` rows of each, the most any rank holds)."""
    return sum(shard_elements(t, world) * t.element_size() for t in table_tensors(model))


@dataclass(frozen=True)
class OptimizerProfile:
    """What the optimizer keeps and what its step allocates. ``bytes_for(n)``: the real storage bytes of the state
    the optimizer keeps for one trainable fp32 tensor (shard) of ``n`` elements, step counter included (``meter``,
    from :func:`optimizer_profile`; without one, ``n x state_bytes``); ``state_bytes``: bytes per element of a large
    tensor (for the report); ``state_dtype``: what the moments are stored in (``optim.state_dtype``);
    ``step_temporary``: ``"all"`` (a multi-tensor update: every shard's temporaries at once, torch's ``foreach``
    default on GPUs), ``"per_tensor"`` (one tensor at a time: the largest shard's) or ``"none"`` (a fused kernel).
    ``step_bytes_for(n)`` / ``carried_bytes_for(n)``: what one step allocates for a tensor of ``n`` elements, and
    what of it a per-tensor update keeps during the next tensor's (``meter``, from :func:`optimizer_profile`;
    without one, torch's AdamW: one fp32 copy per element under ``foreach``, two per
    tensor and one more kept into the next tensor's, none fused)."""

    state_bytes: float = 8.0
    step_temporary: str = "all"
    state_dtype: str = "float32"
    meter: StateMeter | None = field(default=None, compare=False, repr=False)

    def bytes_for(self, numel: int) -> int:
        """State bytes of one trainable tensor (shard) of ``numel`` elements."""
        return self.meter(numel) if self.meter is not None else int(numel * self.state_bytes)

    def step_bytes_for(self, numel: int) -> int:
        """Bytes one step allocates (its peak above the parameter, gradient and state) for a tensor of ``numel``
        elements."""
        if self.meter is not None:
            return self.meter.step(numel)
        return numel * {"all": 4, "per_tensor": 8, "none": 0}[self.step_temporary]

    def carried_bytes_for(self, numel: int) -> int:
        """Bytes a per-tensor step of a tensor of ``numel`` elements keeps during the next tensor's step."""
        if self.meter is not None:
            return self.meter.carried(numel)
        return numel * 4 if self.step_temporary == "per_tensor" else 0


class StateMeter:
    """Real optimizer state bytes, and what a step allocates, as functions of a tensor's element count, measured on
    the configured optimizer.

    ``meter(n)`` builds the optimizer on a probe parameter of ``n`` fp32 elements, takes one step and sums the storage
    of its state (:func:`dsv4.training.optimizer.optimizer_state_bytes`: DTensor local tensors and tensor-subclass
    inner tensors, e.g. torchao's uint8 codes, fp32 block scales and quantization map); ``meter.step(n)`` is the peak
    of the storage a second step allocates (:class:`~dsv4.plan.trace.AllocationTracer`: the update's temporaries, as
    the optimizer runs here: torchao's 8-bit update eagerly on a CPU, about 14 fp32 copies of the tensor, where CUDA
    compiles it into fewer). Above ``cap`` elements the probe is ``m = cap + n mod block`` elements (the same size
    class for a block-quantizing optimizer: the same remainder modulo its block, above its small-tensor threshold)
    and the bytes are extended linearly: ``bytes(m) + (n - m) / block x (bytes(m + block) - bytes(m))``, exact for
    bytes that are affine in the element count within a size class (fp32, bf16, 8-bit codes with one scale per block,
    and the elementwise temporaries of their updates). Each size is measured once."""

    def __init__(self, build_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 block: int = 256, cap: int = 1 << 16) -> None:
        if cap % block or cap < 4096:
            raise ValueError(f"StateMeter: cap={cap} must be a multiple of block={block} and >= 4096")
        self.build_optimizer, self.block, self.cap = build_optimizer, block, cap
        self._one: dict[int, tuple[int, int]] = {}  # numel -> (state bytes, a step's peak) on one probe
        self._two: dict[int, int] = {}  # numel -> a step's peak on two probes

    def measured(self, numel: int) -> int:
        """The state bytes of real steps on a probe of ``numel`` elements."""
        return self._one_probe(numel)[0]

    def _one_probe(self, numel: int) -> tuple[int, int]:
        if numel not in self._one:
            from dsv4.training.optimizer import optimizer_state_bytes

            optimizer, peak = self._probe_step(1, numel)
            self._one[numel] = (optimizer_state_bytes(optimizer), peak)
        return self._one[numel]

    def _step_peak(self, numel: int) -> int:
        return self._one_probe(numel)[1]

    def _carried(self, numel: int) -> int:
        """A step's peak over two probes of ``numel`` elements less one probe's: what an update leaves allocated into
        the next tensor's (torch's per-tensor AdamW keeps one tensor's ``denom`` until the next one's is made)."""
        if numel not in self._two:
            self._two[numel] = self._probe_step(2, numel)[1]
        return max(self._two[numel] - self._step_peak(numel), 0)

    def _probe_step(self, count: int, numel: int) -> tuple[torch.optim.Optimizer, int]:
        """The optimizer over ``count`` probes after a second step, and that step's peak allocation."""
        from dsv4.plan.trace import AllocationTracer

        probes = [nn.Parameter(torch.zeros(numel)) for _ in range(count)]
        optimizer = self.build_optimizer(probes)
        for probe in probes:
            probe.grad = torch.full_like(probe, 1e-3)
        optimizer.step()  # creates the state
        with AllocationTracer() as tracer:
            optimizer.step()
        return optimizer, tracer.peak

    def per_element(self) -> float:
        """State bytes per element of a large tensor (a multiple of the block)."""
        return (self.measured(self.cap + self.block) - self.measured(self.cap)) / self.block

    def _extended(self, numel: int, measure: Callable[[int], int]) -> int:
        if numel <= self.cap:
            return measure(numel)
        m = self.cap + numel % self.block
        return measure(m) + (numel - m) // self.block * (measure(m + self.block) - measure(m))

    def __call__(self, numel: int) -> int:
        return self._extended(numel, self.measured)

    def step(self, numel: int) -> int:
        """What one step allocates for a tensor of ``numel`` elements (its peak)."""
        return self._extended(numel, self._step_peak)

    def carried(self, numel: int) -> int:
        """What a per-tensor step of a tensor of ``numel`` elements leaves allocated during the next tensor's
        (measured on two probes only when asked)."""
        return self._extended(numel, self._carried)


def optimizer_profile(build_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> OptimizerProfile:
    """Measure the state of the configured optimizer (:class:`StateMeter`, per element count) and name its moments'
    dtype (the factory's ``state_dtype`` keyword; ``float32`` without one). Whether the step's temporaries are one
    tensor's or all at once follows the optimizer's ``fused`` / ``foreach`` settings (an optimizer without a
    ``foreach`` option updates per tensor); their size is measured (:meth:`StateMeter.step`)."""
    meter = StateMeter(build_optimizer)
    probe = nn.Parameter(torch.zeros(64, 4))
    optimizer = build_optimizer([probe])
    probe.grad = torch.full_like(probe, 1e-3)
    optimizer.step()
    stateful = any(isinstance(t, torch.Tensor) and t.numel() == probe.numel()
                   for t in optimizer.state.get(probe, {}).values())
    defaults = optimizer.defaults
    if not stateful or defaults.get("fused"):
        temporary = "none"
    elif defaults.get("foreach", False) is False:
        temporary = "per_tensor"
    else:
        temporary = "all"
    state_dtype = str(getattr(build_optimizer, "keywords", {}).get("state_dtype", "float32"))
    return OptimizerProfile(meter.per_element(), temporary, state_dtype, meter)


def gradient_shard_bytes(modules: list[nn.Module], owners: dict[nn.Parameter, FsdpUnit], mesh_size: dict[str, int],
                         skip: FsdpUnit | None = None) -> int:
    """fp32 gradient shard bytes of the trainable parameters of ``modules`` (units other than ``skip``)."""
    seen, total = set(), 0
    for module in modules:
        for p in module.parameters():
            unit = owners.get(p)  # None: an Engram table, row-sharded over dp x cp (its gradient stays on its owner)
            if p.requires_grad and (unit is None or unit is not skip) and p not in seen:
                seen.add(p)
                total += shard_elements(p, mesh_size[unit.mesh if unit is not None else "dp_cp"]) * 4
    return total


def state_bytes(model: nn.Module, *, world: int, ep: int, compute_dtype: torch.dtype,
                optimizer: OptimizerProfile = OptimizerProfile(), only: set[int] | None = None) -> StateBytes:
    """The state terms of the module docstring for ``model`` (on ``meta``, experts already sharded for EP);
    ``only``: the ids of the parameters and buffers to count (a pipeline rank's, :mod:`dsv4.plan.stages`), all when
    None."""
    units = fsdp_units(model, compute_dtype)
    owners = {p: u for p, u in parameter_owners(model, units).items() if only is None or id(p) in only}
    mesh_size = {"dp_cp": world, "edp": world // ep}
    master, trainable, optimizer_bytes = 0, 0, 0
    step_bytes: list[int] = []  # what the step allocates for each trainable shard
    carried: list[int] = []  # and what a per-tensor step keeps into the next shard's
    gathered: dict[int, int] = {}
    reduced: dict[int, int] = {}  # per unit: the trainable elements its gradient reduce-scatter takes in

    def trainable_shard(local: int) -> int:
        """A trainable shard of ``local`` elements: records what its step allocates and carries; its state bytes."""
        step_bytes.append(optimizer.step_bytes_for(local))
        if optimizer.step_temporary == "per_tensor":
            carried.append(optimizer.carried_bytes_for(local))
        return optimizer.bytes_for(local)

    for p, unit in owners.items():
        local = shard_elements(p, mesh_size[unit.mesh])
        master += local * p.element_size()
        if p.requires_grad:
            trainable += local
            optimizer_bytes += trainable_shard(local)
            reduced[id(unit)] = reduced.get(id(unit), 0) + local * mesh_size[unit.mesh]
        gathered[id(unit)] = gathered.get(id(unit), 0) + local * mesh_size[unit.mesh] * unit.param_dtype.itemsize
    tables, table_trainable, table_optimizer = 0, 0, 0
    for t in table_tensors(model):  # row-sharded over dp x cp, never gathered
        if only is not None and id(t) not in only:
            continue
        local = shard_elements(t, world)
        tables += local * t.element_size()
        if t.requires_grad:
            table_trainable += local
            table_optimizer += trainable_shard(local)
    held = {id(t) for t in table_tensors(model)}
    buffers = sum(b.numel() * b.element_size() for b in model.buffers()
                  if id(b) not in held and (only is None or id(b) in only))
    root = units[-1]
    by_unit = sorted(((gathered.get(id(u), 0), u) for u in units[:-1]), key=lambda t: t[0], reverse=True)
    two_largest = sum(b for b, _ in by_unit[:2])
    _, largest = by_unit[0] if by_unit else (0, root)
    return StateBytes(
        parameters=master + buffers + tables,
        gradients=(trainable + table_trainable) * 4,
        optimizer=optimizer_bytes + table_optimizer,
        step_temporary=(max(step_bytes, default=0) + max(carried, default=0) if optimizer.step_temporary == "per_tensor"
                        else sum(step_bytes)),
        gathered=two_largest,
        root_gathered=gathered.get(id(root), 0),
        reduce_buffer=max((n for key, n in reduced.items() if key != id(root)), default=0) * 4,
        largest_unit=type(largest.module).__name__,
        tables=tables,
        table_gradients=table_trainable * 4,
        table_optimizer=table_optimizer,
    )
