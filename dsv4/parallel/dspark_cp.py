"""DSpark drafter training under context parallelism: a CP rank's part of each row, extended by exactly what its
blocks read of its neighbours.

The target runs under CP (each rank its contiguous chunk of every row, :class:`~dsv4.parallel.cp.CPContext`), so a
rank holds the target features and final hidden states of its chunk only. Every rank holds the whole rows' tokens,
document ids, positions and labels, and draws the same anchors on them (:mod:`dsv4.speculative.anchors`); a block
belongs to the rank whose chunk holds its anchor. What a block reads outside that chunk:

* before it: the context rows ``max(a - W, start of a's document) <= j < chunk start`` (their K = V, computed and
  rounded by their owner, per drafter stage: the drafter's :class:`~dsv4.model.v41.drafter_attention.ContextHalo`);
* after it: the target's final hidden state at ``a + k`` of every supervised slot ``k`` past the chunk's end (the
  loss's teacher), received once per step; the labels and tokens there every rank already holds.

:func:`draft_chunk` counts both per chunk of every row (identically on every rank, from the whole rows: the route
plan of :meth:`~dsv4.model.context_parallel.ContextParallel.plan_halos`), so each pair of ranks moves exactly those
rows (a chunk none of whose blocks reads across moves nothing), and lays the rank's rows out as its chunk with
``before`` slots in front (their context arrives by the halo; their features are zeros) and ``after + 1`` slots
behind (the tokens of the labels there, the received teachers). The drafter and its loss then run on these rows as
on whole rows. Contiguous CP only (``cp_balance=none``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from dsv4.model.v41.draft_blocks import DraftBlocks
from dsv4.model.v41.drafter_attention import ContextHalo


@dataclass
class DraftChunk:
    """A CP rank's drafter rows: ``input_ids``, ``seq_ids``, ``positions``, ``loss_mask`` ``[B, P + L + A]``,
    ``features`` ``[B, P + L + A, n * d]``, ``last_hidden`` ``[B, P + L + A, d]``, ``anchors`` ``[B, N]`` (in these
    rows' columns, ``-1`` = none), ``halo`` (the context before the chunk)."""

    input_ids: Tensor
    seq_ids: Tensor
    positions: Tensor
    loss_mask: Tensor
    features: Tensor
    last_hidden: Tensor
    anchors: Tensor
    halo: ContextHalo


def _document_bounds(seq_ids: Tensor) -> tuple[Tensor, Tensor]:
    """``(first, last)`` column of each column's document in rows ``seq_ids [B, S]`` (padding: its own column)."""
    b, s = seq_ids.shape
    cols = torch.arange(s).expand(b, s)
    change = torch.ones(b, s, dtype=torch.bool)
    change[:, 1:] = seq_ids[:, 1:] != seq_ids[:, :-1]
    first = torch.where(change, cols, torch.zeros_like(cols)).cummax(dim=1).values
    end = torch.ones(b, s, dtype=torch.bool)
    end[:, :-1] = seq_ids[:, 1:] != seq_ids[:, :-1]
    last = torch.where(end, cols, torch.full_like(cols, s)).flip(1).cummin(dim=1).values.flip(1)
    return first, last


def halo_counts(seq_ids: Tensor, loss_mask: Tensor, anchors: Tensor, chunks: int, window: int, block_size: int
                ) -> tuple[list[list[int]], list[list[int]]]:
    """``(before, after)`` ``[B][chunks]``: the context rows each chunk's blocks read of the chunk before, and the
    teacher rows (supervised slots' ``a + k``) they read of the chunk after (see the module docstring)."""
    b, s = seq_ids.shape
    length = s // chunks
    seq, mask, anchors = seq_ids.cpu(), loss_mask.cpu(), anchors.cpu()
    first, _ = _document_bounds(seq)
    blocks = DraftBlocks.from_anchors(anchors, block_size, s)
    supervised = blocks.eval_mask(mask, seq)  # [B, N, K]
    before = [[0] * chunks for _ in range(b)]
    after = [[0] * chunks for _ in range(b)]
    for row in range(b):
        for n, a in enumerate(anchors[row].tolist()):
            if a < 0:
                continue
            v = a // length
            start = v * length
            lowest = max(a - window, int(first[row, a]), 0)
            before[row][v] = max(before[row][v], start - lowest)
            slots = supervised[row, n].nonzero().flatten().tolist()
            if slots:
                after[row][v] = max(after[row][v], a + max(slots) + 1 - (start + length))
    return before, after


def _columns(values: Tensor, lo: int, hi: int, fill) -> Tensor:
    """Columns ``[lo, hi)`` of ``values [B, S, ...]``, ``fill`` outside ``[0, S)``."""
    s = values.shape[1]
    out = values.new_full((values.shape[0], hi - lo, *values.shape[2:]), fill)
    a, z = max(lo, 0), min(hi, s)
    if z > a:
        out[:, a - lo:z - lo] = values[:, a:z]
    return out


def draft_chunk(input_ids: Tensor, seq_ids: Tensor, positions: Tensor, loss_mask: Tensor, anchors: Tensor,
                features: Tensor, last_hidden: Tensor, cp, window: int, block_size: int, pad_id: int = 0) -> DraftChunk:
    """This rank's :class:`DraftChunk` (module docstring) from the whole rows (``input_ids``, ``seq_ids``,
    ``positions``, ``loss_mask``, ``anchors``: ``[B, S]`` / ``[B, N]``) and this rank's chunk of the
    target's ``features`` / ``last_hidden`` (``[B, L, *]``); ``cp`` the :class:`~dsv4.model.context_parallel.
    ContextParallel` the target ran under (contiguous)."""
    if cp.chunks_per_rank != 1:
        raise ValueError(f"drafter training under CP holds one contiguous chunk per rank (cp_balance=none), got "
                         f"cp_balance={cp.balance!r}")
    b, s = input_ids.shape
    length = s // cp.num_chunks
    before, after = halo_counts(seq_ids, loss_mask, anchors, cp.num_chunks, window, block_size)
    prev_route, next_route = cp.plan_halos(b, before, after)
    p = max(max(row) for row in before)
    q = max(max(row) for row in after)
    start = cp.rank * length
    lo, hi = start - p, start + length + q + 1
    device = input_ids.device
    received = cp.halo_exchange(last_hidden, q, dim=1, kind="dspark_teacher", route=next_route) if q else \
        last_hidden[:, :0]
    zeros = last_hidden.new_zeros
    local_anchors = torch.full_like(anchors, -1)
    for row in range(b):
        mine = [a - lo for a in anchors[row].tolist() if start <= a < start + length]
        local_anchors[row, :len(mine)] = torch.tensor(mine, dtype=anchors.dtype)
    return DraftChunk(
        input_ids=_columns(input_ids, lo, hi, pad_id),
        seq_ids=_columns(seq_ids, lo, hi, 0),
        positions=_columns(positions, lo, hi, 0),
        loss_mask=_columns(loss_mask, lo, hi, False),
        features=torch.cat((zeros(b, p, features.shape[-1]).to(features), features,
                            features.new_zeros(b, q + 1, features.shape[-1])), dim=1),
        last_hidden=torch.cat((zeros(b, p, last_hidden.shape[-1]), last_hidden, received,
                               zeros(b, 1, last_hidden.shape[-1])), dim=1),
        anchors=local_anchors.to(device),
        halo=ContextHalo(cp, prev_route, p, length),
    )

