"""Shared helpers of the benchmark scripts: JSON output and host-memory measurement."""

from __future__ import annotations

import json
import os
import resource


def emit(name: str, shape: dict, value, unit: str) -> None:
    """Print one measurement as a JSON object on its own line."""
    print(json.dumps({"name": name, "shape": shape, "value": value, "unit": unit}), flush=True)


def current_rss_kib() -> int:
    """Resident set size of this process now, in KiB (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") // 1024


def peak_rss_kib() -> int:
    """High-water resident set size of this process since it started, in KiB (``ru_maxrss`` on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
