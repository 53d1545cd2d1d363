"""The ``plan`` key: whether and how the per-rank memory plan (:mod:`dsv4.plan`) judges the run before it starts
(:mod:`dsv4.training.planning`)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from omegaconf import DictConfig, OmegaConf


RANK_BY = ("cost", "step_time")  # plan.rank_by: how plan.suggest orders what fits
# plan.checkpoint_form: the stored form the plan assumes for the model's weights (auto: model.checkpoint's own)
CHECKPOINT_FORMS = ("auto", "release")


@dataclass(frozen=True)
class PlanOptions:
    """``enabled``: plan at all; ``only``: plan and stop; ``enforce``: refuse to launch what does not fit;
    ``device_memory_gib``: the memory judged against (None: see :mod:`dsv4.training.planning`); ``reserve_gib``: kept
    free of it for what the plan does not trace (the CUDA context, NCCL's buffers, allocator fragmentation: the plan
    fits when its total is at most the device memory less this; :data:`dsv4.plan.plan.DEFAULT_RESERVE_GIB`);
    ``suggest``: when the plan does not fit, print at most this many changes of the existing options that the plan
    fits (0: none); ``rank_by``: ``cost`` (the cheapest changes first) or ``step_time`` (the fastest estimated step
    first, :mod:`dsv4.plan.comm`). The speeds the communication table times the step at
    (:class:`dsv4.plan.comm.LinkSpeeds`, the same defaults): ``nvlink_gb_s``, ``infiniband_gb_s``, ``pcie_gb_s``
    (GB/s per GPU and direction), ``gpus_per_node`` and ``tflops`` (the compute rate a GPU reaches).
    ``checkpoint_form``: ``auto`` plans the weights in the form the run will hold them (``model.checkpoint``'s stored
    form, read from its headers; built weights without one); ``release`` plans a run from the model's released
    checkpoint without reading one (its FP8 / FP4 weights and FP8 Engram tables as stored): plan-only, without
    ``model.checkpoint`` (:func:`check_checkpoint_form`)."""

    enabled: bool = True
    only: bool = False
    enforce: bool = True
    device_memory_gib: float | None = None
    reserve_gib: float = 4.0
    suggest: int = 3
    rank_by: str = "cost"
    nvlink_gb_s: float = 450.0
    infiniband_gb_s: float = 50.0
    pcie_gb_s: float = 64.0
    gpus_per_node: int = 8
    tflops: float = 400.0
    checkpoint_form: str = "auto"


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
    reserve = values.get("reserve_gib", 4.0)
    if isinstance(reserve, bool) or not isinstance(reserve, (int, float)) or reserve < 0:
        raise ValueError(f"`plan.reserve_gib` must be a number of GiB >= 0, got {reserve!r}")
    for name in ("nvlink_gb_s", "infiniband_gb_s", "pcie_gb_s", "tflops"):
        value = values.get(name, 1.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"`plan.{name}` must be a positive number, got {value!r}")
    nodes = values.get("gpus_per_node", 8)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"`plan.gpus_per_node` must be a positive integer, got {nodes!r}")
    if values.get("rank_by", "cost") not in RANK_BY:
        raise ValueError(f"`plan.rank_by` must be one of {', '.join(RANK_BY)}, got {values['rank_by']!r}")
    if values.get("checkpoint_form", "auto") not in CHECKPOINT_FORMS:
        raise ValueError(f"`plan.checkpoint_form` must be one of {', '.join(CHECKPOINT_FORMS)}, got "
                         f"{values['checkpoint_form']!r}")
    return PlanOptions(**values)


def check_checkpoint_form(options: PlanOptions, checkpoint: str | None) -> None:
    """``plan.checkpoint_form=release`` describes a run that loads the release, which this run is not: it is refused
    with ``model.checkpoint`` (the plan reads that checkpoint's own form) and without ``plan.only=true`` (a run that
    starts builds its weights, in another form than the plan's)."""
    if options.checkpoint_form != "release":
        return
    if checkpoint:
        raise ValueError(f"`plan.checkpoint_form`=release with `model.checkpoint`={checkpoint!r}: the plan reads that "
                         "checkpoint's stored form; drop plan.checkpoint_form (auto)")
    if not (options.enabled and options.only):
        raise ValueError("`plan.checkpoint_form`=release plans a run from the released checkpoint without one; it "
                         "needs plan.only=true (a run that starts without model.checkpoint builds its weights)")
