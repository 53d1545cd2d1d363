"""Row-sharded Engram tables (DeepSeek-V4.1): each rank of a 1-D mesh owns a contiguous slice of every table's rows.

V4.1-Flash's two Engram tables are ~98 GB each in FP8: no rank holds one, and FSDP must never gather one. Here rank
``r`` of ``N`` owns rows :func:`~dsv4.model.v41.engram_table.row_range` ``(rows, N, r)`` (``ceil(rows / N)`` per rank,
the last fewer) of each table, and a lookup of ``ids [...]`` on every rank is one round trip per Engram layer:

1. ``unique`` (sorted) the ids: a row asked for twice travels once; sorted ids are grouped by owner already;
2. exchange the per-owner counts (``N`` integers per rank, a plain ``all_to_all_single``) that size the next two;
3. ids out: each owner receives the ids it owns, grouped by the asking rank;
4. rows back: the owner reads them (:meth:`~dsv4.model.v41.engram_table.LocalEngramTable.read`) and returns them in
   the order they were asked; the asking rank spreads them over ``ids`` with the ``unique`` inverse.

A float table's rows travel in the asked ``dtype`` (the streams' compute dtype) through the differentiable
all-to-all: backward returns each row's gradient to its owner, where the embedding backward adds it into that
row only (``index_add``): the gradient of a trainable table is exactly zero on rows no rank looked up, and the sum
over every rank's tokens on the others. The FP8 form (frozen) travels as its stored bytes, ``head_dim`` e4m3 and
``head_dim / 32`` e8m0 bytes per row, and is dequantised by the asking rank.

The table tensors (``weight``, and ``scale`` in the FP8 form) are ``DTensor`` s of the whole table, ``Shard(0)`` on
the mesh (their local tensor is the slice): a distributed checkpoint (DCP) writes each rank's rows at their global
offset and loads under another rank count; AdamW keeps its moments as the same ``DTensor`` s (on the owner's rows
only). FSDP leaves them alone (:func:`dsv4.parallel.wrap.apply_fsdp` passes them as ignored parameters) and the
global gradient norm counts each row once (:func:`dsv4.parallel.wrap.clip_grad_norm_`).

The mesh: every rank of the run (``dp x cp``, the flattened ``dp_cp`` mesh), so a table costs ``1 / world`` of its
bytes per rank; the ranks of a row's CP group and of its DP replicas all look up through the same owners.

Host memory (``trainer.engram_tables=host``, :func:`shard_engram_tables` ``(on_host=True)``): a frozen table's slice
stays in host memory (:meth:`~dsv4.model.v41.engram_table.LocalEngramTable.hold_on_host`). Its ``DTensor`` s keep
their local tensor on the host although the mesh is the device's (``DTensor.from_local`` would copy it to the mesh's
device), so a distributed checkpoint saves and loads the same rows at the same offsets. The owner reads the asked
rows on the host and copies them to the ids' device (the collective's) before the rows-back all-to-all: only the ids
and the rows it serves cross between host and device. FSDP never moves them (:func:`tables_set_apart`).
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from dsv4.model.v41.engram_table import LocalEngramTable, row_owner, row_range

__all__ = ["RowShardedEngramTable", "shard_engram_tables", "engram_tables", "sharded_table_parameters",
           "tables_set_apart"]


def _global(local: torch.Tensor, mesh: DeviceMesh, rows: int, on_host: bool = False) -> DTensor:
    """``local`` (this rank's slice of dim 0) as the ``Shard(0)`` DTensor of the whole ``[rows, ...]`` tensor: on the
    mesh's device (``DTensor.from_local`` copies it there), or with ``on_host`` the same storage where it is."""
    shape = torch.Size((rows, *local.shape[1:]))
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    if on_host and local.device.type != mesh.device_type:
        spec = DTensorSpec(mesh, (Shard(0),), tensor_meta=TensorMeta(shape, stride, local.dtype))
        return DTensor(local, spec, requires_grad=local.requires_grad)
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


class RowShardedEngramTable(LocalEngramTable):
    """Rows :func:`row_range` ``(rows, mesh.size(), mesh rank)`` of a table, looked up collectively over the 1-D
    ``mesh`` (see the module docstring). Build it with :meth:`from_table`."""

    mesh: DeviceMesh

    @classmethod
    @torch.no_grad()
    def from_table(cls, table: LocalEngramTable, mesh: DeviceMesh, on_host: bool = False) -> "RowShardedEngramTable":
        """This rank's slice of the whole ``table`` (float or FP8, values copied), sharded over ``mesh``; held in host
        memory (:meth:`~LocalEngramTable.hold_on_host`) with ``on_host`` or when ``table`` is."""
        if mesh.ndim != 1:
            raise ValueError(f"Engram tables shard over a 1-D mesh, got dims {mesh.mesh_dim_names}")
        if table.local_rows != table.rows:
            raise ValueError(f"shard an Engram table held whole, got rows [{table.row_start}, "
                             f"{table.row_start + table.local_rows}) of {table.rows}")
        start, stop = row_range(table.rows, mesh.size(), mesh.get_local_rank())
        out = cls(table.rows, table.head_dim, trainable=table.weight.requires_grad, row_slice=(start, stop))
        out.mesh = mesh
        if on_host or table.held_on_host:
            out.hold_on_host()  # (a trainable table raises); the slice below is then wrapped where it is
        if table.kept_fp8:
            out._set_storage(_host(table.weight[start:stop], out._on_host).clone(),
                             _host(table.scale[start:stop], out._on_host).clone())
        else:
            out.weight = nn.Parameter(out._wrap(_host(table.weight.detach()[start:stop], out._on_host).clone()),
                                      requires_grad=table.weight.requires_grad)
        return out

    def _wrap(self, local: torch.Tensor) -> torch.Tensor:
        return _global(local, self.mesh, self.rows, on_host=self._on_host)

    def extra_repr(self) -> str:
        return super().extra_repr() + f", sharded over {self.mesh.size()} ranks"

    @property
    def group(self) -> dist.ProcessGroup:
        return self.mesh.get_group()

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``rows [..., head_dim]`` at ``ids [...]`` (global rows); a collective over the mesh (module docstring)."""
        size, group = self.mesh.size(), self.group
        asked, inverse = torch.unique(ids.reshape(-1), sorted=True, return_inverse=True)
        send = torch.bincount(row_owner(asked, self.rows, size), minlength=size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        wanted = asked.new_empty(sum(recv_splits))
        dist.all_to_all_single(wanted, asked, recv_splits, send_splits, group=group)
        local = wanted - self.row_start
        if self.kept_fp8:
            payload = self.encode(local)
            got = payload.new_empty(len(asked), payload.shape[1])
            dist.all_to_all_single(got, payload, send_splits, recv_splits, group=group)
            rows = self.decode(got, dtype)
        else:
            served = self.read(local, dtype)
            if served.requires_grad:
                rows = funcol.all_to_all_single_autograd(served, send_splits, recv_splits, group)
            else:
                rows = served.new_empty(len(asked), self.head_dim)
                dist.all_to_all_single(rows, served.contiguous(), send_splits, recv_splits, group=group)
        return rows[inverse].view(*ids.shape, self.head_dim)


def _host(t: torch.Tensor, on_host: bool) -> torch.Tensor:
    """``t`` in host memory when ``on_host`` (where it is otherwise; a meta tensor stays meta)."""
    return t.cpu() if on_host and t.device.type not in ("cpu", "meta") else t


def engram_tables(model: nn.Module) -> list[tuple[str, LocalEngramTable]]:
    """``(module name, table)`` of every Engram table of ``model`` (none for a V4 model)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, LocalEngramTable)]


def sharded_table_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The parameters of ``model``'s row-sharded Engram tables (FSDP's ignored parameters)."""
    return {m.weight for _, m in engram_tables(model)
            if isinstance(m, RowShardedEngramTable) and isinstance(m.weight, nn.Parameter)}


def shard_engram_tables(model: nn.Module, mesh: DeviceMesh, on_host: bool = False) -> int:
    """Replace every whole Engram table of ``model`` by this rank's :class:`RowShardedEngramTable` over ``mesh``
    (idempotent: a table already sharded stays); returns how many were sharded. ``on_host``: every table (sharded now
    or before) is held in host memory (``trainer.engram_tables=host``; a trainable table raises ``ValueError``).
    Build the optimizer afterwards (new parameters), and load a checkpoint afterwards too (then only this rank's rows
    are read)."""
    count = 0
    for name, table in engram_tables(model):
        if isinstance(table, RowShardedEngramTable):
            if on_host:
                table.hold_on_host()
            continue
        parent, _, attr = name.rpartition(".")
        sharded = RowShardedEngramTable.from_table(table, mesh, on_host=on_host)
        setattr(model.get_submodule(parent) if parent else model, attr, sharded)
        count += 1
    return count


@contextlib.contextmanager
def tables_set_apart(model: nn.Module) -> Iterator[None]:
    """For the duration, the buffers of ``model``'s Engram tables held in host memory (the FP8 form's ``weight`` and
    ``scale``) are out of their modules, then put back as they were (the same tensors). FSDP2's ``fully_shard`` moves
    every buffer of the modules it manages to its device by assigning ``.data`` (not through ``Module._apply``,
    whose override keeps a held table in place), and raises for a ``DTensor`` buffer off its device: without its
    buffers (and with its parameter ignored) a held table is no module of FSDP's."""
    apart = []
    for _, table in engram_tables(model):
        if table.held_on_host:
            held = {k: table._buffers.pop(k) for k in ("weight", "scale") if k in table._buffers}
            apart.append((table, held))
    try:
        yield
    finally:
        for table, held in apart:
            table._buffers.update(held)
