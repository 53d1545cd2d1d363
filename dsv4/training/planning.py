"""The recipe's memory plan (``plan`` in ``conf/finetune.yaml``): plan only, or check before launching.

* ``plan=true`` (or ``plan.only=true``): print the full per-rank plan (:mod:`dsv4.plan`), write
  ``memory_plan.json`` in the run directory and stop; nothing is trained and no data is read.
* a normal start plans too (in the launching process: not again in every rank Lightning starts), logs the one-line
  summary, writes ``memory_plan.json`` and refuses to launch, naming the biggest term, when the plan exceeds the
  device; ``plan.enforce=false`` launches anyway, ``plan=false`` skips the plan.
* ``plan.device_memory_gib``: the memory judged against. Default: on a GPU run (``trainer.accelerator`` gpu) the
  GPU's memory, 80 GiB when this process sees no GPU (a login node); on a CPU run the host's memory shared by the
  node's ranks; a plan-only run with the CPU trainer is judged against 80 GiB (it plans for GPUs).
* ``plan.reserve_gib`` (default 4): kept free of that memory for what the plan does not trace (the CUDA context,
  NCCL's buffers, allocator fragmentation, kernel workspaces); the plan fits when its total is at most the device
  memory less the reserve, and ``plan.suggest`` searches for that.
* ``plan.suggest``: when the plan does not fit (plan only, or a start that ``plan.enforce`` refuses), plan changes
  of the run's existing options (:func:`plan_changes`, each candidate checked by the recipe's own validation,
  :func:`dsv4.training.spec.build_run_spec`) and print the cheapest that fit (:mod:`dsv4.plan.suggest`), at most
  that many (0: no search); ``memory_plan.json`` gets them as ``suggestions``. ``plan.rank_by=step_time`` orders
  what fits by the estimated step time instead (:mod:`dsv4.plan.comm`).
* The plan's communication table (bytes per rank and step by kind, their time, the compute time; printed by
  ``plan=true``, ``communication_per_step`` in ``memory_plan.json``) is timed at ``plan.nvlink_gb_s``,
  ``plan.infiniband_gb_s``, ``plan.pcie_gb_s``, ``plan.gpus_per_node`` and ``plan.tflops``.
* The weights are planned in the form ``model.checkpoint`` stores them (read from its headers: V4.1's Engram tables
  kept in FP8, a LoRA base kept as stored); ``plan.checkpoint_form=release`` (plan only, no checkpoint) plans a run
  from the model's released checkpoint without reading it.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from dsv4.training.spec import RunSpec, accumulation_steps

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from dsv4.training.options.plan import PlanOptions

    from dsv4.plan.comm import LinkSpeeds
    from dsv4.plan.plan import MemoryPlan, PlanSetup
    from dsv4.plan.suggest import Change, SearchResult

log = logging.getLogger("dsv4")

PLAN_FILE = "memory_plan.json"
GIB = 2**30
# The search's bounds (dsv4.plan.suggest): changes per candidate, candidates evaluated, new activation traces.
MAX_CHANGES, MAX_CANDIDATES, MAX_TRACES = 3, 64, 3
# Throughput cost ranks of the changes plan_changes proposes (docs/memory.md#what-would-fit).
COSTS = {"loss chunk": 1, "bfloat16": 1, "experts in chunks": 2, "ep x2": 2, "engram host": 2, "8bit": 3, "cp x2": 3,
         "pp x2": 4, "selective": 4, "block": 5, "micro batch": 5, "cp x4": 6, "offload": 8}


def _is_launching_process() -> bool:
    """False in the ranks a launcher started after this process planned (Lightning's children, torchrun's
    non-zero local ranks): they would only repeat the same plan."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def _device_memory(spec: RunSpec) -> int:
    from dsv4.plan.plan import device_memory_bytes

    options = spec.plan
    if options.device_memory_gib is not None:
        return int(options.device_memory_gib * GIB)
    accelerator = str(spec.trainer.get("accelerator", "cpu"))
    if accelerator == "cpu" and options.only:
        return 80 * GIB
    devices = spec.trainer.get("devices", 1)
    return device_memory_bytes(accelerator, devices if isinstance(devices, int) else 1)


def _engram_kept_fp8(spec: RunSpec) -> bool:
    """The run keeps V4.1's Engram tables in FP8: frozen, and ``model.checkpoint`` stores them so (or the plan assumes
    the release, which does: ``plan.checkpoint_form=release``)."""
    if not getattr(spec.model, "engram_layer_ids", None) or getattr(spec.model, "engram_trainable", False):
        return False
    if spec.plan.checkpoint_form == "release":
        return True
    if not spec.model_checkpoint:
        return False
    from dsv4.checkpoint.load import engram_tables_stored_fp8

    return engram_tables_stored_fp8(spec.model_checkpoint)


def plan_setup(spec: RunSpec, device_memory: int) -> PlanSetup:
    """The :class:`~dsv4.plan.plan.PlanSetup` of a run (dp from the world size; without one, from ``dp``, else 1;
    the attention kernel the run will use, e.g. Triton on GPUs where it imports)."""
    from dataclasses import replace

    from dsv4.plan.plan import PlanSetup
    from dsv4.plan.states import optimizer_profile

    world, cp, pp = spec.parallel.world_size, spec.parallel.cp, spec.parallel.pp
    if world is None and os.environ.get("WORLD_SIZE", "").isdigit():
        world = int(os.environ["WORLD_SIZE"])
    if world is not None:
        dp = world // (cp * pp)
    elif spec.parallel.dp > 0:
        dp = spec.parallel.dp
    else:
        dp = 1
        log.warning("memory plan: the world size is unknown (trainer.devices=auto, no WORLD_SIZE): planned for dp=1; "
                    "set dp or trainer.devices for the real sharding")
    return PlanSetup(
        config=replace(spec.model, attention_backend=spec.attention_backend), seq_len=spec.seq_len,
        micro_batch_size=spec.micro_batch_size, cp=cp, dp=dp, ep=spec.parallel.ep, compute_dtype=spec.compute_dtype,
        optimizer=optimizer_profile(spec.optimizer), device_memory_bytes=device_memory, lora=spec.lora,
        cp_balance=spec.parallel.cp_balance, async_checkpoint=spec.checkpoint.async_save, offload=spec.offload,
        engram_fp8=_engram_kept_fp8(spec), engram_on_host=spec.engram_tables == "host",
        reserve_bytes=int(spec.plan.reserve_gib * GIB), dispatcher=spec.dispatcher, links=link_speeds(spec.plan),
        pp=pp, pp_schedule=spec.parallel.pp_schedule, pp_virtual=spec.parallel.pp_virtual,
        microbatches=accumulation_steps(spec.global_batch_size, spec.micro_batch_size, dp),
    )


def link_speeds(options) -> LinkSpeeds:
    """The :class:`~dsv4.plan.comm.LinkSpeeds` of the ``plan`` options."""
    from dsv4.plan.comm import LinkSpeeds

    return LinkSpeeds(nvlink_gb_s=float(options.nvlink_gb_s), infiniband_gb_s=float(options.infiniband_gb_s),
                      pcie_gb_s=float(options.pcie_gb_s), gpus_per_node=int(options.gpus_per_node),
                      tflops=float(options.tflops))


def check_memory(spec: RunSpec, output_dir: Path, cfg: DictConfig | None = None) -> bool:
    """Run the recipe's memory plan; True when the run should stop here (plan only). Raises ValueError when the
    plan does not fit the device and ``plan.enforce`` is on. ``cfg``: the composed config ``spec`` was built from;
    with it a plan that does not fit is followed by what would fit (``plan.suggest``)."""
    options = spec.plan
    if not options.enabled or not (options.only or _is_launching_process()):
        return options.only
    from dsv4.plan.plan import memory_plan

    plan = memory_plan(plan_setup(spec, _device_memory(spec)))
    search = None if cfg is None else (lambda: suggest_fits(cfg, spec, plan, options.suggest))
    return act_on_plan(plan, plan.setup, options, output_dir, search, "memory plan")


def act_on_plan(plan: Any, memory: PlanSetup, options: PlanOptions, output_dir: Path,
                search: Callable[[], SearchResult] | None, what: str) -> bool:
    """What a recipe does with its plan (``plan`` a :class:`~dsv4.plan.plan.MemoryPlan` or a drafter plan: ``fits``,
    ``total``, ``summary()``, ``report()``, ``as_dict()``, ``biggest_term``; ``memory`` the setup holding the device
    memory and reserve it is judged against): write ``memory_plan.json``, print the table when plan only, run
    ``search`` (what would fit) when it does not fit and ``plan.suggest`` asks, log the summary. True when the run
    stops here (plan only); ValueError naming the biggest term when it does not fit and ``plan.enforce`` is on."""
    output_dir.mkdir(parents=True, exist_ok=True)
    record = {**plan.as_dict(), "suggestions": None}
    (output_dir / PLAN_FILE).write_text(json.dumps(record, indent=2))
    if options.only:
        print(plan.report(), flush=True)
    fits = None
    if not plan.fits and search is not None and options.suggest and (options.only or options.enforce):
        log.info("%s: %.2f GiB per rank does not fit %.2f GiB (%.2f GiB less the %.2f GiB reserve); planning what "
                 "would (plan.suggest=0 skips this)", what, plan.total / GIB, memory.usable_memory_bytes / GIB,
                 memory.device_memory_bytes / GIB, memory.reserve_bytes / GIB)
        fits = search()
        record["suggestions"] = fits.as_dict()
        (output_dir / PLAN_FILE).write_text(json.dumps(record, indent=2))
    if options.only:
        if fits is not None:
            print(fits.report(), flush=True)
        log.info("%s; wrote %s", plan.summary(), output_dir / PLAN_FILE)
        return True
    log.info("%s", plan.summary())
    if not plan.fits and options.enforce:
        raise ValueError(f"{plan.summary()}. Not launching: reduce the {plan.biggest_term} (see `plan=true` for the "
                         "per-rank table), or set plan.enforce=false to launch anyway"
                         + ("" if fits is None else "\n" + fits.report()))
    return False


def plan_changes(cfg: DictConfig, setup: PlanSetup, world: int | None) -> list[Change]:
    """The changes of the run's existing options that can lower its plan (one group each; costs in :data:`COSTS`):

    * ``optim.state_dtype``: the cheaper moments after the current one (float32 -> bfloat16 -> 8bit), when the
      optimizer has the key;
    * ``model.loss_chunk_size``: half the rows (down to 256), when a rank has more tokens than that;
    * ``model.moe_chunk_tokens``: about an eighth of the routed rows a rank's experts receive (micro batch x tokens
      per rank x experts per token, a multiple of 1024) when off; half the current one (down to 1024) when on;
    * the layout within the same world size (when ``world``, every rank, is known): ``ep`` x 2; ``cp`` x 2 and ``dp``
      / 2, or ``cp`` x 4 and ``dp`` / 4 (``dp`` spelled out, so the world stays); ``pp`` x 2 and ``dp`` / 2 (pipeline
      stages, :mod:`dsv4.training.pipeline_step`);
    * ``model.activation_checkpointing``: each mode that recomputes more than the current (none < selective <
      block);
    * ``micro_batch_size``: half, when above 1;
    * ``trainer.engram_tables=host``, when the model has frozen Engram tables (V4.1) held on the device;
    * ``trainer.offload=optimizer``, when off.

    Whether a candidate is a valid run (ep dividing the world and the experts, seq_len a multiple of the chunks, the
    model family's limits on cp, torchao for 8-bit moments) is left to the recipe's validation of each candidate."""
    from dsv4.plan.suggest import Change

    c, changes = setup.config, []
    ladder = ("float32", "bfloat16", "8bit")
    if "state_dtype" in cfg.optim and setup.optimizer.state_dtype in ladder:
        for dtype in ladder[ladder.index(setup.optimizer.state_dtype) + 1:]:
            changes.append(Change("optimizer state", (("optim.state_dtype", dtype),), COSTS[dtype]))
    tokens = setup.micro_batch_size * setup.seq_len // setup.cp  # per rank
    if 256 <= c.loss_chunk_size // 2 < tokens:
        changes.append(Change("loss chunk", (("model.loss_chunk_size", c.loss_chunk_size // 2),), COSTS["loss chunk"]))
    rows = tokens * c.num_experts_per_tok
    chunk = max(rows // 8 // 1024 * 1024, 1024) if c.moe_chunk_tokens == 0 else c.moe_chunk_tokens // 2
    if chunk >= 1024 and chunk < rows:
        changes.append(Change("experts in chunks", (("model.moe_chunk_tokens", chunk),), COSTS["experts in chunks"]))
    if world is not None:
        stage = world // setup.pp  # the dp x cp ranks of a stage
        if stage % (setup.ep * 2) == 0:
            changes.append(Change("ep", (("ep", setup.ep * 2),), COSTS["ep x2"]))
        for times in (2, 4):
            if stage % (setup.cp * times) == 0:
                cp = setup.cp * times
                changes.append(Change("cp", (("cp", cp), ("dp", stage // cp)), COSTS[f"cp x{times}"]))
        pp = setup.pp * 2
        if world % (pp * setup.cp) == 0 and (world // pp) % setup.ep == 0:
            changes.append(Change("pp", (("pp", pp), ("dp", world // (pp * setup.cp))), COSTS["pp x2"]))
    modes = ("none", "selective", "block")
    if c.activation_checkpointing in modes:
        for mode in modes[modes.index(c.activation_checkpointing) + 1:]:
            changes.append(Change("recompute", (("model.activation_checkpointing", mode),), COSTS[mode]))
    if setup.micro_batch_size > 1:
        changes.append(Change("micro batch", (("micro_batch_size", setup.micro_batch_size // 2),),
                              COSTS["micro batch"]))
    if getattr(c, "engram_layer_ids", None) and not getattr(c, "engram_trainable", False) and not setup.engram_on_host:
        changes.append(Change("engram tables", (("trainer.engram_tables", "host"),), COSTS["engram host"]))
    if setup.offload == "none":
        changes.append(Change("host offload", (("trainer.offload", "optimizer"),), COSTS["offload"]))
    return changes


def candidate_setup(cfg: DictConfig, changes: tuple[Change, ...], device_memory: int) -> PlanSetup:
    """The :class:`PlanSetup` of the run ``cfg`` with ``changes`` applied, built as the recipe builds a run
    (:func:`plan_candidate` with :func:`~dsv4.training.spec.build_run_spec`, then :func:`plan_setup`)."""
    from dsv4.training.spec import build_run_spec

    return plan_candidate(cfg, changes, lambda candidate: plan_setup(build_run_spec(candidate), device_memory))


def plan_candidate(cfg: DictConfig, changes: tuple[Change, ...], setup_of: Callable[[DictConfig], Any]) -> Any:
    """``setup_of`` (a recipe's spec builder and plan setup) of a copy of the composed config ``cfg`` with the
    settings of ``changes`` written into it, planned only (``plan.only``; the other ``plan`` keys, such as
    ``plan.checkpoint_form``, kept), so a candidate the recipe would refuse raises :class:`~dsv4.plan.suggest.Refused`
    with the recipe's message. Plan-only: the tokenizer is not loaded (no change touches the data)."""
    from omegaconf import DictConfig as Config
    from omegaconf import OmegaConf

    from dsv4.plan.suggest import Refused

    candidate = copy.deepcopy(cfg)
    for change in changes:
        for key, value in change.settings:
            OmegaConf.update(candidate, key, value, merge=False)
    if isinstance(candidate.get("plan"), Config):
        candidate.plan.enabled, candidate.plan.only = True, True
    else:
        candidate.plan = True
    level = log.level
    log.setLevel(logging.WARNING)  # the run logged the same resolution lines already
    try:
        return setup_of(candidate)
    except (ValueError, KeyError, ImportError) as err:
        raise Refused(str(err)) from None
    finally:
        log.setLevel(level)


def suggest_fits(cfg: DictConfig, spec: RunSpec, plan: MemoryPlan, count: int) -> SearchResult:
    """The cheapest ``count`` candidates (:mod:`dsv4.plan.suggest`) of :func:`plan_changes` that the plan fits, for
    the run ``spec`` built from ``cfg`` and planned as ``plan`` (which does not fit); each candidate's setup from
    :func:`candidate_setup`. The note of a line says what a change does to the optimizer step's batch."""
    from dsv4.plan.suggest import SetupPlanner, search

    base = plan.setup
    rows_per_step = _rows_per_step(spec, base)

    def setup_of(changes: tuple[Change, ...]) -> PlanSetup:
        return candidate_setup(cfg, changes, base.device_memory_bytes)

    def note(setup: PlanSetup, _: MemoryPlan) -> str:
        rows = setup.micro_batch_size * setup.dp
        if setup.pp != base.pp:
            return f"pipeline stages, {setup.microbatches} microbatches per step"

        if spec.global_batch_size is None:
            return "" if rows == rows_per_step else f"rows per optimizer step {rows_per_step} -> {rows}"
        before = spec.global_batch_size // (base.micro_batch_size * base.dp)
        after = spec.global_batch_size // rows
        return "" if after == before else f"micro-batches accumulated per optimizer step {before} -> {after}"

    known_world = spec.parallel.world_size is not None or os.environ.get("WORLD_SIZE", "").isdigit()
    changes = plan_changes(cfg, base, base.gpus if known_world else None)
    planner = SetupPlanner(plan, setup_of, max_traces=MAX_TRACES, note=note)
    result = search(changes, planner, count=count, max_changes=MAX_CHANGES, max_candidates=MAX_CANDIDATES,
                    rank_by=spec.plan.rank_by)
    result.traced = planner.traced
    return result


def _rows_per_step(spec: RunSpec, setup: PlanSetup) -> int:
    return spec.global_batch_size or setup.micro_batch_size * setup.dp
