"""Byte counters for context-parallel exchanges.

Every collective in :mod:`dsv4.parallel.cp.collectives` can be handed a :class:`TrafficCounter` and a *kind*
(``"halo"``, ``"compressed_gather"``, ``"index_key_gather"``, ``"metadata"``, ...). It records how many bytes this
rank sent and received for that kind and how many calls were made, so that benchmarks can compare the traffic of
a design with its analytic lower bound without instrumenting the transport.

Counts are per process (this rank) and accumulate until :meth:`TrafficCounter.reset`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field


@dataclass
class TrafficRecord:
    """Accumulated traffic of one exchange kind on this rank."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    wait_s: float = 0.0  # time this rank was blocked waiting for the kind's messages (forward)


@dataclass
class TrafficCounter:
    """Per-kind byte counts of this rank's context-parallel exchanges (forward and backward)."""

    records: dict[str, TrafficRecord] = field(default_factory=lambda: defaultdict(TrafficRecord))

    def add(self, kind: str, *, sent: int, received: int) -> None:
        """Record one call of ``kind`` that sent ``sent`` and received ``received`` bytes."""
        rec = self.records[kind]
        rec.calls += 1
        rec.bytes_sent += int(sent)
        rec.bytes_received += int(received)

    def add_wait(self, kind: str, seconds: float) -> None:
        """Record ``seconds`` this rank spent blocked waiting for a ``kind`` exchange to arrive."""
        self.records[kind].wait_s += float(seconds)

    def wait_seconds(self, kind: str | None = None) -> float:
        """Seconds blocked waiting for ``kind`` (all kinds when None)."""
        if kind is not None:
            return self.records[kind].wait_s if kind in self.records else 0.0
        return sum(r.wait_s for r in self.records.values())

    def bytes_received(self, kind: str | None = None) -> int:
        """Bytes received for ``kind`` (all kinds when None)."""
        if kind is not None:
            return self.records[kind].bytes_received if kind in self.records else 0
        return sum(r.bytes_received for r in self.records.values())

    def bytes_sent(self, kind: str | None = None) -> int:
        """Bytes sent for ``kind`` (all kinds when None)."""
        if kind is not None:
            return self.records[kind].bytes_sent if kind in self.records else 0
        return sum(r.bytes_sent for r in self.records.values())

    def as_dict(self) -> dict[str, dict[str, int]]:
        """``{kind: {"calls", "bytes_sent", "bytes_received"}}``, for JSON output."""
        return {
            k: {"calls": r.calls, "bytes_sent": r.bytes_sent, "bytes_received": r.bytes_received}
            for k, r in sorted(self.records.items())
        }

    def reset(self) -> None:
        self.records.clear()
