"""`CPLayout`: which columns of a row each context-parallel rank holds, and how they are laid out locally.

A row of ``S`` columns is cut into ``V = k * C`` equal *chunks* of ``l = S / V`` columns (chunk ``v`` holds
columns ``[v l, (v + 1) l)``); each of the ``C`` ranks holds ``k`` of them:

* ``balance="none"`` (``k = 1``): rank ``r`` holds chunk ``r``, the contiguous split.
* ``balance="full"`` (``k = 2``, head-tail): rank ``r`` holds chunks ``r`` and ``2C - 1 - r``. Work that grows with
  the position (indexer scoring, compressed attention) then sums to the same amount on every rank for one causal
  document: the positions of chunk ``r`` and chunk ``2C - 1 - r`` add up to a constant.

Locally the model sees the rank's chunks as separate rows, slot-major: a whole batch of ``B`` rows becomes
``[k B, l]``, local row ``slot * B + b`` holding chunk ``chunks[slot]`` of row ``b``. Every local row is a
contiguous piece of one global row, so the model's per-row arithmetic (window band, compressor windows, causal
rule) is unchanged; the CP exchanges (:mod:`dsv4.parallel.cp.collectives`) route rows between chunks, and chunk ``v``'s
predecessor ``v - 1`` may live on another rank or in another local row of the same rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BALANCE_MODES = ("none", "full")


def check_balance(balance: str) -> str:
    """``balance`` if it is a known mode; ``ValueError`` naming ``cp_balance`` otherwise."""
    if balance not in BALANCE_MODES:
        raise ValueError(f"cp_balance={balance!r} is not one of {list(BALANCE_MODES)}")
    return balance


def cp_chunks(cp: int, balance: str) -> int:
    """How many equal chunks a row is cut into for ``cp`` ranks under ``balance`` (``cp`` or ``2 cp``)."""
    return CPLayout(max(cp, 1), balance).num_chunks


@dataclass(frozen=True)
class CPLayout:
    """The chunk layout of a CP group of ``size`` ranks (see the module docstring)."""

    size: int = 1
    balance: str = "none"

    def __post_init__(self) -> None:
        check_balance(self.balance)
        if self.size < 1:
            raise ValueError(f"CPLayout: size must be >= 1, got {self.size}")

    @property
    def chunks_per_rank(self) -> int:
        return 2 if self.balance == "full" and self.size > 1 else 1

    @property
    def num_chunks(self) -> int:
        return self.chunks_per_rank * self.size

    def chunks(self, rank: int) -> list[int]:
        """The chunks rank ``rank`` holds, in local slot order (ascending)."""
        if not 0 <= rank < self.size:
            raise ValueError(f"CPLayout: rank {rank} is outside [0, {self.size})")
        if self.chunks_per_rank == 1:
            return [rank]
        return [rank, 2 * self.size - 1 - rank]

    def owner(self, chunk: int) -> tuple[int, int]:
        """``(rank, slot)`` holding ``chunk``."""
        if self.chunks_per_rank == 1:
            return chunk, 0
        return (chunk, 0) if chunk < self.size else (2 * self.size - 1 - chunk, 1)

    def chunk_length(self, width: int) -> int:
        """Columns per chunk of a row of ``width`` columns (``width`` must divide evenly)."""
        if width % self.num_chunks:
            raise ValueError(f"CPLayout: a row of {width} columns does not split into {self.num_chunks} chunks "
                             f"(cp={self.size}, cp_balance={self.balance!r})")
        return width // self.num_chunks

    def local_rows(self, rank: int, batch: int) -> list[tuple[int, int]]:
        """``(b, chunk)`` of every local row of ``rank`` for a batch of ``batch`` whole rows (slot-major)."""
        return [(b, chunk) for chunk in self.chunks(rank) for b in range(batch)]

    def cut(self, rows: torch.Tensor, rank: int) -> torch.Tensor:
        """Whole rows ``[B, S, ...]`` -> this rank's local rows ``[k B, l, ...]`` (slot-major)."""
        length = self.chunk_length(rows.shape[1])
        return torch.cat([rows[:, v * length:(v + 1) * length] for v in self.chunks(rank)], dim=0).contiguous()

    def assemble(self, gathered: torch.Tensor) -> torch.Tensor:
        """Every rank's local rows stacked in rank order ``[C, k B, l, ...]`` -> whole rows ``[B, S, ...]``."""
        k, length = self.chunks_per_rank, gathered.shape[2]
        batch = gathered.shape[1] // k
        pieces = [None] * self.num_chunks
        for rank in range(self.size):
            for slot, chunk in enumerate(self.chunks(rank)):
                pieces[chunk] = gathered[rank, slot * batch:(slot + 1) * batch]
        return torch.cat(pieces, dim=1) if length else gathered.new_empty((batch, 0) + tuple(gathered.shape[3:]))
