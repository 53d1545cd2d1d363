"""`RunSpec`: a fine-tuning run resolved once from the composed config; building it is the validation.

:func:`build_run_spec` turns the composed Hydra config (``conf/finetune.yaml`` and its groups) into one typed,
frozen :class:`RunSpec`: the model config, the LoRA config, the parallel dims, the device type, the compute dtype,
the attention backend and the MoE dispatcher resolved for that device, the optimizer and scheduler factories, the
metric callbacks, the logger factory, the plan, export and checkpoint options, and the trainer's keywords. Every
semantic check of the config runs here, in the launching process, before anything is written or any rank starts,
and raises ``ValueError`` / ``KeyError`` naming the key and the value. This module checks the model, parallel and
batch keys and puts the run together; each other group is resolved and checked by its module of
:mod:`dsv4.training.options` (trainer, checkpoint, preemption, data, validation, export, plan, and the instantiated
factories).

The strategy (:meth:`~dsv4.training.strategy.DSV4Strategy.from_spec`), the LightningModule, the memory plan
(:func:`~dsv4.training.planning.plan_setup`), the export and the job (:mod:`dsv4.training.run`) read the spec; no
other code derives a value from the config again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Mapping

import torch
from omegaconf import DictConfig, OmegaConf

from dsv4.config import DSV4Config, check_cp_length
from dsv4.parallel.cp.layout import check_balance, cp_chunks
from dsv4.parallel.mesh import ParallelDims
from dsv4.peft.config import LoRAConfig
from dsv4.training.options.checkpoint import (
    CheckpointSpec,
    check_cadence_and_resume,
    checkpoint_monitor,
    checkpoint_spec,
)
from dsv4.training.options.data import data_preparation, overlong_mode
from dsv4.training.options.export import ExportSpec, export_spec
from dsv4.training.options.family import check_engram_tokenizer
from dsv4.training.options.factories import (
    LoggerFactory,
    OptimizerFactory,
    SchedulerFactory,
    build_callbacks,
    build_logger,
    build_optimization,
)
from dsv4.training.options.plan import PlanOptions, check_checkpoint_form, plan_options
from dsv4.training.options.preemption import PreemptionSpec, preemption_spec
from dsv4.training.options.trainer import (
    check_not_derived,
    compute_dtype_for,
    device_type_of,
    engram_tables_mode,
    offload_mode,
    skip_nonfinite_steps,
    startup_timeout_s,
    world_size_of,
)
from dsv4.training.options.validation import ValidationSpec, objective_of, validation_spec
from dsv4.training.schema import lora_config, model_config


@dataclass(frozen=True)
class ParallelSpec:
    """``cp`` x ``dp`` ranks (``dp`` -1: the world divided by ``pp x cp``), ``ep`` expert-parallel ranks borrowed from
    them, the CP layout ``cp_balance``; ``world_size``: devices x nodes when the trainer config fixes it, else None
    (known at launch); ``pp`` pipeline ranks (``pp_schedule``, ``pp_virtual`` stages each)."""

    cp: int = 1
    dp: int = -1
    ep: int = 1
    cp_balance: str = "none"
    world_size: int | None = None
    pp: int = 1  # pipeline stages' ranks (dsv4.training.pipeline_step)
    pp_schedule: str = "1f1b"
    pp_virtual: int = 1

    @property
    def chunks(self) -> int:
        """Equal chunks every row is cut into (``cp``, or ``2 cp`` balanced)."""
        return cp_chunks(self.cp, self.cp_balance)

    @property
    def pipelined(self) -> bool:
        """The run is split into pipeline stages (``pp > 1`` or virtual stages)."""
        return self.pp > 1 or self.pp_virtual > 1


@dataclass(frozen=True)
class RunSpec:
    """One fine-tuning run, resolved (see the module docstring). Only ``model`` and ``optimizer`` have no default,
    so a test or a script builds the spec it needs directly."""

    model: DSV4Config
    optimizer: OptimizerFactory
    scheduler: SchedulerFactory | None = None
    model_checkpoint: str | None = None
    init_missing_mtp: bool = False  # MTP depths model_checkpoint lacks keep their initialisation (else refused)
    lora: LoRAConfig | None = None
    lora_adapter: str | None = None
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    device_type: str = "cpu"
    compute_dtype: torch.dtype = torch.float32
    attention_backend: str = "torch"  # resolved for device_type (never "auto")
    dispatcher: str = "local"  # resolved for ep (never "auto")
    seq_len: int = 2048
    micro_batch_size: int = 1
    global_batch_size: int | None = None  # rows per optimizer step over all dp replicas (None: micro x dp)
    seed: int = 1234
    bias_update_rate: float = 1e-3
    indexer_warmup_steps: int = 0
    max_steps: int = 100
    skip_nonfinite_steps: int = 0  # non-finite steps skipped over the run before one stops it (trainer.*)
    offload: str = "none"  # trainer.offload: "optimizer" = FSDP shards, gradients, optimizer state on the host
    engram_tables: str = "device"  # trainer.engram_tables: "host" = V4.1's frozen Engram tables in host memory
    startup_timeout_s: float = 300.0  # trainer.startup_timeout_s: the process group forms within it or start-up fails
    dry_run: bool = False
    # the data source's keywords (dsv4.data.build_documents)
    data: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    overlong: str = "split"  # documents longer than seq_len (dsv4.data.packer.OVERLONG)
    data_cache_dir: str | None = None  # prepared datasets (dsv4.data.prepared); None: tokenize in memory
    data_num_proc: int = 1  # tokenizing processes of a prepare
    # Lightning Trainer keywords (precision resolved into compute_dtype)
    trainer: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    callbacks: tuple = ()
    logger: LoggerFactory | None = None
    plan: PlanOptions = field(default_factory=PlanOptions)
    export: ExportSpec = field(default_factory=ExportSpec)
    checkpoint: CheckpointSpec = field(default_factory=CheckpointSpec)
    preemption: PreemptionSpec = field(default_factory=PreemptionSpec)
    validation: ValidationSpec = field(default_factory=ValidationSpec)
    objective: str = "train/loss"  # the metric a sweep job reports (options.validation.OBJECTIVES)
    # drafter training (recipes/train_dspark.py): options.dspark.DSparkSpec; None for fine-tuning
    dspark: Any = None
    # the composed config with every model value spelled out (for the record)
    resolved: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def accumulation(self, world_size: int) -> int:
        """Micro-batches accumulated into one optimizer step on ``world_size`` ranks (:func:`accumulation_steps`
        with this run's dp)."""
        dp = ParallelDims(world_size=world_size, cp=self.parallel.cp, dp=self.parallel.dp, ep=self.parallel.ep,
                          pp=self.parallel.pp).validate()
        return accumulation_steps(self.global_batch_size, self.micro_batch_size, dp)


def accumulation_steps(global_batch_size: int | None, micro_batch_size: int, dp: int) -> int:
    """Micro-batches per optimizer step: ``global_batch_size / (micro_batch_size x dp)`` (1 when
    ``global_batch_size`` is None). ValueError naming the numbers when the global batch is not a positive multiple of
    the rows one forward of every replica takes."""
    if global_batch_size is None:
        return 1
    per_step = micro_batch_size * dp
    if global_batch_size < 1 or global_batch_size % per_step:
        low = max(per_step, global_batch_size // per_step * per_step)
        raise ValueError(
            f"`global_batch_size`={global_batch_size} must be a positive multiple of micro_batch_size x dp = "
            f"{micro_batch_size} x {dp} = {per_step} (the rows of one forward on every replica; gradients are "
            f"accumulated over global_batch_size / {per_step} of them); e.g. global_batch_size={low} or "
            f"{low + per_step}")
    return global_batch_size // per_step


def build_dspark_run_spec(cfg: DictConfig) -> RunSpec:
    """The run of ``recipes/train_dspark.py``: :func:`build_run_spec` plus the drafter's keys
    (:func:`~dsv4.training.options.dspark.dspark_spec`); no LoRA (the drafter trains whole, the target is frozen)."""
    from dsv4.data.tokenizers import build_tokenizer
    from dsv4.training.options.dspark import dspark_spec

    if cfg.peft.get("name", "none") not in (None, "none") or lora_config(cfg.peft) is not None:
        raise ValueError("`peft`: drafter training trains the whole drafter and freezes the target; use peft=none")
    if cfg.get("pp", 1) > 1 or cfg.get("pp_virtual", 1) > 1:
        raise ValueError(f"`pp`={cfg.get('pp', 1)}: drafter training does not run in pipeline stages; use pp=1")
    spec = build_run_spec(cfg, export_beside=True)
    vocab = build_tokenizer(spec.data["tokenizer"]).vocab_size
    dspark = dspark_spec(OmegaConf.to_container(cfg, resolve=True), spec.model, spec.model_checkpoint,
                         vocab if vocab < spec.model.vocab_size else None)
    if spec.export.hf_dir:
        from dsv4.training.options.dspark import check_export_beside

        check_export_beside(spec.export.hf_dir, spec.model, spec.export.overwrite)
    if spec.parallel.cp > 1 and spec.parallel.cp_balance != "none":
        raise ValueError(f"`cp_balance`={spec.parallel.cp_balance!r}: drafter training under CP splits rows "
                         "contiguously (cp_balance=none)")
    return replace(spec, dspark=dspark)


def _check_parallel(cfg: DictConfig, config: DSV4Config, world: int | None) -> None:
    dp = None  # known here only when the trainer config fixes the world size
    pp = cfg.get("pp", 1)
    if world is not None:
        dp = ParallelDims(world_size=world, cp=cfg.cp, dp=cfg.dp, ep=cfg.ep, pp=pp).validate(config.n_routed_experts)
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
    gbs = cfg.get("global_batch_size")
    if gbs is not None and gbs < 1:
        raise ValueError(f"`global_batch_size` must be >= 1 or null, got {gbs}")
    microbatches = accumulation_steps(gbs, cfg.micro_batch_size, dp) if dp is not None else None
    check_pipeline_keys(cfg, config, microbatches)


def check_pipeline_keys(cfg: DictConfig, config: DSV4Config, microbatches: int | None = None) -> None:
    """``pp``, ``pp_schedule``, ``pp_virtual``: ValueError naming the key, and what a run in pipeline stages
    (:mod:`dsv4.training.pipeline_step`) does not do yet: the indexer loss, host offload and balanced CP; and, with
    the step's ``microbatches`` known (the world size fixed), whether the schedule runs that many
    (:func:`dsv4.plan.stages.check_microbatches`)."""
    from dsv4.parallel.pipeline import SCHEDULES, check_pipeline

    pp, schedule, virtual = cfg.get("pp", 1), cfg.get("pp_schedule", "1f1b"), cfg.get("pp_virtual", 1)
    for name, value in (("pp", pp), ("pp_virtual", virtual)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a positive integer, got {value!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"`pp_schedule`={schedule!r} must be one of {', '.join(SCHEDULES)}")
    if virtual > 1 and schedule not in SCHEDULES[2:]:
        raise ValueError(f"`pp_virtual`={virtual} needs an interleaved `pp_schedule` ({', '.join(SCHEDULES[2:])}), "
                         f"got {schedule}")
    if pp == 1 and virtual == 1:
        return
    check_pipeline(config, pp)
    if (cfg.get("trainer") or {}).get("offload", "none") != "none":
        raise ValueError(f"`pp`={pp} with trainer.offload={cfg.trainer.offload}: host offload is not planned under a "
                         "pipeline")
    if cfg.get("cp_balance", "none") != "none":
        raise ValueError(f"`pp`={pp} with `cp_balance`={cfg.cp_balance}: pipeline stages run the contiguous CP "
                         "split (cp_balance=none)")
    if microbatches is not None:
        from dsv4.plan.stages import check_microbatches

        check_microbatches(schedule, pp, virtual, microbatches)


def build_run_spec(cfg: DictConfig, export_beside: bool = False) -> RunSpec:
    """Resolve and validate the composed config (see the module docstring); nothing is written.
    ``export_beside``: ``export.hf_dir`` may hold a checkpoint to add to (the DSpark drafter's export)."""
    from dsv4.model.attention_backend import resolve_attention_backend
    from dsv4.parallel.dispatch import check_dispatcher_available, resolve_dispatcher

    config = model_config(cfg.model)
    trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
    world = world_size_of(trainer)
    _check_parallel(cfg, config, world)
    check_not_derived(trainer)
    compute_dtype = compute_dtype_for(str(trainer.pop("precision", "auto")), config.torch_dtype)
    offload = offload_mode(trainer.pop("offload", "none"))
    engram_tables = engram_tables_mode(trainer.pop("engram_tables", "device"), config)
    startup_timeout = startup_timeout_s(trainer.pop("startup_timeout_s", 300.0))
    device_type = device_type_of(trainer)
    dispatcher = resolve_dispatcher(cfg.dispatcher.name, cfg.ep)
    check_dispatcher_available(dispatcher, device_type)
    backend = resolve_attention_backend(config.attention_backend, device_type)
    if cfg.indexer_warmup_steps < 0 or (cfg.indexer_warmup_steps and not config.indexer_loss_coeff > 0):
        raise ValueError(f"`indexer_warmup_steps`={cfg.indexer_warmup_steps} must be >= 0, and > 0 only with "
                         f"model.indexer_loss_coeff > 0 (got {config.indexer_loss_coeff})")
    check_cadence_and_resume(cfg.checkpoint)
    checkpoint = cfg.model.checkpoint
    if checkpoint and not os.path.isdir(checkpoint):
        raise ValueError(f"`model.checkpoint`={checkpoint!r} is not a directory")
    init_missing_mtp = bool(cfg.model.get("init_missing_mtp", False))
    if checkpoint:
        from dsv4.checkpoint.load import built_mtp_depths, check_mtp_weights, holds_weights

        if holds_weights(checkpoint):  # (a directory without weight files is refused by the load)
            check_mtp_weights(checkpoint, built_mtp_depths(config), init_missing_mtp)
    lora = lora_config(cfg.peft)
    adapter = cfg.peft.get("adapter")
    if adapter and (lora is None or not os.path.isdir(adapter)):
        raise ValueError(f"`peft.adapter`={adapter!r} " + ("needs peft=lora" if lora is None else "is not a directory"))
    export = export_spec(cfg, lora, beside=export_beside)
    data = OmegaConf.to_container(cfg.data, resolve=True)
    overlong = data.pop("overlong", "split")
    checkpoint_spec(cfg.checkpoint)  # validated before any other work
    preemption = preemption_spec(cfg)
    overlong_mode(overlong)
    max_steps = int(trainer.get("max_steps", 100))
    data_cache_dir, data_num_proc = data_preparation(data.pop("cache_dir", None), data.pop("num_proc", None))
    validation = validation_spec(data, trainer, max_steps)
    skip_nonfinite = skip_nonfinite_steps(trainer.pop("skip_nonfinite_steps", 0))
    monitor = checkpoint_monitor(cfg.checkpoint, validation.enabled)
    objective = objective_of(cfg.get("objective", "train/loss"), validation)
    from dsv4.data.defaults import resolve_data_source

    data = resolve_data_source(data, checkpoint or None, config.vocab_size)
    if validation.source is not None:  # the same tokenizer; its own chat template key, if data.val sets one
        validation = replace(
            validation, source=resolve_data_source(validation.source, checkpoint or None, config.vocab_size))
    plan = plan_options(cfg.get("plan"))
    check_checkpoint_form(plan, checkpoint or None)
    if not plan.only:  # a plan hashes nothing (dsv4.training.options.family)
        from dsv4.data.tokenizers import build_tokenizer

        check_engram_tokenizer(config, build_tokenizer(data["tokenizer"]), str(data["tokenizer"]))
    optimizer, scheduler = build_optimization(cfg)
    callbacks = tuple(build_callbacks(cfg))
    logger = build_logger(cfg)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved["model"].update(config.to_dict())
    return RunSpec(
        model=config, optimizer=optimizer, scheduler=scheduler, model_checkpoint=checkpoint or None,
        init_missing_mtp=init_missing_mtp, lora=lora, lora_adapter=adapter or None,
        parallel=ParallelSpec(cp=cfg.cp, dp=cfg.dp, ep=cfg.ep, cp_balance=cfg.cp_balance, world_size=world,
                              pp=cfg.get("pp", 1), pp_schedule=cfg.get("pp_schedule", "1f1b"),
                              pp_virtual=cfg.get("pp_virtual", 1)),
        device_type=device_type, compute_dtype=compute_dtype, attention_backend=backend, dispatcher=dispatcher,
        seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size, global_batch_size=cfg.get("global_batch_size"),
        seed=cfg.seed,
        bias_update_rate=cfg.bias_update_rate, indexer_warmup_steps=cfg.indexer_warmup_steps,
        max_steps=max_steps, skip_nonfinite_steps=skip_nonfinite, offload=offload, engram_tables=engram_tables,
        startup_timeout_s=startup_timeout, dry_run=bool(cfg.dry_run),
        data=MappingProxyType(data), overlong=overlong, data_cache_dir=data_cache_dir, data_num_proc=data_num_proc,
        trainer=MappingProxyType(trainer),
        callbacks=callbacks, logger=logger, plan=plan, export=export,
        checkpoint=checkpoint_spec(cfg.checkpoint, monitor), preemption=preemption,
        validation=validation, objective=objective,
        resolved=MappingProxyType(resolved),
    )
