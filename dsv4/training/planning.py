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
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dsv4.config import DSV4Config

log = logging.getLogger("dsv4")

PLAN_FILE = "memory_plan.json"
GIB = 2**30


@dataclass(frozen=True)
class PlanOptions:
    """``enabled``: plan at all; ``only``: plan and stop; ``enforce``: refuse to launch what does not fit;
    ``device_memory_gib``: the memory judged against (None: see the module docstring)."""

    enabled: bool = True
    only: bool = False
    enforce: bool = True
    device_memory_gib: float | None = None


def plan_options(value: Any) -> PlanOptions:
    """``cfg.plan`` as :class:`PlanOptions`: ``true`` = plan only, ``false`` = no plan, or a mapping of the fields
    (KeyError naming an unknown key, ValueError for a bad value)."""
    if isinstance(value, bool):
        return PlanOptions(enabled=value, only=value)
    if value is None:
        return PlanOptions()
    values = OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else dict(value)
    known = {f.name for f in fields(PlanOptions)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise KeyError(f"`plan.{unknown[0]}` is not a plan option; the options are {sorted(known)}")
    for name in ("enabled", "only", "enforce"):
        if name in values and not isinstance(values[name], bool):
            raise ValueError(f"`plan.{name}` must be true or false, got {values[name]!r}")
    gib = values.get("device_memory_gib")
    if gib is not None and (isinstance(gib, bool) or not isinstance(gib, (int, float)) or gib <= 0):
        raise ValueError(f"`plan.device_memory_gib` must be a positive number of GiB, got {gib!r}")
    return PlanOptions(**values)


def _is_launching_process() -> bool:
    """False in the ranks a launcher started after this process planned (Lightning's children, torchrun's
    non-zero local ranks): they would only repeat the same plan."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def _device_memory(options: PlanOptions, trainer_cfg: dict, plan_only: bool) -> int:
    from dsv4.plan.plan import device_memory_bytes

    if options.device_memory_gib is not None:
        return int(options.device_memory_gib * GIB)
    accelerator = str(trainer_cfg.get("accelerator", "cpu"))
    if accelerator == "cpu" and plan_only:
        return 80 * GIB
    devices = trainer_cfg.get("devices", 1)
    return device_memory_bytes(accelerator, devices if isinstance(devices, int) else 1)


def plan_setup(cfg: DictConfig, config: DSV4Config, world: int | None, device_memory: int):
    """The :class:`~dsv4.plan.plan.PlanSetup` of this run (dp from the world size; without one, from ``dp``, else 1)."""
    from dsv4.plan.plan import PlanSetup
    from dsv4.plan.states import optimizer_profile
    from dsv4.model.attention_backend import resolve_attention_backend
    from dsv4.training.run import build_optimization, device_type_of
    from dsv4.training.schema import lora_config
    from dsv4.training.strategy import compute_dtype_for

    if world is None and os.environ.get("WORLD_SIZE", "").isdigit():
        world = int(os.environ["WORLD_SIZE"])
    if world is not None:
        dp = world // cfg.cp
    elif cfg.dp > 0:
        dp = cfg.dp
    else:
        dp = 1
        log.warning("memory plan: the world size is unknown (trainer.devices=auto, no WORLD_SIZE): planned for dp=1; "
                    "set dp or trainer.devices for the real sharding")
    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    import torch

    optimizer, _ = build_optimization(cfg, [torch.nn.Parameter(torch.zeros(1))])
    # trace the attention kernel the run will use (auto: Triton on GPUs where it imports)
    backend = resolve_attention_backend(config.attention_backend, device_type_of(trainer_cfg))
    config = replace(config, attention_backend=backend)
    return PlanSetup(
        config=config, seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size, cp=cfg.cp, dp=dp, ep=cfg.ep,
        compute_dtype=compute_dtype_for(str(trainer_cfg.get("precision", "auto")), config.torch_dtype),
        optimizer=optimizer_profile(optimizer), device_memory_bytes=device_memory, lora=lora_config(cfg.peft),
        cp_balance=cfg.cp_balance,
    )


def check_memory(cfg: DictConfig, config: DSV4Config, world: int | None, output_dir: Path) -> bool:
    """Run the recipe's memory plan; True when the run should stop here (plan only). Raises ValueError when the
    plan does not fit the device and ``plan.enforce`` is on."""
    options = plan_options(cfg.get("plan"))
    if not options.enabled or not (options.only or _is_launching_process()):
        return options.only
    from dsv4.plan.plan import memory_plan

    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    setup = plan_setup(cfg, config, world, _device_memory(options, trainer_cfg, options.only))
    plan = memory_plan(setup)
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
