"""The memory and communication plan of pipeline stages (``pp > 1``): each pipeline rank's stages planned like one
rank without a pipeline, from the same traces, and the worst rank decides.

**Layout.** ``pp x dp x cp`` ranks, the pipeline outermost: the ``dp x cp`` ranks holding one stage are consecutive
(the stage's FSDP mesh, with its CP and EP groups inside it as without a pipeline), and the ranks of one pipeline are
``dp x cp`` apart. The split is :func:`dsv4.parallel.pipeline.stage_layers` (``pp x virtual`` stages; rank ``r``
holds stages ``r, r + pp, ...``: :func:`~dsv4.parallel.pipeline.stage_indices`), a stage's parameters those of its
:class:`~dsv4.parallel.pipeline.DSV4PipelineStage` (its blocks; the embedding on the first, and on the last too with
MTP depths; the head on the last).

**A step** is ``n_microbatches`` microbatches per pipeline (the run's gradient accumulation:
``global_batch_size / (micro_batch_size x dp)``) through ``torch.distributed.pipelining``'s schedule ``schedule``.

**Memory of a rank** (its stages together), on the terms of :class:`~dsv4.plan.plan.MemoryPlan`:

* parameters, gradients, optimizer: its stages' FSDP shards over the stage's ``dp x cp`` ranks (routed experts over
  ``edp``), as :func:`~dsv4.plan.states.state_bytes` counts them for the whole model;
* communication: FSDP2 inside a stage under ``torch.distributed.pipelining`` keeps every unit gathered and its
  gradient unsharded from the first microbatch's backward to the last's (the engine's ``PipelineStage`` turns off
  resharding after backward and the gradient reduction for every microbatch but the last), so a rank holds all its
  stages' parameters gathered in their compute dtype and their gradients unsharded in fp32 (FSDP2 accumulates
  unsharded gradients in its reduce dtype); and the engine's receive buffers, allocated per microbatch up front:
  every microbatch's inputs of a non-first stage and output gradients of a non-last one
  (:func:`~dsv4.parallel.pipeline.stage_io`). An upper bound where these overlap other terms: a received input is
  also the first block's saved input, a unit's unsharded gradient is freed as the last backward reduces it;
* activations: a microbatch keeps its stage's retained activations (the segments' ``retained`` and the attention
  metadata it built) from its forward to its backward; the schedule decides how many are in flight
  (:func:`in_flight_timeline`, the engine's own action order for the interleaved schedules). A phase of a
  microbatch's forward or backward through stage ``j`` holds what that phase holds in a one-stage step over the
  stage's segments plus the retained bytes of the other microbatches in flight at the rank's peak
  (``held - R_j``: exact with one stage per rank, an upper bound with virtual stages).

**Communication of a rank per step** (:mod:`dsv4.plan.comm`'s table): FSDP's all-gathers once (units kept gathered,
the schedule's first backward finds them so) and reduce-scatters once (the last microbatch) over the stage's ranks;
the CP exchanges, EP all-to-alls and Engram lookups of its stages' segments, and the attention metadata each stage
builds, per microbatch; the ``pp sends`` of :func:`~dsv4.parallel.pipeline.stage_traffic` between pipeline
neighbours (``dp x cp`` ranks apart). Compute: the stages' share of the model's forward FLOPs
(:func:`~dsv4.parallel.pipeline.layer_costs`) of the step's FLOPs per microbatch, times the microbatches; the
schedule's bubble adds ``(pp - 1) / (virtual x n_microbatches)`` of it (1F1B's and interleaved 1F1B's; zero bubble
is counted with the same, an upper bound). Host offload is not planned under a pipeline (refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from dsv4.parallel.pipeline import (
    SCHEDULES,
    DSV4PipelineStage,
    StageSpan,
    layer_costs,
    stage_indices,
    stage_io,
    stage_layers,
    stage_traffic,
)
from dsv4.plan.activations import ActivationPlan, Phase, sum_traffic

INTERLEAVED = ("interleaved_1f1b", "interleaved_zero_bubble")


# ------------------------------------------------------------------------------------------------------ schedules
def in_flight_timeline(schedule: str, pp: int, virtual: int, n_microbatches: int, rank: int) -> list[dict[int, int]]:
    """For pipeline rank ``rank``, after each compute action of the schedule: per stage index the rank holds, how many
    microbatches have run that stage's forward and not finished its backward (their saved activations are live).

    ``gpipe``: every forward, then every backward. ``1f1b``: ``min(n_microbatches, pp - rank)`` forwards, then one
    backward and one forward in turn (``torch.distributed.pipelining.Schedule1F1B``'s order). The interleaved
    schedules: the engine's own action order (their ``pipeline_order``, computed from the stage count, the rank and
    the microbatches); a full backward (``B``) ends a microbatch's stay, and under zero bubble its weight gradient
    (``W``), which still reads saved inputs after the input gradient (``I``)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"`pp_schedule`={schedule!r} must be one of {', '.join(SCHEDULES)}")
    stages = stage_indices(rank, pp, virtual)
    if schedule not in INTERLEAVED:
        if virtual != 1:
            raise ValueError(f"`pp_virtual`={virtual} needs an interleaved `pp_schedule`, got {schedule}")
        stage = stages[0]
        warmup = n_microbatches if schedule == "gpipe" else min(n_microbatches, pp - rank)
        actions = [+1] * warmup
        for _ in range(n_microbatches - warmup):
            actions += [-1, +1]
        actions += [-1] * warmup
        timeline, live = [], 0
        for step in actions:
            live += step
            timeline.append({stage: live})
        return timeline
    live = dict.fromkeys(stages, 0)
    timeline = []
    for action in _engine_order(schedule, pp, virtual, n_microbatches, rank):
        if action is None:
            continue
        kind = str(action.computation_type.value)
        if kind == "F":
            live[action.stage_index] += 1
        elif kind in ("B", "W"):
            live[action.stage_index] -= 1
        else:
            continue
        timeline.append(dict(live))
    return timeline


def check_microbatches(schedule: str, pp: int, virtual: int, microbatches: int) -> None:
    """ValueError naming ``global_batch_size`` when ``schedule`` cannot run ``microbatches`` per step on ``pp x
    virtual`` stages: 1F1B needs at least ``pp``; the interleaved schedules what the engine's own order accepts."""
    if schedule == "1f1b" and microbatches < pp:
        raise ValueError(f"`pp_schedule`=1f1b needs at least pp={pp} microbatches per step, got {microbatches} "
                         "(the gradient accumulation: global_batch_size / (micro_batch_size x dp)); raise "
                         "global_batch_size")
    if schedule in INTERLEAVED:
        _engine_order(schedule, pp, virtual, microbatches, 0)


def _engine_order(schedule: str, pp: int, virtual: int, n_microbatches: int, rank: int) -> list[Any]:
    """``torch.distributed.pipelining``'s action list of ``rank`` for an interleaved schedule: the schedule built over
    stand-ins of the rank's stages (what its constructor reads of a stage: the pipeline's size, the rank, the stage
    count and index, the module)."""
    from torch.distributed import pipelining

    cls = pipelining.ScheduleInterleaved1F1B if schedule == "interleaved_1f1b" \
        else pipelining.ScheduleInterleavedZeroBubble
    stand_ins = [SimpleNamespace(group_size=pp, group_rank=rank, num_stages=pp * virtual, stage_index=i,
                                 submod=nn.Module()) for i in stage_indices(rank, pp, virtual)]
    try:
        built = cls(stand_ins, n_microbatches=n_microbatches, loss_fn=lambda out, target: out, scale_grads=False)
    except (ValueError, RuntimeError) as error:
        raise ValueError(f"`pp_schedule`={schedule} with pp={pp}, pp_virtual={virtual} and {n_microbatches} "
                         f"microbatches per step (global_batch_size / (micro_batch_size x dp)): {error}") from error
    return built.pipeline_order[rank]


def peak_held(timeline: list[dict[int, int]], retained: dict[int, int]) -> int:
    """The most retained bytes the rank holds at once: ``max over the timeline of sum(count_j x retained_j)``."""
    return max((sum(n * retained[j] for j, n in live.items()) for live in timeline), default=0)


def bubble(schedule: str, pp: int, virtual: int, n_microbatches: int) -> float:
    """The schedule's idle time as a fraction of a rank's compute: ``(pp - 1) / (virtual x n_microbatches)``."""
    return (pp - 1) / (virtual * n_microbatches)


# ------------------------------------------------------------------------------------------------------ stages
@dataclass
class RankStages:
    """What pipeline rank ``rank`` holds: its stages' spans, their modules (views of the planned model), the
    segment indices of each stage in the model's activation plan (0 = embedding, 1 + i = block i, last = top), and the
    rank's parameters and buffers (each once, as the model held them when the stages were made)."""

    rank: int
    spans: list[StageSpan]
    modules: list[DSV4PipelineStage]
    segments: list[list[int]]
    parameters: list[nn.Parameter]
    buffers: list[torch.Tensor]

    @property
    def engram_layers(self) -> int:
        """Decoder blocks of the rank's stages that hold an Engram module (DeepSeek-V4.1)."""
        return sum(getattr(b, "engram", None) is not None for m in self.modules for b in m.blocks.values())

    def describe(self) -> str:
        """``stage 0: blocks 0-3 + embedding``, one part per stage."""
        parts = []
        for span in self.spans:
            extra = (" + embedding" if span.first else "") + (" + head" if span.last else "")
            parts.append(f"stage {span.index}: blocks {span.start}-{span.stop - 1}{extra}")
        return ", ".join(parts)


def rank_stages(model: nn.Module, seq_len: int, pp: int, virtual: int) -> list[RankStages]:
    """Every pipeline rank's stages of ``model`` (built on ``meta``, experts sharded), split for ``seq_len``."""
    spans = stage_layers(model.config, seq_len, pp * virtual)
    n = model.config.num_hidden_layers
    out = []
    for rank in range(pp):
        mine = [spans[i] for i in stage_indices(rank, pp, virtual)]
        segments = [([0] if s.first else []) + [1 + i for i in range(s.start, s.stop)] + ([n + 1] if s.last else [])
                    for s in mine]
        modules = [DSV4PipelineStage(model, s) for s in mine]
        params = list({id(p): p for m in modules for p in m.parameters()}.values())
        buffers = list({id(b): b for m in modules for b in m.buffers()}.values())
        out.append(RankStages(rank, mine, modules, segments, params, buffers))
    return out


def stage_activations(full: ActivationPlan, stages: RankStages, timeline: list[dict[int, int]]) -> ActivationPlan:
    """The rank's activation phases (module docstring): per stage ``j`` its segments' phases of one microbatch, with
    the attention metadata it builds, plus ``held - R_j``, the other microbatches in flight at the rank's peak."""
    retained = {}
    for span, segs in zip(stages.spans, stages.segments):
        retained[span.index] = full.metadata + sum(full.segments[i].retained for i in segs)
    held = peak_held(timeline, retained)
    names = {0: "embedding", len(full.segments) - 1: full.top_name}
    phases = []
    for span, segs in zip(stages.spans, stages.segments):
        others = held - retained[span.index]
        before = 0
        for i in segs:
            seg = full.segments[i]
            name = names.get(i, f"block {i - 1} ({seg.kind})")
            phases.append(Phase(f"forward of {name} (stage {span.index})",
                                others + full.metadata + before + seg.forward_peak, None))
            before += seg.retained
        for i in reversed(segs):
            seg = full.segments[i]
            before -= seg.retained
            name = names.get(i, f"block {i - 1} ({seg.kind})")
            phases.append(Phase(f"backward of {name} (stage {span.index})",
                                others + full.metadata + before + seg.backward_peak, None))
    kept = {i for segs in stages.segments for i in segs}
    segments = [seg for i, seg in enumerate(full.segments) if i in kept]
    return ActivationPlan(metadata=full.metadata, segments=segments, phases=phases, top_name=full.top_name,
                          per_forward=full.per_forward, metadata_traffic=full.metadata_traffic)


def stage_traced(full: ActivationPlan, stages: RankStages, n_microbatches: int) -> dict[str, dict[str, int]]:
    """The rank's CP and EP bytes of one step by kind: its stages' segments' and the metadata each stage builds, per
    microbatch (:meth:`~dsv4.plan.activations.ActivationPlan.traffic`'s form)."""
    records = [full.metadata_traffic] * len(stages.spans) + [full.segments[i].traffic for s in stages.segments
                                                             for i in s]
    return sum_traffic(records, n_microbatches)


def flops_share(config: Any, seq_len: int, spans: list[StageSpan]) -> float:
    """The stages' share of the model's forward FLOPs (:func:`~dsv4.parallel.pipeline.layer_costs`; the head's on
    the last stage)."""
    blocks, head = layer_costs(config, seq_len)
    return sum(s.cost for s in spans) / (sum(blocks) + head)


def receive_buffers(stages: RankStages, rows: int, length: int, dtype: torch.dtype, n_microbatches: int) -> int:
    """Bytes of the engine's receive buffers on the rank: per microbatch, a non-first stage's inputs and a non-last
    stage's output gradients (those of its outputs that carry one)."""
    total = 0
    for module in stages.modules:
        inputs, outputs = stage_io(module, rows, length, dtype)
        if not module.span.first:
            total += sum(t.numel() * t.element_size() for t in inputs)
        if not module.span.last:
            total += sum(t.numel() * t.element_size() for t in outputs if t.requires_grad)
    return total * n_microbatches


def pp_sends(stages: RankStages, rows: int, length: int, dtype: torch.dtype, n_microbatches: int) -> dict[str, int]:
    """The rank's point-to-point bytes per step, summed over its stages (:func:`~dsv4.parallel.pipeline.stage_traffic`)
    and the calls (one send or receive per tensor and microbatch, and the handshakes)."""
    sent = received = calls = 0
    for module in stages.modules:
        t = stage_traffic(module, rows, length, n_microbatches, dtype)
        sent, received = sent + t["sent"], received + t["received"]
        inputs, outputs = stage_io(module, rows, length, dtype)
        per_mb = (0 if module.span.last else len(outputs) + sum(t.requires_grad for t in outputs)) + \
            (0 if module.span.first else len(inputs) + sum(t.requires_grad for t in inputs))
        calls += per_mb * n_microbatches
    return {"sent": sent, "received": received, "calls": calls}
