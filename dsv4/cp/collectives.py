"""The CP runtime's collectives: differentiable all-gather, metadata all-gather, halo exchange, causal gather.

These are the exchanges the model makes through :class:`~dsv4.cp.context.CPContext`. All functions are identities
(or cheap local equivalents) when the CP group is ``None`` or has one rank, so model code can call them
unconditionally. Each accepts an optional :class:`~dsv4.cp.traffic.TrafficCounter`
and a ``kind`` label; bytes are counted as the point-to-point volume this rank sends and receives (an all-gather
of ``n`` bytes per rank over ``C`` ranks: ``n*(C-1)`` each way). Backward traffic is recorded under
``f"{kind}.backward"``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dsv4.cp.traffic import TrafficCounter
from dsv4.distributed import ProcessGroup, all_gather_into, group_rank, group_size, reduce_scatter_into


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


def _p2p(ops: list[tuple[str, torch.Tensor, int]], group: ProcessGroup) -> None:
    """Run (``"send"|"recv"``, tensor, group rank) operations together and wait for all of them."""
    if not ops:
        return
    p2p = [
        dist.P2POp(dist.isend if op == "send" else dist.irecv, t, dist.get_global_rank(group, peer), group)
        for op, t, peer in ops
    ]
    for work in dist.batch_isend_irecv(p2p):
        work.wait()


def _shift(t: torch.Tensor, step: int, group, traffic: TrafficCounter | None, kind: str,
           send: list[int] | None = None, recv: list[int] | None = None) -> torch.Tensor:
    """Send ``t`` to rank ``r + step`` and return what rank ``r - step`` sent (zeros where there is no such rank).

    ``send`` / ``recv`` (batch rows, dim 0; None = all): only ``t[send]`` goes out and only the rows ``recv`` come
    in (zeros elsewhere). Both sides derive the lists from the same metadata, so the sender's ``send`` is the
    receiver's ``recv``; an empty list sends (or receives) nothing at all."""
    rank, size = group_rank(group), group_size(group)
    out = torch.zeros_like(t)
    to, source = rank + step, rank - step
    outgoing = incoming = None
    if 0 <= to < size and send != []:
        outgoing = t if send is None else t[send].contiguous()
    if 0 <= source < size and recv != []:
        incoming = out if recv is None else t.new_empty((len(recv), *t.shape[1:]))
    ops = ([("send", outgoing, to)] if outgoing is not None else []) + (
        [("recv", incoming, source)] if incoming is not None else [])
    if ops:
        _p2p(ops, group)
    if incoming is not None and recv is not None:
        out[recv] = incoming
    if traffic is not None:
        traffic.add(kind, sent=0 if outgoing is None else _nbytes(outgoing),
                    received=0 if incoming is None else _nbytes(incoming))
    return out


class _HaloExchange(torch.autograd.Function):
    """Rank r receives the last ``rows`` rows (along ``dim``) of rank r-1; rank 0 receives zeros. Backward sends
    the gradient of the received rows back to rank r-1, where it adds to its last rows' gradient. With ``batch_rows
    = (send, recv)`` only those batch rows travel (``dim`` must not be 0)."""

    @staticmethod
    def forward(ctx, x, rows, dim, group, traffic, kind, batch_rows=None):  # type: ignore[override]
        ctx.rows, ctx.dim, ctx.group, ctx.traffic, ctx.kind = rows, dim, group, traffic, kind
        ctx.length, ctx.batch_rows = x.shape[dim], batch_rows
        send, recv = batch_rows if batch_rows is not None else (None, None)
        return _shift(x.narrow(dim, x.shape[dim] - rows, rows).contiguous(), 1, group, traffic, kind, send, recv)

    @staticmethod
    def backward(ctx, grad_halo):  # type: ignore[override]
        # the gradients go back the way the rows came: my received rows to my predecessor
        send, recv = ctx.batch_rows if ctx.batch_rows is not None else (None, None)
        grad_tail = _shift(grad_halo.contiguous(), -1, ctx.group, ctx.traffic, f"{ctx.kind}.backward", recv, send)
        shape = list(grad_tail.shape)
        shape[ctx.dim] = ctx.length - ctx.rows
        return torch.cat([grad_tail.new_zeros(shape), grad_tail], dim=ctx.dim), None, None, None, None, None, None


def halo_exchange(
    tensor: torch.Tensor,
    rows: int,
    dim: int = 1,
    cp_group: ProcessGroup | None = None,
    *,
    traffic: TrafficCounter | None = None,
    kind: str = "halo",
    batch_rows: tuple[list[int], list[int]] | None = None,
) -> torch.Tensor:
    """Differentiable halo exchange: return the previous rank's last ``rows`` rows of ``tensor`` along ``dim``.

    Shapes: ``tensor`` has ``L >= rows`` rows along ``dim``; the result has the same shape with ``rows`` rows
    along ``dim``. Rank 0 (and the single-rank path) receives zeros. The gradient of the received rows is sent
    back to rank r-1 and added to the gradient of its last ``rows`` rows. Only neighbours talk: each rank sends
    and receives ``rows`` rows once per call. ``batch_rows = (send, recv)``: only the batch rows (dim 0) my
    successor needs travel to it and only those I need come to me (the others receive zeros); empty lists on both
    sides of a pair of ranks mean no message at all.
    """
    dim = dim % tensor.dim()
    length = tensor.shape[dim]
    if rows < 0 or rows > length:
        raise ValueError(
            f"halo_exchange: rows={rows} must be in [0, local length {length}] along dim {dim}; "
            "the local shard is shorter than the halo (use fewer CP ranks or a longer sequence)"
        )
    if not _enabled(cp_group) or rows == 0:
        return tensor.new_zeros(tensor.shape[:dim] + (rows,) + tensor.shape[dim + 1 :])
    if batch_rows is not None and dim == 0:
        raise ValueError("halo_exchange: batch_rows selects along dim 0, so the halo dim must not be 0")
    return _HaloExchange.apply(tensor, rows, dim, cp_group, traffic, kind, batch_rows)


def _preceding_plan(starts: list[int], rank: int, size: int, n: int) -> tuple[list, list]:
    """Who exchanges what in :func:`gather_preceding` (every rank holds ``n`` rows): ``(give, take)`` with
    ``give = [(later rank j, first of my rows it needs)]`` and ``take = [(earlier rank o, first of its rows I
    need)]``; rank j needs global rows ``[starts[j], j * n)``."""
    give = [(j, max(starts[j] - rank * n, 0)) for j in range(rank + 1, size)]
    take = [(o, max(starts[rank] - o * n, 0)) for o in range(rank)]
    return [(j, f) for j, f in give if f < n], [(o, f) for o, f in take if f < n]


def _rows_like(t: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = rows
    return t.new_empty(shape)


class _GatherPreceding(torch.autograd.Function):
    """Rank r receives rows ``[starts[r], r*n)`` of the global concatenation from the ranks that own them."""

    @staticmethod
    def forward(ctx, x, starts, dim, group, traffic, kind):  # type: ignore[override]
        n = x.shape[dim]
        ctx.dim, ctx.group, ctx.traffic, ctx.kind, ctx.starts, ctx.n = dim, group, traffic, kind, starts, n
        give, take = _preceding_plan(starts, group_rank(group), group_size(group), n)
        sent = [(j, x.narrow(dim, f, n - f).contiguous()) for j, f in give]
        received = [(o, _rows_like(x, dim, n - f)) for o, f in take]
        _p2p([("send", t, j) for j, t in sent] + [("recv", t, o) for o, t in received], group)
        if traffic is not None:
            traffic.add(kind, sent=sum(_nbytes(t) for _, t in sent), received=sum(_nbytes(t) for _, t in received))
        return torch.cat([t for _, t in received] + [x], dim=dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        group, dim, n = ctx.group, ctx.dim, ctx.n
        give, take = _preceding_plan(ctx.starts, group_rank(group), group_size(group), n)
        *pieces, own = grad.split([n - f for _, f in take] + [n], dim=dim)  # received rows' gradients, then mine
        returned, grad_x = [(o, t) for (o, _), t in zip(take, pieces)], own.clone()
        incoming = [(f, j, _rows_like(grad_x, dim, n - f)) for j, f in give]
        _p2p([("send", t.contiguous(), o) for o, t in returned] + [("recv", t, j) for _, j, t in incoming], group)
        for f, _, t in incoming:
            grad_x.narrow(dim, f, n - f).add_(t)
        if ctx.traffic is not None:
            ctx.traffic.add(f"{ctx.kind}.backward", sent=sum(_nbytes(t) for _, t in returned),
                            received=sum(_nbytes(t) for *_, t in incoming))
        return grad_x, None, None, None, None, None


def gather_preceding(
    tensor: torch.Tensor,
    starts: list[int],
    dim: int = 1,
    cp_group: ProcessGroup | None = None,
    *,
    traffic: TrafficCounter | None = None,
    kind: str = "gather_preceding",
) -> torch.Tensor:
    """Differentiable causal gather: rows ``[starts[rank], (rank+1)*n)`` of the global concatenation.

    Every rank holds ``n`` rows along ``dim`` (rank r owns global rows ``[r*n, (r+1)*n)``); ``starts`` (identical
    on every rank, ``starts[r] <= r*n``) says where the suffix each rank needs begins. Rank r receives only what
    it asked for, straight from the owners (point-to-point), so a rank that needs nothing from its predecessors
    (``starts[r] == r*n``) receives nothing. The result is ``[received rows of ranks < r in order ; own rows]``.
    Backward returns the gradient of every received row to its owner, summed there.
    """
    if not _enabled(cp_group):
        return tensor
    dim = dim % tensor.dim()
    size, n = group_size(cp_group), tensor.shape[dim]
    if len(starts) != size:
        raise ValueError(f"gather_preceding: {len(starts)} starts for a CP group of {size} ranks")
    for r, s in enumerate(starts):
        if not 0 <= s <= r * n:
            raise ValueError(f"gather_preceding: starts[{r}] = {s} must be in [0, {r * n}] (rank {r} owns row {r * n} on)")
    return _GatherPreceding.apply(tensor, [int(s) for s in starts], dim, cp_group, traffic, kind)
