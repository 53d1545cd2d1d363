"""Apply FSDP2 to a DSV4 model and clip gradients across its meshes.

* Routed experts (``GroupedExperts``) are sharded over the ``edp`` mesh (the replicas of one EP slice); every
  block and the root over the flattened ``dp_cp`` mesh. DeepSeek-V4.1's Engram tables are not FSDP's: they are
  row-sharded over the ``dp_cp`` mesh first (:func:`dsv4.parallel.engram_table.shard_engram_tables`) and passed to
  every ``fully_shard`` as ignored parameters, so no unit gathers or reduces them; a table held in host memory
  (``trainer.engram_tables=host``) has its FP8 buffers set apart while ``fully_shard`` runs, which would otherwise
  move them to the device (:func:`~dsv4.parallel.engram_table.tables_set_apart`). Each element of every parameter
  is then owned by exactly one rank of the world, which :func:`clip_grad_norm_` relies on.
* Gradients are SUMMED, not averaged, across ranks (``set_gradient_divide_factor(1.0)``): each rank
  backpropagates its share ``loss_sum / global_label_count`` (:mod:`dsv4.training.loss`), so the sum over ranks
  is the gradient of the global token mean.
* Mixed precision (``compute_dtype`` bf16 / fp16): FSDP2 keeps fp32 master parameters (and so fp32 gradients and
  optimizer state), all-gathers and computes in ``compute_dtype`` and reduces gradients in fp32. In a LoRA
  model (:mod:`dsv4.peft`) a frozen parameter needs no master copy: it is stored in its unit's compute dtype
  (:func:`store_frozen_in_compute_dtype`), which is what FSDP would have cast it to, so the numbers do not change.
  The modules the released model keeps in fp32 (:data:`FP32_MODULES`: compressors with their gates,
  hyper-connections, the attention sinks) are FSDP units of their own whose parameters are all-gathered and used
  in fp32.
* Host offload (``offload=True``, ``trainer.offload=optimizer``): every unit gets FSDP2's ``CPUOffloadPolicy``. The
  sharded parameters (fp32 masters; a LoRA base's compute-dtype shards), their gradients and so the optimizer state
  live in host memory and the optimizer step runs there; FSDP copies a unit's shards to the device before its
  all-gather and each reduce-scatter output back to the host. Memory is pinned only where CUDA is available. On a
  CPU run the host is the device: the same tensors, the same numbers.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from dsv4.model.attention import AttentionSink
from dsv4.model.compressor import Compressor
from dsv4.model.hyper_connections import HyperConnection, HyperHead
from dsv4.model.moe import GroupedExperts
from dsv4.model.v41.compressor import CSA2Compressor
from dsv4.model.v41.engram_table import LocalEngramTable
from dsv4.parallel.engram_table import shard_engram_tables, sharded_table_parameters, tables_set_apart
from dsv4.parallel.mesh import Meshes
from dsv4.peft.apply import is_lora_model

FP32_MODULES = (Compressor, CSA2Compressor, HyperConnection, HyperHead, AttentionSink)  # V4.1's single-pass
# hyper-connections are HyperConnections
OFFLOAD = ("none", "optimizer")  # trainer.offload: nothing, or shards + gradients + optimizer state to the host


@dataclass(frozen=True)
class FsdpUnit:
    """One ``fully_shard`` call: ``module`` sharded over the mesh named ``mesh`` ("dp_cp" | "edp"), its
    parameters all-gathered in ``param_dtype``; ``reshard_after_forward`` False keeps them gathered until backward."""

    module: nn.Module
    mesh: str
    param_dtype: torch.dtype
    reshard_after_forward: bool


def fsdp_units(model: nn.Module, compute_dtype: torch.dtype = torch.float32,
               reshard_after_forward: bool = True) -> list[FsdpUnit]:
    """The FSDP units of ``model`` in the order :func:`apply_fsdp` shards them (innermost first; a unit owns the
    parameters of its module that no earlier unit owns, except the Engram tables' (:func:`table_parameters`), which
    no unit owns). The memory plan (:mod:`dsv4.plan`) reads the same list."""
    units = []
    if compute_dtype != torch.float32:
        units += [FsdpUnit(m, "dp_cp", torch.float32, reshard_after_forward)
                  for m in model.modules() if isinstance(m, FP32_MODULES)]
    units += [FsdpUnit(m, "edp", compute_dtype, reshard_after_forward)
              for m in model.modules() if isinstance(m, GroupedExperts)]
    units += [FsdpUnit(block, "dp_cp", compute_dtype, reshard_after_forward)
              for block in model_blocks(model)]
    return units + [FsdpUnit(model, "dp_cp", compute_dtype, False)]


def table_parameters(module: nn.Module) -> set[nn.Parameter]:
    """The parameters of the Engram tables inside ``module`` (row-sharded, never an FSDP unit's), whether or not
    they are sharded yet."""
    return {p for m in module.modules() if isinstance(m, LocalEngramTable) for p in m.parameters(recurse=False)}


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The decoder blocks of a causal LM: the backbone's layers, then V4's MTP depths (a V4.1 model has none); of a
    model without a backbone (the DSpark drafter), its own ``layers``."""
    mtp = getattr(model, "mtp", None)
    inner = getattr(model, "model", model)
    return list(inner.layers) + (list(mtp.layers) if mtp is not None else [])


def store_frozen_in_compute_dtype(units: list[FsdpUnit]) -> int:
    """Cast every frozen floating-point parameter to the ``param_dtype`` of the unit that owns it (the first unit
    in ``units`` containing it); returns how many were cast. Trainable parameters keep their fp32 master form."""
    seen: set[int] = {id(p) for unit in units for p in table_parameters(unit.module)}
    cast = 0
    for unit in units:
        for p in unit.module.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if not p.requires_grad and p.is_floating_point() and p.dtype != unit.param_dtype:
                p.data = p.data.to(unit.param_dtype)
                cast += 1
    return cast


def apply_fsdp(
    model: nn.Module, meshes: Meshes, *, compute_dtype: torch.dtype = torch.float32,
    reshard_after_forward: bool = True, offload: bool = False, engram_on_host: bool = False,
    roots: list[nn.Module] | None = None,
) -> nn.Module:
    """Shard ``model`` (a ``DSV4ForCausalLM``) in place: Engram tables by rows over ``dp_cp`` (when not yet), experts
    over ``edp``, blocks and root over ``dp_cp``, computing in ``compute_dtype``; ``offload``: shards, gradients and
    optimizer state in host memory (see the module docstring and :func:`fsdp_units`). The Engram tables stay where
    they are (not offloaded; the caller places them with the model); ``engram_on_host``: held in host memory
    (``trainer.engram_tables=host``), where no move of the model or of FSDP's reaches them.

    ``roots``: shard only what these modules hold (a pipeline rank's stages, :mod:`dsv4.parallel.pipeline`): the
    units inside them, then each of them as the root of its remaining parameters (the embedding, the head), every
    unit kept gathered after forward as the model's root is (``reshard_after_forward`` is not read)."""
    # No unit casts its inputs: the embedding output is already in compute_dtype, the fp32 units upcast inside (so
    # the residual streams stay in compute_dtype), and a cast would rebuild the CPContext argument (a dataclass).
    shard_engram_tables(model, meshes.dp_cp, on_host=engram_on_host)
    ignored = sharded_table_parameters(model)
    units = fsdp_units(model, compute_dtype, reshard_after_forward if roots is None else False)
    if roots is not None:
        held = {id(m) for root in roots for m in root.modules()}
        units = [u for u in units[:-1] if id(u.module) in held] + [FsdpUnit(r, "dp_cp", compute_dtype, False)
                                                                     for r in roots]
    if is_lora_model(model):
        store_frozen_in_compute_dtype(units)
    host = offload_policy(offload)
    with tables_set_apart(model):
        for unit in units:
            policy = MixedPrecisionPolicy(param_dtype=None if unit.param_dtype == torch.float32 else unit.param_dtype,
                                          reduce_dtype=torch.float32, cast_forward_inputs=False)
            fully_shard(unit.module, mesh=getattr(meshes, unit.mesh), mp_policy=policy,
                        reshard_after_forward=unit.reshard_after_forward, offload_policy=host,
                        ignored_params=ignored or None)
    for module in {id(m): m for top in (roots or [model]) for m in top.modules()}.values():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no AVG/PREMUL_SUM)
    return model


@contextlib.contextmanager
def gathered(model: nn.Module) -> Iterator[nn.Module]:
    """Every FSDP unit of ``model`` (sharded by :func:`apply_fsdp`) holds its whole parameters for the duration, so
    code may call its submodules and read its parameters directly (decoding with the DSpark drafter's Markov head,
    one token at a time); afterwards each unit is sharded again, the blocks resharding after forward and the root
    not, as :func:`apply_fsdp` leaves them. Every rank of the units' meshes must enter and leave together. A model
    without FSDP units is left as it is."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield model
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(unit is not model, recurse=False)


def offload_policy(offload: bool) -> OffloadPolicy:
    """FSDP2's offload policy: ``CPUOffloadPolicy`` (pinned host memory only where CUDA is available) or none."""
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()


def offload_policies(model: nn.Module) -> list[OffloadPolicy]:
    """The offload policy FSDP recorded for each unit of ``model`` that holds parameters (in module order)."""
    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
    return [g.offload_policy for g in groups if g is not None]


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float | None, group=None) -> torch.Tensor:
    """Global L2 norm of all gradients (each parameter element owned by exactly one rank), clipped to ``max_norm``.

    One all-reduce over ``group`` (WORLD when None) of the local shards' squared norms; works for gradients on
    different meshes (where ``torch.nn.utils.clip_grad_norm_`` fails in torch 2.13) and for plain tensors on a
    single process. Returns the total norm before clipping (fp32 scalar tensor). A non-finite norm leaves the
    gradients as they are (the caller decides; :mod:`dsv4.training.nonfinite` names the first bad one).
    Offloaded gradients (host memory) are summed on the host; the all-reduce runs on the device of their mesh.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    device = local[0].device if local else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in local:
        sq += g.float().pow(2).sum()
    meshes = [g.device_mesh for g in grads if isinstance(g, DTensor)]
    if dist.is_available() and dist.is_initialized() and meshes:
        reduced = sq.to(meshes[0].device_type)  # an NCCL group reduces device tensors only
        dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=group)
        sq = reduced.to(device)
    total = sq.sqrt()
    if max_norm is not None and max_norm > 0:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        coef = torch.where(torch.isfinite(total), coef, torch.ones_like(coef))  # no host sync
        for g in local:
            g.mul_(coef.to(g.dtype))
    return total
