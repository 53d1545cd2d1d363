"""The CP runtime's collectives: differentiable all-gather, metadata all-gather, and row exchanges (halo, causal
gather) between the chunks of a :class:`~dsv4.parallel.cp.layout.CPLayout`.

These are the exchanges the model makes through :class:`~dsv4.parallel.cp.context.CPContext` (planned by
:mod:`dsv4.parallel.cp.routes`). All functions are identities
(or cheap local equivalents) when the CP group is ``None`` or has one rank, so model code can call them
unconditionally. Each accepts an optional :class:`~dsv4.parallel.cp.traffic.TrafficCounter`
and a ``kind`` label; bytes are counted as the point-to-point volume this rank sends and receives (an all-gather
of ``n`` bytes per rank over ``C`` ranks: ``n*(C-1)`` each way). Backward traffic is recorded under
``f"{kind}.backward"``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dsv4.parallel.cp.traffic import TrafficCounter
from dsv4.distributed import ProcessGroup, all_gather_into, group_rank, group_size, reduce_scatter_into
from dsv4.model.context_parallel import ReadyRows


def _enabled(group: ProcessGroup | None) -> bool:
    return group_size(group) > 1


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _gather_dim0(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Plain all-gather of ``x`` along dim 0 in rank order (bools travel as uint8)."""
    size = group_size(group)
    send = x.contiguous()
    is_bool = send.dtype == torch.bool
    if is_bool:
        send = send.to(torch.uint8)
    out = send.new_empty((size * send.shape[0],) + tuple(send.shape[1:]))
    all_gather_into(out, send, group)
    return out.bool() if is_bool else out


class _AllGather(torch.autograd.Function):
    """Concatenate every rank's tensor along ``dim``; backward reduce-scatters (sums) into the owner."""

    @staticmethod
    def forward(ctx, x, dim, group, traffic, kind):  # type: ignore[override]
        ctx.dim, ctx.group, ctx.traffic, ctx.kind = dim, group, traffic, kind
        size = group_size(group)
        out = _gather_dim0(x.movedim(dim, 0), group).movedim(0, dim)
        if traffic is not None:
            n = _nbytes(x) * (size - 1)
            traffic.add(kind, sent=n, received=n)
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        group, dim = ctx.group, ctx.dim
        size = group_size(group)
        g = grad.movedim(dim, 0).contiguous()
        out = g.new_empty((g.shape[0] // size,) + tuple(g.shape[1:]))
        reduce_scatter_into(out, g, group)
        if ctx.traffic is not None:
            n = _nbytes(out) * (size - 1)
            ctx.traffic.add(f"{ctx.kind}.backward", sent=n, received=n)
        return out.movedim(0, dim), None, None, None, None


def all_gather(
    tensor: torch.Tensor,
    dim: int = 1,
    cp_group: ProcessGroup | None = None,
    *,
    traffic: TrafficCounter | None = None,
    kind: str = "all_gather",
) -> torch.Tensor:
    """Differentiable all-gather along ``dim`` in rank order.

    Without CP the same object is returned. With CP the result has ``C`` times the rank's size along ``dim``; the
    backward pass sums every rank's gradient slice into its owner, so if each rank computes
    ``loss = (gathered * w).sum()`` the local gradient is ``C * w[own slice]``. All ranks must pass tensors of
    the same shape.
    """
    if not _enabled(cp_group):
        return tensor
    dim = dim % tensor.dim()
    return _AllGather.apply(tensor, dim, cp_group, traffic, kind)


def all_gather_metadata(
    tensor: torch.Tensor | None,
    dim: int = 1,
    cp_group: ProcessGroup | None = None,
    *,
    traffic: TrafficCounter | None = None,
    kind: str = "metadata",
) -> torch.Tensor | None:
    """Non-differentiable all-gather of integer/bool metadata along ``dim`` (identity without CP or for None)."""
    if tensor is None or not _enabled(cp_group):
        return tensor
    dim = dim % tensor.dim()
    with torch.no_grad():
        out = _gather_dim0(tensor.detach().movedim(dim, 0), cp_group).movedim(0, dim).contiguous()
    if traffic is not None:
        n = _nbytes(tensor) * (group_size(cp_group) - 1)
        traffic.add(kind, sent=n, received=n)
    return out


def _start_p2p(ops: list[tuple[str, torch.Tensor, int]], group: ProcessGroup) -> list:
    """Post (``"send"|"recv"``, tensor, group rank) operations together; return their work handles."""
    if not ops:
        return []
    p2p = [
        dist.P2POp(dist.isend if op == "send" else dist.irecv, t, dist.get_global_rank(group, peer), group)
        for op, t, peer in ops
    ]
    return dist.batch_isend_irecv(p2p)


def _p2p(ops: list[tuple[str, torch.Tensor, int]], group: ProcessGroup) -> None:
    """Run (``"send"|"recv"``, tensor, group rank) operations together and wait for all of them."""
    for work in _start_p2p(ops, group):
        work.wait()


@dataclass(frozen=True)
class Transfer:
    """One piece of a row exchange: rows ``[lo, hi)`` (along the exchanged dim) of local row ``src_row`` of rank
    ``src_rank`` land at ``[offset, offset + hi - lo)`` of local row ``dst_row`` of rank ``dst_rank``."""

    src_rank: int
    src_row: int
    lo: int
    hi: int
    dst_rank: int
    dst_row: int
    offset: int


@dataclass
class RowPlan:
    """One rank's part of a row exchange whose result is ``[out_rows, out_len, ...]`` (zeros where no piece lands).

    ``sends[peer]`` / ``recvs[peer]``: the pieces this rank sends to / receives from ``peer``, in the order both
    sides list them (:func:`row_plan` keeps the order of one global list, so the sender's list is the receiver's);
    ``local``: pieces that stay on this rank (a copy)."""

    out_rows: int
    out_len: int
    sends: dict[int, list[Transfer]] = field(default_factory=dict)
    recvs: dict[int, list[Transfer]] = field(default_factory=dict)
    local: list[Transfer] = field(default_factory=list)


def row_plan(transfers: list[Transfer], rank: int, out_rows: int, out_len: int) -> RowPlan:
    """This rank's :class:`RowPlan` from the global list of ``transfers`` (the same list, in the same order, on every
    rank); empty pieces are dropped."""
    plan = RowPlan(out_rows, out_len)
    for t in transfers:
        if t.hi <= t.lo or rank not in (t.src_rank, t.dst_rank):
            continue
        if t.src_rank == t.dst_rank:
            plan.local.append(t)
        elif t.src_rank == rank:
            plan.sends.setdefault(t.dst_rank, []).append(t)
        else:
            plan.recvs.setdefault(t.src_rank, []).append(t)
    return plan


def _pack(x: torch.Tensor, pieces: list[tuple[int, int, int]]) -> torch.Tensor:
    """Rows ``x[row, lo:hi]`` of every ``(row, lo, hi)``, concatenated along the row dim -> ``[sum(hi - lo), ...]``."""
    return torch.cat([x[row, lo:hi] for row, lo, hi in pieces])


def _post_rows(x: torch.Tensor, plan: RowPlan, group) -> tuple[list, dict, dict]:
    """Post the sends and receives of ``plan`` for ``x``; ``(work handles, outgoing, incoming buffers)``."""
    outgoing = {p: _pack(x, [(t.src_row, t.lo, t.hi) for t in ts]) for p, ts in plan.sends.items()}
    incoming = {p: x.new_empty((sum(t.hi - t.lo for t in ts),) + tuple(x.shape[2:])) for p, ts in plan.recvs.items()}
    works = _start_p2p([("send", b, p) for p, b in outgoing.items()] + [("recv", b, p) for p, b in incoming.items()],
                       group)
    return works, outgoing, incoming


class _RowExchange(torch.autograd.Function):
    """Run a :class:`RowPlan` on ``x [rows, n, ...]`` (the exchanged dim is 1); backward returns every piece's
    gradient to its source row, summed there. ``posted``: the exchange already posted and waited for
    (:class:`PendingRows`), so forward only assembles what arrived."""

    @staticmethod
    def forward(ctx, x, plan, group, traffic, kind, posted=None):  # type: ignore[override]
        ctx.plan, ctx.group, ctx.traffic, ctx.kind, ctx.shape = plan, group, traffic, kind, x.shape
        out = x.new_zeros((plan.out_rows, plan.out_len) + tuple(x.shape[2:]))
        if posted is None:
            works, outgoing, incoming = _post_rows(x, plan, group)
            for work in works:
                work.wait()
        else:
            outgoing, incoming = posted
        for p, buf in incoming.items():
            for t, piece in zip(plan.recvs[p], buf.split([t.hi - t.lo for t in plan.recvs[p]])):
                out[t.dst_row, t.offset:t.offset + t.hi - t.lo] = piece
        for t in plan.local:
            out[t.dst_row, t.offset:t.offset + t.hi - t.lo] = x[t.src_row, t.lo:t.hi]
        if traffic is not None:
            traffic.add(kind, sent=sum(_nbytes(b) for b in outgoing.values()),
                        received=sum(_nbytes(b) for b in incoming.values()))
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        plan = ctx.plan
        grad = grad.contiguous()
        grad_x = grad.new_zeros(ctx.shape)
        # the gradients go back the way the pieces came
        returned = {p: _pack(grad, [(t.dst_row, t.offset, t.offset + t.hi - t.lo) for t in ts])
                    for p, ts in plan.recvs.items()}
        incoming = {p: grad.new_empty((sum(t.hi - t.lo for t in ts),) + tuple(ctx.shape[2:]))
                    for p, ts in plan.sends.items()}
        _p2p([("send", b, p) for p, b in returned.items()] + [("recv", b, p) for p, b in incoming.items()], ctx.group)
        for p, buf in incoming.items():
            for t, piece in zip(plan.sends[p], buf.split([t.hi - t.lo for t in plan.sends[p]])):
                grad_x[t.src_row, t.lo:t.hi] += piece
        for t in plan.local:
            grad_x[t.src_row, t.lo:t.hi] += grad[t.dst_row, t.offset:t.offset + t.hi - t.lo]
        if ctx.traffic is not None:
            ctx.traffic.add(f"{ctx.kind}.backward", sent=sum(_nbytes(b) for b in returned.values()),
                            received=sum(_nbytes(b) for b in incoming.values()))
        return grad_x, None, None, None, None, None


class PendingRows:
    """A row exchange whose messages are in flight (:func:`start_exchange_rows`): the work between the start and
    :meth:`wait` overlaps the transfer. :meth:`wait` returns what :func:`exchange_rows` would have (differentiable;
    the backward exchange runs synchronously). Time blocked in :meth:`wait` is recorded as the kind's wait time."""

    def __init__(self, x: torch.Tensor, plan: RowPlan, dim: int, group, traffic: TrafficCounter | None, kind: str
                 ) -> None:
        self.x, self.plan, self.dim, self.group, self.traffic, self.kind = x, plan, dim, group, traffic, kind
        self.works, self.outgoing, self.incoming = _post_rows(x, plan, group)

    def wait(self) -> torch.Tensor:
        start = time.perf_counter()
        for work in self.works:
            work.wait()
        if self.traffic is not None:
            self.traffic.add_wait(self.kind, time.perf_counter() - start)
        out = _RowExchange.apply(self.x, self.plan, self.group, self.traffic, self.kind,
                                 (self.outgoing, self.incoming))
        return out.movedim(1, self.dim)


def start_exchange_rows(
    tensor: torch.Tensor,
    plan: RowPlan,
    dim: int = 1,
    cp_group: ProcessGroup | None = None,
    *,
    traffic: TrafficCounter | None = None,
    kind: str = "rows",
) -> PendingRows:
    """:func:`exchange_rows`, started: post the messages now and return a handle whose ``wait()`` gives the result
    (``tensor`` must not change in place before it)."""
    dim = dim % tensor.dim()
    if dim == 0:
        raise ValueError("exchange_rows: dim 0 indexes the rows; exchange along another dim")
    return PendingRows(tensor.movedim(dim, 1), plan, dim, cp_group, traffic, kind)


def exchange_rows(
    tensor: torch.Tensor,
    plan: RowPlan,
    dim: int = 1,
    cp_group: ProcessGroup | None = None,
    *,
    traffic: TrafficCounter | None = None,
    kind: str = "rows",
) -> torch.Tensor:
    """Differentiable row exchange: run ``plan`` (this rank's part of a global list of :class:`Transfer` pieces)
    on ``tensor`` with the pieces along ``dim``; the result has ``plan.out_rows`` rows (dim 0) and
    ``plan.out_len`` along ``dim``. Only peers with pieces exchange messages (one per direction)."""
    return start_exchange_rows(tensor, plan, dim, cp_group, traffic=traffic, kind=kind).wait()


@dataclass(frozen=True)
class HaloRoute:
    """Who sends its last rows to whom in a halo exchange: ``(src_rank, src_row, dst_rank, dst_row)`` pairs, in the
    same order on every rank (the receiving chunk ascending, then the batch row).

    ``depths`` (None: no limit): per pair, how many of the source row's last rows the receiver can read at most,
    i.e. how many columns of the document the receiving chunk's first token continues lie before it (rows of an
    earlier document or padding are read by no query, so they do not travel). A pair moves ``min(rows, depth)``
    rows and the receiver's earlier slots stay zeros."""

    pairs: tuple[tuple[int, int, int, int], ...]
    first: bool = False  # send the FIRST rows instead of the last (a chunk's head to its predecessor)
    depths: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.depths is not None and len(self.depths) != len(self.pairs):
            raise ValueError(f"HaloRoute: {len(self.depths)} depths for {len(self.pairs)} pairs")

    @staticmethod
    def contiguous(size: int, rows: int) -> "HaloRoute":
        """Rank ``r`` -> rank ``r + 1``, every one of the ``rows`` local rows to the same row."""
        return HaloRoute(tuple((r - 1, b, r, b) for r in range(1, size) for b in range(rows)))

    def plan(self, rank: int, out_rows: int, length: int, rows: int) -> RowPlan:
        """The :class:`RowPlan` moving the last (``first``: the first) ``rows`` of ``length`` along the halo dim to
        offset 0, each pair at most its depth: the last rows right-aligned (the slots before them stay zeros), the
        first rows left-aligned."""
        transfers = []
        for k, (s, i, d, j) in enumerate(self.pairs):
            n = rows if self.depths is None else max(min(rows, self.depths[k]), 0)
            lo, offset = (0, 0) if self.first else (length - n, rows - n)
            transfers.append(Transfer(s, i, lo, lo + n, d, j, offset))
        return row_plan(transfers, rank, out_rows, rows)


def start_halo_exchange(
    tensor: torch.Tensor,
    rows: int,
    dim: int = 1,
    cp_group: ProcessGroup | None = None,
    *,
    traffic: TrafficCounter | None = None,
    kind: str = "halo",
    route: HaloRoute | None = None,
) -> PendingRows | ReadyRows:
    """Differentiable halo exchange, started: ``.wait()`` returns the previous chunk's last ``rows`` rows of
    ``tensor`` along ``dim`` (the work done before it overlaps the transfer).

    Shapes: ``tensor`` has ``L >= rows`` rows along ``dim``; the result has the same shape with ``rows`` rows
    along ``dim``. The gradient of the received rows is returned to their owner and added to the gradient of its
    last ``rows`` rows. ``route`` (:class:`HaloRoute`, planned by :mod:`dsv4.parallel.cp.routes` from the CP layout
    and the documents) says which local row of which rank feeds which, and at most how many rows each (those of the
    document the receiver continues); rows not fed receive zeros. None: the contiguous
    split, every batch row (dim 0) of rank ``r - 1`` feeds the same row of rank ``r``, rank 0 receives zeros. A
    pair of ranks with nothing to exchange sends no message at all.
    """
    dim = dim % tensor.dim()
    length = tensor.shape[dim]
    if rows < 0 or rows > length:
        raise ValueError(
            f"halo_exchange: rows={rows} must be in [0, local length {length}] along dim {dim}; "
            "the local shard is shorter than the halo (use fewer CP ranks or a longer sequence)"
        )
    if not _enabled(cp_group) or rows == 0:
        return ReadyRows(tensor.new_zeros(tensor.shape[:dim] + (rows,) + tensor.shape[dim + 1 :]))
    if dim == 0:
        raise ValueError("halo_exchange: dim 0 indexes the batch rows, so the halo dim must not be 0")
    if route is None:
        route = HaloRoute.contiguous(group_size(cp_group), tensor.shape[0])
    plan = route.plan(group_rank(cp_group), tensor.shape[0], length, rows)
    return start_exchange_rows(tensor, plan, dim, cp_group, traffic=traffic, kind=kind)


def halo_exchange(
    tensor: torch.Tensor,
    rows: int,
    dim: int = 1,
    cp_group: ProcessGroup | None = None,
    *,
    traffic: TrafficCounter | None = None,
    kind: str = "halo",
    route: HaloRoute | None = None,
) -> torch.Tensor:
    """The previous chunk's last ``rows`` rows of ``tensor`` along ``dim`` (:func:`start_halo_exchange`, waited
    for)."""
    return start_halo_exchange(tensor, rows, dim, cp_group, traffic=traffic, kind=kind, route=route).wait()
