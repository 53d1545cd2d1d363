"""Expert-parallel MoE token dispatchers, selected by ``dispatcher=``, their registry and start-up checks.

Every dispatcher implements :class:`dsv4.model.dispatch.TokenDispatcher`::

    y [N, d] = dispatcher.run(experts, x [N, d], topk_ids [N, k] int64, topk_weights [N, k] fp32)
    y[n] = sum_j topk_weights[n, j] * expert_{topk_ids[n, j]}(x[n])      (fp32 accumulation, x.dtype out)

for the ``N`` routed (non-padding) tokens of this rank, whatever rank holds the experts. ``dispatcher=`` is
``auto`` or a name registered in :data:`TOKEN_DISPATCHERS` (a :class:`DispatcherEntry` each; a new dispatcher is
one module plus one registration, ``docs/extending.md``). The built-ins:

* ``local``: :class:`~dsv4.model.dispatch.LocalDispatcher`, every expert on every rank (no EP).
* ``alltoall``: :class:`AllToAllDispatcher`, variable-size all-to-all of the (token, expert) pairs to the experts'
  owners and back (CPU gloo and GPU).
* ``allgather``: :class:`AllGatherDispatcher`, all-gather of the EP group's tokens, local experts, reduce-scatter
  of the partial sums; every rank's block is padded to the group's largest token count
  (``needs_uniform_tokens``).
* ``deepep``: :class:`DeepEPDispatcher`, DeepEP's normal (high-throughput) dispatch/combine kernels
  (``deep_ep.Buffer``, NVLink/RDMA). It needs CUDA and the ``deep_ep`` package; :func:`check_dispatcher_available`
  fails at start-up with what to install. HybridEP (``deep_ep.HybridEpBuffer``, a different API) is not supported.
* ``auto`` (a policy, not an entry): ``local`` when ``ep == 1``, ``alltoall`` otherwise.

EP groups: an EP group of size ``ep`` is a set of consecutive global ranks (``[0, 1], [2, 3]`` for world 4,
ep 2; the ``("edp", "ep")`` mesh of ``dsv4.parallel.mesh``) that together hold all ``E`` experts; EP rank
``r`` holds global experts ``[r * E / ep, (r + 1) * E / ep)`` (see :func:`dsv4.parallel.expert_shard.
shard_experts`). ``ep_group`` may be a ``ProcessGroup``, a 1-D ``DeviceMesh`` or ``None`` (the default group
when ``torch.distributed`` is initialised, else a single rank). A size-1 group runs without collectives.

Invariants: zero-token ranks (``N = 0``, e.g. an all-padding shard) and ranks that send nothing to some
expert or EP rank work; every rank issues the same collectives in the same order, in forward and in backward
(a rank whose experts received no rows still runs them on the empty input, so their output, and with it the
backward hooks of the experts' FSDP unit, stays in the autograd graph). The gate's expert-load
statistics are counted on the source rank by ``MoEGate`` and are untouched here.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from dsv4.distributed import (
    GroupMember,
    all_gather_autograd,
    all_gather_into,
    group_size,
    reduce_scatter_autograd,
    resolve_group,
)
from dsv4.model.dispatch import (ExpertGroup, LocalDispatcher, TokenDispatcher, expert_counts, sort_by_expert,
                                 weighted_sum)
from dsv4.registry import Registry

AUTO = "auto"  # the policy name (not an entry): see resolve_dispatcher

DEEP_EP_INSTALL_HINT = (
    "install the DeepEP library (import name `deep_ep`, github.com/deepseek-ai/DeepEP): build it on a CUDA machine "
    "with `pip install .` in a DeepEP checkout or install a prebuilt CUDA wheel such as `pip install sgl-deep-ep`; "
    "dispatcher=alltoall needs no extra library"
)

EPGroup = dist.ProcessGroup | DeviceMesh | None


# --------------------------------------------------------------------------------------------------- registry


def _runs_everywhere(device_type: str) -> None:
    return None


@dataclass(frozen=True)
class DispatcherEntry:
    """One registered MoE token dispatcher.

    Attributes:
        build: the dispatcher over an EP group (``build(ep_group)``, ``ep_group`` as in the module docstring).
        needs_uniform_tokens: it wants the same token count on every rank (DSpark capture then pads every rank's
            rows to the longest); the built dispatcher declares the same as its ``needs_uniform_tokens``.
        check: fails at start-up, before any model is built, when the dispatcher cannot run on ``device_type``
            (``RuntimeError`` naming every missing piece and what to install); returns None otherwise. It imports
            no optional dependency (``importlib.util.find_spec`` is enough).
        expert_parallel: it runs with a slice of the experts per rank (``ep >= 1``); False: every rank holds every
            expert, so ``ep`` must be 1 and the experts are not sharded (``local``).
    """

    build: Callable[[EPGroup], TokenDispatcher]
    needs_uniform_tokens: bool = False
    check: Callable[[str], None] = _runs_everywhere
    expert_parallel: bool = True


TOKEN_DISPATCHERS: Registry[DispatcherEntry] = Registry("dispatcher", "MoE dispatcher", reserved=(AUTO,))


def resolve_dispatcher(name: str, ep: int) -> str:
    """The dispatcher a run uses: ``auto`` is ``local`` without expert parallelism (``ep == 1``) and ``alltoall``
    with it; other names are kept. A dispatcher that is not ``expert_parallel`` (``local``) with ``ep > 1`` raises
    ValueError (it holds every expert)."""
    if TOKEN_DISPATCHERS.check(name, allow=(AUTO,)) == AUTO:
        return "local" if ep == 1 else "alltoall"
    if ep > 1 and not TOKEN_DISPATCHERS.get(name).expert_parallel:
        first, *others = [n for n in TOKEN_DISPATCHERS if TOKEN_DISPATCHERS.get(n).expert_parallel]
        alternatives = first + (f" (or {', '.join(others)})" if others else "")
        raise ValueError(f"`dispatcher`={name} keeps every expert on every rank and cannot run `ep`={ep}; use "
                         f"dispatcher=auto or {alternatives}")
    return name


def dispatcher_needs_uniform_tokens(name: str) -> bool:
    """True when ``name`` wants the same token count on every rank (its dispatcher declares
    ``needs_uniform_tokens``; DSpark capture then pads every rank's rows to the longest)."""
    return TOKEN_DISPATCHERS.get(name).needs_uniform_tokens


def check_dispatcher_available(name: str, device_type: str) -> None:
    """Fail at start-up (before any model is built) if dispatcher ``name`` cannot run on ``device_type``.

    ``local``, ``alltoall`` and ``allgather`` run everywhere. ``deepep`` needs CUDA devices and the ``deep_ep``
    package: ``RuntimeError`` naming every missing piece and what to install. Unknown names:
    ``ValueError`` listing the valid ones.
    """
    TOKEN_DISPATCHERS.get(name).check(device_type)


def build_dispatcher(name: str, ep_group: EPGroup = None) -> TokenDispatcher:
    """The dispatcher called ``name`` over ``ep_group`` (see the module docstring for ``ep_group``)."""
    return TOKEN_DISPATCHERS.get(name).build(ep_group)


def _build_local(ep_group: EPGroup = None) -> LocalDispatcher:
    if ep_group is not None and group_size(resolve_group(ep_group)) > 1:
        raise ValueError(
            "dispatcher='local' keeps every expert on every rank and cannot run expert parallelism "
            f"(ep group of size {group_size(resolve_group(ep_group))}); use alltoall or allgather"
        )
    return LocalDispatcher()


TOKEN_DISPATCHERS.register("local", DispatcherEntry(build=_build_local, expert_parallel=False))


# ---------------------------------------------------------------------------------------------------- helpers


def _check_expert_slice(experts: ExpertGroup, size: int, rank: int, who: str) -> None:
    """The experts must be EP rank ``rank``'s contiguous slice of ``num_experts / size``."""
    total, local = experts.num_experts, experts.num_local_experts
    if total % size or local != total // size or experts.expert_offset != rank * local:
        raise ValueError(
            f"{who}: EP rank {rank} of {size} must hold experts [{rank * (total // max(size, 1))}, "
            f"{(rank + 1) * (total // max(size, 1))}) of {total}, but holds [{experts.expert_offset}, "
            f"{experts.expert_offset + local}); call dsv4.parallel.expert_shard.shard_experts(model, ep_group) "
            f"(n_routed_experts={total} must be divisible by ep={size})"
        )


def _stay_in_graph(y: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """Keep ``y`` in the autograd graph of ``source``.

    An expert group may return a constant for a rank whose experts received no rows (``GroupedExperts`` does
    not: it runs the empty GEMMs); without this that rank's backward would skip the return all-to-all that the
    other ranks run, and the collectives would not match.
    """
    if torch.is_grad_enabled() and source.requires_grad and not y.requires_grad:
        return y + source * 0
    return y


# ------------------------------------------------------------------------------------------------- all-to-all


class _GroupDispatcher(GroupMember):
    """Base of the expert-parallel dispatchers: the EP process group and this rank's place in it."""

    needs_uniform_tokens = False

    def __init__(self, ep_group: EPGroup = None) -> None:
        self.group = resolve_group(ep_group)


class AllToAllDispatcher(_GroupDispatcher):
    """Expert parallelism with variable-size all-to-all (see the module docstring).

    Per call on EP rank ``r`` of ``P`` (``E_l = E / P`` local experts, ``N`` tokens, top-``k``):

    1. sort the ``N*k`` pairs by global expert: this groups them by owner rank too;
    2. exchange ``counts [P, E_l]`` (pairs per destination expert) with a plain ``all_to_all_single``;
    3. send the token rows ``x[token_of_pair]`` (``[N*k, d]``) with the differentiable all-to-all; the owner
       receives them grouped by source rank, regroups them by local expert and runs ``experts``;
    4. send the results back the same way and ``index_add`` them, times the routing weights, in fp32.

    Autograd runs the two all-to-alls in reverse: gradients reach the tokens (on the source rank) and the expert
    weights (on the owner, summed over every EP rank's tokens).
    """

    def run(
        self, experts: ExpertGroup, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        size, rank = self.size, self.rank
        _check_expert_slice(experts, size, rank, "dispatcher='alltoall'")
        n_local = experts.num_local_experts
        order, token_idx, per_expert = sort_by_expert(topk_ids, experts.num_experts)
        send_x = x.index_select(0, token_idx)  # [N*k, d], grouped by destination rank then expert
        if size == 1:
            recv_counts = per_expert.view(1, n_local)
            recv_x = send_x
        else:
            recv_counts = torch.empty_like(per_expert)
            dist.all_to_all_single(recv_counts, per_expert, group=self.group)  # [P * E_l], equal splits
            recv_counts = recv_counts.view(size, n_local)  # [source rank, local expert]
            send_splits = per_expert.view(size, n_local).sum(1).tolist()
            recv_splits = recv_counts.sum(1).tolist()
            recv_x = funcol.all_to_all_single_autograd(send_x, recv_splits, send_splits, self.group)
        # Received rows are grouped by source rank, then local expert: regroup them by local expert.
        expert_of_row = torch.repeat_interleave(
            torch.arange(n_local, device=recv_counts.device).repeat(size), recv_counts.reshape(-1)
        )
        perm = torch.argsort(expert_of_row, stable=True)
        x_sorted = recv_x.index_select(0, perm)
        y_sorted = _stay_in_graph(experts(x_sorted, recv_counts.sum(0)), x_sorted)
        y_recv = y_sorted.index_select(0, torch.argsort(perm))  # back to the arrival order
        if size == 1:
            y_pairs = y_recv
        else:
            y_pairs = funcol.all_to_all_single_autograd(y_recv, send_splits, recv_splits, self.group)
        weights = topk_weights.reshape(-1).index_select(0, order)
        return weighted_sum(x.shape[0], token_idx, y_pairs, weights).to(x.dtype)


TOKEN_DISPATCHERS.register("alltoall", DispatcherEntry(build=AllToAllDispatcher))


# ------------------------------------------------------------------------------------------------- all-gather


class AllGatherDispatcher(_GroupDispatcher):
    """Expert parallelism by all-gather + reduce-scatter with a uniform per-rank capacity.

    Per call on EP rank ``r`` of ``P``: gather the group's token counts ``[P]``; capacity ``C = max``; pad this
    rank's ``x``/``topk_ids``/``topk_weights`` to ``C`` rows (padded pairs route to expert ``-1``, i.e.
    nowhere); all-gather them to ``[P*C, ...]`` (``x`` and the weights differentiably); run the local experts on
    the pairs that target ``[offset, offset + E_l)``; ``index_add`` the weighted outputs into an fp32
    ``[P*C, d]`` partial; reduce-scatter (sum) it back to ``[C, d]`` and keep the first ``N`` rows.

    ``strict_uniform=True`` raises ``ValueError`` naming the per-rank counts when they differ (every rank
    raises, since every rank sees the same counts).
    """

    needs_uniform_tokens = True

    def __init__(self, ep_group: EPGroup = None, strict_uniform: bool = False) -> None:
        super().__init__(ep_group)
        self.strict_uniform = strict_uniform

    def _token_counts(self, n_tokens: int, device: torch.device) -> list[int]:
        if self.size == 1:
            return [n_tokens]
        mine = torch.tensor([n_tokens], dtype=torch.int64, device=device)
        counts = torch.empty(self.size, dtype=torch.int64, device=device)
        all_gather_into(counts, mine, self.group)
        return counts.tolist()

    def run(
        self, experts: ExpertGroup, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        size, rank = self.size, self.rank
        _check_expert_slice(experts, size, rank, "dispatcher='allgather'")
        n_tokens, k = topk_ids.shape
        counts = self._token_counts(n_tokens, x.device)
        if self.strict_uniform and len(set(counts)) > 1:
            raise ValueError(
                f"dispatcher='allgather' needs the same number of routed tokens on every rank of the EP group, "
                f"got {counts} (EP ranks 0..{size - 1}); pad the ranks to one count (strict_uniform=False) or use dispatcher=alltoall"
            )
        capacity = max(counts)
        pad = capacity - n_tokens
        x_p = F.pad(x, (0, 0, 0, pad)).contiguous()
        ids_p = F.pad(topk_ids, (0, 0, 0, pad), value=-1).contiguous()
        w_p = F.pad(topk_weights, (0, 0, 0, pad)).contiguous()
        if size == 1:
            x_all, ids_all, w_all = x_p, ids_p, w_p
        else:
            x_all = all_gather_autograd(x_p, 0, self.group)  # [P*C, d]
            w_all = all_gather_autograd(w_p, 0, self.group)  # [P*C, k]
            ids_all = torch.empty(size * capacity, k, dtype=ids_p.dtype, device=ids_p.device)
            all_gather_into(ids_all, ids_p, self.group)
        lo, n_local = experts.expert_offset, experts.num_local_experts
        flat = ids_all.reshape(-1)
        pairs = ((flat >= lo) & (flat < lo + n_local)).nonzero().squeeze(-1)
        local_expert = flat.index_select(0, pairs) - lo
        by_expert = torch.argsort(local_expert, stable=True)
        pairs = pairs.index_select(0, by_expert)
        token_idx = pairs // k
        x_sorted = x_all.index_select(0, token_idx)
        y = _stay_in_graph(experts(x_sorted, expert_counts(local_expert, n_local)), x_sorted)
        partial = weighted_sum(size * capacity, token_idx, y, w_all.reshape(-1).index_select(0, pairs))
        out = partial if size == 1 else reduce_scatter_autograd(partial, 0, self.group)
        return out[:n_tokens].to(x.dtype)


TOKEN_DISPATCHERS.register("allgather", DispatcherEntry(
    build=AllGatherDispatcher, needs_uniform_tokens=AllGatherDispatcher.needs_uniform_tokens))


# ----------------------------------------------------------------------------------------------------- DeepEP


def _deepep_check(device_type: str) -> None:
    """DeepEP needs CUDA devices and the ``deep_ep`` package (found without importing it)."""
    problems = []
    if device_type != "cuda":
        problems.append(f"it runs on CUDA GPUs only (this run uses device_type={device_type!r})")
    elif not torch.cuda.is_available():
        problems.append("torch.cuda.is_available() is False")
    if importlib.util.find_spec("deep_ep") is None:
        problems.append("the `deep_ep` package is not installed")
    if problems:
        raise RuntimeError(
            f"dispatcher='deepep' is not available: {'; '.join(problems)}. To use it, {DEEP_EP_INSTALL_HINT}."
        )


class _DeepEPDispatch(torch.autograd.Function):
    """DeepEP dispatch; its backward is a combine of the gradients (the handle carries the layout)."""

    @staticmethod
    def forward(ctx: Any, x, topk_weights, topk_ids, buffer, num_experts: int, state: dict):  # type: ignore[override]
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_ids, num_experts)
        recv_x, recv_ids, recv_weights, _, handle, _ = buffer.dispatch(
            x,
            topk_idx=topk_ids,
            topk_weights=topk_weights,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
        )
        ctx.buffer, ctx.handle = buffer, handle
        state["handle"] = handle
        ctx.mark_non_differentiable(recv_ids)
        return recv_x, recv_weights, recv_ids

    @staticmethod
    def backward(ctx: Any, grad_x, grad_weights, _grad_ids):  # type: ignore[override]
        grad_x, grad_weights, _ = ctx.buffer.combine(
            grad_x.contiguous(), ctx.handle, topk_weights=None if grad_weights is None else grad_weights.contiguous()
        )
        return grad_x, grad_weights, None, None, None, None


class _DeepEPCombine(torch.autograd.Function):
    """DeepEP combine (sum over the ranks that hold a token's experts); its backward is a dispatch."""

    @staticmethod
    def forward(ctx: Any, y, buffer, handle):  # type: ignore[override]
        ctx.buffer, ctx.handle = buffer, handle
        combined, _, _ = buffer.combine(y, handle)
        return combined

    @staticmethod
    def backward(ctx: Any, grad):  # type: ignore[override]
        grad_y = ctx.buffer.dispatch(grad.contiguous(), handle=ctx.handle)[0]
        return grad_y, None, None


class DeepEPDispatcher(_GroupDispatcher):
    """``deepep``: DeepEP's normal (high-throughput) dispatch/combine kernels (``deep_ep.Buffer``) on CUDA.

    DeepEP sends each token once to every rank that owns one of its experts, with its routing row
    (``recv_topk_ids`` local expert ids, ``-1`` where the expert lives elsewhere). The owner runs its experts on
    the valid (row, slot) pairs grouped by local expert, weights and sums them per received row in fp32, and
    DeepEP's combine sums the rows back on the source rank. Autograd: dispatch <-> combine (the handle cached by
    the forward dispatch keeps the layout for both backward passes).

    Dtypes: DeepEP's combine kernel takes bf16 only (and its docs require bf16 for dispatch), so ``x`` of any
    float dtype is cast to bf16 for the dispatch, the received rows are cast back to ``x.dtype`` for the experts
    (whose weights are in the caller's compute dtype), the fp32 per-row sums are cast to bf16 for the combine,
    and the result is returned in ``x.dtype``. The ``.to()`` casts are differentiable, so the backward
    combine/dispatch see bf16 gradients too. With fp32 ``x`` the token rows and the combined sums are therefore
    rounded to bf16 on the way (relative error ~2**-8); routing weights stay fp32. Routing ids are passed as
    ``deep_ep.topk_idx_t`` (int64 unless DeepEP was built with ``EP_NUM_TOPK_IDX_BITS``).

    A size-1 EP group runs :class:`~dsv4.model.dispatch.LocalDispatcher` (DeepEP has no single-rank config).
    This path needs a GPU and the ``deep_ep`` package; ``tests/distributed/test_deepep_glue.py`` runs this glue
    against a gloo stand-in of ``deep_ep.Buffer`` on CPU.
    """

    name = "deepep"

    def __init__(self, ep_group: EPGroup = None) -> None:
        check_dispatcher_available(self.name, "cuda")
        super().__init__(ep_group)
        if self.group is None:
            raise RuntimeError(f"dispatcher={self.name!r} needs torch.distributed (NCCL) to be initialised")
        self._buffer = None

    def _get_buffer(self, hidden_bytes: int):
        import deep_ep  # noqa: PLC0415 - optional GPU dependency, checked at start-up

        buffer_cls, size = deep_ep.Buffer, self.size
        nvl_bytes = rdma_bytes = 0
        for config in (buffer_cls.get_dispatch_config(size), buffer_cls.get_combine_config(size)):
            nvl_bytes = max(nvl_bytes, config.get_nvl_buffer_size_hint(hidden_bytes, size))
            rdma_bytes = max(rdma_bytes, config.get_rdma_buffer_size_hint(hidden_bytes, size))
        buf = self._buffer
        if buf is None or buf.num_nvl_bytes < nvl_bytes or buf.num_rdma_bytes < rdma_bytes:
            self._buffer = buffer_cls(self.group, nvl_bytes, rdma_bytes)
        return self._buffer

    def run(
        self, experts: ExpertGroup, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        _check_expert_slice(experts, self.size, self.rank, f"dispatcher={self.name!r}")
        if self.size == 1:
            return LocalDispatcher().run(experts, x, topk_ids, topk_weights)
        import deep_ep  # noqa: PLC0415

        x_bf16 = x.to(torch.bfloat16).contiguous()
        if (x_bf16.shape[-1] * x_bf16.element_size()) % 16:
            raise ValueError(f"dispatcher={self.name!r}: DeepEP needs hidden * 2 bytes to be a multiple of 16, got "
                             f"hidden={x.shape[-1]}; use dispatcher=alltoall")
        buffer = self._get_buffer(x_bf16.shape[-1] * x_bf16.element_size())
        state: dict = {}
        recv_x, recv_weights, recv_ids = _DeepEPDispatch.apply(
            x_bf16, topk_weights.float().contiguous(),
            topk_ids.to(getattr(deep_ep, "topk_idx_t", torch.int64)).contiguous(), buffer, experts.num_experts, state,
        )
        recv_x = recv_x.to(x.dtype)  # the experts compute in the caller's dtype
        rows, slots = (recv_ids >= 0).nonzero(as_tuple=True)
        local_expert = recv_ids[rows, slots].long()
        by_expert = torch.argsort(local_expert, stable=True)
        rows, slots, local_expert = rows[by_expert], slots[by_expert], local_expert[by_expert]
        x_sorted = recv_x.index_select(0, rows)
        y = _stay_in_graph(
            experts(x_sorted, expert_counts(local_expert, experts.num_local_experts)), x_sorted
        )
        y_rows = weighted_sum(recv_x.shape[0], rows, y, recv_weights[rows, slots])  # fp32 [recv rows, d]
        combined = _DeepEPCombine.apply(y_rows.to(torch.bfloat16), buffer, state["handle"])
        return combined.to(x.dtype)


TOKEN_DISPATCHERS.register("deepep", DispatcherEntry(build=DeepEPDispatcher, check=_deepep_check))

DISPATCHERS: tuple[str, ...] = TOKEN_DISPATCHERS.names()  # the built-in names; TOKEN_DISPATCHERS lists every one
