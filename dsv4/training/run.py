"""The fine-tuning job behind ``recipes/finetune.py``: validate the config, build data/model/strategy, fit.

Order matters for users: everything that can be wrong with the config or the data is checked in the launching
process before Lightning starts the other ranks, and nothing is written before the checks pass. The optimizer,
the LR schedule, the metric callbacks and the logger are built from their config groups with
``hydra.utils.instantiate``.

A ``-m`` sweep runs every job as its own single-run command (see :func:`run_sweep_job`); the job's objective (its
last ``train/loss``) comes back through ``objective.json`` in its run directory, so sweepers such as Optuna get a
number for every trial.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dsv4.config import DSV4Config, check_cp_length
from dsv4.parallel.cp.layout import check_balance, cp_chunks
from dsv4.parallel.mesh import ParallelDims
from dsv4.training.schema import lora_config, model_config
from dsv4.training.strategy import compute_dtype_for

log = logging.getLogger("dsv4")

OBJECTIVE_FILE = "objective.json"
OBJECTIVE_METRIC = "train/loss"


def world_size_of(trainer_cfg: dict) -> int | None:
    """World size implied by the trainer config (``devices`` x ``num_nodes``); None when only known at launch."""
    devices = trainer_cfg.get("devices", 1)
    if isinstance(devices, (list, tuple)):
        devices = len(devices)
    if not isinstance(devices, int) or devices < 1:
        return None
    return devices * int(trainer_cfg.get("num_nodes", 1))


def _instantiate(cfg: Any, key: str, *args: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` (plain Python containers as arguments, e.g. AdamW's ``betas`` a tuple-like list,
    never a ListConfig inside optimizer state) with errors turned into a ValueError naming the config key."""
    from hydra.utils import instantiate

    try:
        return instantiate(cfg, *args, _convert_="all", **kwargs)
    except Exception as err:  # noqa: BLE001 - Hydra wraps import and call errors in several types
        cause = err.__cause__ or err
        raise ValueError(f"`{key}` cannot be instantiated: {type(cause).__name__}: {cause}") from None


def build_optimization(cfg: DictConfig, params) -> tuple[Any, Any]:
    """``(optimizer, scheduler or None)`` factories from ``cfg.optim`` / ``cfg.scheduler``, checked on ``params``."""
    import torch

    optimizer = _instantiate(cfg.optim, "optim")
    scheduler = _instantiate(cfg.scheduler, "scheduler") if cfg.get("scheduler") else None
    try:
        probe = optimizer(params)
    except (TypeError, ValueError) as err:
        raise ValueError(f"`optim` cannot be instantiated: {type(err).__name__}: {err}") from None
    if not isinstance(probe, torch.optim.Optimizer):
        raise ValueError(f"`optim` must build a torch.optim.Optimizer from the parameters, got {type(probe).__name__}")
    if scheduler is not None:
        try:
            scheduler(probe)
        except (TypeError, ValueError) as err:
            raise ValueError(f"`scheduler` cannot be instantiated: {type(err).__name__}: {err}") from None
    return optimizer, scheduler


def build_callbacks(cfg: DictConfig) -> list:
    """The metric callbacks of ``cfg.callbacks`` (one entry per callback, each with a ``_target_``)."""
    return [_instantiate(spec, f"callbacks.{name}") for name, spec in (cfg.get("callbacks") or {}).items()
            if spec is not None]


def build_logger(cfg: DictConfig, output_dir: Path):
    """The logger of ``cfg.logger`` writing under ``output_dir``; False without one."""
    if not cfg.get("logger"):
        return False
    return _instantiate(cfg.logger, "logger", save_dir=str(output_dir))


def device_type_of(trainer_cfg: dict) -> str:
    """The torch device type a trainer config runs on (``trainer.accelerator``: gpu / cuda -> ``cuda``)."""
    accelerator = str(trainer_cfg.get("accelerator", "cpu"))
    return "cuda" if accelerator in ("gpu", "cuda") else accelerator


def validate(cfg: DictConfig) -> tuple[DSV4Config, int | None]:
    """Semantic checks that need no process group; raises ValueError naming the key and the value."""
    import torch

    config = model_config(cfg.model)
    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    world = world_size_of(trainer_cfg)
    if world is not None:
        ParallelDims(world_size=world, cp=cfg.cp, dp=cfg.dp, ep=cfg.ep).validate(config.n_routed_experts)
    elif cfg.cp < 1:
        raise ValueError(f"`cp` must be a positive integer, got {cfg.cp}")
    check_balance(cfg.cp_balance)
    chunks = cp_chunks(cfg.cp, cfg.cp_balance)
    if chunks != cfg.cp and cfg.seq_len % (chunks * config.shard_multiple):
        step = chunks * config.shard_multiple
        raise ValueError(f"`seq_len`={cfg.seq_len} must be a multiple of 2 x cp x shard multiple = {step} under "
                         f"cp_balance=full (rank r holds chunks r and 2cp-1-r of {chunks}); e.g. "
                         f"seq_len={max(1, round(cfg.seq_len / step)) * step}")
    check_cp_length(cfg.seq_len, cfg.cp, config.shard_multiple)
    if cfg.micro_batch_size < 1:
        raise ValueError(f"`micro_batch_size` must be >= 1, got {cfg.micro_batch_size}")
    from dsv4.model.attention_backend import resolve_attention_backend
    from dsv4.parallel.dispatch import check_dispatcher_available, resolve_dispatcher

    compute_dtype_for(str(trainer_cfg.get("precision", "auto")), config.torch_dtype)
    device_type = device_type_of(trainer_cfg)
    check_dispatcher_available(resolve_dispatcher(cfg.dispatcher.name, cfg.ep), device_type)
    resolve_attention_backend(config.attention_backend, device_type)
    if cfg.indexer_warmup_steps < 0 or (cfg.indexer_warmup_steps and not config.indexer_loss_coeff > 0):
        raise ValueError(f"`indexer_warmup_steps`={cfg.indexer_warmup_steps} must be >= 0, and > 0 only with "
                         f"model.indexer_loss_coeff > 0 (got {config.indexer_loss_coeff})")
    if cfg.checkpoint.every_n_steps < 0:
        raise ValueError(f"`checkpoint.every_n_steps` must be >= 0, got {cfg.checkpoint.every_n_steps}")
    checkpoint = cfg.model.checkpoint
    if checkpoint and not os.path.isdir(checkpoint):
        raise ValueError(f"`model.checkpoint`={checkpoint!r} is not a directory")
    lora = lora_config(cfg.peft)
    adapter = cfg.peft.get("adapter")
    if adapter and (lora is None or not os.path.isdir(adapter)):
        raise ValueError(f"`peft.adapter`={adapter!r} " + ("needs peft=lora" if lora is None else "is not a directory"))
    if lora is None and (cfg.export.adapter_dir or cfg.export.merge):
        raise ValueError("`export.adapter_dir` / `export.merge` need peft=lora (a full fine-tune has no adapters)")
    if lora is not None and cfg.export.hf_dir and not cfg.export.merge:
        raise ValueError("`export.hf_dir` with peft=lora writes the merged model: set export.merge=true (or "
                         "export.adapter_dir for the adapters alone)")
    if cfg.export.merge and not cfg.export.hf_dir:
        raise ValueError("`export.merge=true` needs `export.hf_dir` (where the merged model goes)")
    if cfg.export.hf_dir:
        from dsv4.checkpoint import EXPORT_DTYPES

        if cfg.export.dtype not in EXPORT_DTYPES:
            raise ValueError(f"`export.dtype`={cfg.export.dtype!r} must be one of {EXPORT_DTYPES}")
    if (cfg.export.hf_dir or cfg.export.adapter_dir) and cfg.ep > 1:
        raise ValueError("`export.hf_dir` / `export.adapter_dir` with ep > 1 are not supported yet (experts would "
                         "need unsharding)")
    build_optimization(cfg, [torch.nn.Parameter(torch.zeros(1))])
    build_callbacks(cfg)
    from dsv4.training.planning import plan_options

    plan_options(cfg.get("plan"))
    if cfg.get("logger"):
        from hydra.utils import get_object

        target = cfg.logger.get("_target_")
        try:
            get_object(str(target))
        except Exception as err:  # noqa: BLE001
            raise ValueError(f"`logger._target_`={target!r} cannot be imported: {err}") from None
    return config, world


_LAUNCH_ENV = frozenset({"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK",
                         "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE"})


def is_multirun_job() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def run_sweep_job(output_dir: Path) -> float | None:
    """Run this ``-m`` job as its own single-run command; return its objective (None if it wrote none).

    Lightning's launcher re-executes ``sys.argv`` (in a sweep every child rank would re-run the whole sweep), and
    each job gets a fresh process group. The child writes ``objective.json`` in its run dir.
    """
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    cmd = [sys.executable, sys.argv[0], *hc.overrides.task, f"hydra.run.dir={output_dir}",
           f"hydra.job.name={hc.job.name}"]
    log.info("sweep job %s: running %s", hc.job.num, " ".join(cmd))
    # a previous job of this sweep may have left its process-group variables in this process's environment
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV and not k.startswith(("PL_", "TORCHELASTIC_"))}
    subprocess.run(cmd, check=True, env={**env, "DSV4_SWEEP_CHILD": "1"})
    return read_objective(output_dir)


def read_objective(output_dir: Path) -> float | None:
    path = Path(output_dir) / OBJECTIVE_FILE
    if not path.exists():
        return None
    value = json.loads(path.read_text()).get("value")
    return None if value is None else float(value)


def _write_objective(output_dir: Path, value: float | None) -> None:
    (output_dir / OBJECTIVE_FILE).write_text(json.dumps({"metric": OBJECTIVE_METRIC, "value": value}))


def _resume_path(cfg: DictConfig, ckpt_dir: Path) -> str | None:
    resume = cfg.checkpoint.resume
    if resume == "none":
        return None
    if resume == "auto":  # the newest COMPLETE checkpoint: a job killed while saving leaves a partial one
        complete = [d for d in ckpt_dir.glob("*.ckpt") if (d / "meta.pt").exists() and (d / ".metadata").exists()]
        if not complete:
            return None
        newest = max(complete, key=lambda d: ((d / "meta.pt").stat().st_mtime, d.name == "last.ckpt"))
        log.info("resuming from %s", newest)
        return str(newest)
    if not Path(resume).exists():
        raise ValueError(f"`checkpoint.resume`={resume!r}: no such checkpoint")
    return resume


def build_module(cfg: DictConfig, config: DSV4Config):
    """The LightningModule of this config (its optimizer and schedule from their groups)."""
    import torch

    from dsv4.training.module import DSV4LightningModule

    optimizer, scheduler = build_optimization(cfg, [torch.nn.Parameter(torch.zeros(1))])
    return DSV4LightningModule(config, optimizer=optimizer, scheduler=scheduler,
                               bias_update_rate=cfg.bias_update_rate, hf_checkpoint=cfg.model.checkpoint,
                               export_hf_dir=cfg.export.hf_dir, export_dtype=cfg.export.dtype,
                               lora=lora_config(cfg.peft), lora_adapter=cfg.peft.get("adapter"),
                               export_adapter_dir=cfg.export.adapter_dir,
                               indexer_warmup_steps=cfg.indexer_warmup_steps)


def run_finetune(cfg: DictConfig, output_dir: str | Path) -> float | None:
    """Validate, then train; returns the objective (the last ``train/loss``) for sweepers."""
    output_dir = Path(output_dir)
    config, world = validate(cfg)
    if is_multirun_job() and not os.environ.get("DSV4_SWEEP_CHILD"):
        return run_sweep_job(output_dir)
    from dsv4.training.planning import check_memory

    if check_memory(cfg, config, world, output_dir):  # plan only
        return None

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import WandbLogger

    from dsv4.data.datamodule import DSV4DataModule
    from dsv4.parallel.dispatch import resolve_dispatcher
    from dsv4.training.strategy import DSV4Strategy

    L.seed_everything(cfg.seed, workers=True, verbose=False)
    data = DSV4DataModule(
        source=OmegaConf.to_container(cfg.data, resolve=True), seq_len=cfg.seq_len,
        shard_multiple=config.shard_multiple, micro_batch_size=cfg.micro_batch_size,
        cp_size=cp_chunks(cfg.cp, cfg.cp_balance), seed=cfg.seed,
    )
    dataset = data.build_dataset()  # tokenizes and packs: bad data fails here, before any rank starts
    if cfg.dry_run:
        log.info("dry run: %d packed rows of %d tokens; %s", len(dataset), cfg.seq_len, dataset.stats.as_dict())
        return None

    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    max_steps = int(trainer_cfg.get("max_steps", 100))
    compute_dtype = compute_dtype_for(str(trainer_cfg.pop("precision", "auto")), config.torch_dtype)
    log.info("compute dtype %s (fp32 master weights, optimizer state and gradient reduction)", compute_dtype)
    strategy = DSV4Strategy(cp=cfg.cp, dp=cfg.dp, ep=cfg.ep, cp_balance=cfg.cp_balance,
                            dispatcher=resolve_dispatcher(cfg.dispatcher.name, cfg.ep),
                            compute_dtype=compute_dtype)
    ckpt_dir = output_dir / "checkpoints"
    checkpointing = ModelCheckpoint(dirpath=str(ckpt_dir), filename="step{step}", save_last=True, save_top_k=-1,
                                    every_n_train_steps=cfg.checkpoint.every_n_steps or max_steps,
                                    save_on_train_epoch_end=False, auto_insert_metric_name=False)
    logger = build_logger(cfg, output_dir)
    trainer = L.Trainer(strategy=strategy, logger=logger, callbacks=[checkpointing, *build_callbacks(cfg)],
                        use_distributed_sampler=False, default_root_dir=str(output_dir), precision="32-true",
                        **trainer_cfg)
    resolved = OmegaConf.to_container(cfg, resolve=True)  # every model value spelled out (the preset resolved)
    resolved["model"].update(config.to_dict())
    if trainer.global_rank == 0:
        OmegaConf.save(OmegaConf.create(resolved), output_dir / "resolved_config.yaml")
    if logger:
        logger.log_hyperparams(resolved)
    trainer.fit(build_module(cfg, config), datamodule=data, ckpt_path=_resume_path(cfg, ckpt_dir))
    loss = trainer.callback_metrics.get(OBJECTIVE_METRIC)
    objective = float(loss) if isinstance(loss, torch.Tensor) else None
    if trainer.global_rank == 0:
        _write_objective(output_dir, objective)
        if isinstance(logger, WandbLogger):
            import wandb

            wandb.finish()  # one run per job, also inside a sweep
    return objective
