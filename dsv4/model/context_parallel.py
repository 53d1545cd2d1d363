"""The model's only view of context parallelism: the :class:`ContextParallel` protocol (the CP seam, as
:class:`~dsv4.model.dispatch.TokenDispatcher` is the expert-parallel one).

Model code receives ``cp=None`` (one rank) or an object satisfying :class:`ContextParallel`. It never sees a
process group, a layout class or a transport: it asks which chunks of each whole row its local rows are, gathers
one summary integer per chunk, hands the per-row document runs to :meth:`ContextParallel.plan_routes`, and runs the
returned (opaque) routes through the exchange verbs. Implementations: :class:`dsv4.parallel.cp.CPContext` (a process
group) and :class:`dsv4.plan.stand_ins.PlanCP` (the memory plan's shape-true stand-in).

Chunks: a whole row of ``S`` columns is cut into ``num_chunks`` equal chunks of ``l`` columns; this rank holds
``chunks_per_rank`` of them, and a batch of ``B`` whole rows reaches the model as ``[chunks_per_rank * B, l]`` local
rows, row ``i`` being chunk ``local_rows(B)[i][1]`` of whole row ``local_rows(B)[i][0]``. Every exchange is
differentiable: the gradient of what a rank received goes back to the rank that sent it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from torch import Tensor


@runtime_checkable
class PendingExchange(Protocol):
    """An exchange in flight: ``wait()`` returns its result (the work done before ``wait`` overlaps it)."""

    def wait(self) -> Any: ...


class ReadyRows:
    """A finished exchange in :class:`PendingExchange`'s shape (one rank, nothing to exchange, or no overlap)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def wait(self) -> Any:
        return self.value


@dataclass(frozen=True)
class CPRoutes:
    """Which rows travel where in one forward, planned by :meth:`ContextParallel.plan_routes` from the document
    runs; identical on every rank of the group.

    ``halo``: each local row whose first token continues a document from the previous chunk receives that chunk's
    last rows (the window keys, the compressor boundary, the halo's metadata, Engram's token ids), at most as many as
    that document has there (right-aligned, zeros before); ``next``: the reverse direction (a
    chunk's first rows to the chunk it continues: what multi-token prediction shifts in); ``continues_next``: the
    local rows whose document continues into the next chunk (they receive through ``next``); ``preceding[ratio]``:
    this rank's part of the causal gather of compressed rows, whose result is ``preceding_width[ratio]`` rows long
    per local row (received rows left-padded to the rank's longest need, then the row's own ``l / ratio``).
    ``halo``, ``next`` and ``preceding`` are the implementation's own plans: model code only passes them back.
    """

    halo: Any
    next: Any
    continues_next: tuple[int, ...]
    preceding: dict[int, Any] = field(default_factory=dict)
    preceding_width: dict[int, int] = field(default_factory=dict)


@runtime_checkable
class ContextParallel(Protocol):
    """Context parallelism as the model sees it (see the module docstring). ``size == 1`` must behave exactly as
    ``cp=None``; the model calls nothing on a one-rank context except ``size``.

    ``halo``: window rows a chunk receives from its predecessor (None: ``sliding_window - 1``, set by the model from
    its config; a larger value is honoured). ``balance``: the layout's name, for error messages.
    """

    rank: int
    size: int
    halo: int | None
    balance: str

    @property
    def chunks_per_rank(self) -> int: ...

    @property
    def num_chunks(self) -> int: ...

    def local_rows(self, batch: int) -> list[tuple[int, int]]:
        """``(whole row b, chunk v)`` of each local row of a batch of ``batch`` whole rows, in local order."""
        ...

    def gather_rows(self, local: Tensor, kind: str = "metadata") -> Tensor:
        """Whole rows ``[B, S, ...]`` of integer metadata from every rank's local rows ``[k B, l, ...]``
        (not differentiable)."""
        ...

    def plan_routes(self, batch: int, length: int, continues: Sequence[Sequence[int]],
                    need: Mapping[int, Sequence[Sequence[int]]]) -> CPRoutes:
        """The routes of a batch of ``batch`` whole rows of ``num_chunks`` chunks of ``length`` columns:
        ``continues[b][v]``: how many columns of the document chunk ``v``'s first token continues lie before it (an
        int; 0: the chunk starts a document or padding), so its halo carries no more rows than that;
        ``need[ratio][b][v]``: the first global compressed row (of ``l / ratio`` per chunk) that chunk needs."""
        ...

    def plan_halos(self, batch: int, before: Sequence[Sequence[int]], after: Sequence[Sequence[int]]
                   ) -> tuple[Any, Any]:
        """Two halo routes of exact row counts for ``batch`` whole rows: chunk ``v`` of row ``b`` receives the last
        ``before[b][v]`` rows of chunk ``v - 1`` and the first ``after[b][v]`` rows of chunk ``v + 1`` (for
        :meth:`halo_exchange`: the previous route right-aligns, the next one left-aligns)."""
        ...

    def halo_exchange(self, tensor: Tensor, rows: int, dim: int = 1, kind: str = "halo",
                      route: Any = None) -> Tensor:
        """The last ``rows`` rows along ``dim`` of the chunk each local row continues (``route``:
        :attr:`CPRoutes.halo`, or :attr:`CPRoutes.next` for the first rows of the next chunk); zeros where none,
        and before the continued document's first row."""
        ...

    def start_halo_exchange(self, tensor: Tensor, rows: int, dim: int = 1, kind: str = "halo",
                            route: Any = None) -> PendingExchange:
        """:meth:`halo_exchange`, started."""
        ...

    def start_exchange_rows(self, tensor: Tensor, plan: Any, dim: int = 1, kind: str = "rows") -> PendingExchange:
        """A planned row exchange (:attr:`CPRoutes.preceding`), started."""
        ...


def is_parallel(cp: ContextParallel | None) -> bool:
    """True when ``cp`` spans more than one rank (None and one-rank contexts are the single-rank path)."""
    return cp is not None and cp.size > 1
