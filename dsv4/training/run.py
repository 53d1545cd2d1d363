"""The fine-tuning job behind ``recipes/finetune.py``: resolve the run, plan, build data/model/strategy, fit.

Order matters for users: everything that can be wrong with the config (:func:`dsv4.training.spec.build_run_spec`)
or the data is checked in the launching process before Lightning starts the other ranks, and nothing is written
before the checks pass. Everything after reads the :class:`~dsv4.training.spec.RunSpec`.

A ``-m`` sweep runs every job as its own single-run command (see :func:`run_sweep_job`), also where submitit runs
the job (:mod:`dsv4.training.submitit_job`); the job's objective (the last logged value of ``objective``:
``train/loss`` of the last step, or ``val/loss`` of the validation after it) comes back through ``objective.json``
in its run directory, so sweepers such as Optuna get a number for every trial. Ranks that SLURM created are read by
:mod:`dsv4.training.slurm`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from omegaconf import DictConfig

from dsv4.training.options.family import refuse_image_tokens
from dsv4.training.planning import check_memory
from dsv4.training.slurm import check_slurm_layout, cluster_plugins
from dsv4.training.spec import RunSpec, build_run_spec

log = logging.getLogger("dsv4")

OBJECTIVE_FILE = "objective.json"


_LAUNCH_ENV = frozenset({"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK",
                         "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE"})


def is_multirun_job() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def run_sweep_job(output_dir: Path, script: str | Path, preemption_signals: Iterable[str] = ()) -> float | None:
    """Run this ``-m`` job as its own single-run command, ``python <script> <the job's overrides>``; return its
    objective (None if it wrote none).

    Lightning's launcher re-executes ``sys.argv`` (in a sweep every child rank would re-run the whole sweep), and
    each job gets a fresh process group. ``script`` is the recipe's file: this process's ``sys.argv`` is not the
    recipe's under a launcher that runs jobs elsewhere (submitit's task is ``python -m submitit.core._submit``).
    Under submitit (:mod:`dsv4.training.submitit_job`) the task's checks run first, and its preemption signal
    reaches the training before submitit requeues the job. The child writes ``objective.json`` in its run dir.
    """
    from hydra.core.hydra_config import HydraConfig

    from dsv4.training.submitit_job import (ForwardSignals, check_submitit_task, hand_over, should_requeue,
                                            submitit_task)

    hc = HydraConfig.get()
    task = submitit_task()
    if task is not None:
        check_submitit_task(task, preemption_signals)
    cmd = [sys.executable, str(script), *hc.overrides.task, f"hydra.run.dir={output_dir}",
           f"hydra.job.name={hc.job.name}"]
    log.info("sweep job %s: running %s", hc.job.num, " ".join(cmd))
    with ForwardSignals((task.signal, signal.SIGTERM) if task is not None else ()) as forward:
        child = subprocess.Popen(cmd, env=sweep_child_env(os.environ))
        forward.attach(child)
        try:
            status = child.wait()
        except BaseException:
            child.kill()
            child.wait()
            raise
    if task is not None and should_requeue(task, forward.received, status):
        hand_over(task, forward.previous[task.signal], status)  # task 0 requeues the job and exits
        return None
    if status != 0:
        raise subprocess.CalledProcessError(status, cmd)
    return read_objective(output_dir)


def sweep_child_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of a sweep job's training command: this process's, less the process-group variables a
    previous job of the sweep may have left here (``MASTER_PORT``, ``RANK``, ``PL_*``, ``TORCHELASTIC_*``, ...).
    The ``SLURM_*`` variables stay: under SLURM they make the command the rank SLURM created
    (:mod:`dsv4.training.slurm`)."""
    env = {k: v for k, v in environ.items() if k not in _LAUNCH_ENV and not k.startswith(("PL_", "TORCHELASTIC_"))}
    return {**env, "DSV4_SWEEP_CHILD": "1"}


def read_objective(output_dir: Path) -> float | None:
    path = Path(output_dir) / OBJECTIVE_FILE
    if not path.exists():
        return None
    value = json.loads(path.read_text()).get("value")
    return None if value is None else float(value)


def _write_objective(output_dir: Path, metric: str, value: float | None) -> None:
    (output_dir / OBJECTIVE_FILE).write_text(json.dumps({"metric": metric, "value": value}))


def _resume_path(spec: RunSpec, ckpt_dir: Path) -> str | None:
    from dsv4.training.checkpointing import (META_FILE, checkpoint_step, complete_checkpoints, is_complete,
                                             newest_complete)

    resume = spec.checkpoint.resume
    if resume == "none":
        return None
    if resume == "auto":  # the newest COMPLETE checkpoint: a save that was killed leaves none that looks complete
        complete, incomplete = complete_checkpoints(ckpt_dir)
        for path in incomplete:
            log.warning("not resuming from %s: incomplete (a save interrupted before every rank finished)", path)
        if not complete:
            return None
        resume = str(newest_complete(complete))
    elif not is_complete(resume):
        raise ValueError(f"`checkpoint.resume`={resume!r} is not a complete distributed checkpoint directory "
                         f"(it needs {META_FILE} and .metadata)")
    log.info("resuming from %s (step %s)", resume, checkpoint_step(resume))
    return resume


def _wait_for_local_ranks(trainer) -> None:
    """Lightning's launching process (rank 0 of ``python recipes/finetune.py``) waits for the ranks it started, so
    its exit status is the job's. Its child-process observer would SIGKILL it on their non-zero exit: it is given an
    empty list first (it then ends). Under torchrun or SLURM there are no such children."""
    procs = getattr(trainer.strategy.launcher, "procs", None)
    if not procs:
        return
    children = list(procs)
    procs.clear()
    for child in children:
        child.wait()


@dataclass(frozen=True)
class TrainingRecipe:
    """What a training recipe of the framework brings to :func:`run_finetune`: how its config resolves into a
    :class:`~dsv4.training.spec.RunSpec`, its data module, its LightningModule, and its memory plan
    (``check_memory(spec, output_dir, cfg)``: True to stop after planning, ValueError when it does not fit; see
    :func:`dsv4.training.planning.check_memory`). Everything else (sweeps, launchers, the Trainer, checkpoints,
    resume, preemption, loggers, callbacks) is shared."""

    build_spec: Callable[[DictConfig], RunSpec]
    build_data: Callable[[RunSpec], Any]
    build_module: Callable[[RunSpec, Any], Any]
    check_memory: Callable[[RunSpec, Path, DictConfig], bool] = check_memory


def _finetune_data(spec: RunSpec):
    from dsv4.data.datamodule import DSV4DataModule

    return DSV4DataModule.from_spec(spec)


def _finetune_module(spec: RunSpec, data):
    from dsv4.training.module import DSV4LightningModule

    return DSV4LightningModule(spec, val_data=data.validation_dataloader if data.has_validation else None)


FINETUNE = TrainingRecipe(build_run_spec, _finetune_data, _finetune_module)


def run_finetune(cfg: DictConfig, output_dir: str | Path, script: str | Path | None = None,
                 recipe: TrainingRecipe = FINETUNE) -> float | None:
    """Resolve the run, then train; returns the objective (the last ``spec.objective``) for sweepers. ``script``:
    the recipe file that runs each job of a ``-m`` sweep (:func:`run_sweep_job`); ``recipe``: what is trained
    (fine-tuning by default; :data:`dsv4.training.dspark_run.TRAIN_DSPARK` the DSpark drafter)."""
    output_dir = Path(output_dir)
    spec = recipe.build_spec(cfg)
    check_slurm_layout(spec.trainer, os.environ)
    if is_multirun_job() and not os.environ.get("DSV4_SWEEP_CHILD"):
        if script is None:
            raise ValueError("a -m sweep job runs the recipe once per job: run_finetune(..., script=<the recipe "
                             "file>) is needed")
        return run_sweep_job(output_dir, script, spec.preemption.signals)
    if recipe.check_memory(spec, output_dir, cfg):  # plan only
        return None

    import lightning as L
    import torch
    from lightning.pytorch.loggers import WandbLogger
    from omegaconf import OmegaConf

    from dsv4.callbacks.preemption import Preemption
    from dsv4.training.checkpointing import StepCheckpoint, checkpoint_step
    from dsv4.training.strategy import DSV4Strategy

    ckpt_dir = output_dir / "checkpoints"
    resume = _resume_path(spec, ckpt_dir)
    L.seed_everything(spec.seed, workers=True, verbose=False)
    data = recipe.build_data(spec)
    dataset = data.build_dataset()  # tokenizes and packs (or maps the prepared copy): bad data fails here, before
    # any rank starts; Lightning's ranks re-run this and map the copy the launching process prepared
    log.info("%s", dataset.stats.summary())
    val_rows = data.build_val_dataset()
    refuse_image_tokens(dataset, spec.model)
    refuse_image_tokens(val_rows, spec.model, "held-out data")
    if val_rows is not None:
        log.info("validation %s", val_rows.stats.summary())
    if spec.dry_run:
        log.info("dry run: %d packed rows of %d tokens; %s", len(dataset), spec.seq_len, dataset.stats.as_dict())
        if val_rows is not None:
            log.info("dry run: %d held-out rows; %s", len(val_rows), val_rows.stats.as_dict())
        return None

    log.info("compute dtype %s (fp32 master weights, optimizer state and gradient reduction)", spec.compute_dtype)
    checkpointing = StepCheckpoint(ckpt_dir, spec.checkpoint.every_n_steps, keep_last=spec.checkpoint.keep_last,
                                   keep_every_n_steps=spec.checkpoint.keep_every_n_steps,
                                   best_of=spec.checkpoint.monitor)
    resume_step = checkpoint_step(resume) if resume else None  # the logs continue from this step
    logger = spec.logger(output_dir, resume_step=resume_step) if spec.logger is not None else False
    preemption = Preemption(spec.preemption.signals, spec.preemption.exit_code) if spec.preemption.signals else None
    callbacks = [checkpointing, *spec.callbacks, *([preemption] if preemption else [])]
    stages = spec.parallel.pipelined
    trainer_keys = dict(spec.trainer)
    if stages:  # the pipeline step clips by the global norm itself (manual optimization: dsv4.training.pipeline_step)
        trainer_keys.pop("gradient_clip_val", None)
        if trainer_keys.pop("gradient_clip_algorithm", "norm") not in (None, "norm"):
            raise ValueError(f"`trainer.gradient_clip_algorithm`={spec.trainer['gradient_clip_algorithm']!r}: only "
                             "'norm' is supported")
    strategy = DSV4Strategy.from_spec(spec)
    trainer = L.Trainer(strategy=strategy, logger=logger, callbacks=callbacks,
                        plugins=cluster_plugins(os.environ), use_distributed_sampler=False,
                        default_root_dir=str(output_dir), precision="32-true", **trainer_keys)
    # gradient accumulation from global_batch_size (the world size is known here also when the config left it open)
    accumulation = spec.accumulation(trainer.world_size)
    micro_batch_size = spec.micro_batch_size
    if stages:  # one batch of every microbatch per step, the pipeline's schedule runs them
        strategy.microbatches, micro_batch_size, accumulation = accumulation, micro_batch_size * accumulation, 1
        data.train_batch_rows = micro_batch_size
    trainer.accumulate_grad_batches = accumulation
    if resume:  # another layout is refused here, in the launching process, not after every rank started
        from dsv4.parallel.mesh import ParallelDims
        from dsv4.training.resume import RunLayout, check_resume

        p = spec.parallel
        dp = ParallelDims(world_size=trainer.world_size, cp=p.cp, dp=p.dp, ep=p.ep, pp=p.pp).validate()
        check_resume(resume, RunLayout(dp=dp, cp=p.cp, ep=p.ep, micro_batch_size=micro_batch_size,
                                       accumulation=accumulation))
    if trainer.global_rank == 0:
        OmegaConf.save(OmegaConf.create(dict(spec.resolved)), output_dir / "resolved_config.yaml")
    if logger:
        logger.log_hyperparams(dict(spec.resolved))
    module = recipe.build_module(spec, data)
    trainer.fit(module, datamodule=data, ckpt_path=resume)
    if preemption is not None and preemption.stopped_at is not None:
        _wait_for_local_ranks(trainer)
        log.warning("preempted: stopped after step %d with a complete checkpoint; exit status %d (rerun the same "
                    "command to resume)", preemption.stopped_at, preemption.exit_code)
        raise SystemExit(preemption.exit_code)
    if spec.objective == "val/loss":
        objective = module.last_validation.loss if module.last_validation is not None else None
    else:
        loss = trainer.callback_metrics.get(spec.objective)
        objective = float(loss) if isinstance(loss, torch.Tensor) else None
    if trainer.global_rank == 0:
        _write_objective(output_dir, spec.objective, objective)
        if isinstance(logger, WandbLogger):
            import wandb

            wandb.finish()  # one run per job, also inside a sweep
    return objective
