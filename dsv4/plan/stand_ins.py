"""Shape-true stand-ins for the parts of a training step that depend on data or on other ranks.

The memory plan runs real model code on the ``meta`` device (:mod:`dsv4.plan.trace`); three things cannot run
there as they do on a rank, so these replace them with what has the same shapes, dtypes and lifetimes:

* :class:`PlanCP`: a :class:`~dsv4.model.context_parallel.ContextParallel` for rank ``rank`` of ``size`` (layout
  ``balance``, routes planned by the real :func:`~dsv4.parallel.cp.routes.plan_routes`) for one document spanning
  every rank (the worst case: the rank holding the last chunk receives every earlier compressed row). Received
  tensors are new tensors of the received shape; the chunk summaries are those of that one document.
* :class:`PlanDispatcher`: the MoE with every expert receiving the same number of (token, expert) pairs (the
  balance the load-balancing bias aims for); with expert parallelism the all-to-all's receive buffers are new
  tensors of the sent size (uniform routing sends and receives as many rows as it routes).
* :func:`plan_metadata`: the attention metadata of that document, built by the real code on the CPU (it reads a
  few integers) and moved to ``meta``.

**Bytes moved.** While a :class:`~dsv4.parallel.cp.traffic.TrafficCounter` is set as their ``traffic`` (the tracer
sets one per traced segment), both stand-ins count what the rank they stand for would send and receive, by kind,
as the real collectives count it (:mod:`dsv4.parallel.cp.collectives`: an all-gather of ``n`` bytes per rank over
``C`` ranks is ``n (C - 1)`` each way; a row exchange, the pieces of its :class:`~dsv4.parallel.cp.collectives.RowPlan`
to and from other ranks). :class:`PlanCP` plans every halo from its route exactly as ``CPContext`` does (the real
``HaloRoute.plan``; the compressed-row gathers arrive as the real ``RowPlan``), so its counts are the counter's of
that rank on that document. The backward of a differentiable exchange (each received piece's gradient back to its
sender: :func:`~dsv4.parallel.cp.collectives.exchange_rows`) is counted when autograd computes the received
tensor's gradient, under ``"<kind>.backward"``; a recomputed forward (``activation_checkpointing``) runs the stand-in
again and is counted again, as the real exchange runs again. :class:`PlanDispatcher` counts the dispatcher's
collectives (``dispatcher``: ``alltoall``, ``allgather``, or ``deepep``, an estimate) under uniform routing: each of
the ``ep`` ranks' experts receives ``1 / ep`` of a rank's (token, expert) pairs, so ``(ep - 1) / ep`` of them leave
the rank.
"""

from __future__ import annotations

import dataclasses
from math import comb, prod

import torch

from dsv4.config import DSV4Config
from dsv4.model.attention_metadata import AttentionMetadata, build_attention_metadata
from dsv4.model.chunk_summary import FIELD, LIMIT
from dsv4.model.context_parallel import ReadyRows
from dsv4.model.dispatch import weighted_sum
from dsv4.parallel.cp.collectives import HaloRoute, RowPlan
from dsv4.parallel.cp.layout import CPLayout
from dsv4.parallel.cp.routes import PlannedLayout
from dsv4.parallel.cp.traffic import TrafficCounter


def _count_backward(out: torch.Tensor, traffic: TrafficCounter, kind: str, sent: int, received: int) -> None:
    """Count ``sent`` and ``received`` bytes under ``"<kind>.backward"`` when autograd computes ``out``'s gradient
    (the backward of the exchange that made ``out``; nothing when ``out`` takes no gradient)."""
    if out.requires_grad and (sent or received):
        out.register_hook(lambda _grad: traffic.add(f"{kind}.backward", sent=sent, received=received))


def _piece_bytes(tensor: torch.Tensor, dim: int) -> int:
    """Bytes of one position along ``dim`` of one row (dim 0) of ``tensor``: what a piece of one row moves."""
    rows, length = tensor.shape[0], tensor.shape[dim]
    inner = prod(tensor.shape) // max(rows * length, 1)
    return inner * tensor.element_size()


class PlanCP(PlannedLayout):
    """A ``CPContext`` stand-in for rank ``rank`` of ``size`` under ``balance`` (see the module docstring)."""

    def __init__(self, rank: int, size: int, balance: str = "none") -> None:
        self.rank, self.size, self.halo, self.balance = rank, size, None, balance
        self.layout = CPLayout(size, balance)
        self.traffic: TrafficCounter | None = None  # set while a segment is traced (module docstring)
        self.chunk_units: int | None = None  # a chunk's length in shard multiples (plan_metadata sets it)

    def _count(self, tensor: torch.Tensor, out: torch.Tensor, plan: RowPlan, dim: int, kind: str) -> None:
        """Count a row exchange of ``plan`` on ``tensor`` (pieces along ``dim``), and its backward on ``out``."""
        if self.traffic is None:
            return
        piece = _piece_bytes(tensor, dim)
        sent = sum(t.hi - t.lo for ts in plan.sends.values() for t in ts) * piece
        received = sum(t.hi - t.lo for ts in plan.recvs.values() for t in ts) * piece
        self.traffic.add(kind, sent=sent, received=received)
        # backward: each received piece's gradient goes back to its sender, each sent piece's comes back
        _count_backward(out if out is not tensor else tensor, self.traffic, kind, sent=received, received=sent)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def gather_rows(self, local: torch.Tensor, kind: str = "") -> torch.Tensor:
        """Every chunk's summary ``[B, V]`` from this rank's ``[R, 1]`` (:mod:`dsv4.model.chunk_summary`): on
        the CPU, where the metadata is built, those of one document over every chunk; on ``meta``, the shape."""
        batch = local.shape[0] // self.layout.chunks_per_rank
        if self.traffic is not None and self.size > 1:  # CPContext.gather_rows: an all-gather of the local rows
            n = local.numel() * local.element_size() * (self.size - 1)
            self.traffic.add(kind or "metadata", sent=n, received=n)
        if local.device.type == "meta":
            return local.new_empty((batch, local.shape[1] * self.layout.num_chunks) + tuple(local.shape[2:]))
        # one document over every chunk: chunk v continues it from position v * l, its last token ends at (v + 1) l;
        # the fields as chunk_summaries writes them: positions in shard multiples, a tail at or past LIMIT left 0 (no
        # successor can start there), a head at or past it (a chunk the real run refuses as bad input) left 0 here:
        # no route, and the communication table says so (dsv4.plan.comm)
        units = self.chunk_units
        if units is None:  # l in shard multiples, from this chunk's tail field
            units = ((int(local[0, 0]) >> 16) & (FIELD - 1)) // (self.layout.chunks(self.rank)[0] + 1)
        v = torch.arange(self.layout.num_chunks)
        head = torch.where((v > 0) & (v * units < LIMIT), v * units + 1, 0)
        tail = torch.where((v + 1) * units < LIMIT, (v + 1) * units, 0)
        ids = FIELD**2 * (1 + FIELD)  # document 1 first and last
        rows = (head + FIELD * tail + ids).to(local.dtype)[None]
        return rows.expand(batch, -1).clone()

    def halo_exchange(self, tensor: torch.Tensor, rows: int, dim: int = 1, kind: str = "halo",
                      route=None) -> torch.Tensor:
        out = tensor.narrow(dim, tensor.shape[dim] - rows, rows).clone()  # received: a new tensor, same shape
        if self.traffic is not None and self.size > 1 and rows > 0:  # the route's plan, as CPContext runs it
            dim = dim % tensor.dim()
            route = route if route is not None else HaloRoute.contiguous(self.size, tensor.shape[0])
            self._count(tensor, out, route.plan(self.rank, tensor.shape[0], tensor.shape[dim], rows), dim, kind)
        return out

    def start_halo_exchange(self, tensor: torch.Tensor, rows: int, dim: int = 1, kind: str = "halo", route=None):
        return ReadyRows(self.halo_exchange(tensor, rows, dim, kind, route))

    def start_exchange_rows(self, tensor: torch.Tensor, plan, dim: int = 1, kind: str = "rows"):
        return ReadyRows(self.exchange_rows(tensor, plan, dim, kind))

    def exchange_rows(self, tensor: torch.Tensor, plan, dim: int = 1, kind: str = "rows") -> torch.Tensor:
        received = plan.out_len - tensor.shape[dim]
        if received == 0:
            out = tensor
        else:
            shape = list(tensor.shape)
            shape[dim] = received
            # received rows: a new tensor on the autograd path (their gradient goes back to their owners)
            out = torch.cat([tensor.narrow(dim, 0, 1).expand(shape).clone(), tensor], dim=dim)
        self._count(tensor, out, plan, dim % tensor.dim(), kind)
        return out


class PlanDispatcher:
    """The routed experts with every local expert receiving the same number of pairs (see the module docstring).
    ``ep``: the EP group's size and ``dispatcher`` the dispatcher the run uses, for the bytes it moves (counted while
    ``traffic`` is set)."""

    needs_uniform_tokens = False

    def __init__(self, expert_parallel: bool = False, ep: int = 1, dispatcher: str = "alltoall") -> None:
        if dispatcher not in DISPATCHER_TRAFFIC:
            raise ValueError(f"PlanDispatcher: no traffic model for dispatcher {dispatcher!r}; "
                             f"known: {', '.join(DISPATCHER_TRAFFIC)}")
        self.expert_parallel, self.ep, self.dispatcher = expert_parallel, ep, dispatcher
        self.traffic: TrafficCounter | None = None

    def run(self, experts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        n, k = topk_ids.shape
        pairs, local = n * k, experts.num_local_experts
        counts = torch.full((local,), pairs // local, dtype=torch.long)
        counts[: pairs % local] += 1
        token_idx = torch.arange(pairs, device=x.device) // k
        sent = x.index_select(0, token_idx)
        received = sent.clone() if self.expert_parallel else sent  # the all-to-all's receive buffer
        counting = self.traffic is not None and self.expert_parallel and self.ep > 1
        if counting:  # the dispatch (and, through the hook, its backward), in the real dispatcher's order
            there, back = DISPATCHER_TRAFFIC[self.dispatcher](self.ep, experts, x, topk_ids, topk_weights)
            self.traffic.add("ep_dispatch", sent=there[0], received=there[1])
            _count_backward(received, self.traffic, "ep_dispatch", *back[0])
        y = experts(received, counts)
        if self.expert_parallel:
            y = y.clone()  # and the return trip's
        if counting:  # the combine
            self.traffic.add("ep_combine", sent=there[2], received=there[3])
            _count_backward(y, self.traffic, "ep_combine", *back[1])
        return weighted_sum(n, token_idx, y, topk_weights.reshape(-1)).to(x.dtype)


def _alltoall_traffic(ep: int, experts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
    """:class:`~dsv4.parallel.dispatch.AllToAllDispatcher` under uniform routing: the per-expert counts (int64, one
    per local expert of each rank), the ``(ep - 1) / ep`` of the ``N k`` pair rows that leave the rank, and the same
    rows back. Returns ``((dispatch sent, dispatch received, combine sent, combine received), ((dispatch backward
    sent, received), (combine backward sent, received)))``: a backward moves its forward's bytes the other way."""
    n, k = topk_ids.shape
    rows = round(n * k * (ep - 1) / ep) * x.shape[-1] * x.element_size()
    counts = (ep - 1) * experts.num_local_experts * 8
    return (counts + rows, counts + rows, rows, rows), ((rows, rows), (rows, rows))


def _allgather_traffic(ep: int, experts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
    """:class:`~dsv4.parallel.dispatch.AllGatherDispatcher` with the same token count on every rank (the capacity):
    the token counts (int64), then ``x``, the routing weights and ids gathered, and the fp32 partial sums
    reduce-scattered; backward: ``x``'s and the weights' gradients reduce-scattered, the partial sums' gradient
    gathered."""
    n, k = topk_ids.shape
    others = ep - 1
    rows = n * x.shape[-1] * x.element_size() * others
    weights = n * k * topk_weights.element_size() * others
    there = others * 8 + rows + weights + n * k * topk_ids.element_size() * others
    partial = n * x.shape[-1] * 4 * others
    back_weights = weights if topk_weights.requires_grad else 0
    return (there, there, partial, partial), ((rows + back_weights, rows + back_weights), (partial, partial))


def _deepep_traffic(ep: int, experts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
    """An estimate of :class:`~dsv4.parallel.dispatch.DeepEPDispatcher` (not measured: it needs CUDA and DeepEP):
    each token travels once to every other rank that owns one of its ``k`` experts (uniformly chosen:
    ``(ep - 1) (1 - C(E - E_l, k) / C(E, k))`` ranks on average), as bf16 with its ``k`` fp32 weights and int64 ids,
    and comes back as one bf16 row from each; backward the same rows (and the weights' gradients) the other way."""
    n, k = topk_ids.shape
    e, local = experts.num_experts, experts.num_local_experts
    ranks = (ep - 1) * (1 - comb(e - local, k) / comb(e, k)) if e >= k else ep - 1
    copies = round(n * ranks)
    rows = copies * x.shape[-1] * 2
    weights = copies * k * 4
    there = rows + weights + copies * k * 8
    back = rows + (weights if topk_weights.requires_grad else 0)
    return (there, there, rows, rows), ((back, back), (rows, rows))


# what each dispatcher moves per call (PlanDispatcher.run); "local" never runs with ep > 1
DISPATCHER_TRAFFIC = {"alltoall": _alltoall_traffic, "allgather": _allgather_traffic, "deepep": _deepep_traffic,
                      "local": _alltoall_traffic}


def _to_meta(value):
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, tuple):  # RoPE tables (cos, sin)
        return tuple(_to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_meta(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(value, **{f.name: _to_meta(getattr(value, f.name))
                                             for f in dataclasses.fields(value)})
    return value


def plan_metadata(config: DSV4Config, rows: int, local_len: int, cp: PlanCP) -> AttentionMetadata:
    """The metadata of rank ``cp.rank``'s ``rows`` local rows of ``local_len`` (its chunks of whole rows, each one
    document over all ranks), on ``meta``."""
    local = cp.layout.local_rows(cp.rank, rows // cp.layout.chunks_per_rank)
    cp.chunk_units = local_len // config.shard_multiple
    positions = torch.stack([torch.arange(v * local_len, (v + 1) * local_len) for _, v in local])
    return _to_meta(build_attention_metadata(config, positions, torch.ones_like(positions), None,
                                             cp if cp.size > 1 else None))
