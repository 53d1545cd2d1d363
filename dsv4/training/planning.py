"""The recipe's memory plan (``plan`` in ``conf/finetune.yaml``): plan only, or check before launching.

* ``plan=true`` (or ``plan.only=true``): print the full per-rank plan (:mod:`dsv4.plan`), write
  ``memory_plan.json`` in the run directory and stop; nothing is trained and no data is read.
* a normal start plans too (in the launching process: not again in every rank Lightning starts), logs the one-line
  summary, writes ``memory_plan.json`` and refuses to launch, naming the biggest term, when the plan exceeds the
  device; ``plan.enforce=false`` launches anyway, ``plan=false`` skips the plan.
* ``plan.device_memory_gib``: the memory judged against. Default: on a GPU run (``trainer.accelerator`` gpu) the
  GPU's memory, 80 GiB when this process sees no GPU (a login node); on a CPU run the host's memory shared by the
  node's ranks; a plan-only run with the CPU trainer is judged against 80 GiB (it plans for GPUs).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from dsv4.training.spec import RunSpec

if TYPE_CHECKING:
    from dsv4.plan.plan import PlanSetup

log = logging.getLogger("dsv4")

PLAN_FILE = "memory_plan.json"
GIB = 2**30


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
    """The run keeps V4.1's Engram tables in FP8: frozen, and ``model.checkpoint`` stores them so."""
    if not getattr(spec.model, "engram_layer_ids", None) or getattr(spec.model, "engram_trainable", False) \
            or not spec.model_checkpoint:
        return False
    from dsv4.checkpoint.load import engram_tables_stored_fp8

    return engram_tables_stored_fp8(spec.model_checkpoint)


def plan_setup(spec: RunSpec, device_memory: int) -> PlanSetup:
    """The :class:`~dsv4.plan.plan.PlanSetup` of a run (dp from the world size; without one, from ``dp``, else 1;
    the attention kernel the run will use, e.g. Triton on GPUs where it imports)."""
    from dataclasses import replace

    from dsv4.plan.plan import PlanSetup
    from dsv4.plan.states import optimizer_profile

    world, cp = spec.parallel.world_size, spec.parallel.cp
    if world is None and os.environ.get("WORLD_SIZE", "").isdigit():
        world = int(os.environ["WORLD_SIZE"])
    if world is not None:
        dp = world // cp
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
        engram_fp8=_engram_kept_fp8(spec),
    )


def check_memory(spec: RunSpec, output_dir: Path) -> bool:
    """Run the recipe's memory plan; True when the run should stop here (plan only). Raises ValueError when the
    plan does not fit the device and ``plan.enforce`` is on."""
    options = spec.plan
    if not options.enabled or not (options.only or _is_launching_process()):
        return options.only
    from dsv4.plan.plan import memory_plan

    plan = memory_plan(plan_setup(spec, _device_memory(spec)))
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / PLAN_FILE).write_text(json.dumps(plan.as_dict(), indent=2))
    if options.only:
        print(plan.report(), flush=True)
        log.info("%s; wrote %s", plan.summary(), output_dir / PLAN_FILE)
        return True
    log.info("%s", plan.summary())
    if not plan.fits and options.enforce:
        raise ValueError(f"{plan.summary()}. Not launching: reduce the {plan.biggest_term} (see `plan=true` for the "
                         "per-rank table), or set plan.enforce=false to launch anyway")
    return False
