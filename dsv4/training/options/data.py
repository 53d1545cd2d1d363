"""The ``data`` group's packing and preparation keys: ``overlong`` (:data:`dsv4.data.packer.OVERLONG`) and the
prepared copy (``cache_dir``, ``num_proc``; :mod:`dsv4.data.prepared`). The document source is resolved by
:func:`dsv4.data.defaults.resolve_data_source`, held-out data by :mod:`dsv4.training.options.validation`."""

from __future__ import annotations

import os
from typing import Any


def overlong_mode(value: Any) -> str:
    """``data.overlong``: what the packer does with a document longer than ``seq_len``."""
    from dsv4.data.packer import OVERLONG

    if value not in OVERLONG:
        raise ValueError(f"`data.overlong`={value!r} must be one of {', '.join(OVERLONG)}")
    return value


def data_preparation(cache_dir: str | None, num_proc: int | None) -> tuple[str | None, int]:
    """``data.cache_dir`` (``~`` expanded; None: no prepared copy) and ``data.num_proc`` (None: min(8, CPUs))."""
    if num_proc is None:
        num_proc = min(8, os.cpu_count() or 1)
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"`data.num_proc` must be an integer >= 1 or null, got {num_proc!r}")
    return (os.path.expanduser(cache_dir) if cache_dir else None), num_proc
