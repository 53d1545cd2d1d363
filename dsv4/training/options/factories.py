"""The groups Hydra instantiates (``optim``, ``scheduler``, ``callbacks``, ``logger``): each built (or its target
imported) and checked once, at resolution, so a bad keyword fails before any rank starts."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

import torch
from omegaconf import DictConfig, OmegaConf

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
LoggerFactory = Callable[..., Any]  # (output_dir, resume_step=None) -> logger


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
