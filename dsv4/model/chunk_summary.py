"""What one CP chunk must know of the others: one int64 per chunk of each row, not the row's token metadata.

Under context parallelism a local row is one chunk of a whole row (:class:`~dsv4.parallel.cp.layout.CPLayout`). Positions are
document-local (they count from 0 at each document's first token, by one inside it), so a chunk whose first token
sits at position ``p > 0`` continues the document that began ``p`` columns before it, and knows from that alone which
halo rows, compressor boundary and earlier windows it needs and what they describe (that document's id, positions
from 0). What it cannot know alone is whether the previous chunk really ends with that document (document ids, not
positions, define documents), and the other chunks must learn where its continued document began. So every rank
publishes per local row (:func:`chunk_summaries`) one int64 of four 16-bit fields (positions in units of the shard
multiple ``m``, on which documents start):

* ``head``: ``p / m + 1`` when the chunk continues a document (its first token belongs to a document, ``p > 0``, and
  the run of that document in the chunk holds a real token), else 0; its top bit flags input the CP path cannot
  trust (positions not counting up by one inside a document, a document starting at a position other than 0 or off
  the multiple, a window off its ratio);
* ``tail``: ``(q + 1) / m`` for the last token's position ``q`` when it belongs to a document (else 0); its top bit
  flags a caller's padding inside a document;
* the first and the last token's document ids (mod 2^16: neighbouring documents differ).

One all-gather gives every rank every chunk's integer (``8 (V - k)`` bytes per row), and :func:`row_runs` resolves
them on the host, identically on every rank, so a bad input raises on every rank before any layer's exchange. Only
when a caller's padding lies inside a document does the halo's own token metadata travel (``metadata_halo``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

FIELD = 1 << 16  # four 16-bit fields packed in one int64
FLAG = 1 << 15  # the top bit of each field
LIMIT = FLAG - 1  # positions / shard multiple must stay below this (4M tokens at a multiple of 128)


def misaligned_windows(seq_ids: Tensor, positions: Tensor, ratios: list[int]) -> Tensor:
    """``[R]`` bool: a valid window (all its tokens one document) of an active ratio starts at a position that is
    not a multiple of that ratio (its compressed row would mix a document's start with what precedes it)."""
    rows, length = seq_ids.shape
    bad = torch.zeros(rows, dtype=torch.bool, device=seq_ids.device)
    for ratio in ratios:
        n = length // ratio
        ids = seq_ids[:, :n * ratio].reshape(rows, n, ratio)
        valid = (ids[..., 0] > 0) & (ids == ids[..., :1]).all(-1)
        bad |= (valid & (positions[:, :n * ratio:ratio] % ratio != 0)).any(dim=1)
    return bad


def chunk_summaries(seq_ids: Tensor, positions: Tensor, padding: Tensor, ratios: list[int], multiple: int) -> Tensor:
    """``[R]`` int64 for local rows ``[R, L]``: the fields ``head``, ``tail``, ``first id``, ``last id`` (16 bits
    each, in that order from the low bits; see the module docstring; positions in units of the shard ``multiple``,
    on which documents start)."""
    doc = seq_ids > 0
    same = seq_ids[:, 1:] == seq_ids[:, :-1]
    bad = ((positions[:, 1:] - positions[:, :-1] != 1) & same & doc[:, 1:]).any(dim=1)
    bad |= (doc[:, 1:] & ~same & (positions[:, 1:] != 0)).any(dim=1)  # a document starting inside the chunk
    bad |= misaligned_windows(seq_ids, positions, ratios)
    first_run = torch.cat([torch.ones_like(same[:, :1]), same], dim=1).long().cumprod(dim=1).bool()
    p = positions[:, 0]
    continues = doc[:, 0] & (p > 0) & (first_run & ~padding).any(dim=1)
    bad |= continues & ((p % multiple != 0) | (p // multiple >= LIMIT))
    head = torch.where(continues & ~bad, p // multiple + 1, torch.zeros_like(p)) + bad.long() * FLAG
    end = positions[:, -1] + 1  # a successor continuing the last token's document starts at this position
    fits = doc[:, -1] & (end % multiple == 0) & (end // multiple < LIMIT)
    tail = torch.where(fits, end // multiple, torch.zeros_like(end)) + (doc & padding).any(dim=1).long() * FLAG
    ids = (seq_ids[:, 0] % FIELD) + FIELD * (seq_ids[:, -1] % FIELD)  # neighbouring documents differ mod 2^16
    return head + FIELD * tail + FIELD**2 * ids


@dataclass
class RowRuns:
    """The resolved summaries of every chunk ``v`` (of ``length`` columns) of every whole row ``b``: ``start[b][v]``,
    the column where the document continued by the chunk's first token began, or None when the chunk starts fresh
    (a document, padding); ``caller_padding``: some chunk holds padding inside a document."""

    start: list[list[int | None]]
    caller_padding: bool
    length: int

    def continues(self, b: int, v: int) -> bool:
        return self.start[b][v] is not None

    def need(self, b: int, v: int, ratio: int) -> int:
        """The first global window (of ``ratio``) chunk ``v`` of row ``b`` needs: the earlier windows of the
        document it continues, none when it starts fresh."""
        start = self.start[b][v]
        return (v * self.length if start is None else start) // ratio


def row_runs(summaries: list[list[int]], length: int, ratios: list[int], multiple: int) -> RowRuns:
    """Resolve gathered summaries ``[B][V]`` (non-negative int64) of chunks of ``length`` columns (see :class:`RowRuns`); ``ValueError``,
    identical on every rank, for input the CP path cannot trust."""
    starts, caller_padding = [], False
    for b, row in enumerate(summaries):
        starts.append([])
        fields = [[(code >> shift) & (FIELD - 1) for shift in (0, 16, 32, 48)] for code in row]
        for v, (head, tail, first_id, _) in enumerate(fields):
            if head & FLAG:
                raise ValueError(
                    "build_attention_metadata: under context parallelism positions must count from 0 at each "
                    "document's first token and up by one inside it, every document must start on a multiple of "
                    f"{multiple} (shorter than {LIMIT * multiple} tokens) and every compressor window at a multiple of "
                    f"its ratio (ratios {ratios}; pack with dsv4.data.pack_documents or "
                    f"dsv4.packing.aligned_packed_layout); row {b}, chunk {v} breaks this")
            caller_padding |= bool(tail & FLAG)
            if head == 0:
                starts[b].append(None)
                continue
            p = (head - 1) * multiple
            before = (fields[v - 1][1] & LIMIT) * multiple if v else 0
            last_id = fields[v - 1][3] if v else 0
            # the predecessor must end with the same document, at position p - 1
            if v == 0 or p > v * length or before != p or last_id != first_id:
                raise ValueError(
                    f"build_attention_metadata: row {b}, chunk {v} starts at document position {p} but the document "
                    f"does not continue there from the previous chunk (it ends with document {last_id} at position "
                    f"{before - 1}); positions must count from 0 at each document's first token")
            starts[b].append(v * length - p)
    return RowRuns(starts, caller_padding, length)


def misaligned_error(ratios: list[int], multiple: int) -> ValueError:
    """The error of a compressor window that starts off its ratio (single-rank path)."""
    return ValueError(
        "build_attention_metadata: a compressor window starts at a document-local position that is not a "
        f"multiple of its ratio (ratios {ratios}); every document must start on a multiple of {multiple} with "
        "positions counted from 0 (pack with dsv4.data.pack_documents or dsv4.packing.aligned_packed_layout), "
        "otherwise compressed keys would leak future tokens"
    )
