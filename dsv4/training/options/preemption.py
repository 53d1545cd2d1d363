"""The ``preemption`` group: the signals that stop a run after the current optimizer step with a complete
checkpoint (:mod:`dsv4.callbacks.preemption`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsv4.training.options import is_int


@dataclass(frozen=True)
class PreemptionSpec:
    """``signals``: the signal names that stop the run after the current optimizer step with a complete checkpoint
    (empty: none); ``exit_code``: the process status after such a stop (:mod:`dsv4.callbacks.preemption`)."""

    signals: tuple[str, ...] = ("SIGTERM", "SIGUSR1", "SIGUSR2")
    exit_code: int = 143


def preemption_spec(cfg: Any) -> PreemptionSpec:
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
    if not is_int(code) or not 0 <= int(code) <= 255:
        raise ValueError(f"`preemption.exit_code`={code!r} must be an integer in 0..255")
    return PreemptionSpec(signals=signals, exit_code=int(code))
