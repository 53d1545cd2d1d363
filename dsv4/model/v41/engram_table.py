"""The Engram tables of DeepSeek-V4.1 behind one interface: :class:`EngramTable`, ``lookup(ids) -> rows``.

Engram reads rows of a table of ``rows x head_dim`` (V4.1-Flash: about 384M rows of 256 per layer, ~98 GB each in
the release's FP8). The model only calls :meth:`EngramTable.lookup`; where the rows live is the table's business:

* :class:`LocalEngramTable` (this module): every row on this process. The one-process (CPU) path.
* ``dsv4.parallel.engram_table.RowShardedEngramTable``: a contiguous slice of the rows per rank of a process group,
  looked up with one all-to-all round trip (ids to their owners, rows back). It is a :class:`LocalEngramTable`
  holding its slice, so the row storage, the FP8 form and the row reads below are the same code.

Rows ``[row_start, row_start + local_rows)`` of the table are held; :func:`row_range` is the split over ``size``
ranks (``torch.chunk``'s: ``ceil(rows / size)`` rows per rank, the last ranks fewer or none) and
:func:`row_owner` its inverse. A whole table is the slice of rank 0 of 1.

Storage: ``float`` (a parameter ``weight [local_rows, head_dim]``; trains when ``trainable``) or the release's
FP8 (:meth:`LocalEngramTable.keep_fp8`: buffers ``weight`` float8_e4m3fn ``[local_rows, head_dim]`` and ``scale``
float8_e8m0fnu ``[local_rows, ceil(head_dim / 32)]``, one power-of-two scale per row and 32 columns; frozen). The
state-dict names are the checkpoint's (``layers.{i}.engram.embed.weight`` / ``.scale``). Rows of the FP8 form are
dequantised after the lookup, only the looked-up ones. ``weight`` / ``scale`` may be ``DTensor`` s (a sharded
table's rows as one global tensor, for distributed checkpoints); rows are always read from the local tensor.

Host memory (:meth:`LocalEngramTable.hold_on_host`, ``trainer.engram_tables=host``): a frozen table's storage stays
in host memory when the model moves. Invariants: a held table's ``weight`` / ``scale`` are never moved or cast by a
module move (``.to(device)``, ``.to(dtype)``, ``.cuda()``, ``.float()``: :meth:`LocalEngramTable._apply` leaves them
as they are, and the state-dict names are unchanged, so a checkpoint load still writes the rows into them); a row
read (:meth:`~LocalEngramTable.read`, :meth:`~LocalEngramTable.encode`) moves the asked ids to the storage's device,
gathers (and, for a float table, casts to the asked dtype) there, and returns the rows on the ids' device: the only
bytes that cross are the ids and the rows asked for. A kept FP8 table is never cast by a dtype move, held or not: it
follows a move's device only.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["EngramTable", "LocalEngramTable", "row_range", "row_owner", "ROW_SCALE_COLUMNS"]

ROW_SCALE_COLUMNS = 32
"""Columns one FP8 row scale covers (the release's Engram tables: ``[rows, head_dim / 32]`` scales)."""


@runtime_checkable
class EngramTable(Protocol):
    """What Engram reads: ``rows`` rows of ``head_dim``. ``lookup(ids [...], dtype) -> [..., head_dim]`` in
    ``dtype`` (the table's own float dtype when None); every id in ``[0, rows)``. Under a process group every rank
    of it calls ``lookup`` once per Engram layer and forward (a collective)."""

    rows: int
    head_dim: int

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor: ...


def row_range(rows: int, size: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a ``rows``-row table that rank ``rank`` of ``size`` holds: ``torch.chunk``'s split,
    ``ceil(rows / size)`` rows per rank in rank order (so the last ranks may hold fewer, or none)."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"row_range: rank {rank} is outside [0, {size})")
    chunk = -(-rows // size)
    return min(rank * chunk, rows), min((rank + 1) * chunk, rows)


def row_owner(ids: torch.Tensor, rows: int, size: int) -> torch.Tensor:
    """The rank of ``size`` that holds each row id of ``ids`` (ids in ``[0, rows)``): the inverse of
    :func:`row_range`."""
    return torch.div(ids, -(-rows // size), rounding_mode="floor")


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a ``DTensor`` 's local tensor; a plain tensor as is)."""
    return t.to_local() if hasattr(t, "to_local") else t


class LocalEngramTable(nn.Module):
    """Rows ``[row_start, row_start + local_rows)`` of a ``rows x head_dim`` Engram table, all of them unless
    ``row_slice`` says otherwise; see the module docstring for the storage. ``lookup`` reads the held rows (ids are
    global row numbers inside the slice)."""

    def __init__(self, rows: int, head_dim: int, trainable: bool = False,
                 row_slice: tuple[int, int] | None = None) -> None:
        super().__init__()
        start, stop = (0, rows) if row_slice is None else row_slice
        if not 0 <= start <= stop <= rows:
            raise ValueError(f"Engram table: row slice [{start}, {stop}) is outside its {rows} rows")
        self.rows, self.head_dim = int(rows), int(head_dim)
        self.row_start, self.local_rows = int(start), int(stop - start)
        self.weight = nn.Parameter(torch.empty(self.local_rows, self.head_dim), requires_grad=bool(trainable))
        self._on_host = False

    def extra_repr(self) -> str:
        held = "" if self.local_rows == self.rows else f", rows [{self.row_start}, {self.row_start + self.local_rows})"
        host = ", in host memory" if self._on_host else ""
        return f"{self.rows}, {self.head_dim}{held}, {'fp8' if self.kept_fp8 else str(self.weight.dtype)[6:]}{host}"

    @property
    def held_on_host(self) -> bool:
        """True when the rows stay in host memory whatever the model's device (:meth:`hold_on_host`)."""
        return self._on_host

    @torch.no_grad()
    def hold_on_host(self) -> None:
        """Keep this frozen table's rows in host memory (module docstring): the storage moves to the CPU now if it is
        elsewhere, and from now on no module move touches it. A trainable table refuses (``ValueError``): its gradient
        and optimizer state live with its rows on the device. Idempotent."""
        if self.weight.requires_grad:
            raise ValueError(f"Engram table of {self.rows} rows: a trainable table (model.engram_trainable=true) "
                             "cannot be held in host memory (trainer.engram_tables=host holds frozen tables only)")
        self._on_host = True
        for name in ("weight", "scale"):
            t = getattr(self, name, None)
            if t is None:
                continue
            local = _local(t)
            if local.device.type in ("cpu", "meta"):
                continue
            moved = self._wrap(local.detach().cpu())
            if name in self._parameters:
                self._parameters[name] = nn.Parameter(moved, requires_grad=False)
            else:
                self._buffers[name] = moved

    def _wrap(self, local: torch.Tensor) -> torch.Tensor:
        """``local`` (rows of this table's slice) as the table stores them: as they are here; a sharded table wraps
        them in a ``DTensor`` of the whole table."""
        return local

    def _apply(self, fn, recurse: bool = True):
        """A module move (``to``, ``cuda``, ``float``, ...): a table held on the host stays where and as it is (module
        docstring); a kept FP8 table follows the move's device, never its dtype; a float table moves as any module."""
        if self._on_host:
            return self
        if not self.kept_fp8:
            return super()._apply(fn, recurse)
        for name in ("weight", "scale"):
            t = self._buffers[name]
            local = _local(t)
            target = fn(local.new_empty(0))  # where (and in which dtype) the move would put it
            self._buffers[name] = fn(t) if target.dtype == local.dtype else t.to(target.device)
        return self

    @property
    def kept_fp8(self) -> bool:
        """True when the rows are kept in the release's FP8 form (buffers ``weight`` and ``scale``)."""
        return self.weight.dtype == torch.float8_e4m3fn

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """Rows ~ N(0, ``std``) (a float table)."""
        nn.init.normal_(self.weight, std=std)

    @torch.no_grad()
    def keep_fp8(self) -> None:
        """Keep the rows in the release's FP8 form (quantised from the float rows; a checkpoint load then writes the
        stored bytes as they are). A trainable table refuses (``ValueError``): it trains in float."""
        from dsv4.checkpoint.quant import quantize

        if self.kept_fp8:
            return
        if self.weight.requires_grad:
            raise ValueError(f"Engram table of {self.rows} rows: a trainable table (model.engram_trainable=true) is "
                             "kept in float, not in the release's FP8 form")
        weight = _local(self.weight)
        if weight.device.type == "meta":
            q = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device="meta")
            s = torch.empty(weight.shape[0], -(-self.head_dim // ROW_SCALE_COLUMNS), dtype=torch.float8_e8m0fnu,
                            device="meta")
        else:
            q, s = quantize(weight.float(), "fp8_rows")
        self._set_storage(q, s)

    def _set_storage(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """Replace the float parameter by the FP8 buffers (local tensors, wrapped by :meth:`_wrap`)."""
        del self.weight
        self.register_buffer("weight", self._wrap(weight))
        self.register_buffer("scale", self._wrap(scale))

    def read(self, local_ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The held rows at positions ``local_ids [n]`` of the slice (global row ``row_start + local_id``),
        ``[n, head_dim]`` in ``dtype`` on ``local_ids``' device (FP8 rows dequantised there after the gather; a float
        table's rows gathered and cast where the table is, then sent; the gather is differentiable)."""
        if self.kept_fp8:
            return self.decode(self.encode(local_ids), dtype)
        weight = _local(self.weight)
        rows = F.embedding(local_ids.to(weight.device), weight)
        rows = rows if dtype is None else rows.to(dtype)
        return rows.to(local_ids.device)

    def encode(self, local_ids: torch.Tensor) -> torch.Tensor:
        """The FP8 rows at ``local_ids [n]`` as they travel: ``uint8 [n, head_dim + scale columns]`` (the e4m3 bytes,
        then the e8m0 scale bytes), gathered where the table is and returned on ``local_ids``' device."""
        weight, scale = _local(self.weight), _local(self.scale)
        at = local_ids.to(weight.device)
        payload = torch.cat([weight.view(torch.uint8)[at], scale.view(torch.uint8)[at]], dim=-1)
        return payload.to(local_ids.device)

    def decode(self, payload: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """:meth:`encode` 's bytes -> the dequantised rows ``[n, head_dim]`` in ``dtype`` (bf16 when None)."""
        from dsv4.checkpoint.quant import V41_SCHEME, dequantize

        q = payload[:, : self.head_dim].contiguous().view(torch.float8_e4m3fn)
        s = payload[:, self.head_dim:].contiguous().view(torch.float8_e8m0fnu)
        return dequantize(q, s, "fp8_rows", dtype or torch.bfloat16, V41_SCHEME)

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``rows [..., head_dim]`` at ``ids [...]`` (global row numbers, all held by this table)."""
        local = ids.reshape(-1) - self.row_start if self.row_start else ids.reshape(-1)
        return self.read(local, dtype).view(*ids.shape, self.head_dim)
