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
"""

from __future__ import annotations

import dataclasses

import torch

from dsv4.config import DSV4Config
from dsv4.model.attention_metadata import AttentionMetadata, build_attention_metadata
from dsv4.model.chunk_summary import FIELD
from dsv4.model.context_parallel import ReadyRows
from dsv4.model.dispatch import weighted_sum
from dsv4.parallel.cp.layout import CPLayout
from dsv4.parallel.cp.routes import PlannedLayout


class PlanCP(PlannedLayout):
    """A ``CPContext`` stand-in for rank ``rank`` of ``size`` under ``balance`` (see the module docstring)."""

    def __init__(self, rank: int, size: int, balance: str = "none") -> None:
        self.rank, self.size, self.halo, self.balance = rank, size, None, balance
        self.layout = CPLayout(size, balance)

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def gather_rows(self, local: torch.Tensor, kind: str = "") -> torch.Tensor:
        """Every chunk's summary ``[B, V]`` from this rank's ``[R, 1]`` (:mod:`dsv4.model.chunk_summary`): on
        the CPU, where the metadata is built, those of one document over every chunk; on ``meta``, the shape."""
        batch = local.shape[0] // self.layout.chunks_per_rank
        if local.device.type == "meta":
            return local.new_empty((batch, local.shape[1] * self.layout.num_chunks) + tuple(local.shape[2:]))
        # one document over every chunk: chunk v continues it from position v * l, its last token ends at (v + 1) l
        chunk = self.layout.chunks(self.rank)[0]
        units = ((int(local[0, 0]) >> 16) & (FIELD - 1)) // (chunk + 1)  # l in shard multiples, from its tail field
        v = torch.arange(self.layout.num_chunks)
        ids = FIELD**2 * (1 + FIELD)  # document 1 first and last
        rows = (torch.where(v > 0, v * units + 1, 0) + FIELD * (v + 1) * units + ids).to(local.dtype)[None]
        return rows.expand(batch, -1).clone()

    def halo_exchange(self, tensor: torch.Tensor, rows: int, dim: int = 1, kind: str = "",
                      route=None) -> torch.Tensor:
        return tensor.narrow(dim, tensor.shape[dim] - rows, rows).clone()  # received: a new tensor, same shape

    def start_halo_exchange(self, tensor: torch.Tensor, rows: int, dim: int = 1, kind: str = "", route=None):
        return ReadyRows(self.halo_exchange(tensor, rows, dim))

    def start_exchange_rows(self, tensor: torch.Tensor, plan, dim: int = 1, kind: str = ""):
        return ReadyRows(self.exchange_rows(tensor, plan, dim))

    def exchange_rows(self, tensor: torch.Tensor, plan, dim: int = 1, kind: str = "") -> torch.Tensor:
        received = plan.out_len - tensor.shape[dim]
        if received == 0:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = received
        # received rows: a new tensor on the autograd path (their gradient goes back to their owners)
        return torch.cat([tensor.narrow(dim, 0, 1).expand(shape).clone(), tensor], dim=dim)


class PlanDispatcher:
    """The routed experts with every local expert receiving the same number of pairs (see the module docstring)."""

    needs_uniform_tokens = False

    def __init__(self, expert_parallel: bool = False) -> None:
        self.expert_parallel = expert_parallel

    def run(self, experts, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        n, k = topk_ids.shape
        pairs, local = n * k, experts.num_local_experts
        counts = torch.full((local,), pairs // local, dtype=torch.long)
        counts[: pairs % local] += 1
        token_idx = torch.arange(pairs, device=x.device) // k
        sent = x.index_select(0, token_idx)
        received = sent.clone() if self.expert_parallel else sent  # the all-to-all's receive buffer
        y = experts(received, counts)
        if self.expert_parallel:
            y = y.clone()  # and the return trip's
        return weighted_sum(n, token_idx, y, topk_weights.reshape(-1)).to(x.dtype)


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
    positions = torch.stack([torch.arange(v * local_len, (v + 1) * local_len) for _, v in local])
    return _to_meta(build_attention_metadata(config, positions, torch.ones_like(positions), None,
                                             cp if cp.size > 1 else None))
