"""The drafter recipe's memory plan (``plan`` in ``conf/train_dspark.yaml``): what :mod:`dsv4.training.planning`
does for fine-tuning, with the drafter plan (:mod:`dsv4.plan.dspark`).

* ``plan=true`` (``plan.only=true``): print the per-rank plan of drafter training, write ``memory_plan.json`` in the
  run directory and stop; a normal start plans too, logs the one-line summary and refuses to launch, naming the
  biggest term, when the plan exceeds the device less ``plan.reserve_gib`` (``plan.enforce=false`` launches anyway,
  ``plan=false`` skips the plan);
* the target's weights are planned in the form the run holds them: kept as ``model.checkpoint`` stores them when it
  stores FP8 / FP4 weights (and its Engram tables in FP8 when it stores them so), read from its headers; the float
  weights in the run's compute dtype; ``plan.checkpoint_form=release`` (with ``plan.only=true``, no checkpoint) plans
  the target as the release stores it;
* ``plan.suggest``: when it does not fit, the changes of the run's options that the drafter plan reads (the
  optimizer's moments, ``ep``, ``cp``, routed experts in chunks, the micro batch, Engram tables in host memory), the
  cheapest ``plan.suggest`` that fit (:mod:`dsv4.plan.suggest`, the costs of :data:`dsv4.training.planning.COSTS`);
  ``plan.rank_by=step_time`` is refused (the drafter plan has no communication table).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from dsv4.training.planning import (MAX_CANDIDATES, MAX_CHANGES, _device_memory, _is_launching_process,
                                    act_on_plan, plan_candidate, plan_changes, plan_setup)
from dsv4.training.spec import RunSpec

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from dsv4.plan.dspark import DSparkMemoryPlan, DSparkPlanSetup
    from dsv4.plan.suggest import SearchResult

log = logging.getLogger("dsv4")

# the groups of dsv4.training.planning.plan_changes that change what the drafter plan reads
DRAFTER_CHANGE_GROUPS = ("optimizer state", "experts in chunks", "ep", "cp", "micro batch", "engram tables")


def target_kept(spec: RunSpec) -> bool:
    """The run keeps its target's weights quantised: ``model.checkpoint`` is a directory storing FP8 / FP4 weights, or
    the plan assumes the release, which stores them so (``plan.checkpoint_form=release``)."""
    if spec.plan.checkpoint_form == "release":
        return True
    checkpoint = spec.model_checkpoint
    if not checkpoint or not Path(checkpoint).is_dir():
        return False
    from dsv4.speculative.target import stores_quantized_weights

    return stores_quantized_weights(checkpoint)


def dspark_plan_setup(spec: RunSpec, device_memory: int) -> DSparkPlanSetup:
    """The :class:`~dsv4.plan.dspark.DSparkPlanSetup` of a drafter run: the fine-tuning setup of its layout, dtypes,
    optimizer, device and Engram tables (:func:`dsv4.training.planning.plan_setup`), its mode, anchors, the target's
    stored form and whether it decodes held-out prompts."""
    from dsv4.plan.dspark import DSparkPlanSetup

    drafter = spec.dspark
    return DSparkPlanSetup(plan_setup(spec, device_memory), mode=drafter.mode, num_anchors=drafter.num_anchors,
                           target_kept=target_kept(spec), evaluates=drafter.eval_prompts > 0)


def check_dspark_memory(spec: RunSpec, output_dir: Path, cfg: DictConfig | None = None) -> bool:
    """:func:`dsv4.training.planning.check_memory` for drafter training: True when the run should stop here (plan
    only); ValueError when the plan does not fit and ``plan.enforce`` is on."""
    options = spec.plan
    if not options.enabled or not (options.only or _is_launching_process()):
        return options.only
    if options.rank_by != "cost":
        raise ValueError(f"`plan.rank_by`={options.rank_by!r}: the drafter plan has no step-time estimate; use "
                         "plan.rank_by=cost")
    from dsv4.plan.dspark import dspark_memory_plan

    plan = dspark_memory_plan(dspark_plan_setup(spec, _device_memory(spec)))
    search = None if cfg is None else (lambda: suggest_dspark_fits(cfg, plan, options.suggest))
    return act_on_plan(plan, plan.setup.base, options, output_dir, search, "drafter memory plan")


def suggest_dspark_fits(cfg: DictConfig, plan: DSparkMemoryPlan, count: int) -> SearchResult:
    """The cheapest ``count`` changes of :data:`DRAFTER_CHANGE_GROUPS` (from
    :func:`~dsv4.training.planning.plan_changes`) whose drafter plan fits, each candidate resolved by the recipe's own
    validation (:func:`~dsv4.training.spec.build_dspark_run_spec`)."""
    from dsv4.plan.dspark import DSparkSetupPlanner
    from dsv4.plan.suggest import search
    from dsv4.training.spec import build_dspark_run_spec

    base = plan.setup.base

    def setup_of(changes):
        return plan_candidate(cfg, changes,
                              lambda c: dspark_plan_setup(build_dspark_run_spec(c), base.device_memory_bytes))

    changes = [c for c in plan_changes(cfg, base, base.world) if c.group in DRAFTER_CHANGE_GROUPS]
    planner = DSparkSetupPlanner(plan, setup_of)
    result = search(changes, planner, count=count, max_changes=MAX_CHANGES, max_candidates=MAX_CANDIDATES)
    result.traced = planner.traced
    return result
