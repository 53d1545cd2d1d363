"""Apply FSDP2 to a DSV4 model and clip gradients across its meshes.

* Routed experts (``GroupedExperts``) are sharded over the ``edp`` mesh (the replicas of one EP slice); every
  block and the root over the flattened ``dp_cp`` mesh. Each element of every parameter is then owned by exactly
  one rank of the world, which :func:`clip_grad_norm_` relies on.
* Gradients are SUMMED, not averaged, across ranks (``set_gradient_divide_factor(1.0)``): each rank
  backpropagates its share ``loss_sum / global_label_count`` (:mod:`dsv4.training.loss`), so the sum over ranks
  is the gradient of the global token mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from dsv4.model.moe import GroupedExperts
from dsv4.parallel.mesh import Meshes


def apply_fsdp(model: nn.Module, meshes: Meshes, *, reshard_after_forward: bool = True) -> nn.Module:
    """Shard ``model`` (a ``DSV4ForCausalLM``) in place: experts over ``edp``, blocks and root over ``dp_cp``."""
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            fully_shard(module, mesh=meshes.edp, reshard_after_forward=reshard_after_forward)
    blocks = list(model.model.layers) + list(model.mtp.layers)
    for block in blocks:
        fully_shard(block, mesh=meshes.dp_cp, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=meshes.dp_cp, reshard_after_forward=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # plain SUM collectives (gloo has no AVG/PREMUL_SUM)
    return model


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float | None, group=None) -> torch.Tensor:
    """Global L2 norm of all gradients (each parameter element owned by exactly one rank), clipped to ``max_norm``.

    One all-reduce over ``group`` (WORLD when None) of the local shards' squared norms; works for gradients on
    different meshes (where ``torch.nn.utils.clip_grad_norm_`` fails in torch 2.13) and for plain tensors on a
    single process. Returns the total norm before clipping (fp32 scalar tensor).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    device = local[0].device if local else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in local:
        sq += g.float().pow(2).sum()
    if dist.is_available() and dist.is_initialized() and any(isinstance(g, DTensor) for g in grads):
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
    total = sq.sqrt()
    if max_norm is not None and max_norm > 0:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in local:
            g.mul_(coef.to(g.dtype))
    return total
