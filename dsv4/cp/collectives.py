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


class _HaloExchange(torch.autograd.Function):
    """Rank r receives the last ``rows`` rows (along ``dim``) of rank r-1; rank 0 receives zeros."""

    @staticmethod
    def forward(ctx, x, rows, dim, group, traffic, kind):  # type: ignore[override]
        rank, size = group_rank(group), group_size(group)
        ctx.rows, ctx.dim, ctx.group, ctx.traffic, ctx.kind = rows, dim, group, traffic, kind
        ctx.length = x.shape[dim]
        tail = x.narrow(dim, x.shape[dim] - rows, rows).contiguous()
        halo = torch.zeros_like(tail)
        ops = []
        if rank + 1 < size:
            ops.append(("send", tail, rank + 1))
        if rank > 0:
            ops.append(("recv", halo, rank - 1))
        _p2p(ops, group)
        if traffic is not None:
            n = _nbytes(tail)
            traffic.add(kind, sent=n if rank + 1 < size else 0, received=n if rank > 0 else 0)
        return halo

    @staticmethod
    def backward(ctx, grad_halo):  # type: ignore[override]
        group, rows, dim = ctx.group, ctx.rows, ctx.dim
        rank, size = group_rank(group), group_size(group)
        grad_halo = grad_halo.contiguous()
        grad_tail = torch.zeros_like(grad_halo)
        ops = []
        if rank > 0:
            ops.append(("send", grad_halo, rank - 1))
        if rank + 1 < size:
            ops.append(("recv", grad_tail, rank + 1))
        _p2p(ops, group)
        if ctx.traffic is not None:
            n = _nbytes(grad_halo)
            ctx.traffic.add(
                f"{ctx.kind}.backward", sent=n if rank > 0 else 0, received=n if rank + 1 < size else 0
            )
        shape = list(grad_halo.shape)
        shape[dim] = ctx.length - rows
        grad_x = torch.cat([grad_tail.new_zeros(shape), grad_tail], dim=dim)
        return grad_x, None, None, None, None, None


def halo_exchange(
    tensor: torch.Tensor,
    rows: int,
    dim: int = 1,
    cp_group: ProcessGroup | None = None,
    *,
    traffic: TrafficCounter | None = None,
    kind: str = "halo",
) -> torch.Tensor:
    """Differentiable halo exchange: return the previous rank's last ``rows`` rows of ``tensor`` along ``dim``.

    Shapes: ``tensor`` has ``L >= rows`` rows along ``dim``; the result has the same shape with ``rows`` rows
    along ``dim``. Rank 0 (and the single-rank path) receives zeros. The gradient of the received rows is sent
    back to rank r-1 and added to the gradient of its last ``rows`` rows. Only neighbours talk: each rank sends
    and receives ``rows`` rows once per call.
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
    return _HaloExchange.apply(tensor, rows, dim, cp_group, traffic, kind)


class _GatherPreceding(torch.autograd.Function):
    """Rank r receives rows ``[starts[r], r*n)`` of the global concatenation from the ranks that own them."""

    @staticmethod
    def forward(ctx, x, starts, dim, group, traffic, kind):  # type: ignore[override]
        rank, size = group_rank(group), group_size(group)
        n = x.shape[dim]
        ctx.dim, ctx.group, ctx.traffic, ctx.kind, ctx.starts, ctx.n = dim, group, traffic, kind, starts, n
        ops, received, sent_bytes = [], [], 0
        for receiver in range(rank + 1, size):  # my rows that a later rank needs: [max(starts[j], rank*n), (rank+1)*n)
            first = max(starts[receiver] - rank * n, 0)
            if first < n:
                piece = x.narrow(dim, first, n - first).contiguous()
                ops.append(("send", piece, receiver))
                sent_bytes += _nbytes(piece)
        for owner in range(rank):  # rows of an earlier rank that I need
            first = max(starts[rank] - owner * n, 0)
            if first < n:
                shape = list(x.shape)
                shape[dim] = n - first
                buf = x.new_empty(shape)
                ops.append(("recv", buf, owner))
                received.append(buf)
        _p2p(ops, group)
        if traffic is not None:
            traffic.add(kind, sent=sent_bytes, received=sum(_nbytes(b) for b in received))
        return torch.cat(received + [x], dim=dim)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        group, dim, n, starts = ctx.group, ctx.dim, ctx.n, ctx.starts
        rank, size = group_rank(group), group_size(group)
        ops, incoming, offset, sent_bytes = [], [], 0, 0
        for owner in range(rank):  # return the gradient of rows I received to their owners
            first = max(starts[rank] - owner * n, 0)
            if first < n:
                piece = grad.narrow(dim, offset, n - first).contiguous()
                ops.append(("send", piece, owner))
                sent_bytes += _nbytes(piece)
                offset += n - first
        grad_x = grad.narrow(dim, offset, n).clone()
        for receiver in range(rank + 1, size):
            first = max(starts[receiver] - rank * n, 0)
            if first < n:
                shape = list(grad_x.shape)
                shape[dim] = n - first
                buf = grad_x.new_empty(shape)
                ops.append(("recv", buf, receiver))
                incoming.append((first, buf))
        _p2p(ops, group)
        for first, buf in incoming:
            grad_x.narrow(dim, first, n - first).add_(buf)
        if ctx.traffic is not None:
            ctx.traffic.add(
                f"{ctx.kind}.backward", sent=sent_bytes, received=sum(_nbytes(b) for _, b in incoming)
            )
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
