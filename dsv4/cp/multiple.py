"""The CP shard multiple of a DSV4 config and the rounding helpers.

``dsv4_cp_local_seq_multiple`` = lcm over the non-zero ``compress_ratios``, with ratio 4 counted as 8 because
ratio-4 (CSA) layers pool over the previous window too. Documents are repadded to this multiple and every CP
shard is a multiple of it, so no compressor window straddles a document or a rank boundary.
DSV4-Flash (ratios 4 and 128): 128.
"""

from __future__ import annotations

import math
from typing import Any


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
    """LCM shard multiple of a model (anything with ``.config``) or a config with ``compress_ratios``; 1 if none."""
    config = getattr(model_or_config, "config", model_or_config)
    ratios = getattr(config, "compress_ratios", None) or []
    multiple = 1
    for ratio in ratios:
        r = int(ratio)
        if r > 0:
            multiple = _lcm(multiple, 2 * r if r == 4 else r)
    return max(multiple, 1)
