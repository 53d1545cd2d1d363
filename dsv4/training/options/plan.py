"""The ``plan`` key: whether and how the per-rank memory plan (:mod:`dsv4.plan`) judges the run before it starts
(:mod:`dsv4.training.planning`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from omegaconf import DictConfig, OmegaConf


@dataclass(frozen=True)
class PlanOptions:
    """``enabled``: plan at all; ``only``: plan and stop; ``enforce``: refuse to launch what does not fit;
    ``device_memory_gib``: the memory judged against (None: see :mod:`dsv4.training.planning`); ``suggest``: when
    the plan does not fit, print at most this many changes of the existing options that the plan fits (0: none)."""

    enabled: bool = True
    only: bool = False
    enforce: bool = True
    device_memory_gib: float | None = None
    suggest: int = 3


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
    suggest = values.get("suggest", 3)
    if isinstance(suggest, bool) or not isinstance(suggest, int) or suggest < 0:
        raise ValueError(f"`plan.suggest` must be an integer >= 0 (0: no suggestions), got {suggest!r}")
    gib = values.get("device_memory_gib")
    if gib is not None and (isinstance(gib, bool) or not isinstance(gib, (int, float)) or gib <= 0):
        raise ValueError(f"`plan.device_memory_gib` must be a positive number of GiB, got {gib!r}")
    return PlanOptions(**values)
