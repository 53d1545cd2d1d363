"""Route planning: which rows each CP exchange of one forward moves, from the per-row document runs.

Pure arithmetic on the layout and on integers every rank holds identically (the resolved chunk summaries), so each
rank plans the same global exchanges and keeps its own part. Nothing here runs a collective.

* The halo route: chunk ``v - 1`` of whole row ``b`` sends its last rows to chunk ``v`` only when ``v``'s first
  token continues a document from it, and only the rows of that document: at most the ``depth`` columns of it
  that precede ``v`` (a document that began a few tokens before the boundary sends those few, whatever the halo's
  length: the window keys, Engram's token ids and the halo's metadata alike); the multi-token prediction's route is
  the same pairs reversed (a chunk's first rows to its predecessor).
* Exact halos (:func:`plan_halos`, the DSpark drafter's): per chunk, exactly the rows its queries read of the chunk
  before and of the chunk after, counts the caller computed from what every rank holds.
* The causal gather of compressed rows (one per active ratio): chunk ``v`` of row ``b`` receives global rows
  ``[need, v n)`` (``n = l / ratio`` per chunk) from their owners, right-aligned before its own ``n`` rows in a result
  as long as the rank's longest need.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from dsv4.model.context_parallel import CPRoutes
from dsv4.parallel.cp.collectives import HaloRoute, Transfer, row_plan
from dsv4.parallel.cp.layout import CPLayout


def local_row(layout: CPLayout, chunk: int, b: int, batch: int) -> tuple[int, int]:
    """``(rank, local row)`` holding chunk ``chunk`` of whole row ``b`` of a batch of ``batch`` whole rows."""
    rank, slot = layout.owner(chunk)
    return rank, slot * batch + b


def preceding_transfers(starts: list[list[int]], layout_chunks: list[list[int]], owners: list[tuple[int, int]],
                        n: int) -> tuple[list[Transfer], list[int]]:
    """The global pieces of a causal gather: ``starts[b][v]`` (``<= v * n``) is the first global row chunk ``v`` of
    batch row ``b`` needs; every chunk holds ``n`` rows along the dim, chunk ``u`` of row ``b`` sits in local row
    ``owners[u][1] * B + b`` of rank ``owners[u][0]``; ``layout_chunks[rank]`` lists each rank's chunks (slot order).
    Each local row receives ``[starts, v n)`` then its own ``n`` rows, right-aligned in a result of the rank's
    longest need (left: zeros). Returns ``(transfers, out_len per rank)``."""
    batch = len(starts)
    out_len = [n + max((v * n - starts[b][v] for v in chunks for b in range(batch)), default=0)
               for chunks in layout_chunks]
    transfers = []
    for v in range(len(owners)):
        rank, slot = owners[v]
        for b in range(batch):
            row, first = slot * batch + b, out_len[rank] - n - (v * n - starts[b][v])
            for u in range(starts[b][v] // n, v):
                src_rank, src_slot = owners[u]
                lo = max(starts[b][v] - u * n, 0)
                transfers.append(Transfer(src_rank, src_slot * batch + b, lo, n, rank, row, first + u * n + lo
                                          - starts[b][v]))
            transfers.append(Transfer(rank, row, 0, n, rank, row, out_len[rank] - n))
    return transfers, out_len


class PlannedLayout:
    """The layout half of :class:`~dsv4.model.context_parallel.ContextParallel`, for an object with ``layout``
    (a :class:`CPLayout`) and ``rank``: the chunks it holds and its routes (shared by the runtime context and the
    memory plan's stand-in, so both plan exactly the same exchanges)."""

    layout: CPLayout
    rank: int

    @property
    def chunks_per_rank(self) -> int:
        return self.layout.chunks_per_rank

    @property
    def num_chunks(self) -> int:
        return self.layout.num_chunks

    def local_rows(self, batch: int) -> list[tuple[int, int]]:
        """``(whole row, chunk)`` of each of this rank's local rows for ``batch`` whole rows."""
        return self.layout.local_rows(self.rank, batch)

    def plan_routes(self, batch: int, length: int, continues: Sequence[Sequence[int]],
                    need: Mapping[int, Sequence[Sequence[int]]]) -> CPRoutes:
        """This rank's routes of one forward (:func:`plan_routes`)."""
        return plan_routes(self.layout, self.rank, batch, length, continues, need)

    def plan_halos(self, batch: int, before: Sequence[Sequence[int]], after: Sequence[Sequence[int]]
                   ) -> tuple[HaloRoute, HaloRoute]:
        """This rank's two halo routes of exact row counts (:func:`plan_halos`)."""
        return plan_halos(self.layout, batch, before, after)


def plan_halos(layout: CPLayout, batch: int, before: Sequence[Sequence[int]], after: Sequence[Sequence[int]]
               ) -> tuple[HaloRoute, HaloRoute]:
    """``(previous, next)`` halo routes for ``batch`` whole rows of ``layout.num_chunks`` chunks: chunk ``v`` of row
    ``b`` receives the last ``before[b][v]`` rows of chunk ``v - 1`` (right-aligned in the halo, zeros before) and
    the first ``after[b][v]`` rows of chunk ``v + 1`` (left-aligned); a zero count moves nothing. Counts are the
    receiver's exact needs (what its queries read), computed identically on every rank."""
    chunks = layout.num_chunks
    for name, counts in (("before", before), ("after", after)):
        if len(counts) != batch or any(len(row) != chunks or min(row, default=0) < 0 for row in counts):
            raise ValueError(f"plan_halos: {name} must be [{batch}][{chunks}] non-negative row counts")
    prev = [(v, b) for v in range(1, chunks) for b in range(batch) if before[b][v]]
    nxt = [(v, b) for v in range(chunks - 1) for b in range(batch) if after[b][v]]
    return (HaloRoute(tuple((*local_row(layout, v - 1, b, batch), *local_row(layout, v, b, batch)) for v, b in prev),
                      depths=tuple(before[b][v] for v, b in prev)),
            HaloRoute(tuple((*local_row(layout, v + 1, b, batch), *local_row(layout, v, b, batch)) for v, b in nxt),
                      first=True, depths=tuple(after[b][v] for v, b in nxt)))


def plan_routes(layout: CPLayout, rank: int, batch: int, length: int, continues: Sequence[Sequence[int]],
                need: Mapping[int, Sequence[Sequence[int]]]) -> CPRoutes:
    """Rank ``rank``'s :class:`~dsv4.model.context_parallel.CPRoutes` for ``batch`` whole rows of
    ``layout.num_chunks`` chunks of ``length`` columns (see
    :meth:`~dsv4.model.context_parallel.ContextParallel.plan_routes` for ``continues``, the depth of the continued
    document before each chunk, and ``need``)."""
    chunks = layout.num_chunks
    if len(continues) != batch or any(len(row) != chunks for row in continues):
        raise ValueError(f"plan_routes: continues must be [{batch}][{chunks}] (rows x chunks)")
    for b, row in enumerate(continues):
        for v, d in enumerate(row):
            if isinstance(d, bool) or not 0 <= d <= v * length:
                raise ValueError(f"plan_routes: continues[{b}][{v}] = {d!r}; it is how many columns of the document "
                                 f"chunk {v}'s first token continues precede it, an int in [0, {v * length}] (0: the "
                                 "chunk starts a document or padding)")
    pairs = [(v, b) for v in range(1, chunks) for b in range(batch) if continues[b][v]]
    halo = HaloRoute(tuple((*local_row(layout, v - 1, b, batch), *local_row(layout, v, b, batch)) for v, b in pairs),
                     depths=tuple(continues[b][v] for v, b in pairs))
    following = HaloRoute(tuple((d, j, s, i) for s, i, d, j in halo.pairs), first=True)
    continues_next = tuple(sorted({i for s, i, _, _ in halo.pairs if s == rank}))
    owners = [layout.owner(v) for v in range(chunks)]
    rank_chunks = [layout.chunks(r) for r in range(layout.size)]
    rows = batch * layout.chunks_per_rank
    preceding, widths = {}, {}
    for ratio, starts in need.items():
        transfers, out_len = preceding_transfers([list(row) for row in starts], rank_chunks, owners, length // ratio)
        widths[ratio] = out_len[rank]
        preceding[ratio] = row_plan(transfers, rank, rows, widths[ratio])
    return CPRoutes(halo=halo, next=following, continues_next=continues_next, preceding=preceding,
                    preceding_width=widths)
