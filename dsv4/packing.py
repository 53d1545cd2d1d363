"""Aligned packed rows: the one implementation of moving documents onto shard-multiple boundaries.

Every path that packs documents goes through here: the data packer (``dsv4.data.packer``), the seed CP repad
(``dsv4.cp.seed.repad``), the V4.1 API :func:`aligned_packed_layout` and DSpark capture.

A caller row of width ``S`` holds documents back to back: document ``d`` occupies caller columns
``[start_d, start_d + span_d)`` (``start_d`` = sum of the earlier spans), of which the first ``length_d`` are its
tokens and the rest the caller's own padding. The aligned row of width ``S_al`` puts document ``d`` at
``aligned_start_d`` (a multiple of ``multiple``) and gives it ``ceil(length_d / multiple) * multiple`` slots; the
caller's padding is dropped. :class:`PackedSequenceLayout` holds the map both ways.

Shapes and invariants of a layout (``B`` rows, caller width ``S``, aligned width ``S_al``; ``int64`` on the
lengths' device):

* ``source_indices [B, S_al]``: caller column each aligned slot reads from; ``-1`` = padding.
* ``input_positions [B, S]``: aligned slot of each caller column; ``-1`` = caller padding, discarded.
  ``source_indices[b, input_positions[b, k]] == k`` wherever ``input_positions[b, k] >= 0``.
* ``position_ids [B, S_al]``: document-local positions ``0..len-1``; padding slots hold 0.
* ``sequence_ids [B, S_al]``: document id = 1-based column of the document in ``seq_lens``; 0 = padding (a slot
  holding no real token). This is the one padding convention of the training batch (``dsv4.batch``).
* ``span_documents [B, S_al]``: column of the document whose aligned span holds the slot (its tokens and its
  alignment padding), ``-1`` for the row's trailing pack padding; ``span_positions [B, S_al]``: the slot's offset
  inside that span (0 outside). The seed API's repad reports pad slots in these terms.

The construction is vectorised (cumsum + batched searchsorted + gather) and never syncs with the host itself:
the front ends validate and choose ``S_al`` with one host read each.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from dsv4.distributed import all_reduce_max, is_initialized


SEQ_LENS_PAD = -1000
"""Right-pads the document axis of ``seq_lens`` tables; such entries are absent documents."""


def take_tokens(values: torch.Tensor, index: torch.Tensor, fill: Any = 0) -> torch.Tensor:
    """``out[b, j, ...] = values[b, index[b, j], ...]``, or ``fill`` where ``index[b, j] < 0`` (differentiable).

    ``values [B, N, ...]``, ``index [B, M]`` long; ``fill`` a scalar or a tensor broadcastable to the trailing dims.
    """
    index = index.to(values.device)
    if values.shape[1] == 0:  # nothing to read: every slot is fill
        out = values.new_zeros((index.shape[0], index.shape[1]) + tuple(values.shape[2:]))
    else:
        trailing = values.shape[2:]
        idx = index.clamp_min(0)
        idx = idx.reshape(idx.shape + (1,) * len(trailing)).expand(idx.shape + trailing)
        out = torch.gather(values, 1, idx)
    missing = (index < 0).reshape(index.shape + (1,) * (values.dim() - 2))
    return torch.where(missing, torch.as_tensor(fill, dtype=values.dtype, device=values.device), out)


@dataclass(frozen=True, eq=False)
class PackedSequenceLayout:
    """Map between caller rows ``[B, S]`` and aligned packed rows ``[B, S_al]`` (see the module docstring)."""

    source_indices: torch.Tensor
    input_positions: torch.Tensor
    position_ids: torch.Tensor
    sequence_ids: torch.Tensor
    span_documents: torch.Tensor | None = None
    span_positions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        fields = {"source_indices": self.source_indices, "input_positions": self.input_positions,
                  "position_ids": self.position_ids, "sequence_ids": self.sequence_ids}
        for name, t in fields.items():
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                raise ValueError(f"PackedSequenceLayout.{name} must be a 2-D tensor, got {type(t).__name__} "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else ''}")
        aligned = tuple(self.source_indices.shape)
        for name, t in (("position_ids", self.position_ids), ("sequence_ids", self.sequence_ids),
                        ("span_documents", self.span_documents), ("span_positions", self.span_positions)):
            if t is not None and tuple(t.shape) != aligned:
                raise ValueError(f"PackedSequenceLayout.{name} has shape {tuple(t.shape)}, expected "
                                 f"{aligned} (the shape of source_indices)")
        if self.input_positions.shape[0] != aligned[0]:
            raise ValueError(f"PackedSequenceLayout.input_positions has batch size {self.input_positions.shape[0]}, "
                             f"expected {aligned[0]} (the batch size of source_indices)")

    @property
    def batch_size(self) -> int:
        """``B``."""
        return int(self.source_indices.shape[0])

    @property
    def input_length(self) -> int:
        """Caller width ``S``."""
        return int(self.input_positions.shape[1])

    @property
    def aligned_length(self) -> int:
        """Aligned width ``S_al``."""
        return int(self.source_indices.shape[1])

    @property
    def padding_mask(self) -> torch.Tensor:
        """``[B, S_al]`` bool, True where the slot holds no real token (``sequence_ids == 0``)."""
        return self.sequence_ids == 0

    def pack(self, values: torch.Tensor, fill: Any = 0) -> torch.Tensor:
        """Caller layout ``[B, S, ...]`` -> aligned layout ``[B, S_al, ...]``; padding slots get ``fill``."""
        _check_rows("pack", values, (self.batch_size, self.input_length), "S")
        return take_tokens(values, self.source_indices, fill)

    def restore(self, values: torch.Tensor, fill: Any = 0) -> torch.Tensor:
        """Aligned layout ``[B, S_al, ...]`` -> caller layout ``[B, S, ...]``; caller padding columns get ``fill``."""
        _check_rows("restore", values, (self.batch_size, self.aligned_length), "S_al")
        return take_tokens(values, self.input_positions, fill)


def _check_rows(verb: str, values: Any, expected: tuple[int, int], width: str) -> None:
    if not isinstance(values, torch.Tensor) or values.dim() < 2 or tuple(values.shape[:2]) != expected:
        got = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
        raise ValueError(f"PackedSequenceLayout.{verb}: values must have shape [B, {width}, ...] = "
                         f"[{expected[0]}, {expected[1]}, ...], got {got}")


# ---------------------------------------------------------------------------------------------- the core
@dataclass(frozen=True)
class DocumentTable:
    """Per-document placement of ``[B, D]`` documents, all int64 on one device (no host sync to build).

    ``lengths`` real tokens (0 = absent), ``starts`` / ``ends`` caller columns of each span, ``aligned`` slots in
    the aligned row (``ceil(length / multiple) * multiple``), ``aligned_starts`` / ``aligned_ends`` there.
    ``row_ends [B]``: aligned columns used by each row (the minimum aligned width).
    """

    lengths: torch.Tensor
    starts: torch.Tensor
    ends: torch.Tensor
    aligned_starts: torch.Tensor
    aligned_ends: torch.Tensor
    multiple: int

    @property
    def row_ends(self) -> torch.Tensor:
        if self.aligned_ends.shape[1] == 0:
            return self.aligned_ends.new_zeros(self.aligned_ends.shape[0])
        return self.aligned_ends[:, -1]


def document_table(lengths: torch.Tensor, spans: torch.Tensor, multiple: int) -> DocumentTable:
    """Place documents of ``lengths [B, D]`` (>= 0) whose caller spans are ``spans [B, D]`` (>= lengths)."""
    lengths, spans = lengths.long(), spans.to(device=lengths.device, dtype=torch.long)
    ends = spans.cumsum(1)
    aligned = (lengths + (multiple - 1)) // multiple * multiple
    aligned_ends = aligned.cumsum(1)
    return DocumentTable(lengths, ends - spans, ends, aligned_ends - aligned, aligned_ends, int(multiple))


def build_layout(docs: DocumentTable, input_width: int, aligned_width: int) -> PackedSequenceLayout:
    """The layout of ``docs`` from caller rows of ``input_width`` columns into ``aligned_width`` slots.

    The caller validated that every span fits ``input_width`` and every aligned span fits ``aligned_width``.
    """
    batch, num_docs = docs.lengths.shape
    device = docs.lengths.device
    # one sentinel absent document at the end keeps every lookup in range (also for D == 0)
    zero = docs.lengths.new_zeros((batch, 1))
    lengths = torch.cat([docs.lengths, zero], 1)
    starts = torch.cat([docs.starts, docs.ends[:, -1:] if num_docs else zero], 1)
    aligned_starts = torch.cat([docs.aligned_starts, docs.aligned_ends[:, -1:] if num_docs else zero], 1)
    aligned_ends = docs.aligned_ends.contiguous() if num_docs else zero

    # aligned side: slot j of row b lies in the first document whose aligned end exceeds j
    cols = torch.arange(aligned_width, device=device).expand(batch, aligned_width).contiguous()
    doc = torch.searchsorted(aligned_ends, cols, right=True).clamp_max(num_docs)
    offset = cols - aligned_starts.gather(1, doc)
    real = offset < lengths.gather(1, doc)
    in_span = doc < num_docs
    # caller side: column k of row b lies in the first document whose span end exceeds k
    kcols = torch.arange(input_width, device=device).expand(batch, input_width).contiguous()
    kdoc = torch.searchsorted(docs.ends.contiguous() if num_docs else zero, kcols, right=True).clamp_max(num_docs)
    koff = kcols - starts.gather(1, kdoc)
    kreal = koff < lengths.gather(1, kdoc)
    return PackedSequenceLayout(
        source_indices=torch.where(real, starts.gather(1, doc) + offset, -1),
        input_positions=torch.where(kreal, aligned_starts.gather(1, kdoc) + koff, -1),
        position_ids=torch.where(real, offset, 0),
        sequence_ids=torch.where(real, doc + 1, 0),
        span_documents=torch.where(in_span, doc, -1),
        span_positions=torch.where(in_span, offset, 0),
    )


# ---------------------------------------------------------------------------------------------- V4.1 front end
def _as_int(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got bool {value!r}")
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        return int(value.item())
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def _check_int_tensor(t: Any, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be an int32/int64 tensor, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must have dtype int32 or int64, got {t.dtype}")
    return t


def _first_index(mask: torch.Tensor) -> tuple[int, int]:
    """(row, column) of the first True of a 2-D mask (error path only)."""
    b, d = mask.nonzero()[0].tolist()
    return int(b), int(d)


def aligned_packed_layout(
    seq_lens: torch.Tensor,
    input_shape: Sequence[int] | torch.Size,
    alignment: int,
    sync_across_ranks: bool = False,
    *,
    seq_lens_padded: torch.Tensor | None = None,
    minimum_length: int = 0,
    group: Any = None,
) -> PackedSequenceLayout:
    """Build the aligned packed layout of caller rows ``input_shape = (B, S, ...)`` (V4.1 semantics).

    Args:
        seq_lens: ``[B, D]`` (or ``[D]`` for ``B == 1``) int32/int64 real document lengths in column order;
            entries 0 or ``SEQ_LENS_PAD`` (-1000) are absent documents (their id is skipped).
        input_shape: the caller batch shape; only ``B`` and ``S`` (the first two entries) are used.
        alignment: every document starts at a multiple of it and ``S_al`` is a multiple of it (``>= 1``).
        sync_across_ranks: when True and ``torch.distributed`` is initialised, ``S_al`` is MAX-all-reduced over
            ``group`` (WORLD when None) so every rank gets the same width (HybridEP needs equal token counts).
            A collective: every rank of ``group`` must call it, with the same ``alignment``.
        seq_lens_padded: optional caller spans, same shape as ``seq_lens``, including padding the caller
            already put after each document (dropped by the layout); None = documents are concatenated.
        minimum_length: lower bound for ``S_al`` before rounding up to ``alignment``.
        group: process group for ``sync_across_ranks``.

    Returns:
        :class:`PackedSequenceLayout` with ``S_al = round_up(max(minimum_length, 1, max row length), alignment)``
        where a row's length is the sum of its present documents' lengths, each rounded up to ``alignment``.

    Raises:
        ValueError: naming the argument, the row / document column and the numbers, for: ``alignment < 1``,
            a non-integer dtype, a bad rank or shape, an absent document with a caller span, a negative length,
            ``span < length``, or documents that run past the caller width ``S``. Everything is validated
            before anything is built (and before the all-reduce), with one host read.
    """
    alignment = _as_int(alignment, "alignment")
    if alignment < 1:
        raise ValueError(f"alignment must be >= 1, got {alignment}")
    minimum_length = _as_int(minimum_length, "minimum_length")
    if minimum_length < 0:
        raise ValueError(f"minimum_length must be >= 0, got {minimum_length}")
    try:
        dims = [int(operator.index(x)) for x in tuple(input_shape)]
    except TypeError:
        raise ValueError(f"input_shape must be a sequence of ints (B, S, ...), got {input_shape!r}") from None
    if len(dims) < 2 or dims[0] < 0 or dims[1] < 0:
        raise ValueError(f"input_shape must be (B, S, ...) with B, S >= 0, got {tuple(dims)}")
    batch, width = dims[0], dims[1]

    lengths = _check_int_tensor(seq_lens, "seq_lens")
    spans = lengths if seq_lens_padded is None else _check_int_tensor(seq_lens_padded, "seq_lens_padded")
    lengths = lengths.unsqueeze(0) if lengths.dim() == 1 else lengths
    spans = spans.unsqueeze(0) if spans.dim() == 1 else spans
    if lengths.dim() != 2:
        raise ValueError(f"seq_lens must be [B, D] or [D], got shape {tuple(seq_lens.shape)}")
    if lengths.shape[0] != batch:
        raise ValueError(f"seq_lens has {lengths.shape[0]} rows (shape {tuple(lengths.shape)}) but input_shape "
                         f"has batch size {batch} (input_shape {tuple(dims)})")
    if spans.shape != lengths.shape:
        raise ValueError(f"seq_lens_padded has shape {tuple(spans.shape)}, expected the shape of seq_lens "
                         f"{tuple(lengths.shape)}")
    lengths = lengths.long()
    spans = spans.to(device=lengths.device, dtype=torch.long)

    absent = (lengths == 0) | (lengths == SEQ_LENS_PAD)
    present = ~absent
    docs = document_table(torch.where(present, lengths, 0), torch.where(present, spans, 0), alignment)
    errors = (
        absent & ~((spans == 0) | (spans == SEQ_LENS_PAD)),
        present & (lengths < 0),
        present & (spans < lengths),
        present & (docs.ends > width),
    )
    row_max = docs.row_ends.max() if batch else lengths.new_zeros(())
    flags = torch.cat([torch.stack([e.any() for e in errors]).long(), row_max.reshape(1)]).tolist()  # one host read
    if flags[0]:
        b, d = _first_index(errors[0])
        raise ValueError(
            f"seq_lens_padded: absent packed document cannot have a physical span: row {b}, document column {d} "
            f"has seq_lens {int(lengths[b, d])} (absent: 0 or {SEQ_LENS_PAD}) but seq_lens_padded "
            f"{int(spans[b, d])} (must be 0 or {SEQ_LENS_PAD} too)")
    if flags[1]:
        b, d = _first_index(errors[1])
        raise ValueError(f"seq_lens: negative document length {int(lengths[b, d])} at row {b}, document column "
                         f"{d} (only 0 and {SEQ_LENS_PAD} mark absent documents)")
    if flags[2]:
        b, d = _first_index(errors[2])
        raise ValueError(f"seq_lens_padded: span {int(spans[b, d])} is shorter than seq_lens {int(lengths[b, d])} "
                         f"at row {b}, document column {d} (span must be >= length)")
    if flags[3]:
        b, d = _first_index(errors[3])
        start, span = int(docs.starts[b, d]), int(docs.ends[b, d] - docs.starts[b, d])
        raise ValueError(f"seq_lens{'_padded' if seq_lens_padded is not None else ''}: document at row {b}, "
                         f"document column {d} starts at caller column {start} with span {span}, ending at "
                         f"{start + span} > input width S={width} (input_shape {tuple(dims)})")

    aligned_width = -(-max(minimum_length, 1, int(flags[4])) // alignment) * alignment
    if sync_across_ranks and is_initialized():
        aligned_width = all_reduce_max(aligned_width, group=group)
        aligned_width = -(-aligned_width // alignment) * alignment  # no-op when every rank uses the same alignment
    return build_layout(docs, width, aligned_width)
