"""The groups of the composed config, each resolved into its frozen part of
:class:`~dsv4.training.spec.RunSpec` with its checks: one group per module (``trainer``, ``checkpoint``,
``preemption``, ``data``, ``validation``, ``export``, ``plan``, and ``factories`` for the groups Hydra
instantiates). :func:`~dsv4.training.spec.build_run_spec` calls them; every check raises ``ValueError`` /
``KeyError`` naming the key and the value."""

from __future__ import annotations

from typing import Any


def is_int(value: Any) -> bool:
    """An integer that is not a bool (YAML ``true`` is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)
