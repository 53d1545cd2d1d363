"""`CPContext`: context parallelism over a process group, as the model sees it
(:class:`~dsv4.model.context_parallel.ContextParallel`).

The model receives ``cp=None`` (single rank) or a ``CPContext``. It never touches process groups directly: it
asks the context for its chunks, has it plan the forward's routes (:mod:`dsv4.parallel.cp.routes`) and calls its
exchange verbs, which count their traffic.

Invariants:

* ``size == 1`` (``group`` None or a one-rank group) is exactly the single-rank path: every verb is an identity
  (gathers) or returns zeros (halo), and no collective runs.
* Which columns a rank holds is its :class:`~dsv4.parallel.cp.layout.CPLayout` (``balance``): ``"none"``, rank ``r`` owns
  global tokens ``[r*L, (r+1)*L)`` of the padded row (contiguous split); ``"full"``, the row is cut into ``2C``
  chunks and rank ``r`` holds chunks ``r`` and ``2C-1-r`` as two local rows (head-tail, balanced work).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4.model.context_parallel import ReadyRows
from dsv4.parallel.cp.collectives import (
    HaloRoute,
    RowPlan,
    all_gather,
    all_gather_metadata,
    exchange_rows,
    halo_exchange,
    start_exchange_rows,
    start_halo_exchange,
)
from dsv4.parallel.cp.layout import CPLayout, check_balance
from dsv4.parallel.cp.routes import PlannedLayout
from dsv4.parallel.cp.traffic import TrafficCounter
from dsv4.distributed import GroupMember, ProcessGroup


@dataclass
class CPContext(PlannedLayout, GroupMember):
    """Context-parallel state handed to ``model.forward(..., cp=...)``.

    Args:
        group: the CP process group (``None`` or one rank = CP disabled).
        halo: rows a rank receives from its predecessor per layer (the model sets it from its config when None:
            ``sliding_window - 1``, at least the compressor overlap).
        traffic: counter of bytes moved per exchange kind (shared by every verb of this context).
        balance: ``"none"`` (contiguous split) or ``"full"`` (head-tail chunks; :class:`~dsv4.parallel.cp.layout.CPLayout`).
        overlap: the model starts its halo and preceding-row exchanges before the work that does not need them and
            waits where it does (``start_*`` verbs); False completes each exchange where it starts (to measure what
            the overlap hides).
    """

    group: ProcessGroup | None = None
    halo: int | None = None
    traffic: TrafficCounter = field(default_factory=TrafficCounter)
    balance: str = "none"
    overlap: bool = True

    def __post_init__(self) -> None:
        check_balance(self.balance)

    @property
    def layout(self) -> CPLayout:
        """Which chunks of a row this group's ranks hold."""
        return CPLayout(self.size, self.balance)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_gather(self, tensor: torch.Tensor, dim: int = 1, kind: str = "all_gather") -> torch.Tensor:
        """Differentiable all-gather along ``dim`` (see :func:`dsv4.parallel.cp.collectives.all_gather`)."""
        return all_gather(tensor, dim, self.group, traffic=self.traffic, kind=kind)

    def all_gather_metadata(self, tensor: torch.Tensor, dim: int = 1, kind: str = "metadata") -> torch.Tensor:
        """Non-differentiable all-gather of integer/bool metadata along ``dim``."""
        return all_gather_metadata(tensor, dim, self.group, traffic=self.traffic, kind=kind)

    def gather_rows(self, local: torch.Tensor, kind: str = "metadata") -> torch.Tensor:
        """Whole rows ``[B, S, ...]`` of integer/bool metadata from every rank's local rows ``[k B, l, ...]``
        (non-differentiable; the layout puts every chunk in its place)."""
        gathered = self.all_gather_metadata(local.unsqueeze(0), dim=0, kind=kind)
        return self.layout.assemble(gathered)

    def halo_exchange(self, tensor: torch.Tensor, rows: int, dim: int = 1, kind: str = "halo",
                      route: HaloRoute | None = None) -> torch.Tensor:
        """The previous chunk's last ``rows`` rows along ``dim`` (zeros where there is none), differentiable;
        ``route``: which rows feed which (see :func:`dsv4.parallel.cp.collectives.halo_exchange`)."""
        return halo_exchange(tensor, rows, dim, self.group, traffic=self.traffic, kind=kind, route=route)

    def start_halo_exchange(self, tensor: torch.Tensor, rows: int, dim: int = 1, kind: str = "halo",
                            route: HaloRoute | None = None):
        """:meth:`halo_exchange`, started: returns a handle whose ``wait()`` gives the rows. With ``overlap``
        False the exchange completes here (the handle is already done)."""
        pending = start_halo_exchange(tensor, rows, dim, self.group, traffic=self.traffic, kind=kind, route=route)
        return pending if self.overlap else ReadyRows(pending.wait())

    def start_exchange_rows(self, tensor: torch.Tensor, plan: RowPlan, dim: int = 1, kind: str = "rows"):
        """:meth:`exchange_rows`, started (see :meth:`start_halo_exchange`)."""
        pending = start_exchange_rows(tensor, plan, dim, self.group, traffic=self.traffic, kind=kind)
        return pending if self.overlap else ReadyRows(pending.wait())

    def exchange_rows(self, tensor: torch.Tensor, plan: RowPlan, dim: int = 1, kind: str = "rows") -> torch.Tensor:
        """Run this rank's part of a row exchange (:func:`dsv4.parallel.cp.collectives.exchange_rows`), differentiable."""
        return exchange_rows(tensor, plan, dim, self.group, traffic=self.traffic, kind=kind)
