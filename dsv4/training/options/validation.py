"""Held-out data and its schedule (``data.val`` / ``data.val_fraction``, ``trainer.val_check_interval`` /
``trainer.limit_val_batches``), and the run's ``objective`` (``val/loss`` needs held-out data)."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

from dsv4.training.options import is_int

OBJECTIVES = ("train/loss", "val/loss")

# the keys of the data group that name a document source (data.val may override them; the tokenizer is the
# training one, so the two losses count the same tokens)
VAL_SOURCE_KEYS = ("kind", "path", "split", "text_key", "messages_key", "chat_template_file", "max_documents",
                   "max_bytes", "min_bytes", "seed", "options")


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


def validation_spec(data: dict[str, Any], trainer: dict[str, Any], max_steps: int) -> ValidationSpec:
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
        unknown = sorted(set(val) - set(VAL_SOURCE_KEYS))
        if unknown:
            raise KeyError(f"`data.val.{unknown[0]}` cannot be set: data.val overrides the training source's keys "
                           f"{list(VAL_SOURCE_KEYS)} (the tokenizer and data.overlong are the training ones)")
        source = {**data, **val}
    enabled = source is not None or fraction is not None
    if every is not None:
        if not is_int(every) or every < 1:
            raise ValueError(f"`trainer.val_check_interval`={every!r} must be a whole number of optimizer steps >= 1")
        if not enabled:
            raise ValueError(f"`trainer.val_check_interval`={every} needs held-out data: set data.val_fraction or "
                             "data.val")
    if limit is not None:
        fractional = isinstance(limit, float) and 0.0 < limit <= 1.0
        if not fractional and not (is_int(limit) and limit >= 1):
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


def objective_of(value: Any, validation: ValidationSpec) -> str:
    """``objective``: the metric a sweep job reports, one of :data:`OBJECTIVES`."""
    if value not in OBJECTIVES:
        raise ValueError(f"`objective`={value!r} must be one of {list(OBJECTIVES)}")
    if value == "val/loss" and not validation.enabled:
        raise ValueError("`objective`=val/loss needs held-out data: set data.val_fraction or data.val")
    return value
