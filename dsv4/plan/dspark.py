"""The memory plan of DSpark drafter training (``recipes/train_dspark.py``): what one rank holds, term by term.

A rank holds the frozen target (``mode=online``: it computes the drafter's features on every micro-batch) and the
drafter it trains, and runs three kinds of phase:

* **target forward** (online): the target's forward over the rank's tokens without gradients (each block's
  activations freed after it), ending with the captured features ``[B, L, n * d]`` and final hidden states
  ``[B, L, d]`` (:class:`~dsv4.speculative.capture.FeatureCapture`);
* **drafter step**: the drafter's forward, its loss and backward over the micro-batch's anchors, beside the
  features, with FSDP's gathered units and reduce buffer and every fp32 gradient shard (as a micro-batch after the
  first of an accumulated step holds them from its start: at most that at the first, which reduces them as its
  backward goes); each trainable parameter's unsharded gradient lives from its creation until it is reduced (the
  trace frees it once accumulated: a parameter at a time, where FSDP reduces a unit at a time);
* **optimizer step**: every gradient shard, the optimizer state and the step's temporary;
* **decoding evaluation** (``drafter.eval_prompts > 0``): the drafter whole on every rank
  (:func:`dsv4.parallel.wrap.gathered`: every FSDP unit's parameters in its compute dtype, routed experts still
  this rank's) beside the target running the prompts; the target's activations counted as the training forward's
  (the prompts and their continuations are shorter than a row; not traced).

Each phase holds the fixed bytes: the target (its weights as the run holds them: a checkpoint that stores FP8 /
FP4 weights kept so, :func:`dsv4.peft.keep_base_quantized`; the float weights in the compute dtype as FSDP2's mixed
precision casts them, :func:`dsv4.speculative.target.store_in_compute_dtype`; the routed experts of this
expert-parallel rank; nothing gathered, nothing sharded by FSDP), V4.1's Engram tables row-sharded over the
``dp x cp`` ranks (in host memory with ``trainer.engram_tables=host``: then outside the device total), and the
drafter's FSDP state (:func:`dsv4.plan.states.state_bytes`: fp32 master shards of what trains, the frozen embedding
and head copies sharded in float32, the optimizer state). ``mode=offline``: no target during training (the rows
carry the captured features, whole rows on every rank), the target built only for the decoding evaluation.

Activations are traced on ``meta`` with the real code (:class:`~dsv4.plan.trace.AllocationTracer`): the target
through :class:`~dsv4.plan.activations.V41StepTracer`'s stand-ins (CP exchanges, EP dispatch, attention
metadata), the drafter with its real forward and :func:`~dsv4.speculative.dspark_loss.dspark_loss` on
``drafter.num_anchors`` blocks per row. Under CP a rank drafts the blocks anchored in its chunk: the plan counts
all ``num_anchors`` of the row on every rank (the most a rank can draw) over its ``seq_len / cp`` tokens; the
context rows a halo brings from the neighbour (at most ``sliding_window`` per block) are not counted.

The Engram traffic of the target's forward (online) is reported beside the memory, per micro-batch and rank
(:func:`dsv4.plan.comm.engram_traffic`, :func:`dsv4.plan.comm.engram_host_traffic`: one lookup per Engram layer, no
recompute without gradients; upper bounds, every id counted as distinct): the lookups' bytes each way between the
``dp x cp`` ranks, and with the tables in host memory the ids device -> host and the rows host -> device, with their
time over PCIe at ``plan.pcie_gb_s``.

Not counted: the rest of the communication table (FSDP and EP bytes and time per step; :mod:`dsv4.plan.comm` covers
fine-tuning), host offload (``trainer.offload=optimizer`` is refused here), what the fine-tuning plan also leaves out (the CUDA context
and NCCL buffers: the reserve, allocator fragmentation).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dsv4.plan.plan import GIB, PlanSetup, _row, _size
from dsv4.plan.states import StateBytes, parameter_owners, shard_elements, state_bytes, table_tensors
from dsv4.plan.trace import AllocationTracer

TERMS = ("target", "parameters", "gradients", "optimizer", "activations", "communication")
MODES = ("online", "offline")


@dataclass(frozen=True)
class DSparkPlanSetup:
    """What the drafter plan is for: ``base`` (the model with its drafter sizes, the step shape, the layout, the
    drafter's optimizer, the device and reserve, the Engram form and place, the dispatcher: a fine-tuning
    :class:`~dsv4.plan.plan.PlanSetup`), the ``mode``, the blocks drawn per row (``num_anchors``), whether the
    target's weights are kept as a quantised checkpoint stores them (``target_kept``) and whether the run decodes
    held-out prompts (``evaluates``)."""

    base: PlanSetup
    mode: str = "online"
    num_anchors: int = 64
    target_kept: bool = False
    evaluates: bool = True

    def check(self) -> None:
        """ValueError naming the setting before anything is built."""
        self.base.check()
        if self.mode not in MODES:
            raise ValueError(f"drafter plan: `mode`={self.mode!r} must be one of {', '.join(MODES)}")
        if isinstance(self.num_anchors, bool) or not isinstance(self.num_anchors, int) or self.num_anchors < 1:
            raise ValueError(f"drafter plan: `drafter.num_anchors` must be a positive integer, got "
                             f"{self.num_anchors!r}")
        if self.base.offload != "none":
            raise ValueError(f"drafter plan: `trainer.offload`={self.base.offload!r} is not planned for drafter "
                             "training (plan=false launches without a plan)")
        if self.base.lora is not None:
            raise ValueError("drafter plan: the drafter trains whole (no LoRA)")
        if getattr(self.base.config, "model_type", None) != "deepseek_v41":
            raise ValueError("drafter plan: a DSpark drafter needs a DeepSeek-V4.1 model")

    @property
    def engram_on_host(self) -> bool:
        return bool(getattr(self.base, "engram_on_host", False))


@dataclass
class DSparkMemoryPlan:
    """Per-rank bytes by term (:data:`TERMS`; ``target`` holds the target's weights and the Engram rows kept on the
    device), the phases and the verdict (see the module docstring). ``features``: the target's outputs the
    drafter step reads; ``target_forward`` / ``drafter_step``: the traced activation peaks (the target's with its
    attention metadata; :class:`DSparkTraces`); ``gathered_drafter``: the whole drafter of the decoding evaluation;
    ``engram_table_bytes``: the rank's Engram rows (on the device, or in host memory with ``host_tables``)."""

    setup: DSparkPlanSetup
    states: StateBytes
    target_bytes: int
    engram_table_bytes: int
    traces: "DSparkTraces"
    gathered_drafter: int
    per_rank_bytes: dict[str, int] = field(init=False)
    phase_bytes: dict[str, int] = field(init=False)
    peak_phase: str = field(init=False)

    @property
    def features(self) -> int:
        return self.traces.features

    @property
    def target_forward(self) -> int:
        return self.traces.target_forward

    @property
    def drafter_step(self) -> int:
        return self.traces.drafter_step

    @property
    def drafter_step_by_label(self) -> dict[str, int]:
        return self.traces.drafter_step_by_label

    def __post_init__(self) -> None:
        s, online = self.states, self.setup.mode == "online"
        tables = 0 if self.host_tables else self.engram_table_bytes
        target = self.target_bytes + tables
        fixed = s.parameters + s.optimizer  # the drafter's master shards (and buffers), its optimizer state
        phases = {}
        if online:
            phases["target forward"] = target + fixed + self.target_forward
        phases["drafter step"] = ((target if online else 0) + fixed + s.communication + self.features
                                  + s.gradients + self.drafter_step)
        phases["optimizer step"] = (target if online else 0) + fixed + s.gradients + s.step_temporary
        if self.setup.evaluates:
            phases["decoding evaluation"] = target + fixed + self.gathered_drafter + self.target_forward
        self.phase_bytes = phases
        self.peak_phase, total = max(phases.items(), key=lambda kv: kv[1])
        activations = max(self.target_forward if online or self.setup.evaluates else 0,
                          self.features + self.drafter_step)
        self.per_rank_bytes = {"target": target if online or self.setup.evaluates else 0,
                               "parameters": s.parameters, "gradients": s.gradients, "optimizer": s.optimizer,
                               "activations": activations,
                               "communication": max(s.communication, self.gathered_drafter if self.setup.evaluates
                                                    else 0),
                               "total": total}

    @property
    def host_tables(self) -> bool:
        return self.setup.engram_on_host

    def engram_traffic(self) -> dict[str, float]:
        """The online target forward's Engram bytes per micro-batch and rank (module docstring): ``lookups`` (each
        way between the ranks), ``host_ids`` (device -> host), ``host_rows`` (host -> device) and ``host_seconds``
        (the larger of the two over PCIe); zeros offline or without Engram tables."""
        from dataclasses import replace

        from dsv4.plan.comm import engram_host_traffic, engram_traffic

        base = self.setup.base
        zero = {"lookups": 0, "host_ids": 0, "host_rows": 0, "host_seconds": 0.0}
        if self.setup.mode != "online" or not getattr(base.config, "engram_layer_ids", None):
            return zero
        config = replace(base.config, activation_checkpointing="none")  # a forward without gradients looks up once
        tokens = base.micro_batch_size * base.seq_len // base.cp
        lookups, _ = engram_traffic(config, tokens, base.world, base.compute_dtype, base.engram_fp8)
        if not self.host_tables:
            return {**zero, "lookups": lookups}
        ids, rows, _ = engram_host_traffic(config, tokens, base.compute_dtype, base.engram_fp8)
        return {"lookups": lookups, "host_ids": ids, "host_rows": rows,
                "host_seconds": max(ids, rows) / base.links.bandwidth("pcie")}

    @property
    def total(self) -> int:
        return self.per_rank_bytes["total"]

    @property
    def fits(self) -> bool:
        return self.total <= self.setup.base.usable_memory_bytes

    @property
    def biggest_term(self) -> str:
        return max(TERMS, key=lambda t: self.per_rank_bytes[t])

    @property
    def host_bytes(self) -> int:
        """Host memory per rank: the Engram rows with ``trainer.engram_tables=host`` (0 otherwise)."""
        return self.engram_table_bytes if self.host_tables else 0

    def _against(self) -> str:
        base = self.setup.base
        if not base.reserve_bytes:
            return f"of {_size(base.device_memory_bytes)}"
        return (f"of {_size(base.device_memory_bytes)} less a {_size(base.reserve_bytes)} reserve "
                f"({_size(base.usable_memory_bytes)})")

    def summary(self) -> str:
        """One line: the total against the device, the terms, the verdict."""
        terms = ", ".join(f"{t} {_size(self.per_rank_bytes[t])}" for t in TERMS)
        verdict = "fits" if self.fits else f"DOES NOT FIT (biggest term: {self.biggest_term})"
        host = f"; Engram rows in host memory {_size(self.host_bytes)} per rank" if self.host_bytes else ""
        return (f"drafter memory plan: {_size(self.total)} per rank at its peak ({self.peak_phase}) {self._against()} "
                f"({terms}): {verdict}{host}")

    def report(self) -> str:
        """The per-rank table: each term, the phases, the total and the verdict."""
        setup, base, s = self.setup, self.setup.base, self.states
        c = base.config
        lines = [
            f"drafter memory plan per rank ({setup.mode}): seq_len {base.seq_len} x micro_batch_size "
            f"{base.micro_batch_size}, cp {base.cp} ({base.seq_len // base.cp} tokens per rank), dp {base.dp}, ep "
            f"{base.ep} (world {base.world}); {setup.num_anchors} blocks of {c.dspark_block_size} per row, "
            f"{c.num_nextn_predict_layers} drafter stages; compute {str(base.compute_dtype).removeprefix('torch.')}",
            _row("target", self.per_rank_bytes["target"],
                 "none (offline: the rows carry the features)" if not self.per_rank_bytes["target"] else
                 f"frozen, weights {_size(self.target_bytes)} ("
                 + ("kept FP8 / FP4 as the checkpoint stores them, " if setup.target_kept else "")
                 + f"float weights in {str(base.compute_dtype).removeprefix('torch.')} (fp32 modules in fp32)"
                 + ", routed experts of this EP rank, replicated otherwise)"
                 + ("" if self.host_tables or not self.engram_table_bytes else
                    f" + Engram rows {_size(self.engram_table_bytes)} (row-sharded over {base.world} ranks)")
                 + ("" if setup.mode == "online" else "; built for the decoding evaluation only")),
            _row("parameters", s.parameters, "drafter: fp32 master shards, the frozen embedding and head copies "
                 "sharded, buffers"),
            _row("gradients", s.gradients, "fp32 shards of the trainable drafter parameters"),
            _row("optimizer", s.optimizer, f"{base.optimizer.state_dtype} moments, {base.optimizer.state_bytes:g} "
                 f"bytes per trainable element of a large shard; the step allocates {_size(s.step_temporary)}"),
            _row("activations", self.per_rank_bytes["activations"],
                 (f"target forward {_size(self.target_forward)} (no gradients, attention metadata included); "
                  if setup.mode == "online" or setup.evaluates else "")
                 + f"features {_size(self.features)}, then the drafter's forward and backward "
                 f"{_size(self.drafter_step)} ({_parts(self.drafter_step_by_label)})"),
            _row("communication", self.per_rank_bytes["communication"],
                 f"drafter step: two gathered units {_size(s.gathered)} (largest: {s.largest_unit}), root "
                 f"{_size(s.root_gathered)}, fp32 gradient reduce {_size(s.reduce_buffer)}"
                 + (f"; decoding evaluation: the whole drafter gathered {_size(self.gathered_drafter)}"
                    if setup.evaluates else "")),
        ]
        for name, n in self.phase_bytes.items():
            lines.append(f"    phase {name:<20} {_size(n):>12}")
        verdict = "fits" if self.fits else f"DOES NOT FIT; biggest term: {self.biggest_term}"
        lines.append(_row("total", self.total, f"at the peak ({self.peak_phase}) {self._against()}: {verdict}"))
        if self.host_bytes:
            lines.append(_row("host", self.host_bytes, "the rank's Engram rows in host memory (not in the device "
                              "total; trainer.engram_tables=host)"))
        traffic = self.engram_traffic()
        if traffic["lookups"] or traffic["host_rows"]:
            line = (f"  engram traffic per micro-batch: lookups {_size(traffic['lookups'])} each way between the "
                    f"{base.world} ranks")
            if traffic["host_rows"]:
                line += (f"; host copies: ids {_size(traffic['host_ids'])} device -> host, rows "
                         f"{_size(traffic['host_rows'])} host -> device ({traffic['host_seconds'] * 1e3:.2f} ms at "
                         f"{base.links.pcie_gb_s:g} GB/s)")
            lines.append(line + " (upper bounds: every id distinct)")
        lines.append("  not counted: the rest of the communication per step (FSDP, EP: the fine-tuning plan has it), "
                     "allocator fragmentation and the CUDA context (the reserve)")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """The JSON of ``memory_plan.json``."""
        base = self.setup.base
        return {
            "recipe": "train_dspark",
            "per_rank_bytes": dict(self.per_rank_bytes),
            "fits": self.fits,
            "peak_phase": self.peak_phase,
            "phase_bytes": dict(self.phase_bytes),
            "biggest_term": self.biggest_term,
            "device_memory_bytes": base.device_memory_bytes,
            "reserve_bytes": base.reserve_bytes,
            "usable_memory_bytes": base.usable_memory_bytes,
            "host_bytes": self.host_bytes,
            "engram_table_bytes": self.engram_table_bytes,
            "target_weight_bytes": self.target_bytes,
            "features_bytes": self.features,
            "target_forward_bytes": self.target_forward,
            "drafter_step_bytes": self.drafter_step,
            "drafter_step_by_label": dict(self.drafter_step_by_label),
            "gathered_drafter_bytes": self.gathered_drafter,
            "engram_traffic_per_micro_batch": self.engram_traffic(),
            "setup": {"mode": self.setup.mode, "num_anchors": self.setup.num_anchors,
                      "target_kept": self.setup.target_kept, "evaluates": self.setup.evaluates,
                      "seq_len": base.seq_len, "micro_batch_size": base.micro_batch_size, "cp": base.cp,
                      "dp": base.dp, "ep": base.ep, "world": base.world,
                      "compute_dtype": str(base.compute_dtype).removeprefix("torch."),
                      "optimizer_state_dtype": base.optimizer.state_dtype, "engram_fp8": base.engram_fp8,
                      "engram_on_host": self.host_tables},
        }


def _parts(by_label: dict[str, int]) -> str:
    return ", ".join(f"{k} {_size(v)}" for k, v in sorted(by_label.items(), key=lambda kv: -kv[1]) if v)


@dataclass(frozen=True)
class DSparkTraces:
    """The traced activation bytes of a drafter plan (see :class:`DSparkMemoryPlan`): what :func:`trace_key` says
    they depend on."""

    features: int
    target_forward: int
    drafter_step: int
    drafter_step_by_label: dict[str, int]


def trace_key(setup: DSparkPlanSetup) -> str:
    """What the traces of ``setup`` depend on: the setup less what only the state terms read (dp, the optimizer,
    the device and its reserve, the checkpoint staging, where the Engram tables are held, the link speeds, whether
    the run evaluates). Setups with equal keys have equal :class:`DSparkTraces`."""
    from dataclasses import replace

    from dsv4.plan.comm import LinkSpeeds
    from dsv4.plan.states import OptimizerProfile

    base = replace(setup.base, dp=1, optimizer=OptimizerProfile(), device_memory_bytes=GIB, reserve_bytes=0,
                   async_checkpoint=True, engram_on_host=False, links=LinkSpeeds())
    return repr(replace(setup, base=base, evaluates=True))


def dspark_memory_plan(setup: DSparkPlanSetup, traces: DSparkTraces | None = None) -> DSparkMemoryPlan:
    """Build the target and the drafter on ``meta``, shard them like rank 0 of ``setup`` and plan one step of
    drafter training (module docstring). ``traces``: those of a setup with the same :func:`trace_key` (reused, not
    traced again)."""
    from dsv4.model import build_causal_lm
    from dsv4.model.v41.drafter import DSparkDrafter
    from dsv4.parallel.expert_shard import shard_experts
    from dsv4.parallel.wrap import fsdp_units
    from dsv4.plan.activations import cast_for_compute
    from dsv4.speculative.target import store_in_compute_dtype

    setup.check()
    base = setup.base
    with torch.device("meta"):
        target = build_causal_lm(base.config)
        drafter = DSparkDrafter(base.config)
    target.requires_grad_(False)
    if setup.target_kept:
        from dsv4.peft.apply import keep_base_quantized

        keep_base_quantized(target)
    if base.engram_fp8:
        from dsv4.model.v41.engram_table import LocalEngramTable

        for table in (m for m in target.modules() if isinstance(m, LocalEngramTable)):
            table.keep_fp8()
    shard_experts(target, ep_rank=0, ep_size=base.ep)
    store_in_compute_dtype(target, base.compute_dtype)
    shard_experts(drafter, ep_rank=0, ep_size=base.ep)
    tables = table_tensors(target)
    held = {id(t) for t in tables}
    target_bytes = sum(t.untyped_storage().nbytes() for t in [*target.parameters(), *target.buffers()]
                       if id(t) not in held)
    engram = sum(shard_elements(t, base.world) * t.element_size() for t in tables)

    states = state_bytes(drafter, world=base.world, ep=base.ep, compute_dtype=base.compute_dtype,
                         optimizer=base.optimizer)
    units = fsdp_units(drafter, base.compute_dtype)
    owners = parameter_owners(drafter, units)
    mesh_size = {"dp_cp": base.world, "edp": base.world // base.ep}
    gathered_drafter = sum(shard_elements(p, mesh_size[u.mesh]) * mesh_size[u.mesh] * u.param_dtype.itemsize
                           for p, u in owners.items())
    if traces is None:
        cast_for_compute(drafter, {p: unit.param_dtype for p, unit in owners.items()})
        features, last, target_peak = _trace_target(target, setup)
        step_peak, by_label = _trace_drafter(drafter, features, last, setup)
        traces = DSparkTraces(features.untyped_storage().nbytes() + last.untyped_storage().nbytes(), target_peak,
                              step_peak, by_label)
    return DSparkMemoryPlan(setup, states, target_bytes, engram, traces, gathered_drafter)


def _trace_target(target: nn.Module, setup: DSparkPlanSetup) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The target's forward without gradients on the rank's tokens (the CP rank receiving the most, as in the
    fine-tuning plan): ``(features, last hidden, peak bytes with the attention metadata)``. Offline, the features
    the rows carry (``[B, S, ...]``: whole rows on every rank) and the target's forward for the decoding
    evaluation."""
    from dsv4.plan.activations import V41StepTracer
    from dsv4.speculative.capture import FeatureCapture

    base = setup.base
    c = base.config
    tracer = V41StepTracer(target, base.micro_batch_size, base.seq_len // base.cp, base.cp, base.ep > 1,
                           cp_balance="none", ep=base.ep, dispatcher=base.dispatcher)
    weights = [*target.parameters(), *target.buffers()]  # the target term's; a view of one is no new memory
    with AllocationTracer(untracked=weights) as trace, torch.no_grad():
        with FeatureCapture(target, c.dspark_target_layer_ids) as capture:
            backbone = target.model(tracer.ids, tracer.meta, tracer.engram_inputs, tracer.cp_arg)
            features, last = capture.hidden_states(), capture.last_hidden_state()
        del backbone, capture
        peak = trace.peak
    peak += tracer.metadata_bytes()
    if setup.mode == "offline":  # the captured rows, whole on every rank, read as float32 (CaptureReader)
        b, s, d = base.micro_batch_size, base.seq_len, c.hidden_size
        features = torch.empty(b, s, features.shape[-1], dtype=torch.float32, device="meta")
        last = torch.empty(b, s, d, dtype=torch.float32, device="meta")
    return features, last, peak


def _trace_drafter(drafter: nn.Module, features: torch.Tensor, last: torch.Tensor,
                   setup: DSparkPlanSetup) -> tuple[int, dict[str, int]]:
    """The drafter's forward, loss and backward on ``num_anchors`` blocks per row of the rank's tokens: the peak
    bytes above the features and the gradient shards, by label (``gradients``: each unsharded gradient from its
    creation until FSDP reduces it, a parameter at a time)."""
    from dsv4.model.moe import set_dispatcher
    from dsv4.plan.stand_ins import PlanDispatcher
    from dsv4.speculative.dspark_loss import dspark_loss

    base = setup.base
    b, length = base.micro_batch_size, base.seq_len // base.cp
    features = features[:, :length] if features.shape[1] > length else features  # offline: the rank's chunk
    last = last[:, :length] if last.shape[1] > length else last
    set_dispatcher(drafter, PlanDispatcher(base.ep > 1, base.ep, base.dispatcher))
    drafter.eval()  # no expert-load statistics (a bincount over routed ids)
    ids = torch.zeros(b, length, dtype=torch.long, device="meta")
    anchors = torch.zeros(b, setup.num_anchors, dtype=torch.long, device="meta")
    mask = torch.ones(b, length, dtype=torch.bool, device="meta")
    hooks = []
    # the drafter's parameters as FSDP gathers them are the communication term's: a view of one is no new memory
    with AllocationTracer("drafter", untracked=list(drafter.parameters())) as trace:
        def reduced(p: nn.Parameter) -> None:  # FSDP reduce-scatters the gradient into its shard (counted apart)
            p.grad = None

        for p in drafter.parameters():
            if p.requires_grad:
                hooks.append(p.register_post_accumulate_grad_hook(reduced))
        try:
            out = drafter(ids, features, anchors, position_ids=ids, packed_seq_ids=ids)
            terms = dspark_loss(out, ids, anchors, last, mask, gamma=None)
            del out
            trace.default_label = "gradients"
            terms["numerator"].backward()
            del terms
        finally:
            for h in hooks:
                h.remove()
        peak, by_label = trace.peak, dict(trace.peak_by_label)
    return peak, by_label


class DSparkSetupPlanner:
    """Plans candidate changes of the drafter run ``base`` was planned for (a
    :class:`~dsv4.plan.suggest.CandidatePlanner`): each candidate in full (a drafter plan is two short traces), the
    traces shared by :func:`trace_key`. ``setup_of(changes)``: the candidate's :class:`DSparkPlanSetup` (raises
    :class:`~dsv4.plan.suggest.Refused` for what the recipe refuses); it must keep the world size. ``note(setup,
    plan)``: the line's note (host memory of Engram rows held there is added)."""

    def __init__(self, base: DSparkMemoryPlan, setup_of, note=None) -> None:
        self.base, self.setup_of, self.note = base, setup_of, note
        self.device_memory_bytes = base.setup.base.usable_memory_bytes
        self.reserve_bytes = base.setup.base.reserve_bytes
        self.traces: dict[str, DSparkTraces] = {trace_key(base.setup): base.traces}
        self.traced = 0
        self._plans: dict = {}

    def estimate(self, changes):
        return self.plan(changes)

    def plan(self, changes):
        from dataclasses import replace

        from dsv4.plan.suggest import Planned, Refused

        if changes not in self._plans:
            first = self.base.setup
            setup = self.setup_of(changes)
            setup = replace(setup, base=replace(setup.base, device_memory_bytes=first.base.device_memory_bytes,
                                                reserve_bytes=first.base.reserve_bytes, links=first.base.links))
            if setup == first:
                raise Refused("changes nothing the memory plan reads")
            if setup.base.world != first.base.world:
                raise Refused(f"world size {setup.base.world} is not the run's {first.base.world}")
            key = trace_key(setup)
            self.traced += key not in self.traces
            plan = dspark_memory_plan(setup, self.traces.get(key))
            self.traces[key] = plan.traces
            note = self.note(setup, plan) if self.note is not None else ""
            if plan.host_bytes:
                note = ", ".join(n for n in (note, f"Engram rows in host memory {_size(plan.host_bytes)} per rank")
                                 if n)
            self._plans[changes] = Planned(plan.total, note)
        return self._plans[changes]


__all__ = ["DSparkPlanSetup", "DSparkMemoryPlan", "DSparkTraces", "DSparkSetupPlanner", "dspark_memory_plan",
           "trace_key", "TERMS", "MODES", "GIB"]
