"""`RunSpec`: a fine-tuning run resolved once from the composed config; building it is the validation.

:func:`build_run_spec` turns the composed Hydra config (``conf/finetune.yaml`` and its groups) into one typed,
frozen :class:`RunSpec`: the model config, the LoRA config, the parallel dims, the device type, the compute dtype,
the attention backend and the MoE dispatcher resolved for that device, the optimizer and scheduler factories, the
metric callbacks, the logger factory, the plan, export and checkpoint options, and the trainer's keywords. Every
semantic check of the config runs here, in the launching process, before anything is written or any rank starts,
and raises ``ValueError`` / ``KeyError`` naming the key and the value.

The strategy (:meth:`~dsv4.training.strategy.DSV4Strategy.from_spec`), the LightningModule, the memory plan
(:func:`~dsv4.training.planning.plan_setup`), the export and the job (:mod:`dsv4.training.run`) read the spec; no
other code derives a value from the config again.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

import torch
from omegaconf import DictConfig, OmegaConf

from dsv4.config import DSV4Config, check_cp_length
from dsv4.parallel.cp.layout import check_balance, cp_chunks
from dsv4.parallel.mesh import ParallelDims
from dsv4.peft.config import LoRAConfig
from dsv4.training.schema import lora_config, model_config

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
LoggerFactory = Callable[..., Any]  # (output_dir, resume_step=None) -> logger

PRECISIONS = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_dtype_for(precision: str, torch_dtype: str) -> torch.dtype:
    """The dtype the model computes in: ``precision`` ``auto`` follows ``model.torch_dtype`` (float32 -> fp32,
    bfloat16 -> bf16 mixed, float16 -> fp16 mixed); ``32-true`` / ``bf16-mixed`` / ``16-mixed`` choose directly.
    Lightning's own autocast is not used: mixed precision is FSDP2's, with fp32 master weights."""
    if precision == "auto":
        return _TORCH_DTYPES[torch_dtype]
    if precision not in PRECISIONS:
        raise ValueError(f"`trainer.precision`={precision!r} must be auto or one of {sorted(PRECISIONS)} (dsv4 keeps "
                         "fp32 master weights; a *-true half precision would not)")
    return PRECISIONS[precision]


@dataclass(frozen=True)
class PlanOptions:
    """``enabled``: plan at all; ``only``: plan and stop; ``enforce``: refuse to launch what does not fit;
    ``device_memory_gib``: the memory judged against (None: see :mod:`dsv4.training.planning`)."""

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


@dataclass(frozen=True)
class ParallelSpec:
    """``cp`` x ``dp`` ranks (``dp`` -1: the world divided by ``cp``), ``ep`` expert-parallel ranks borrowed from
    them, the CP layout ``cp_balance``; ``world_size``: devices x nodes when the trainer config fixes it, else None
    (known at launch)."""

    cp: int = 1
    dp: int = -1
    ep: int = 1
    cp_balance: str = "none"
    world_size: int | None = None

    @property
    def chunks(self) -> int:
        """Equal chunks every row is cut into (``cp``, or ``2 cp`` balanced)."""
        return cp_chunks(self.cp, self.cp_balance)


@dataclass(frozen=True)
class ExportSpec:
    """At the end of training: ``hf_dir`` gets the model in the Hugging Face layout in ``dtype`` (merged under LoRA
    with ``merge``), ``adapter_dir`` the LoRA adapters in the PEFT format."""

    hf_dir: str | None = None
    dtype: str = "bfloat16"
    adapter_dir: str | None = None
    merge: bool = False


@dataclass(frozen=True)
class CheckpointSpec:
    """``every_n_steps``: distributed checkpoint cadence (0 = only at the end); ``resume``: ``auto`` | ``none`` | a
    checkpoint directory; ``keep_last``: how many periodic ``step<N>.ckpt`` to keep (None: all);
    ``keep_every_n_steps``: periodic checkpoints of steps divisible by it are always kept (None: none);
    ``async_save``: write in the background (the step waits only for the host copy); ``monitor``: ``val/loss``
    also keeps ``best.ckpt``, the checkpoint of the lowest one (None: no best checkpoint)."""

    every_n_steps: int = 50
    resume: str = "auto"
    keep_last: int | None = 3
    keep_every_n_steps: int | None = None
    async_save: bool = True
    monitor: str | None = None


@dataclass(frozen=True)
class PreemptionSpec:
    """``signals``: the signal names that stop the run after the current optimizer step with a complete checkpoint
    (empty: none); ``exit_code``: the process status after such a stop (:mod:`dsv4.callbacks.preemption`)."""

    signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
    exit_code: int = 143


def _preemption_spec(cfg: Any) -> PreemptionSpec:
    """The ``preemption`` group; an unknown or uncatchable signal name, or a status outside 0-255, is refused."""
    from dsv4.callbacks.preemption import signal_of

    group = cfg.get("preemption") or {}
    signals = tuple(str(s) for s in (group.get("signals") or ()))
    for name in signals:
        try:
            signal_of(name)
        except ValueError as err:
            raise ValueError(f"`preemption.signals`: {err}") from None
    code = group.get("exit_code", 143)
    if not _is_int(code) or not 0 <= int(code) <= 255:
        raise ValueError(f"`preemption.exit_code`={code!r} must be an integer in 0..255")
    return PreemptionSpec(signals=signals, exit_code=int(code))


MONITORS = ("val/loss",)
OBJECTIVES = ("train/loss", "val/loss")


@dataclass(frozen=True)
class ValidationSpec:
    """Held-out data and when to evaluate it. ``source``: the keywords of a second document source
    (``data.val`` over the training source's keys), or ``fraction``: the share of the training source's documents
    held out (``data.val_fraction``); at most one is set, neither = no validation. ``every_n_steps``
    (``trainer.val_check_interval``): evaluate after every that many optimizer steps, and always after the last one
    (None: after the last one only); ``limit_batches`` (``trainer.limit_val_batches``): each dp rank evaluates at
    most that many micro-batches (an int) or that fraction of them (a float in (0, 1], at least one)."""

    source: Mapping[str, Any] | None = None
    fraction: float | None = None
    every_n_steps: int | None = None
    limit_batches: int | float | None = None

    @property
    def enabled(self) -> bool:
        return self.source is not None or self.fraction is not None


@dataclass(frozen=True)
class RunSpec:
    """One fine-tuning run, resolved (see the module docstring). Only ``model`` and ``optimizer`` have no default,
    so a test or a script builds the spec it needs directly."""

    model: DSV4Config
    optimizer: OptimizerFactory
    scheduler: SchedulerFactory | None = None
    model_checkpoint: str | None = None
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
    objective: str = "train/loss"  # the metric a sweep job reports (OBJECTIVES)
    # the composed config with every model value spelled out (for the record)
    resolved: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def accumulation(self, world_size: int) -> int:
        """Micro-batches accumulated into one optimizer step on ``world_size`` ranks (:func:`accumulation_steps`
        with this run's dp)."""
        dp = ParallelDims(world_size=world_size, cp=self.parallel.cp, dp=self.parallel.dp, ep=self.parallel.ep).validate()
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


def world_size_of(trainer_cfg: Mapping[str, Any]) -> int | None:
    """World size implied by the trainer config (``devices`` x ``num_nodes``); None when only known at launch."""
    devices = trainer_cfg.get("devices", 1)
    if isinstance(devices, (list, tuple)):
        devices = len(devices)
    if not isinstance(devices, int) or devices < 1:
        return None
    return devices * int(trainer_cfg.get("num_nodes", 1))


def device_type_of(trainer_cfg: Mapping[str, Any]) -> str:
    """The torch device type a trainer config runs on (``trainer.accelerator``: gpu / cuda -> ``cuda``)."""
    accelerator = str(trainer_cfg.get("accelerator", "cpu"))
    return "cuda" if accelerator in ("gpu", "cuda") else accelerator


def _instantiate(cfg: Any, key: str, *args: Any, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` (plain Python containers as arguments, e.g. AdamW's ``betas`` a tuple-like list,
    never a ListConfig inside optimizer state) with errors turned into a ValueError naming the config key."""
    from hydra.utils import instantiate

    try:
        return instantiate(cfg, *args, _convert_="all", **kwargs)
    except Exception as err:  # noqa: BLE001 - Hydra wraps import and call errors in several types
        cause = err.__cause__ or err
        raise ValueError(f"`{key}` cannot be instantiated: {type(cause).__name__}: {cause}") from None


def build_optimization(cfg: DictConfig) -> tuple[OptimizerFactory, SchedulerFactory | None]:
    """``(optimizer, scheduler or None)`` factories from ``cfg.optim`` / ``cfg.scheduler``, checked on a probe
    parameter; ``optim.state_dtype`` is checked first (ValueError naming it; ImportError naming it and the install
    command when ``8bit`` needs torchao)."""
    state_dtype = cfg.optim.get("state_dtype")
    if state_dtype is not None:  # our AdamW factory's key: a clear error before anything is built
        from dsv4.training.optimizer import check_state_dtype

        check_state_dtype(state_dtype)
    optimizer = _instantiate(cfg.optim, "optim")
    scheduler = _instantiate(cfg.scheduler, "scheduler") if cfg.get("scheduler") else None
    try:
        probe = optimizer([torch.nn.Parameter(torch.zeros(1))])
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


def _make_logger(logger_cfg: Mapping[str, Any], output_dir: Path, resume_step: int | None = None) -> Any:
    """The logger writing under ``output_dir``; ``resume_step`` (the step a resumed run continues from) goes to
    factories that take it (``dsv4.training.loggers``: they continue the run's logs)."""
    import inspect

    from hydra.utils import get_object

    extra = {}
    if resume_step is not None and "resume_step" in inspect.signature(get_object(logger_cfg["_target_"])).parameters:
        extra["resume_step"] = resume_step
    return _instantiate(dict(logger_cfg), "logger", save_dir=str(output_dir), **extra)


def build_logger(cfg: DictConfig) -> LoggerFactory | None:
    """``(output_dir, resume_step=None) -> logger`` for ``cfg.logger`` (its target checked now), or None without
    one."""
    if not cfg.get("logger"):
        return None
    from hydra.utils import get_object

    target = cfg.logger.get("_target_")
    try:
        get_object(str(target))
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"`logger._target_`={target!r} cannot be imported: {err}") from None
    return partial(_make_logger, MappingProxyType(OmegaConf.to_container(cfg.logger, resolve=True)))


def _check_parallel(cfg: DictConfig, config: DSV4Config, world: int | None) -> None:
    dp = None  # known here only when the trainer config fixes the world size
    if world is not None:
        dp = ParallelDims(world_size=world, cp=cfg.cp, dp=cfg.dp, ep=cfg.ep).validate(config.n_routed_experts)
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
    if dp is not None:
        accumulation_steps(gbs, cfg.micro_batch_size, dp)


def _export_spec(cfg: DictConfig, lora: LoRAConfig | None) -> ExportSpec:
    export = ExportSpec(hf_dir=cfg.export.hf_dir, dtype=cfg.export.dtype, adapter_dir=cfg.export.adapter_dir,
                        merge=bool(cfg.export.merge))
    if lora is None and (export.adapter_dir or export.merge):
        raise ValueError("`export.adapter_dir` / `export.merge` need peft=lora (a full fine-tune has no adapters)")
    if lora is not None and export.hf_dir and not export.merge:
        raise ValueError("`export.hf_dir` with peft=lora writes the merged model: set export.merge=true (or "
                         "export.adapter_dir for the adapters alone)")
    if export.merge and not export.hf_dir:
        raise ValueError("`export.merge=true` needs `export.hf_dir` (where the merged model goes)")
    if export.hf_dir:
        from dsv4.checkpoint import EXPORT_DTYPES

        if export.dtype not in EXPORT_DTYPES:
            raise ValueError(f"`export.dtype`={export.dtype!r} must be one of {EXPORT_DTYPES}")
    return export


# the keys of the data group that name a document source (data.val may override them; the tokenizer is the
# training one, so the two losses count the same tokens)
_VAL_SOURCE_KEYS = ("kind", "path", "split", "text_key", "messages_key", "chat_template_file", "max_documents",
                    "max_bytes", "min_bytes", "seed", "options")


def offload_mode(value: Any) -> str:
    """``trainer.offload``: ``none`` (every FSDP shard and the optimizer on the device) or ``optimizer`` (FSDP2's
    CPU offload policy: sharded fp32 master parameters, their gradients and the optimizer state in host memory, the
    optimizer step on the host; docs/memory.md)."""
    from dsv4.parallel.wrap import OFFLOAD

    if value not in OFFLOAD:
        raise ValueError(f"`trainer.offload`={value!r} must be one of {', '.join(OFFLOAD)}")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _validation_spec(data: dict[str, Any], trainer: dict[str, Any], max_steps: int) -> ValidationSpec:
    """Pop ``val`` / ``val_fraction`` from the data group and ``val_check_interval`` / ``limit_val_batches`` from
    the trainer keywords (the schedule is dsv4's, in optimizer steps) and check them."""
    val, fraction = data.pop("val", None), data.pop("val_fraction", None)
    every, limit = trainer.pop("val_check_interval", None), trainer.pop("limit_val_batches", None)
    if val is not None and fraction is not None:
        raise ValueError(f"`data.val` and `data.val_fraction`={fraction} are both set: hold out documents of the "
                         "training source (data.val_fraction) or read a second source (data.val), not both")
    source = None
    if fraction is not None:
        from dsv4.data.validation import check_val_fraction

        fraction = check_val_fraction(fraction)
    if val is not None:
        if not isinstance(val, dict):
            raise ValueError(f"`data.val`={val!r} must be a mapping of source keys, e.g. data.val={{path:val.jsonl}}")
        unknown = sorted(set(val) - set(_VAL_SOURCE_KEYS))
        if unknown:
            raise KeyError(f"`data.val.{unknown[0]}` cannot be set: data.val overrides the training source's keys "
                           f"{list(_VAL_SOURCE_KEYS)} (the tokenizer and data.overlong are the training ones)")
        source = {**data, **val}
    enabled = source is not None or fraction is not None
    if every is not None:
        if not _is_int(every) or every < 1:
            raise ValueError(f"`trainer.val_check_interval`={every!r} must be a whole number of optimizer steps >= 1")
        if not enabled:
            raise ValueError(f"`trainer.val_check_interval`={every} needs held-out data: set data.val_fraction or "
                             "data.val")
    if limit is not None:
        fractional = isinstance(limit, float) and 0.0 < limit <= 1.0
        if not fractional and not (_is_int(limit) and limit >= 1):
            raise ValueError(f"`trainer.limit_val_batches`={limit!r} must be a number of micro-batches >= 1 or a "
                             "fraction in (0, 1]")
        if not enabled:
            raise ValueError(f"`trainer.limit_val_batches`={limit} needs held-out data: set data.val_fraction or "
                             "data.val")
    if enabled and every is None and max_steps < 1:
        raise ValueError(f"validation with `trainer.max_steps`={max_steps} needs `trainer.val_check_interval` (it "
                         "otherwise runs after the last step, which is not known)")
    return ValidationSpec(source=MappingProxyType(source) if source is not None else None, fraction=fraction,
                          every_n_steps=every, limit_batches=limit)


def _check_monitor_and_objective(cfg: DictConfig, validation: ValidationSpec) -> tuple[str | None, str]:
    monitor = cfg.checkpoint.get("monitor")
    if monitor is not None and monitor not in MONITORS:
        raise ValueError(f"`checkpoint.monitor`={monitor!r} must be null or one of {list(MONITORS)}")
    objective = cfg.get("objective", "train/loss")
    if objective not in OBJECTIVES:
        raise ValueError(f"`objective`={objective!r} must be one of {list(OBJECTIVES)}")
    for key, value in (("checkpoint.monitor", monitor), ("objective", objective)):
        if value == "val/loss" and not validation.enabled:
            raise ValueError(f"`{key}`=val/loss needs held-out data: set data.val_fraction or data.val")
    return monitor, objective


def _data_preparation(cache_dir: str | None, num_proc: int | None) -> tuple[str | None, int]:
    """``data.cache_dir`` (``~`` expanded; None: no prepared copy) and ``data.num_proc`` (None: min(8, CPUs))."""
    if num_proc is None:
        num_proc = min(8, os.cpu_count() or 1)
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"`data.num_proc` must be an integer >= 1 or null, got {num_proc!r}")
    return (os.path.expanduser(cache_dir) if cache_dir else None), num_proc


def build_run_spec(cfg: DictConfig) -> RunSpec:
    """Resolve and validate the composed config (see the module docstring); nothing is written."""
    from dsv4.model.attention_backend import resolve_attention_backend
    from dsv4.parallel.dispatch import check_dispatcher_available, resolve_dispatcher

    config = model_config(cfg.model)
    trainer = OmegaConf.to_container(cfg.trainer, resolve=True)
    world = world_size_of(trainer)
    _check_parallel(cfg, config, world)
    if "accumulate_grad_batches" in trainer:
        raise ValueError(f"`trainer.accumulate_grad_batches`={trainer['accumulate_grad_batches']!r} is derived: set "
                         "`global_batch_size` (rows per optimizer step over all dp replicas) instead")
    compute_dtype = compute_dtype_for(str(trainer.pop("precision", "auto")), config.torch_dtype)
    offload = offload_mode(trainer.pop("offload", "none"))
    device_type = device_type_of(trainer)
    dispatcher = resolve_dispatcher(cfg.dispatcher.name, cfg.ep)
    check_dispatcher_available(dispatcher, device_type)
    backend = resolve_attention_backend(config.attention_backend, device_type)
    if cfg.indexer_warmup_steps < 0 or (cfg.indexer_warmup_steps and not config.indexer_loss_coeff > 0):
        raise ValueError(f"`indexer_warmup_steps`={cfg.indexer_warmup_steps} must be >= 0, and > 0 only with "
                         f"model.indexer_loss_coeff > 0 (got {config.indexer_loss_coeff})")
    if cfg.checkpoint.every_n_steps < 0:
        raise ValueError(f"`checkpoint.every_n_steps` must be >= 0, got {cfg.checkpoint.every_n_steps}")
    if cfg.checkpoint.resume not in ("auto", "none") and not Path(cfg.checkpoint.resume).exists():
        raise ValueError(f"`checkpoint.resume`={cfg.checkpoint.resume!r}: no such checkpoint")
    checkpoint = cfg.model.checkpoint
    if checkpoint and not os.path.isdir(checkpoint):
        raise ValueError(f"`model.checkpoint`={checkpoint!r} is not a directory")
    lora = lora_config(cfg.peft)
    adapter = cfg.peft.get("adapter")
    if adapter and (lora is None or not os.path.isdir(adapter)):
        raise ValueError(f"`peft.adapter`={adapter!r} " + ("needs peft=lora" if lora is None else "is not a directory"))
    export = _export_spec(cfg, lora)
    data = OmegaConf.to_container(cfg.data, resolve=True)
    overlong = data.pop("overlong", "split")
    from dsv4.data.packer import OVERLONG

    _checkpoint_spec(cfg.checkpoint)  # validated before any other work
    preemption = _preemption_spec(cfg)
    if overlong not in OVERLONG:
        raise ValueError(f"`data.overlong`={overlong!r} must be one of {', '.join(OVERLONG)}")
    max_steps = int(trainer.get("max_steps", 100))
    data_cache_dir, data_num_proc = _data_preparation(data.pop("cache_dir", None), data.pop("num_proc", None))
    validation = _validation_spec(data, trainer, max_steps)
    skip_nonfinite = trainer.pop("skip_nonfinite_steps", 0)
    if not _is_int(skip_nonfinite) or skip_nonfinite < 0:
        raise ValueError(f"`trainer.skip_nonfinite_steps`={skip_nonfinite!r} must be a whole number of steps >= 0 "
                         "(0: the first non-finite loss or gradient norm stops the run)")
    monitor, objective = _check_monitor_and_objective(cfg, validation)
    from dsv4.data.defaults import resolve_data_source

    data = resolve_data_source(data, checkpoint or None, config.vocab_size)
    if validation.source is not None:  # the same tokenizer; its own chat template key, if data.val sets one
        validation = replace(
            validation, source=resolve_data_source(validation.source, checkpoint or None, config.vocab_size))
    optimizer, scheduler = build_optimization(cfg)
    callbacks = tuple(build_callbacks(cfg))
    plan = plan_options(cfg.get("plan"))
    logger = build_logger(cfg)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved["model"].update(config.to_dict())
    return RunSpec(
        model=config, optimizer=optimizer, scheduler=scheduler, model_checkpoint=checkpoint or None, lora=lora,
        lora_adapter=adapter or None,
        parallel=ParallelSpec(cp=cfg.cp, dp=cfg.dp, ep=cfg.ep, cp_balance=cfg.cp_balance, world_size=world),
        device_type=device_type, compute_dtype=compute_dtype, attention_backend=backend, dispatcher=dispatcher,
        seq_len=cfg.seq_len, micro_batch_size=cfg.micro_batch_size, global_batch_size=cfg.get("global_batch_size"),
        seed=cfg.seed,
        bias_update_rate=cfg.bias_update_rate, indexer_warmup_steps=cfg.indexer_warmup_steps,
        max_steps=max_steps, skip_nonfinite_steps=skip_nonfinite, offload=offload, dry_run=bool(cfg.dry_run),
        data=MappingProxyType(data), overlong=overlong, data_cache_dir=data_cache_dir, data_num_proc=data_num_proc,
        trainer=MappingProxyType(trainer),
        callbacks=callbacks, logger=logger, plan=plan, export=export,
        checkpoint=_checkpoint_spec(cfg.checkpoint, monitor), preemption=preemption,
        validation=validation, objective=objective,
        resolved=MappingProxyType(resolved),
    )


def _checkpoint_spec(ckpt: Any, monitor: str | None = None) -> CheckpointSpec:
    """The ``checkpoint`` group as a :class:`CheckpointSpec`; a count below 1 is refused, naming its key."""
    keep_last, keep_every = ckpt.get("keep_last", 3), ckpt.get("keep_every_n_steps")
    for key, value in (("keep_last", keep_last), ("keep_every_n_steps", keep_every)):
        if value is not None and int(value) < 1:
            raise ValueError(f"`checkpoint.{key}`={value} must be at least 1 (or null: "
                             f"{'keep every periodic checkpoint' if key == 'keep_last' else 'no milestones'})")
    return CheckpointSpec(every_n_steps=int(ckpt.every_n_steps), resume=ckpt.resume,
                          keep_last=None if keep_last is None else int(keep_last),
                          keep_every_n_steps=None if keep_every is None else int(keep_every),
                          async_save=bool(ckpt.get("async_save", True)), monitor=monitor)
