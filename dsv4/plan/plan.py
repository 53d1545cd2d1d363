"""The memory plan of a fine-tuning configuration: what one rank needs, term by term, and whether it fits.

:func:`memory_plan` builds the model on the ``meta`` device (nothing is allocated), applies the real expert
sharding and the FSDP unit list (:mod:`dsv4.plan.states`), traces the step's activations with the real model
code (:mod:`dsv4.plan.activations`) and adds up, per rank:

    total = parameters + gradients + optimizer + activations + communication

``activations`` is the step's peak of live activation bytes (the rank planned is the last CP rank, which receives
the most earlier rows of a document spanning the sequence); ``communication`` is FSDP's gathered parameters and
gradient reduce buffer (EP dispatch buffers are inside the MoE activations). What is not counted: the CUDA
context and NCCL workspaces (about 1-2 GiB per GPU), allocator fragmentation, and the kernels' workspaces.

Checkpoints: each rank writes its trainable parameter shards (fp32) and their optimizer state
(:attr:`MemoryPlan.checkpoint_bytes`; a LoRA run its adapters only), the whole checkpoint about ``world`` times that
on disk. An asynchronous save (``checkpoint.async_save``) stages that share in host memory while it is written: a
host-side term, outside the device total (on a CPU run the host is the device: add it).

Host offload (``offload="optimizer"``, ``trainer.offload``; :mod:`dsv4.plan.offload`): the sharded parameters,
their gradients and the optimizer state move to the host (:attr:`MemoryPlan.host_offload_bytes`, outside the device
total like the staging copy), the optimizer step and its temporary with them; the device keeps the buffers and
gains FSDP's staging copies (in ``communication``).

Engram tables in host memory (``engram_on_host``, ``trainer.engram_tables=host``; DeepSeek-V4.1, frozen tables): the
rank's rows of the tables leave the device's ``parameters`` and are host memory per rank
(:attr:`MemoryPlan.engram_host_bytes`, outside the device total); the ids a lookup sends to the host and the rows it
copies back are the communication table's ``engram host copies``. The rows one lookup copies are at most the few
thousand asked per step, a transient not added to the device total (the looked-up rows themselves are activations).

The verdict: the plan fits when its total is at most the device memory less ``reserve_bytes``, the reserve for what
it does not trace (the CUDA context, NCCL's buffers, allocator fragmentation, kernel workspaces; the recipe's
``plan.reserve_gib``, default :data:`DEFAULT_RESERVE_GIB`).

Communication (:mod:`dsv4.plan.comm`, :attr:`MemoryPlan.comm`): the bytes the rank sends and receives per step by
kind (FSDP, EP, CP, Engram lookups, PP, host copies), their time at ``links`` and the step's compute time.

``MemoryPlan.as_dict()`` is what ``memory_plan.json`` holds; ``report()`` the table the recipe prints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from dsv4.config import DSV4Config
from dsv4.parallel.cp.layout import cp_chunks
from dsv4.model import build_causal_lm
from dsv4.model.v41.engram_table import LocalEngramTable
from dsv4.parallel.expert_shard import shard_experts
from dsv4.parallel.wrap import OFFLOAD, fsdp_units, store_frozen_in_compute_dtype
from dsv4.peft.apply import apply_lora
from dsv4.peft.config import LoRAConfig
from dsv4.plan.activations import ActivationPlan, Phase, cast_for_compute, plan_activations, step_tracer
from dsv4.plan.comm import CommPlan, LinkSpeeds, StageComm, comm_plan, format_seconds, unit_gathers
from dsv4.plan.offload import OffloadBytes, offload_bytes
from dsv4.plan.stand_ins import DISPATCHER_TRAFFIC
from dsv4.plan.stages import (bubble, check_microbatches, flops_share, in_flight_timeline, pp_sends, rank_stages,
                              receive_buffers, stage_activations, stage_traced)
from dsv4.plan.states import (OptimizerProfile, StateBytes, engram_table_bytes, gradient_shard_bytes,
                              parameter_owners, shard_elements, state_bytes, table_tensors)

GIB = 2**30
TERMS = ("parameters", "gradients", "optimizer", "activations", "communication")
# The recipe's default reserve (plan.reserve_gib) for what the plan does not trace, per GPU: the CUDA context
# (0.5-1 GiB), NCCL's buffers (about 1 GiB), kernel workspaces and allocator fragmentation (docs/memory.md).
DEFAULT_RESERVE_GIB = 4.0


@dataclass(frozen=True)
class PlanSetup:
    """What the plan is for: the model, the step shape, the parallel layout, the optimizer's state (its bytes per
    trainable shard, :class:`~dsv4.plan.states.OptimizerProfile`), the device memory judged against less
    ``reserve_bytes`` (what the plan does not trace; 0 here, the recipe's ``plan.reserve_gib`` otherwise), the MoE
    ``dispatcher`` (for its bytes, with ``ep > 1``) and the speeds communication and compute are timed at."""

    config: DSV4Config
    seq_len: int
    micro_batch_size: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1
    compute_dtype: torch.dtype = torch.float32
    optimizer: OptimizerProfile = OptimizerProfile()
    device_memory_bytes: int = 80 * GIB
    chunked_loss: bool = True  # the training step's loss; False: through full [L, vocab] logits
    lora: LoRAConfig | None = None  # a LoRA fine-tune (dsv4.peft): frozen base, trainable adapters
    cp_balance: str = "none"  # the CP layout (dsv4.parallel.cp.layout): "full" = head-tail chunks
    async_checkpoint: bool = True  # checkpoint.async_save: a host staging copy of the rank's checkpoint share
    offload: str = "none"  # trainer.offload: "optimizer" = shards, gradients, optimizer state in host memory
    engram_fp8: bool = False  # V4.1: frozen Engram tables kept in the release's FP8 form (a checkpoint storing them so)
    engram_on_host: bool = False  # V4.1: frozen Engram tables held in host memory (trainer.engram_tables=host)
    reserve_bytes: int = 0  # kept free of the plan's total: the CUDA context, NCCL buffers, fragmentation
    dispatcher: str = "alltoall"  # the MoE dispatcher with ep > 1 (alltoall | allgather | deepep)
    links: LinkSpeeds = LinkSpeeds()  # link speeds and the compute rate of the communication table
    pp: int = 1  # pipeline stages' ranks (dsv4.plan.stages): pp x dp x cp GPUs
    pp_schedule: str = "1f1b"  # torch.distributed.pipelining's schedule (dsv4.parallel.pipeline.SCHEDULES)
    pp_virtual: int = 1  # stages per pipeline rank (the interleaved schedules)
    microbatches: int = 1  # per step and pipeline (the gradient accumulation)

    @property
    def world(self) -> int:
        """The ranks of one pipeline stage (all of them without a pipeline): ``dp x cp``, FSDP's mesh."""
        return self.dp * self.cp

    @property
    def gpus(self) -> int:
        """Every rank of the layout: ``pp x dp x cp``."""
        return self.pp * self.world

    @property
    def pipelined(self) -> bool:
        """Planned in pipeline stages (``pp > 1`` or virtual stages: :mod:`dsv4.plan.stages`)."""
        return self.pp > 1 or self.pp_virtual > 1

    def check(self) -> None:
        """ValueError naming the setting before anything is built."""
        for name in ("seq_len", "micro_batch_size", "cp", "dp", "ep", "pp", "pp_virtual", "microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"memory plan: `{name}` must be a positive integer, got {value!r}")
        if self.world % self.ep:
            raise ValueError(f"memory plan: `ep`={self.ep} must divide dp x cp = {self.world}")
        if self.config.n_routed_experts % self.ep:
            raise ValueError(f"memory plan: `ep`={self.ep} must divide model.n_routed_experts="
                             f"{self.config.n_routed_experts}")
        chunks = cp_chunks(self.cp, self.cp_balance)
        if self.seq_len % (chunks * self.config.shard_multiple):
            raise ValueError(f"memory plan: `seq_len`={self.seq_len} must be a multiple of chunks x shard multiple = "
                             f"{chunks} x {self.config.shard_multiple} (cp={self.cp}, cp_balance={self.cp_balance})")
        if self.offload not in OFFLOAD:
            raise ValueError(f"memory plan: `offload`={self.offload!r} must be one of {', '.join(OFFLOAD)}")
        if self.engram_on_host and getattr(self.config, "engram_trainable", False):
            raise ValueError("memory plan: `engram_on_host` holds frozen Engram tables in host memory, but "
                             "model.engram_trainable=true trains them")
        if self.device_memory_bytes <= 0:
            raise ValueError(f"memory plan: the device memory must be positive, got {self.device_memory_bytes} bytes")
        if not isinstance(self.reserve_bytes, int) or self.reserve_bytes < 0:
            raise ValueError(f"memory plan: the reserve must be a number of bytes >= 0, got {self.reserve_bytes!r}")
        if self.dispatcher not in DISPATCHER_TRAFFIC:
            raise ValueError(f"memory plan: `dispatcher`={self.dispatcher!r} must be one of "
                             f"{', '.join(DISPATCHER_TRAFFIC)}")
        self.links.check()
        if self.pipelined:
            from dsv4.parallel.pipeline import SCHEDULES, check_pipeline

            check_pipeline(self.config, self.pp)
            if self.pp_schedule not in SCHEDULES:
                raise ValueError(f"memory plan: `pp_schedule`={self.pp_schedule!r} must be one of "
                                 f"{', '.join(SCHEDULES)}")
            if self.offload != "none":
                raise ValueError(f"memory plan: `pp`={self.pp} with trainer.offload={self.offload}: host offload is "
                                 "not planned under a pipeline")
            check_microbatches(self.pp_schedule, self.pp, self.pp_virtual, self.microbatches)

    @property
    def usable_memory_bytes(self) -> int:
        """What the plan's total must fit: the device memory less the reserve (0 when the reserve takes it all)."""
        return max(self.device_memory_bytes - self.reserve_bytes, 0)


@dataclass
class MemoryPlan:
    """Per-rank bytes by term (:data:`TERMS`), the activation detail and the verdict.

    The terms do not all peak at once: a phase of the step holds the parameters, the optimizer state, the
    communication buffers, that phase's activations and the gradient shards already reduced (FSDP reduces each
    unit's gradients after its backward; the root unit's last), and the optimizer step holds every gradient plus
    the update's temporary (see :class:`~dsv4.plan.states.OptimizerProfile`). ``total`` is the largest phase.
    ``segment_gradients``: the gradient shard bytes each segment's units reduce, in forward order.

    ``engram_table_bytes`` (DeepSeek-V4.1): the rank's rows of the Engram tables (row-sharded over the ``dp x cp``
    ranks, never gathered), counted in ``parameters``; frozen (no gradient, no optimizer state) unless
    ``engram_trainable``, then with a dense fp32 gradient and optimizer state over the rank's rows. They stay on the
    device under host offload. With ``setup.engram_on_host`` they are host memory instead
    (:attr:`engram_host_bytes`): the device's ``parameters`` is less exactly those bytes.

    ``offload`` (host offload, :mod:`dsv4.plan.offload`): the terms are the device's. ``parameters`` is the
    buffers, ``gradients`` and ``optimizer`` are 0, ``communication`` adds FSDP's staging copies; the optimizer step
    holds only the buffers on the device and no phase holds reduced gradients there."""

    setup: PlanSetup
    states: StateBytes
    activations: ActivationPlan
    segment_gradients: list[int]
    offload: OffloadBytes | None = None
    engram_table_bytes: int = 0  # V4.1: this rank's rows of the Engram tables (inside ``parameters``)
    comm: CommPlan | None = None  # bytes moved per step by kind, their time, the compute time (dsv4.plan.comm)
    stages: Any = None  # under a pipeline: this rank's dsv4.plan.stages.RankStages
    step_activations: ActivationPlan | None = None  # under a pipeline: the one-microbatch trace it was composed from
    ranks: list[MemoryPlan] = field(default_factory=list)  # under a pipeline: every rank's plan (this one's among)
    per_rank_bytes: dict[str, int] = field(init=False)
    peak_phase: str = field(init=False)
    phase_bytes: dict[str, int] = field(init=False)  # device bytes of each phase; ``total`` is the largest

    def __post_init__(self) -> None:
        s, o = self.states, self.offload
        if o is None:
            device = {"parameters": s.parameters, "gradients": s.gradients, "optimizer": s.optimizer,
                      "communication": s.communication}
            step_temporary = s.step_temporary
        else:  # the shards, gradients and optimizer state (and the step) are on the host
            device = {"parameters": s.parameters - o.parameters, "gradients": s.table_gradients,
                      "optimizer": s.table_optimizer,
                      "communication": s.communication + o.device_staging}
            step_temporary = 0
        device["parameters"] -= self.engram_host_bytes  # frozen tables held in host memory
        self.per_rank_bytes = {t: device.get(t, self.activations.peak) for t in TERMS}
        fixed = device["parameters"] + device["optimizer"]
        phases = [("optimizer step", fixed + device["gradients"] + step_temporary)]
        for phase in self.activations.phases:
            reduced = 0 if o is not None else self._reduced_before(phase)
            phases.append((phase.name, fixed + device["communication"] + phase.activations + reduced))
        self.phase_bytes = dict(phases)
        self.peak_phase, self.per_rank_bytes["total"] = max(phases, key=lambda p: p[1])

    @property
    def total(self) -> int:
        return self.per_rank_bytes["total"]

    @property
    def checkpoint_bytes(self) -> int:
        """What this rank writes per checkpoint: trainable fp32 parameter shards (the full model's, with its
        buffers; a LoRA run's adapters) and their optimizer state."""
        s = self.states
        return (s.parameters if self.setup.lora is None else s.gradients) + s.optimizer

    @property
    def host_staging_bytes(self) -> int:
        """Host memory an asynchronous save holds while it is written (0 for synchronous saves)."""
        return self.checkpoint_bytes if self.setup.async_checkpoint else 0

    @property
    def shared_memory_total(self) -> int:
        """The peak when host and device are one memory (a run on the CPU). Without offload ``total`` (plus the Engram
        tables held in host memory). With it, each phase's device bytes, less FSDP's staging copies (a copy to the
        same memory is the shard itself; a cast to the compute dtype stays), plus what the host holds in that phase:
        the parameter shards, the optimizer state, the gradient shards reduced so far (at the optimizer step every
        gradient and the step's temporary) and the Engram tables held there."""
        o = self.offload
        if o is None:
            return self.total + self.engram_host_bytes
        host = o.parameters + o.optimizer + self.engram_host_bytes
        phases = [self.phase_bytes["optimizer step"] + host + o.gradients + o.step_temporary]
        for phase in self.activations.phases:
            phases.append(self.phase_bytes[phase.name] - o.device_staging + o.gather_cast + host
                          + self._reduced_before(phase))
        return max(phases)

    def _reduced_before(self, phase: Phase) -> int:
        """The gradient shard bytes FSDP has reduced when ``phase`` runs: those of the segments after the one whose
        backward it is (none in forward)."""
        return 0 if phase.backward_of is None else sum(self.segment_gradients[phase.backward_of + 1:])

    @property
    def traced(self) -> ActivationPlan:
        """The traced activations this plan was composed from (what :func:`memory_plan` takes back for a setup of the
        same :func:`dsv4.plan.suggest.activation_key`): :attr:`activations`, or under a pipeline the whole step's."""
        return self.step_activations if self.step_activations is not None else self.activations

    @property
    def step_seconds(self) -> float | None:
        """The step estimate (:mod:`dsv4.plan.comm`; under a pipeline its slowest rank's)."""
        plans = self.ranks or [self]
        times = [p.comm.step_seconds for p in plans if p.comm is not None]
        return max(times) if times else None

    @property
    def host_offload_bytes(self) -> int:
        """Host memory host offload holds (0 without it): the sharded parameters, their gradients and the
        optimizer state; the optimizer step adds its temporary there (:attr:`OffloadBytes.step_temporary`)."""
        return 0 if self.offload is None else self.offload.host

    @property
    def engram_host_bytes(self) -> int:
        """Host memory the rank's rows of the Engram tables take when held there (``setup.engram_on_host``; 0
        otherwise): :attr:`engram_table_bytes`, out of the device total."""
        return self.engram_table_bytes if self.setup.engram_on_host else 0

    @property
    def host_bytes(self) -> int:
        """Host memory per rank the plan holds outside the device total: host offload's and the Engram tables' (not
        the asynchronous checkpoint's staging copy, :attr:`host_staging_bytes`)."""
        return self.host_offload_bytes + self.engram_host_bytes

    @property
    def fits(self) -> bool:
        """The total is at most the device memory less the reserve."""
        return self.total <= self.setup.usable_memory_bytes

    def _against(self) -> str:
        """``of <device>`` and the reserve kept free of it."""
        setup = self.setup
        if not setup.reserve_bytes:
            return f"of {_size(setup.device_memory_bytes)}"
        return (f"of {_size(setup.device_memory_bytes)} less a {_size(setup.reserve_bytes)} reserve "
                f"({_size(setup.usable_memory_bytes)})")

    @property
    def biggest_term(self) -> str:
        return max(TERMS, key=lambda t: self.per_rank_bytes[t])

    def summary(self) -> str:
        """One line: the total against the device, the terms, the verdict."""
        terms = ", ".join(f"{t} {_size(self.per_rank_bytes[t])}" for t in TERMS)
        verdict = "fits" if self.fits else f"DOES NOT FIT (biggest term: {self.biggest_term})"
        host = "" if self.offload is None else f"; host offload {_size(self.host_offload_bytes)} per rank"
        if self.engram_host_bytes:
            host += f"; Engram tables in host memory {_size(self.engram_host_bytes)} per rank"
        step = "" if self.comm is None else f"; {self.comm.summary()}"
        return (f"memory plan: {_size(self.total)} per rank at its peak ({self.peak_phase}) {self._against()} "
                f"({terms}): {verdict}{host}{step}")

    def report(self) -> str:
        """The per-rank table: each term, the activations per block kind by component, the total and verdict."""
        s, setup, acts = self.states, self.setup, self.activations
        c = setup.config
        lines = [
            f"memory plan per rank: seq_len {setup.seq_len} x micro_batch_size {setup.micro_batch_size}, cp "
            f"{setup.cp} ({setup.seq_len // setup.cp} tokens per rank), dp {setup.dp}, ep {setup.ep} (world "
            f"{setup.world}{self._pipeline_layout()}); compute {str(setup.compute_dtype).removeprefix('torch.')}, "
            f"activation_checkpointing "
            f"{c.activation_checkpointing}, loss chunk {c.loss_chunk_size} rows, attention {c.attention_backend}"
            + ("" if setup.lora is None else f"; LoRA r={setup.lora.rank} on {'/'.join(setup.lora.targets)}, "
               f"base {setup.lora.base_dtype}"),
            _row("parameters", self.per_rank_bytes["parameters"], ("fp32 master shards + buffers" if setup.lora is None
                 else "adapters: fp32 shards; frozen base: compute-dtype shards" + (
                     " + kept FP8 / FP4 buffers (replicated)" if setup.lora.base_dtype == "fp8" else ""))
                 + ("; the Engram tables are in host memory (host Engram, below)" if self.engram_host_bytes else "")),
            _row("gradients", s.gradients, "fp32 shards of the trainable parameters (filled during backward)"),
            _row("optimizer", s.optimizer, f"{setup.optimizer.state_dtype} moments, {setup.optimizer.state_bytes:g} "
                 f"bytes per trainable element of a large shard; the step allocates {_size(s.step_temporary)} "
                 f"({setup.optimizer.step_temporary.replace('_', ' ')})"),
            _row("activations", acts.peak, f"peak, at the {acts.phase}"),
        ]
        if self.offload is not None:  # the device's parameters, gradients and optimizer rows
            lines[1:4] = self._offloaded_state_rows()
        if self.engram_table_bytes and not self.engram_host_bytes:
            trainable = getattr(c, "engram_trainable", False)
            lines.insert(2, f"      of which Engram tables {_size(self.engram_table_bytes)} (layers "
                            f"{list(c.engram_layer_ids)}, {sum(c.engram_num_embeddings):,} rows of "
                            f"{c.engram_head_dim}{' in FP8' if setup.engram_fp8 and not trainable else ''}, "
                            f"row-sharded over the {setup.world} ranks, never gathered; " +
                            ("trainable: a dense fp32 gradient and optimizer state on the rank's rows" if trainable
                             else "frozen: no gradients, no optimizer state") + ")")
        for seg, count in acts.block_kinds():
            lines.append(f"    {count:>3} x block {seg.kind:<22} saved {_size(seg.retained)} each "
                         f"({_parts(seg.saved_by_component)})")
            lines.append(f"          {'':<28} backward peak {_size(seg.backward_peak)} "
                         f"({_parts(seg.backward_peak_by_component)})")
        top = acts.segments[-1]
        if self.stages is None or self.stages.spans[-1].last:
            lines.append(f"          {acts.top_name:<28} saved {_size(top.retained)} "
                         f"({_parts(top.saved_by_component)})")
            lines.append(f"          {'':<28} backward peak {_size(top.backward_peak)} "
                         f"({_parts(top.backward_peak_by_component)})")
        rows = min(c.loss_chunk_size, setup.micro_batch_size * setup.seq_len // setup.cp)
        lines.append(f"          loss chunk: one [{rows}, {c.vocab_size}] fp32 logits block, "
                     f"{_size(rows * c.vocab_size * 4)}, and its gradient in place")
        if acts.per_forward:  # V4.1: what one forward shares across its blocks
            f = acts.per_forward
            lines.append(f"          per-forward state: {_size(acts.metadata)} kept all step (attention metadata "
                         f"{_size(f['attention metadata'])}, Engram n-gram ids {_size(f['Engram n-gram ids'])}); "
                         f"CSA2 shared state {_size(f['CSA2 shared state'])} (in the saved bytes of the Full / "
                         "Reindex blocks that publish it)")
        else:
            lines.append(f"          attention metadata: {_size(acts.metadata)}")
        staging = "" if self.offload is None else (
            f", offload staging {_size(self.offload.gather_staging)} (shards copied to the device for an "
            f"all-gather) + {_size(self.offload.reduce_staging)} (a reduce-scatter output before its copy to the host)")
        if self.stages is None:
            units = (f"two gathered units {_size(s.gathered)} (largest: {s.largest_unit}), root kept gathered "
                     f"{_size(s.root_gathered)}, fp32 gradient reduce {_size(s.reduce_buffer)}{staging}")
        else:
            units = (f"the stages' parameters kept gathered {_size(s.gathered)}, their gradients unsharded in fp32 "
                     f"{_size(s.reduce_buffer)} (reduced after the last microbatch), the pipeline's receive buffers "
                     f"{_size(s.pipeline_buffers)} ({setup.microbatches} microbatches)")
        lines.append(_row("communication", self.per_rank_bytes["communication"], units))
        verdict = "fits" if self.fits else f"DOES NOT FIT; biggest term: {self.biggest_term}"
        lines.append(_row("total", self.total, f"at the peak ({self.peak_phase}) {self._against()}: {verdict}"))
        lines.append(_row("checkpoint", self.checkpoint_bytes,
                          f"written per rank per save; about {_size(self.checkpoint_bytes * setup.world)} on disk "
                          "per checkpoint" + (f"; host staging {_size(self.host_staging_bytes)} while an "
                                              "asynchronous save is written (not in the device total)"
                                              if setup.async_checkpoint else "")))
        o = self.offload
        if o is not None:
            lines.append(_row("host offload", o.host,
                              f"not in the device total: parameter shards {_size(o.parameters)}, gradients "
                              f"{_size(o.gradients)}, optimizer {_size(o.optimizer)}; the step runs on the host and "
                              f"allocates {_size(o.step_temporary)} there; per step {_size(o.host_to_device)} host -> "
                              f"device, {_size(o.device_to_host)} device -> host"))
        if self.engram_host_bytes:
            copies = "" if self.comm is None else self.comm.by_kind().get("engram host copies")
            per_step = "" if not copies else (f"; per step {_size(copies.received)} of rows host -> device, "
                                              f"{_size(copies.sent)} of ids device -> host")
            lines.append(_row("host Engram", self.engram_host_bytes,
                              f"not in the device total: the rank's rows of the Engram tables (layers "
                              f"{list(c.engram_layer_ids)}, {sum(c.engram_num_embeddings):,} rows of "
                              f"{c.engram_head_dim}{' in FP8' if setup.engram_fp8 else ''}, row-sharded over the "
                              f"{setup.world} ranks), frozen, held in host memory (trainer.engram_tables=host); a "
                              f"lookup copies the rows it reads to the device{per_step}"))
        lines += self._pipeline_rows()
        if self.comm is not None:
            lines.append(self.comm.report())
        return "\n".join(lines)

    def _pipeline_layout(self) -> str:
        setup = self.setup
        if self.stages is None:
            return ""
        virtual = f" x {setup.pp_virtual} virtual" if setup.pp_virtual > 1 else ""
        return (f"; pp {setup.pp}{virtual}, {setup.pp_schedule}, {setup.microbatches} microbatches per step: "
                f"{setup.gpus} GPUs; pipeline rank {self.stages.rank} planned, the largest")

    def _pipeline_rows(self) -> list[str]:
        """Every pipeline rank's stages, total and bytes per step (under a pipeline)."""
        if not self.ranks:
            return []
        lines = ["  pipeline ranks (each holds its stages' parameters; the largest total decides):"]
        for plan in self.ranks:
            comm = plan.comm
            lines.append(f"      rank {plan.stages.rank}: {_size(plan.total):>10} at {plan.peak_phase}; sends "
                         f"{_size(comm.total_sent)}, receives {_size(comm.total_received)} per step; step about "
                         f"{format_seconds(comm.step_seconds)}; {plan.stages.describe()}")
        return lines

    def _offloaded_state_rows(self) -> list[str]:
        device = self.per_rank_bytes
        return [
            _row("parameters", device["parameters"], "buffers; the parameter shards are in host memory"),
            _row("gradients", device["gradients"], "none on the device: each reduce-scatter output goes to the host"),
            _row("optimizer", device["optimizer"], f"none on the device: {self.setup.optimizer.state_bytes:g} bytes "
                 "per trainable element in host memory, the step runs on the host"),
        ]

    def as_dict(self) -> dict[str, Any]:
        """The JSON of ``memory_plan.json``."""
        setup = self.setup
        return {
            "per_rank_bytes": dict(self.per_rank_bytes),
            "fits": self.fits,
            "peak_phase": self.peak_phase,
            "engram_table_bytes": self.engram_table_bytes,
            "engram_host_bytes": self.engram_host_bytes,
            "host_bytes_per_rank": self.host_bytes,
            "device_memory_bytes": setup.device_memory_bytes,
            "reserve_bytes": setup.reserve_bytes,
            "usable_memory_bytes": setup.usable_memory_bytes,
            "biggest_term": self.biggest_term,
            "setup": {"seq_len": setup.seq_len, "micro_batch_size": setup.micro_batch_size, "cp": setup.cp,
                      "dp": setup.dp, "ep": setup.ep, "world": setup.world, "pp": setup.pp, "gpus": setup.gpus,
                      "compute_dtype": str(setup.compute_dtype).removeprefix("torch."),
                      "activation_checkpointing": setup.config.activation_checkpointing,
                      "loss_chunk_size": setup.config.loss_chunk_size,
                      "attention_backend": setup.config.attention_backend,
                      "optimizer_state_dtype": setup.optimizer.state_dtype,
                      "optimizer_state_bytes_per_element": setup.optimizer.state_bytes,
                      "optimizer_step_temporary": setup.optimizer.step_temporary, "offload": setup.offload,
                      "engram_fp8": setup.engram_fp8, "engram_on_host": setup.engram_on_host,
                      "dispatcher": setup.dispatcher,
                      "lora": None if setup.lora is None else setup.lora.as_dict()},
            "checkpoint_bytes": {"per_rank": self.checkpoint_bytes, "disk": self.checkpoint_bytes * setup.world,
                                 "host_staging_per_rank": self.host_staging_bytes},
            "host_offload_bytes": None if self.offload is None else {
                "per_rank": self.host_offload_bytes, "parameters": self.offload.parameters,
                "gradients": self.offload.gradients, "optimizer": self.offload.optimizer,
                "step_temporary": self.offload.step_temporary, "gather_staging": self.offload.gather_staging,
                "reduce_staging": self.offload.reduce_staging, "host_to_device_per_step": self.offload.host_to_device,
                "device_to_host_per_step": self.offload.device_to_host},
            "communication_bytes": {"gathered": self.states.gathered, "root_gathered": self.states.root_gathered,
                                    "reduce_buffer": self.states.reduce_buffer},
            "communication_per_step": None if self.comm is None else self.comm.as_dict(),
            "pipeline": None if self.stages is None else {
                "pp": setup.pp, "schedule": setup.pp_schedule, "virtual": setup.pp_virtual,
                "microbatches": setup.microbatches, "gpus": setup.gpus, "planned_rank": self.stages.rank,
                "step_seconds": self.step_seconds,
                "ranks": [{"rank": p.stages.rank, "total": p.total, "peak_phase": p.peak_phase,
                           "stages": [[s.index, s.start, s.stop] for s in p.stages.spans],
                           "bytes_sent": p.comm.total_sent, "bytes_received": p.comm.total_received,
                           "step_seconds": p.comm.step_seconds} for p in self.ranks]},
            "activations": {
                "peak_phase": self.activations.phase,
                "metadata_bytes": self.activations.metadata,
                "per_forward_bytes": dict(self.activations.per_forward),
                "segments": [{"name": seg.name, "forward_peak": seg.forward_peak, "retained": seg.retained,
                              "backward_peak": seg.backward_peak, "saved_by_component": seg.saved_by_component,
                              "backward_peak_by_component": seg.backward_peak_by_component}
                             for seg in self.activations.segments],
            },
        }


def memory_plan(setup: PlanSetup, activations: ActivationPlan | None = None) -> MemoryPlan:
    """Build the model on ``meta``, shard it like rank 0 of ``setup`` and plan one training step. ``activations``:
    the step's activations already traced for a setup of the same :func:`dsv4.plan.suggest.activation_key` (reused,
    not traced again)."""
    setup.check()
    with torch.device("meta"):
        model = build_causal_lm(setup.config)
    if setup.lora is not None:  # frozen parameters are stored in their unit's compute dtype (apply_fsdp does it)
        apply_lora(model, setup.lora)
        store_frozen_in_compute_dtype(fsdp_units(model, setup.compute_dtype))
    if setup.engram_fp8:
        for table in (m for m in model.modules() if isinstance(m, LocalEngramTable) and not m.weight.requires_grad):
            table.keep_fp8()
    shard_experts(model, ep_rank=0, ep_size=setup.ep)
    states = state_bytes(model, world=setup.world, ep=setup.ep, compute_dtype=setup.compute_dtype,
                         optimizer=setup.optimizer)
    units = fsdp_units(model, setup.compute_dtype)
    owners = parameter_owners(model, units)
    mesh_size = {"dp_cp": setup.world, "edp": setup.world // setup.ep}
    # the embedding is the root unit's (reduced when backward ends); blocks and MTP depths reduce after their backward
    # (a V4.1 model's top segment reduces nothing of its own: its norm and head are the root's)
    mtp = getattr(model, "mtp", None)
    segment_gradients = [0, *(gradient_shard_bytes([m], owners, mesh_size, skip=units[-1])
                              for m in [*model.model.layers, *([mtp] if mtp is not None else [nn.Identity()])])]
    engram = engram_table_bytes(model, setup.world)
    pipeline = None
    if setup.pipelined:  # the stages hold the parameters as stored (before the cast below)
        pipeline = [(stages, state_bytes(model, world=setup.world, ep=setup.ep, compute_dtype=setup.compute_dtype,
                                         optimizer=setup.optimizer,
                                         only={id(t) for t in [*stages.parameters, *stages.buffers]}))
                    for stages in rank_stages(model, setup.seq_len, setup.pp, setup.pp_virtual)]
    cast_for_compute(model, {p: unit.param_dtype for p, unit in owners.items()})
    root = {p for p, unit in owners.items() if unit is units[-1]}
    tracer = step_tracer(model, setup.micro_batch_size, setup.seq_len // setup.cp, setup.cp, setup.ep > 1,
                        return_logits=not setup.chunked_loss, root_parameters=root, cp_balance=setup.cp_balance,
                        ep=setup.ep, dispatcher=setup.dispatcher, unit_modules=[u.module for u in units[:-1]])
    activations = plan_activations(tracer) if activations is None else activations
    if pipeline is not None:
        return _pipeline_plan(setup, model, units, owners, mesh_size, activations, pipeline)
    gathers = unit_gathers(model, units, activations.segments)
    # ``owners`` holds the parameters as stored (cast_for_compute made new ones for the trace)
    offload = None if setup.offload == "none" else offload_bytes(units, owners, mesh_size, states, gathers)
    comm = comm_plan(setup, units, owners, mesh_size, activations.traffic(), offload, gathers)
    return MemoryPlan(setup, states, activations, segment_gradients, offload, engram, comm)


def _pipeline_plan(setup: PlanSetup, model: nn.Module, units: list, owners: dict, mesh_size: dict[str, int],
                   activations: ActivationPlan, pipeline: list) -> MemoryPlan:
    """Every pipeline rank's plan (:mod:`dsv4.plan.stages`; ``pipeline``: each rank's stages and the state bytes
    of their parameters); the one with the largest total, holding them all in :attr:`MemoryPlan.ranks`."""
    rows, length, m = setup.micro_batch_size, setup.seq_len // setup.cp, setup.microbatches
    engram_layers = len(getattr(setup.config, "engram_layer_ids", None) or []) or 1
    plans = []
    for stages, states in pipeline:
        rank_owners = {p: owners[p] for p in stages.parameters if p in owners}
        gathered = unsharded = 0  # every unit kept gathered, every gradient unsharded in fp32 (module docstring)
        for p, unit in rank_owners.items():
            full = shard_elements(p, mesh_size[unit.mesh]) * mesh_size[unit.mesh]
            gathered += full * unit.param_dtype.itemsize
            unsharded += full * 4 if p.requires_grad else 0
        states = replace(states, gathered=gathered, root_gathered=0, reduce_buffer=unsharded,
                         pipeline_buffers=receive_buffers(stages, rows, length, setup.compute_dtype, m))
        timeline = in_flight_timeline(setup.pp_schedule, setup.pp, setup.pp_virtual, m, stages.rank)
        acts = stage_activations(activations, stages, timeline)
        held = {id(u): u for u in rank_owners.values()}
        rank_units = [u for u in units if id(u) in held]
        sends = pp_sends(stages, rows, length, setup.compute_dtype, m)
        stage = StageComm(setup.pp, m, sends["sent"], sends["received"], sends["calls"],
                          flops_share(setup.config, setup.seq_len, stages.spans),
                          stages.engram_layers / engram_layers, bubble(setup.pp_schedule, setup.pp, setup.pp_virtual, m),
                          f"activations and tokens to the next stage, their gradients back ({stages.describe()})")
        comm = comm_plan(setup, rank_units, rank_owners, mesh_size, stage_traced(activations, stages, m), None,
                         {id(u): 1 for u in rank_units}, stage)
        tables = {id(t): t for module in stages.modules for t in table_tensors(module)}
        engram = sum(shard_elements(t, setup.world) * t.element_size() for t in tables.values())
        plans.append(MemoryPlan(setup, states, acts, [], None, engram, comm, stages=stages,
                                step_activations=activations))
    worst = max(plans, key=lambda p: p.total)
    worst.ranks = plans
    return worst


def _parts(by_component: dict[str, int]) -> str:
    """``name size, ...``, largest first."""
    return ", ".join(f"{k} {_size(v)}" for k, v in sorted(by_component.items(), key=lambda kv: -kv[1]) if v)


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.1f} MiB"


def _row(name: str, n: int, note: str) -> str:
    return f"  {name:<14} {_size(n):>12}  {note}"


def device_memory_bytes(accelerator: str, processes_per_node: int = 1) -> int:
    """The default ``plan.device_memory_gib`` in bytes: a GPU's memory on GPU runs (80 GiB when none is visible
    from this process); on CPU the host's memory divided among the ranks of this node."""
    if accelerator in ("gpu", "cuda", "auto") and torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    if accelerator == "cpu":
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // max(processes_per_node, 1)
    return 80 * GIB
