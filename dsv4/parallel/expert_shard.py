"""Expert sharding for expert parallelism: keep this EP rank's slice of every ``GroupedExperts``.

A model is built with all ``E`` routed experts on every rank (same seed -> same weights everywhere). EP rank
``r`` of ``ep`` then keeps global experts ``[r * E / ep, (r + 1) * E / ep)``:

    w1, w3 [E, I, d] -> [E / ep, I, d]      w2 [E, d, I] -> [E / ep, d, I]   (every ``stacked_names()`` tensor,
                                                                       LoRA adapters and kept scales too)
    expert_offset = r * E / ep              num_local_experts = E / ep        num_experts = E (unchanged)

The slices are copies of the unsharded weights, so the sharded model holds exactly the unsharded model's
expert weights. The parameters are new ``nn.Parameter`` objects: build the optimizer (and FSDP) after sharding.
``E`` not divisible by ``ep`` raises ``ValueError``; sharding an already sharded module raises too.

:func:`unshard_experts` is the inverse (all-gather over the EP group), e.g. to save a full checkpoint.
:func:`apply_expert_parallel` is the one way expert parallelism is applied (``DSV4Strategy.parallelize`` calls it):
start-up check, shard, install the dispatcher.

Gradient note: the owner's expert gradients already sum every EP rank's tokens (the dispatcher's backward
brings them); replicas of the same slice in other EP groups (the ``edp`` mesh dimension) still need the usual
data-parallel gradient reduction, like every other parameter.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.model.dispatch import TokenDispatcher
from dsv4.model.moe import GroupedExperts, set_dispatcher
from dsv4.distributed import all_gather_into, group_rank, group_size, resolve_group
from dsv4.parallel.dispatch import TOKEN_DISPATCHERS, EPGroup, build_dispatcher, check_dispatcher_available



def _replace_stacked(experts: GroupedExperts, name: str, value: torch.Tensor) -> None:
    """Put ``value`` in place of the stacked tensor ``name``: a parameter stays a parameter (same
    ``requires_grad``), a buffer (a kept quantized base, :mod:`dsv4.peft`) a buffer."""
    old = getattr(experts, name)
    if isinstance(old, nn.Parameter):
        setattr(experts, name, nn.Parameter(value, requires_grad=old.requires_grad))
    else:
        experts.register_buffer(name, value)


def _grouped_experts(model: nn.Module) -> list[GroupedExperts]:
    return [m for m in model.modules() if isinstance(m, GroupedExperts)]


def _ep_rank_size(ep_group: EPGroup, ep_rank: int | None, ep_size: int | None) -> tuple[int, int]:
    if (ep_rank is None) != (ep_size is None):
        raise ValueError("give both ep_rank and ep_size, or neither (then they come from ep_group)")
    if ep_size is not None:
        if not 0 <= ep_rank < ep_size:
            raise ValueError(f"ep_rank={ep_rank} is outside [0, ep_size={ep_size})")
        return ep_rank, ep_size
    group = resolve_group(ep_group)
    return group_rank(group), group_size(group)


@torch.no_grad()
def shard_experts(
    model: nn.Module, ep_group: EPGroup = None, *, ep_rank: int | None = None, ep_size: int | None = None
) -> int:
    """Turn every full ``GroupedExperts`` of ``model`` into EP rank ``ep_rank``'s slice; returns how many.

    ``ep_rank``/``ep_size`` default to the rank and size of ``ep_group`` (the default group when it is
    ``None`` and ``torch.distributed`` is initialised, else a single rank: nothing changes). Giving them
    explicitly needs no process group (single-process tests, planning).
    """
    rank, size = _ep_rank_size(ep_group, ep_rank, ep_size)
    modules = _grouped_experts(model)
    for experts in modules:
        total = experts.num_experts
        if total % size:
            raise ValueError(f"n_routed_experts={total} is not divisible by ep={size}; choose an ep that divides it")
        if experts.num_local_experts != total or experts.expert_offset != 0:
            raise ValueError(
                f"shard_experts: a GroupedExperts already holds experts [{experts.expert_offset}, "
                f"{experts.expert_offset + experts.num_local_experts}) of {total}; shard a model built with all experts"
            )
    if size == 1:
        return len(modules)
    for experts in modules:
        local = experts.num_experts // size
        offset = rank * local
        for name in experts.stacked_names():
            _replace_stacked(experts, name, getattr(experts, name).detach()[offset : offset + local].clone())
        experts.expert_offset = offset
        experts.num_local_experts = local
    return len(modules)


@torch.no_grad()
def unshard_experts(model: nn.Module, ep_group: EPGroup = None) -> int:
    """Inverse of :func:`shard_experts`: all-gather every expert slice over ``ep_group`` (collective: every EP
    rank must call it) so each rank holds all experts again; returns how many modules were gathered."""
    group = resolve_group(ep_group)
    size, rank = group_size(group), group_rank(group)
    modules = _grouped_experts(model)
    for experts in modules:
        if experts.num_local_experts == experts.num_experts:
            continue
        local = experts.num_local_experts
        if local * size != experts.num_experts or experts.expert_offset != rank * local:
            raise ValueError(
                f"unshard_experts: this rank holds experts [{experts.expert_offset}, {experts.expert_offset + local}) "
                f"of {experts.num_experts}, which is not EP rank {rank}'s slice for an EP group of size {size}"
            )
        for name in experts.stacked_names():
            piece = getattr(experts, name)
            full = torch.empty((experts.num_experts, *piece.shape[1:]), dtype=piece.dtype, device=piece.device)
            # one-byte kept formats (float8 weights and e8m0 scales of a LoRA base) travel as raw bytes
            raw = (lambda t: t.view(torch.uint8)) if piece.element_size() == 1 else (lambda t: t)
            all_gather_into(raw(full), raw(piece.detach().contiguous()), group)
            _replace_stacked(experts, name, full)
        experts.expert_offset = 0
        experts.num_local_experts = experts.num_experts
    return len(modules)


def apply_expert_parallel(
    model: nn.Module, dispatcher: str, ep_group: EPGroup = None, device_type: str = "cpu"
) -> TokenDispatcher:
    """Start-up check, shard the experts over ``ep_group`` (only for an ``expert_parallel`` dispatcher: not for
    ``local``) and install the dispatcher on every MoE layer of ``model``. Returns the dispatcher."""
    check_dispatcher_available(dispatcher, device_type)
    built = build_dispatcher(dispatcher, ep_group)
    if TOKEN_DISPATCHERS.get(dispatcher).expert_parallel:
        shard_experts(model, ep_group)
    set_dispatcher(model, built)
    return built
