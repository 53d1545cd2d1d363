"""Communication in the plan: the bytes one rank sends and receives in a training step, by kind, the time they take
at stated link speeds, and the step's compute time from the FLOP model.

A step is one micro-batch: forward, backward (with the recomputed forward of ``activation_checkpointing``) and the
optimizer step; with gradient accumulation every micro-batch moves all of it again (FSDP gathers and reduces each
micro-batch). What one rank moves, per kind (:data:`KINDS`):

* **FSDP all-gathers** (:func:`fsdp_traffic`): every unit of :func:`~dsv4.parallel.wrap.fsdp_units` gathers its
  parameters over its mesh (``dp x cp`` ranks; the routed experts over ``edp = world / ep``) in the dtype it computes
  in (its ``param_dtype``: bf16 under mixed precision, fp32 for the fp32 modules). A unit resharded after forward
  (every unit but the root, which is gathered once and kept) is gathered at each call of its forward and again each
  time backward reaches a call's output, at least once in backward (FSDP's backward prefetch gathers a unit whose
  output takes no gradient too: the frozen indexer's compressor); a forward recomputed in backward finds it
  gathered. The calls are the traced ones (:attr:`~dsv4.plan.activations.SegmentTrace.unit_calls`: once each,
  except where the model calls a unit twice, e.g. an overlap compressor's boundary under CP). A rank contributes its
  padded shard (``ceil(dim0 / mesh)`` rows of each parameter) and receives the other ranks': ``shard x (mesh - 1)``
  bytes each way per gather. A one-rank mesh moves nothing.
* **FSDP reduce-scatters**: each unit with trainable parameters reduces their gradients once per backward, in fp32
  (the reduce dtype): ``trainable shard x 4 x (mesh - 1)`` bytes each way. Frozen parameters (a LoRA base) are
  gathered, never reduced.
* **EP dispatch and combine** and **CP exchanges**: counted by the memory plan's stand-ins while they trace each
  segment's forward, recomputed forward and backward (:mod:`dsv4.plan.stand_ins`: the CP stand-in runs the real
  route plans, so its bytes are the ``CPContext`` counter's for the planned rank, the last CP rank of one document
  spanning the sequence; the dispatcher's bytes assume uniform routing, ``(ep - 1) / ep`` of a rank's (token, expert)
  pairs leave it, and back).
* **Engram lookups** (DeepSeek-V4.1's row-sharded tables, over the ``dp x cp`` ranks): per Engram layer and forward
  (a recomputed block looks up again) the per-owner counts (int64), the ids asked of other ranks (int64) and their
  rows back (the compute dtype, or the FP8 form's ``head_dim + head_dim / 32`` bytes), the rows' gradients back to
  their owners when the tables train. An upper bound: every id looked up is counted as distinct (``unique`` sends a
  repeated id once) and ``(world - 1) / world`` of them as another rank's.
* **Engram host copies** (``engram_on_host``, ``trainer.engram_tables=host``: the frozen tables held in host
  memory): per Engram layer and lookup (a recomputed block looks up again), the ids the rank's owned rows are asked
  for go device -> host (int64) and those rows come back host -> device (the FP8 form's ``head_dim + head_dim / 32``
  bytes, or the float rows cast to the compute dtype on the host), before the rows-back all-to-all. The rows a rank
  serves are the ids every rank asks of it (its own included): under the uniform spread of the Engram lookups above,
  as many as it asks itself, ``micro batch x tokens per CP rank x (engram_max_ngram_size - 1) x engram_n_heads`` per
  layer and lookup. The same upper bound (every id counted as distinct; ``unique`` copies a repeated one once); one
  rank copies its own lookups. Two copies per lookup (the ids, the rows).
* **host -> device** and **device -> host** under host offload (:mod:`dsv4.plan.offload`): every unit's stored
  shards each time FSDP gathers it (the copy precedes the all-gather; on a one-rank mesh too), every fp32 gradient
  shard once.

Not counted: the small all-reduces of a step (the loss and its label count, the gradient norm, the routers' expert
loads, the step statistics: a few bytes per MoE layer and expert; at most 0.01 % of the bytes of the tiny model's CPU
runs, ``benchmarks/comm_plan.py``), and the Engram token ids a V4.1 CP rank receives with its halo (``engram_max_ngram_size
- 1`` int32 per continued row).

**Time.** A kind's time is ``max(sent, received) / bandwidth`` of its link (links are full duplex, and the per-rank
volumes above are what ring all-gathers, reduce-scatters and all-to-alls move on a rank's link): NVLink when the
group's ranks share a node (``gpus_per_node`` consecutive ranks form a node; CP and EP groups are consecutive ranks,
the expert FSDP mesh strides by ``ep``), InfiniBand when a group spans nodes (the slowest link of a ring), PCIe for
the host copies. Compute: the per-rank FLOPs of the step (:mod:`dsv4.flops`, the busiest CP rank, times the micro
batch; with recompute the recomputed forward too; LoRA: no weight gradients for the frozen base; none for V4.1,
whose CSA2 attention that model does not describe) at ``tflops``. The
step estimate overlaps what runs beside compute (FSDP's prefetched all-gathers and its reduce-scatters on their own
streams, the offload copies) and adds what the model waits for (EP dispatches, CP exchanges, Engram lookups and
their host copies, PP sends)::

    step = max(compute, FSDP + max(host -> device, device -> host)) + EP + CP + Engram + Engram host copies + PP

a model, not a measurement: no GPU run has checked these times. ``serial`` (compute plus every kind) bounds it above.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dsv4.config import DSV4Config
from dsv4.model.chunk_summary import LIMIT
from dsv4.parallel.cp.layout import cp_chunks
from dsv4.parallel.wrap import FsdpUnit
from dsv4.plan.states import shard_elements

GIB = 2**30
# The kinds of the communication table, in its order.
KINDS = ("fsdp all-gather", "fsdp reduce-scatter", "fsdp all-gather, experts", "fsdp reduce-scatter, experts",
         "ep dispatch + combine", "cp exchanges", "engram lookups", "engram host copies", "pp sends", "host -> device",
         "device -> host")
OVERLAPPED = ("fsdp all-gather", "fsdp all-gather, experts", "fsdp reduce-scatter", "fsdp reduce-scatter, experts")
HOST_COPIES = ("host -> device", "device -> host")
EXPOSED = ("ep dispatch + combine", "cp exchanges", "engram lookups", "engram host copies", "pp sends")
EP_KINDS = ("ep_dispatch", "ep_combine")  # the dispatcher stand-in's kinds (and their ".backward")


@dataclass(frozen=True)
class LinkSpeeds:
    """The speeds the plan times communication and compute at (``plan.*`` of the recipe, docs/memory.md): GB/s
    (10^9 bytes per second) per GPU and direction for NVLink inside a node, InfiniBand between nodes and PCIe to the
    host; ``gpus_per_node``: how many consecutive ranks share a node; ``tflops``: the compute rate a GPU reaches on
    the step (TFLOP/s, not its peak).

    Defaults: an H100 / H200 SXM node of 8 GPUs: NVLink 4 at 900 GB/s both ways (450 each way), one 400 Gb/s
    InfiniBand NDR port per GPU (50 GB/s), PCIe 5.0 x16 (64 GB/s each way), and 400 TFLOP/s, about 40 % of the
    989 TFLOP/s dense bf16 peak. Nominal link rates: NCCL's measured bus bandwidth is typically 70-85 % of them."""

    nvlink_gb_s: float = 450.0
    infiniband_gb_s: float = 50.0
    pcie_gb_s: float = 64.0
    gpus_per_node: int = 8
    tflops: float = 400.0

    def check(self) -> None:
        for name in ("nvlink_gb_s", "infiniband_gb_s", "pcie_gb_s", "tflops"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"plan: `{name}` must be a positive number, got {value!r}")
        if isinstance(self.gpus_per_node, bool) or not isinstance(self.gpus_per_node, int) or self.gpus_per_node < 1:
            raise ValueError(f"plan: `gpus_per_node` must be a positive integer, got {self.gpus_per_node!r}")

    def bandwidth(self, link: str) -> float:
        """Bytes per second of ``link`` (``nvlink``, ``infiniband`` or ``pcie``)."""
        return {"nvlink": self.nvlink_gb_s, "infiniband": self.infiniband_gb_s, "pcie": self.pcie_gb_s}[link] * 1e9


@dataclass(frozen=True)
class Traffic:
    """One kind of communication of one rank per step: bytes ``sent`` and ``received``, ``calls`` (collectives or
    copies), over ``link`` (``nvlink``, ``infiniband``, ``pcie``; ``-`` when nothing moves) among ``group`` ranks;
    ``seconds`` at the plan's speeds; ``note``: what it is."""

    kind: str
    sent: int
    received: int
    calls: int
    link: str
    group: int
    seconds: float
    note: str = ""

    @property
    def bytes(self) -> int:
        """The busier direction: what the time is of."""
        return max(self.sent, self.received)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "bytes_sent": self.sent, "bytes_received": self.received, "calls": self.calls,
                "link": self.link, "group_ranks": self.group, "seconds": self.seconds, "note": self.note}


@dataclass
class CommPlan:
    """The communication table of a plan (module docstring): :attr:`traffic` by kind (the order of :data:`KINDS`),
    the step's per-rank FLOPs (``flops``: with recompute; ``model_flops``: without) and the speeds; under a pipeline
    (:mod:`dsv4.plan.stages`) a step is ``microbatches`` microbatches and its compute waits ``bubble`` more."""

    traffic: list[Traffic]
    flops: float | None  # None: no FLOP model for the family (V4.1); the compute time is then 0
    model_flops: float | None
    speeds: LinkSpeeds = field(default_factory=LinkSpeeds)
    bubble: float = 0.0  # a pipeline schedule's idle time, a fraction of the compute (dsv4.plan.stages.bubble)
    microbatches: int = 1  # what a step is: one micro-batch, or a pipeline's microbatches

    def by_kind(self) -> dict[str, Traffic]:
        return {t.kind: t for t in self.traffic}

    @property
    def compute_seconds(self) -> float:
        return 0.0 if self.flops is None else self.flops / (self.speeds.tflops * 1e12)

    def _seconds(self, kinds: tuple[str, ...]) -> float:
        return sum(t.seconds for t in self.traffic if t.kind in kinds)

    @property
    def overlapped_seconds(self) -> float:
        """What runs beside compute: FSDP's collectives and the busier direction of the host copies."""
        copies = max((t.seconds for t in self.traffic if t.kind in HOST_COPIES), default=0.0)
        return self._seconds(OVERLAPPED) + copies

    @property
    def exposed_seconds(self) -> float:
        """What the model waits for: EP, CP, the Engram lookups and their host copies, PP."""
        return self._seconds(EXPOSED)

    @property
    def step_seconds(self) -> float:
        """The step estimate (module docstring)."""
        return max(self.compute_seconds * (1 + self.bubble), self.overlapped_seconds) + self.exposed_seconds

    @property
    def serial_seconds(self) -> float:
        """Compute (with the pipeline's bubble) plus every kind, nothing overlapped: an upper bound of the model."""
        return self.compute_seconds * (1 + self.bubble) + sum(t.seconds for t in self.traffic)

    @property
    def total_sent(self) -> int:
        return sum(t.sent for t in self.traffic)

    @property
    def total_received(self) -> int:
        return sum(t.received for t in self.traffic)

    def summary(self) -> str:
        """One line: the step estimate, compute and the communication that is not hidden."""
        compute = ("compute not estimated" if self.flops is None else
                   f"compute {format_seconds(self.compute_seconds)} at {self.speeds.tflops:g} TFLOP/s")
        if self.bubble:
            compute += f", pipeline bubble {self.bubble:.0%} of it"
        return (f"step about {format_seconds(self.step_seconds)} {self._per()} ({compute}; beside it FSDP and host copies "
                f"{format_seconds(self.overlapped_seconds)}; exposed EP / CP / Engram / PP {format_seconds(self.exposed_seconds)})")

    def report(self) -> str:
        """The communication table ``plan=true`` prints (per rank and step)."""
        s = self.speeds
        lines = [(f"communication per rank and step ({self._step()}), at NVLink {s.nvlink_gb_s:g}, InfiniBand "
                  f"{s.infiniband_gb_s:g}, PCIe {s.pcie_gb_s:g} GB/s, {s.gpus_per_node} GPUs per node:"),
                 f"      {'kind':<30} {'sent':>11} {'received':>11} {'calls':>6}  {'link':<16} {'time':>9}  what"]
        for t in self.traffic:
            link = "-" if t.link == "-" else f"{t.link} ({t.group})" if t.link != "pcie" else "pcie"
            lines.append(f"      {t.kind:<30} {_size(t.sent):>11} {_size(t.received):>11} {t.calls:>6}  {link:<16} "
                         f"{format_seconds(t.seconds):>9}  {t.note}")
        if self.flops is None:
            lines.append(f"      {'compute':<30} {'not estimated':>24} {'':<17} {'-':>9}  dsv4/flops.py models V4's "
                         "attention, not V4.1's CSA2: the step estimate is its communication alone")
        else:
            lines.append(f"      {'compute':<30} {self.flops / 1e12:>10.1f}T FLOPs {'':<17} "
                         f"{format_seconds(self.compute_seconds):>9}  at {s.tflops:g} TFLOP/s (model FLOPs "
                         f"{self.model_flops / 1e12:.1f}T, recompute included)")
        bubble = f" x (1 + bubble {self.bubble:.3f})" if self.bubble else ""
        lines.append(f"      {'step estimate':<30} {'':>11} {'':>11} {'':>6}  {'':<16} {format_seconds(self.step_seconds):>9}"
                     f"  max(compute{bubble}, FSDP + host copies) + EP + CP + Engram + PP; all in series "
                     f"{format_seconds(self.serial_seconds)}")
        return "\n".join(lines)

    def _step(self) -> str:
        return "one micro-batch" if self.microbatches == 1 and not self.bubble else \
            f"{self.microbatches} microbatches through the pipeline"

    def _per(self) -> str:
        return "per micro-batch" if self.microbatches == 1 and not self.bubble else \
            f"per step of {self.microbatches} microbatches"

    def as_dict(self) -> dict[str, Any]:
        """``memory_plan.json``'s ``communication_per_step``."""
        s = self.speeds
        return {"kinds": [t.as_dict() for t in self.traffic], "bytes_sent": self.total_sent,
                "microbatches": self.microbatches, "pipeline_bubble": self.bubble,
                "bytes_received": self.total_received, "flops": self.flops, "model_flops": self.model_flops,
                "compute_seconds": self.compute_seconds, "overlapped_seconds": self.overlapped_seconds,
                "exposed_seconds": self.exposed_seconds, "step_seconds": self.step_seconds,
                "serial_seconds": self.serial_seconds,
                "speeds": {"nvlink_gb_s": s.nvlink_gb_s, "infiniband_gb_s": s.infiniband_gb_s,
                           "pcie_gb_s": s.pcie_gb_s, "gpus_per_node": s.gpus_per_node, "tflops": s.tflops}}


# ------------------------------------------------------------------------------------------------------ groups
def group_link(world: int, size: int, stride: int, gpus_per_node: int) -> str:
    """The link a group's collectives run over: ``-`` for one rank, ``nvlink`` when every group of ``size`` ranks
    ``stride`` apart (``r, r + stride, ...``; consecutive groups for ``stride = 1``, one group per residue otherwise)
    lies within one node of ``gpus_per_node`` consecutive ranks, ``infiniband`` when one spans nodes."""
    if size <= 1:
        return "-"
    starts = range(0, world, size) if stride == 1 else range(stride)
    for start in starts:
        ranks = [start + i * stride for i in range(size)]
        if len({r // gpus_per_node for r in ranks}) > 1:
            return "infiniband"
    return "nvlink"


# ------------------------------------------------------------------------------------------------------ FSDP
@dataclass(frozen=True)
class FsdpBytes:
    """Per-rank bytes of FSDP's collectives on one mesh in one step (each way: sent = received)."""

    gather: int = 0
    gather_calls: int = 0
    reduce: int = 0
    reduce_calls: int = 0


def unit_gathers(model: nn.Module, units: list[FsdpUnit], segments: list) -> dict[int, int]:
    """How often FSDP gathers each unit (by ``id``) in a step: the root once; a unit resharded after forward at
    each traced forward call of its module, and in backward once per call backward reaches, at least once (the
    trace of its segment: :attr:`~dsv4.plan.activations.SegmentTrace.unit_calls`, a block's units named within the
    block, whose trace blocks of its kind share; the others within the model); a unit no trace saw, twice."""
    layers = list(model.model.layers)
    within = {}  # unit module -> (segment index, name within the segment's scope)
    for i, layer in enumerate(layers):
        for name, module in layer.named_modules():
            within[module] = (i + 1, name)
    names = {m: n for n, m in model.named_modules()}
    out = {}
    for unit in units:
        if unit is units[-1] or not unit.reshard_after_forward:
            out[id(unit)] = 1
            continue
        index, name = within.get(unit.module, (len(segments) - 1, names.get(unit.module, "")))
        calls = segments[index].unit_calls if segments else {}
        forward, reached = calls.get(name, (1, 1)) if calls else (1, 1)
        # backward: a gather per call whose output backward reaches (FSDP reshards after each call's backward), at
        # least one where forward called it (FSDP's backward prefetch gathers the unit before the one whose backward
        # runs, by the forward's order, whether or not backward reaches it; it then stays gathered to the end)
        out[id(unit)] = forward + (max(reached, 1) if forward else 0)
    return out


def fsdp_traffic(units: list[FsdpUnit], owners: dict[nn.Parameter, FsdpUnit], mesh_size: dict[str, int],
                 gathers: dict[int, int] | None = None) -> dict[str, FsdpBytes]:
    """Per mesh name (``dp_cp``, ``edp``), the bytes one rank's FSDP all-gathers and reduce-scatters move per step
    (module docstring); ``owners`` from :func:`~dsv4.plan.states.parameter_owners`, the model sharded for EP;
    ``gathers``: each unit's gathers per step (:func:`unit_gathers`; None: the root once, the others twice)."""
    contributed = {id(u): 0 for u in units}  # a rank's all-gather input (its padded shards in the param dtype)
    reduced = {id(u): 0 for u in units}  # a rank's reduce-scatter output (fp32 trainable shards)
    for p, unit in owners.items():
        local = shard_elements(p, mesh_size[unit.mesh])
        contributed[id(unit)] += local * unit.param_dtype.itemsize
        if p.requires_grad:
            reduced[id(unit)] += local * 4
    out: dict[str, list[int]] = {}
    for unit in units:
        others = mesh_size[unit.mesh] - 1
        acc = out.setdefault(unit.mesh, [0, 0, 0, 0])
        if others == 0 or not contributed[id(unit)]:
            continue
        count = (1 if unit is units[-1] or not unit.reshard_after_forward else 2) if gathers is None \
            else gathers[id(unit)]
        acc[0] += contributed[id(unit)] * others * count
        acc[1] += count
        if reduced[id(unit)]:
            acc[2] += reduced[id(unit)] * others
            acc[3] += 1
    return {mesh: FsdpBytes(*values) for mesh, values in out.items()}


# ------------------------------------------------------------------------------------------------------ FLOPs
def step_flops(config: DSV4Config, seq_len: int, cp: int, micro_batch_size: int = 1, balance: str = "none",
               lora: bool = False) -> tuple[float, float] | None:
    """``(FLOPs, model FLOPs)`` of one rank's step (None for DeepSeek-V4.1: :mod:`dsv4.flops` models V4's attention,
    and would count V4.1's CSA2 layers, which select their keys, as dense ones): the busiest CP rank's share of one
    causal document of
    ``seq_len`` tokens (:func:`dsv4.flops.cp_rank_training_flops`, per part), times the micro batch. Training is
    forward + 2 x forward for the gradients of inputs and weights (LoRA: the frozen base's weight gradients are not
    computed, 1 x forward); the frozen indexer forward only. ``FLOPs`` adds the recomputed forward: every part but
    the lm_head for ``block``, the attention and MoE parts for ``selective``."""
    from dsv4.flops import BREAKDOWN_KEYS, INDEXER_KEYS, cp_rank_training_flops

    if getattr(config, "model_type", None) == "deepseek_v41":
        return None
    forward_only = set() if config.indexer_loss_coeff > 0 else set(INDEXER_KEYS)
    recompute = {"block": set(BREAKDOWN_KEYS) - {"lm_head"},
                 "selective": {"attention_projections", "compressor", "indexer_projections", "indexer_scores",
                               "attention_core", "router", "moe_routed", "moe_shared"}}.get(
        config.activation_checkpointing, set())
    model = [0.0] * cp
    hardware = [0.0] * cp
    for part in BREAKDOWN_KEYS:
        factor = 1 if part in forward_only else 3
        per_rank = cp_rank_training_flops(config, seq_len, cp, balance, parts=(part,))
        for r, value in enumerate(per_rank):
            forward = value / factor
            trained = forward if part in forward_only else forward * (2 if lora else 3)
            model[r] += trained
            hardware[r] += trained + (forward if part in recompute else 0.0)
    busiest = max(range(cp), key=lambda r: hardware[r])
    return hardware[busiest] * micro_batch_size, model[busiest] * micro_batch_size


# ------------------------------------------------------------------------------------------------------ Engram
def engram_traffic(config: Any, tokens: int, world: int, compute_dtype: torch.dtype, fp8: bool) -> tuple[int, int]:
    """``(bytes each way, calls)`` of one rank's Engram lookups per step (module docstring; an upper bound), for
    ``tokens`` tokens per rank (micro batch x tokens per CP rank) and tables row-sharded over ``world`` ranks."""
    layers = list(getattr(config, "engram_layer_ids", None) or [])
    if not layers or world <= 1:
        return 0, 0
    head = int(config.engram_head_dim)
    ids = tokens * (int(config.engram_max_ngram_size) - 1) * int(config.engram_n_heads)
    remote = ids * (world - 1) // world
    trainable = bool(getattr(config, "engram_trainable", False))
    row = head + head // 32 if fp8 and not trainable else head * compute_dtype.itemsize
    passes = 2 if config.activation_checkpointing == "block" else 1  # a recomputed block looks up again
    per_lookup = (world - 1) * 8 + remote * 8 + remote * row
    backward = remote * head * compute_dtype.itemsize if trainable else 0
    calls = len(layers) * (passes * 3 + (1 if trainable else 0))
    return len(layers) * (passes * per_lookup + backward), calls


def engram_host_traffic(config: Any, tokens: int, compute_dtype: torch.dtype, fp8: bool) -> tuple[int, int, int]:
    """``(ids bytes device -> host, row bytes host -> device, copies)`` per step of one rank whose frozen Engram
    tables are held in host memory (module docstring; an upper bound), for ``tokens`` tokens per rank (micro batch x
    tokens per CP rank): the rows it serves, as many as it asks."""
    layers = list(getattr(config, "engram_layer_ids", None) or [])
    if not layers:
        return 0, 0, 0
    head = int(config.engram_head_dim)
    ids = tokens * (int(config.engram_max_ngram_size) - 1) * int(config.engram_n_heads)
    row = head + head // 32 if fp8 else head * compute_dtype.itemsize
    lookups = len(layers) * (2 if config.activation_checkpointing == "block" else 1)
    return lookups * ids * 8, lookups * ids * row, lookups * 2


# ------------------------------------------------------------------------------------------------------ the table
@dataclass(frozen=True)
class StageComm:
    """A pipeline rank's part of :func:`comm_plan` (:mod:`dsv4.plan.stages`): ``pp`` ranks per pipeline,
    ``microbatches`` per step, its point-to-point bytes and calls (``sent``, ``received``, ``calls``), its stages'
    share of the forward FLOPs and of the Engram layers, and the schedule's ``bubble``."""

    pp: int
    microbatches: int
    sent: int
    received: int
    calls: int
    flops_share: float
    engram_share: float
    bubble: float
    note: str


def comm_plan(setup: Any, units: list[FsdpUnit], owners: dict[nn.Parameter, FsdpUnit], mesh_size: dict[str, int],
              traced: dict[str, dict[str, int]], offload: Any = None, gathers: dict[int, int] | None = None,
              stage: StageComm | None = None) -> CommPlan:
    """The :class:`CommPlan` of a :class:`~dsv4.plan.plan.PlanSetup`: FSDP's bytes from its units and their gathers
    (:func:`fsdp_traffic`, :func:`unit_gathers`), the CP and EP bytes ``traced`` by the stand-ins
    (:meth:`~dsv4.plan.activations.ActivationPlan.traffic`), the Engram lookups, the host copies of ``offload``
    (:class:`~dsv4.plan.offload.OffloadBytes`, None without it: its host -> device bytes are recounted with
    ``gathers``). ``stage``: a pipeline rank's (``units``, ``owners`` and ``traced`` then its stages' for the whole
    step; the Engram lookups and the compute its share, per microbatch)."""
    speeds: LinkSpeeds = setup.links
    world, gpn = setup.world, speeds.gpus_per_node
    pp = 1 if stage is None else stage.pp
    link = {"dp_cp": group_link(world, world, 1, gpn), "edp": group_link(world, world // setup.ep, setup.ep, gpn),
            "ep": group_link(world, setup.ep, 1, gpn), "cp": group_link(world, setup.cp, 1, gpn),
            "pp": group_link(world * pp, pp, world, gpn)}
    size = {"dp_cp": world, "edp": world // setup.ep, "ep": setup.ep, "cp": setup.cp, "pp": pp}
    microbatches = 1 if stage is None else stage.microbatches
    rows: list[Traffic] = []

    def add(kind: str, sent: int, received: int, calls: int, mesh: str | None, note: str) -> None:
        where = "pcie" if mesh is None else link[mesh]
        if not (sent or received):
            where = "-"
        seconds = max(sent, received) / speeds.bandwidth(where) if where != "-" else 0.0
        rows.append(Traffic(kind, sent, received, calls, where, 0 if mesh is None else size[mesh], seconds, note))

    fsdp = fsdp_traffic(units, owners, mesh_size, gathers)
    for mesh, suffix, ranks in (("dp_cp", "", "dp x cp"), ("edp", ", experts", "edp = world / ep")):
        b = fsdp.get(mesh, FsdpBytes())
        when = ("forward, again in backward (not the root)" if stage is None
                else "once per step, kept gathered for every microbatch")
        add(f"fsdp all-gather{suffix}", b.gather, b.gather, b.gather_calls, mesh,
            f"parameters in their compute dtype over the {ranks} ranks; {when}")
        add(f"fsdp reduce-scatter{suffix}", b.reduce, b.reduce, b.reduce_calls, mesh,
            f"fp32 gradients of the trainable parameters over the {ranks} ranks"
            + ("" if stage is None else "; once per step, after the last microbatch"))

    def traced_sum(kinds: list[str]) -> tuple[int, int, int]:
        return (sum(traced[k]["bytes_sent"] for k in kinds), sum(traced[k]["bytes_received"] for k in kinds),
                sum(traced[k]["calls"] for k in kinds))

    ep_kinds = [k for k in traced if k.split(".")[0] in EP_KINDS]
    cp_kinds = [k for k in traced if k.split(".")[0] not in EP_KINDS]
    add("ep dispatch + combine", *traced_sum(ep_kinds), "ep",
        f"dispatcher {setup.dispatcher}, uniform routing; forward, recomputed forward, backward")
    exchanges = sorted({k.split(".")[0] for k in cp_kinds})
    note = f"{', '.join(exchanges) if exchanges else 'none'}; the last CP rank of one document over the sequence"
    last_start = setup.seq_len - setup.seq_len // cp_chunks(setup.cp, setup.cp_balance)  # the last chunk's position
    if setup.cp > 1 and last_start // setup.config.shard_multiple >= LIMIT:
        note = (f"NOT PLANNED: a document of {setup.seq_len} tokens has chunk positions the CP chunk summaries cannot "
                f"hold (below {LIMIT * setup.config.shard_multiple} at shard multiple {setup.config.shard_multiple}, "
                "dsv4/model/chunk_summary.py), so CP has no route for it")
    add("cp exchanges", *traced_sum(cp_kinds), "cp", note)
    tokens = setup.micro_batch_size * setup.seq_len // setup.cp
    engram, calls = engram_traffic(setup.config, tokens, world, setup.compute_dtype, setup.engram_fp8)
    if stage is not None:
        engram, calls = (round(n * stage.engram_share) * microbatches for n in (engram, calls))
    add("engram lookups", engram, engram, calls, "dp_cp", "V4.1 tables, upper bound (every id distinct)" if engram
        else "no row-sharded Engram tables" if not getattr(setup.config, "engram_layer_ids", None) else "one rank")
    if getattr(setup, "engram_on_host", False):
        ids_out, rows_in, copies = engram_host_traffic(setup.config, tokens, setup.compute_dtype, setup.engram_fp8)
        if stage is not None:
            ids_out, rows_in, copies = (round(n * stage.engram_share) * microbatches for n in (ids_out, rows_in, copies))
        add("engram host copies", ids_out, rows_in, copies, None,
            "ids device -> host, the rows this rank serves host -> device (trainer.engram_tables=host), upper bound")
    else:
        add("engram host copies", 0, 0, 0, None, "none (trainer.engram_tables=device)")
    if stage is None:
        add("pp sends", 0, 0, 0, None, "no pipeline parallelism (pp = 1)")
    else:
        add("pp sends", stage.sent, stage.received, stage.calls, "pp", stage.note)
    if offload is not None:  # the device receives the shards and sends the gradients
        copies = sum((1 if u is units[-1] or not u.reshard_after_forward else 2) if gathers is None
                     else gathers[id(u)] for u in units)
        graded = len({id(u) for p, u in owners.items() if p.requires_grad})
        add("host -> device", 0, offload.host_to_device, copies, None,
            "parameter shards each time FSDP gathers them (host offload)")
        add("device -> host", offload.device_to_host, 0, graded, None, "fp32 gradient shards after each reduce")
    else:
        add("host -> device", 0, 0, 0, None, "none (trainer.offload=none)")
        add("device -> host", 0, 0, 0, None, "none (trainer.offload=none)")
    flops = step_flops(setup.config, setup.seq_len, setup.cp, setup.micro_batch_size, setup.cp_balance,
                       setup.lora is not None)
    if flops is not None and stage is not None:
        flops = tuple(f * stage.flops_share * microbatches for f in flops)
    return CommPlan(rows, *(flops if flops is not None else (None, None)), speeds,
                    bubble=0.0 if stage is None else stage.bubble, microbatches=microbatches)


def _size(n: float) -> str:
    if n >= GIB:
        return f"{n / GIB:.2f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB" if n else "0"


def format_seconds(s: float) -> str:
    return f"{s:.3f} s" if s >= 0.1 else f"{s * 1e3:.2f} ms"
