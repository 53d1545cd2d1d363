"""Seed rounding helpers and ``dsv4_cp_local_seq_multiple`` (a wrapper of :func:`dsv4.config.shard_multiple`)."""

from __future__ import annotations

import math
from typing import Any

from dsv4.config import shard_multiple


def _lcm(a: int, b: int) -> int:
    """Least common multiple; when either is 0 return ``max(a, b)`` (seed rule: lcm(0, 5) = 5, lcm(-4, 6) = 12)."""
    if a and b:
        return abs(a * b) // math.gcd(a, b)
    return max(a, b)


def _pad_length(n: int, multiple: int) -> int:
    """Round ``n`` up to a multiple of ``max(int(multiple), 1)``."""
    m = max(int(multiple), 1)
    return n + (-n) % m


def dsv4_cp_local_seq_multiple(model_or_config: Any) -> int:
    """Shard multiple of a model (anything with ``.config``) or a config with ``compress_ratios``; 1 if none."""
    config = getattr(model_or_config, "config", model_or_config)
    return shard_multiple(getattr(config, "compress_ratios", None) or [])
