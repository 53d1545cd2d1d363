"""The fine-tuning job behind ``recipes/finetune.py``: validate the config, build data/model/strategy, fit.

Order matters for users: everything that can be wrong with the config or the data is checked in the launching
process before Lightning starts the other ranks, and nothing is written before the checks pass.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dsv4.config import DSV4Config
from dsv4.parallel.mesh import ParallelDims

log = logging.getLogger("dsv4")


def world_size_of(trainer_cfg: dict) -> int | None:
    """World size implied by the trainer config (``devices`` x ``num_nodes``); None when only known at launch."""
    devices = trainer_cfg.get("devices", 1)
    if isinstance(devices, (list, tuple)):
        devices = len(devices)
    if not isinstance(devices, int) or devices < 1:
        return None
    return devices * int(trainer_cfg.get("num_nodes", 1))


def validate(cfg: DictConfig) -> tuple[DSV4Config, int | None]:
    """Semantic checks that need no process group; raises ValueError naming the key and the value."""
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    checkpoint = model_cfg.pop("checkpoint", None)
    try:
        config = DSV4Config.from_dict(model_cfg)
    except ValueError as err:
        raise ValueError(f"model: {err}") from None
    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    world = world_size_of(trainer_cfg)
    if world is not None:
        ParallelDims(world_size=world, cp=cfg.cp, dp=cfg.dp, ep=cfg.ep).validate(config.n_routed_experts)
    elif cfg.cp < 1:
        raise ValueError(f"`cp` must be a positive integer, got {cfg.cp}")
    multiple = config.cp_shard_multiple
    if cfg.seq_len < 1 or cfg.seq_len % (cfg.cp * multiple):
        raise ValueError(
            f"`seq_len`={cfg.seq_len} must be a positive multiple of cp x shard multiple = {cfg.cp} x {multiple} = "
            f"{cfg.cp * multiple} (the shard multiple is the lcm of model.compress_ratios, ratio 4 counted as 8); "
            f"e.g. seq_len={max(1, round(cfg.seq_len / (cfg.cp * multiple))) * cfg.cp * multiple}"
        )
    if cfg.micro_batch_size < 1:
        raise ValueError(f"`micro_batch_size` must be >= 1, got {cfg.micro_batch_size}")
    from dsv4.parallel.dispatch import check_dispatcher_available

    accelerator = str(trainer_cfg.get("accelerator", "cpu"))
    check_dispatcher_available(cfg.dispatcher.name, "cuda" if accelerator in ("gpu", "cuda") else accelerator)
    if cfg.logger.kind not in ("wandb", "csv", "none"):
        raise ValueError(f"`logger.kind`={cfg.logger.kind!r} must be one of wandb, csv, none")
    if cfg.checkpoint.every_n_steps < 0:
        raise ValueError(f"`checkpoint.every_n_steps` must be >= 0, got {cfg.checkpoint.every_n_steps}")
    if checkpoint and not os.path.isdir(checkpoint):
        raise ValueError(f"`model.checkpoint`={checkpoint!r} is not a directory")
    export = cfg.get("export")
    if export is not None and export.hf_dir:
        from dsv4.checkpoint import EXPORT_DTYPES

        if export.dtype not in EXPORT_DTYPES:
            raise ValueError(f"`export.dtype`={export.dtype!r} must be one of {EXPORT_DTYPES}")
        if cfg.ep > 1:
            raise ValueError("`export.hf_dir` with ep > 1 is not supported yet (experts would need unsharding)")
    return config, world


_LAUNCH_ENV = frozenset({"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK",
                         "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE"})


def _is_multirun_job() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def _run_sweep_job_in_subprocess(output_dir: Path) -> None:
    """Every job of a ``-m`` sweep runs as its own single-run command: Lightning's launcher re-executes ``sys.argv``
    (in a sweep every child rank would re-run the whole sweep), and each job gets a fresh process group."""
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    overrides = [o for o in hc.overrides.task]
    cmd = [sys.executable, sys.argv[0], *overrides, f"hydra.run.dir={output_dir}",
           f"hydra.job.name={hc.job.name}"]
    log.info("sweep job %s: running %s", hc.job.num, " ".join(cmd))
    # a previous job of this sweep may have left its process-group variables in this process's environment
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV and not k.startswith(("PL_", "TORCHELASTIC_"))}
    subprocess.run(cmd, check=True, env={**env, "DSV4_SWEEP_CHILD": "1"})


def _logger(cfg: DictConfig, output_dir: Path):
    kind = cfg.logger.kind
    if kind == "none":
        return False
    if kind == "csv":
        from lightning.pytorch.loggers import CSVLogger

        return CSVLogger(save_dir=str(output_dir), name="csv", version="")
    from lightning.pytorch.loggers import WandbLogger

    offline = cfg.logger.offline
    if offline is None:  # no credentials configured: stay offline rather than failing or prompting
        offline = not (os.environ.get("WANDB_API_KEY") or Path.home().joinpath(".netrc").exists())
    if offline:
        os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    return WandbLogger(project=cfg.logger.project, name=cfg.logger.name or output_dir.name,
                       save_dir=str(output_dir), offline=bool(offline))


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


def run_finetune(cfg: DictConfig, output_dir: str | Path) -> float | None:
    """Validate, then train; returns the last logged training loss (for sweepers)."""
    output_dir = Path(output_dir)
    config, world = validate(cfg)
    if _is_multirun_job() and not os.environ.get("DSV4_SWEEP_CHILD"):
        _run_sweep_job_in_subprocess(output_dir)
        return None

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    from callbacks import CPTrafficCallback, MemoryCallback, PaddingCallback, ThroughputCallback
    from dsv4.data.datamodule import DSV4DataModule
    from dsv4.parallel.dispatch import dispatcher_needs_uniform_tokens
    from dsv4.training.module import DSV4LightningModule
    from dsv4.training.strategy import DSV4Strategy

    L.seed_everything(cfg.seed, workers=True, verbose=False)
    multiple = config.cp_shard_multiple
    data = DSV4DataModule(
        source=OmegaConf.to_container(cfg.data, resolve=True), seq_len=cfg.seq_len, alignment=multiple,
        micro_batch_size=cfg.micro_batch_size, cp_size=cfg.cp, seed=cfg.seed,
    )
    dataset = data.build_dataset()  # tokenizes and packs: bad data fails here, before any rank starts
    if cfg.dry_run:
        log.info("dry run: %d packed rows of %d tokens; %s", len(dataset), cfg.seq_len, dataset.stats.as_dict())
        return None

    trainer_cfg = OmegaConf.to_container(cfg.trainer, resolve=True)
    max_steps = int(trainer_cfg.get("max_steps", 100))
    optim = OmegaConf.to_container(cfg.optim, resolve=True)
    module = DSV4LightningModule(model=config.to_dict(), optim=optim, max_steps=max_steps,
                                 bias_update_rate=optim.pop("bias_update_rate", 1e-3),
                                 hf_checkpoint=cfg.model.checkpoint,
                                 export_hf_dir=cfg.export.hf_dir if "export" in cfg else None,
                                 export_dtype=cfg.export.dtype if "export" in cfg else "bfloat16")
    strategy = DSV4Strategy(
        cp=cfg.cp, dp=cfg.dp, ep=cfg.ep, dispatcher=cfg.dispatcher.name, pad_multiple=multiple,
        sync_packed_length=dispatcher_needs_uniform_tokens(cfg.dispatcher.name),
    )
    ckpt_dir = output_dir / "checkpoints"
    checkpointing = ModelCheckpoint(dirpath=str(ckpt_dir), filename="step{step}", save_last=True, save_top_k=-1,
                                    every_n_train_steps=cfg.checkpoint.every_n_steps or max_steps,
                                    save_on_train_epoch_end=False, auto_insert_metric_name=False)
    callbacks = [checkpointing, ThroughputCallback(config=config), PaddingCallback(), CPTrafficCallback(),
                 MemoryCallback()]
    trainer = L.Trainer(strategy=strategy, logger=_logger(cfg, output_dir), callbacks=callbacks,
                        use_distributed_sampler=False, default_root_dir=str(output_dir), **trainer_cfg)
    if trainer.global_rank == 0:
        OmegaConf.save(cfg, output_dir / "resolved_config.yaml", resolve=True)
    trainer.fit(module, datamodule=data, ckpt_path=_resume_path(cfg, ckpt_dir))
    loss = trainer.callback_metrics.get("train/loss")
    if cfg.logger.kind == "wandb" and trainer.global_rank == 0:
        import wandb

        wandb.finish()  # one run per job, also inside a sweep
    return float(loss) if isinstance(loss, torch.Tensor) else None
