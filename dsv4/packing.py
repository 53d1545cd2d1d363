"""V4.1-style aligned packed rows: :class:`PackedSequenceLayout` and :func:`aligned_packed_layout`.

A caller row of width ``S`` holds documents back to back (optionally each followed by its own padding, described
by ``seq_lens_padded``). The aligned layout moves every document so that it starts at a multiple of
``alignment`` (a compression-group boundary), drops the caller's per-document padding, and gives every slot that
belongs to no document ``sequence_id 0``. ``S_al`` is the aligned width shared by all rows of the batch.

Shapes and invariants of a layout (``B`` rows, caller width ``S``, aligned width ``S_al``; all ``int64`` on
``seq_lens.device``):

* ``source_indices [B, S_al]``: caller column each aligned slot reads from; ``-1`` = alignment / pack padding.
* ``input_positions [B, S]``: aligned slot of each caller column; ``-1`` = caller padding, discarded.
  ``source_indices`` and ``input_positions`` are inverse maps on real tokens:
  ``source_indices[b, input_positions[b, k]] == k`` wherever ``input_positions[b, k] >= 0``.
* ``position_ids [B, S_al]``: document-local positions ``0..len-1`` (RoPE); padding slots hold 0.
* ``sequence_ids [B, S_al]``: document id = 1-based column index of the document in ``seq_lens`` (absent
  columns still use up their id, so ids may have gaps); 0 = padding.
* ``S_al % alignment == 0``; every document starts at a multiple of ``alignment``; the tail slots of a
  document's last partial alignment group and every trailing slot of a row are padding.

The construction is vectorised (cumsum + batched searchsorted + gather); a call performs one host sync to
validate the metadata and learn ``S_al`` (plus one MAX all-reduce when ``sync_across_ranks``), none per row or
document.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from dsv4.cp.collectives import all_reduce_max
from dsv4.cp.seq_ids import _SEQ_LENS_PADDING_VALUE

__all__ = ["PackedSequenceLayout", "aligned_packed_layout"]


def _gather_tokens(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``out[b, j, ...] = values[b, index[b, j], ...]`` for ``index [B, N]`` (non-negative), any trailing dims."""
    trailing = values.shape[2:]
    idx = index.reshape(index.shape + (1,) * len(trailing)).expand(index.shape + trailing)
    return torch.gather(values, 1, idx)


def _fill_where(mask: torch.Tensor, fill: Any, values: torch.Tensor) -> torch.Tensor:
    """``values`` with the token slots of ``mask [B, N]`` replaced by ``fill`` (broadcast over trailing dims)."""
    mask = mask.reshape(mask.shape + (1,) * (values.dim() - 2))
    fill_t = torch.as_tensor(fill, dtype=values.dtype, device=values.device)
    return torch.where(mask, fill_t, values)


@dataclass(frozen=True, eq=False)
class PackedSequenceLayout:
    """Map between caller rows ``[B, S]`` and aligned packed rows ``[B, S_al]`` (see the module docstring)."""

    source_indices: torch.Tensor
    input_positions: torch.Tensor
    position_ids: torch.Tensor
    sequence_ids: torch.Tensor

    def __post_init__(self) -> None:
        fields = {
            "source_indices": self.source_indices,
            "input_positions": self.input_positions,
            "position_ids": self.position_ids,
            "sequence_ids": self.sequence_ids,
        }
        for name, t in fields.items():
            if not isinstance(t, torch.Tensor) or t.dim() != 2:
                raise ValueError(f"PackedSequenceLayout.{name} must be a 2-D tensor, got {type(t).__name__} "
                                 f"{tuple(t.shape) if isinstance(t, torch.Tensor) else ''}")
        aligned = tuple(self.source_indices.shape)
        for name in ("position_ids", "sequence_ids"):
            if tuple(fields[name].shape) != aligned:
                raise ValueError(f"PackedSequenceLayout.{name} has shape {tuple(fields[name].shape)}, expected "
                                 f"{aligned} (the shape of source_indices)")
        if self.input_positions.shape[0] != aligned[0]:
            raise ValueError(f"PackedSequenceLayout.input_positions has batch size {self.input_positions.shape[0]}, "
                             f"expected {aligned[0]} (the batch size of source_indices)")

    # ------------------------------------------------------------------ properties
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
        """``[B, S_al]`` bool, True where the slot belongs to no document (``sequence_ids == 0``)."""
        return self.sequence_ids == 0

    @property
    def token_mask(self) -> torch.Tensor:
        """``[B, S_al]`` bool, True on real document tokens (the complement of :attr:`padding_mask`)."""
        return self.sequence_ids != 0

    @property
    def device(self) -> torch.device:
        return self.source_indices.device

    # ------------------------------------------------------------------ pack / restore
    def pack(self, values: torch.Tensor, fill: Any = 0) -> torch.Tensor:
        """Caller layout ``[B, S, ...]`` -> aligned layout ``[B, S_al, ...]``.

        Real tokens are gathered (gradients flow back to their caller columns); padding slots get ``fill``, a
        scalar or a tensor broadcastable to the trailing dims. Returns a new tensor.
        """
        expected = (self.batch_size, self.input_length)
        if not isinstance(values, torch.Tensor) or values.dim() < 2 or tuple(values.shape[:2]) != expected:
            got = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
            raise ValueError(f"PackedSequenceLayout.pack: values must have shape [B, S, ...] = "
                             f"[{expected[0]}, {expected[1]}, ...], got {got}")
        src = self.source_indices.to(values.device)
        if values.shape[1] == 0:  # nothing to read: every aligned slot is padding
            out = values.new_zeros((self.batch_size, self.aligned_length) + tuple(values.shape[2:]))
        else:
            out = _gather_tokens(values, src.clamp_min(0))
        return _fill_where(src < 0, fill, out)

    def restore(self, values: torch.Tensor) -> torch.Tensor:
        """Aligned layout ``[B, S_al, ...]`` -> caller layout ``[B, S, ...]``.

        Each real caller column reads its aligned slot (differentiable); caller padding columns
        (``input_positions < 0``) come back as zeros. Returns a new tensor.
        """
        expected = (self.batch_size, self.aligned_length)
        if not isinstance(values, torch.Tensor) or values.dim() < 2 or tuple(values.shape[:2]) != expected:
            got = tuple(values.shape) if isinstance(values, torch.Tensor) else type(values).__name__
            raise ValueError(f"PackedSequenceLayout.restore: values must have shape [B, S_al, ...] = "
                             f"[{expected[0]}, {expected[1]}, ...], got {got}")
        pos = self.input_positions.to(values.device)
        out = _gather_tokens(values, pos.clamp_min(0))
        return _fill_where(pos < 0, 0, out)


# ---------------------------------------------------------------------- construction
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


def _reduce_device(group: Any) -> torch.device:
    backend = str(dist.get_backend(group))
    if "nccl" in backend.lower() and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
    """Build the aligned packed layout of caller rows ``input_shape = (B, S, ...)``.

    Args:
        seq_lens: ``[B, D]`` (or ``[D]`` for ``B == 1``) int32/int64 real document lengths in column order;
            entries 0 or ``_SEQ_LENS_PADDING_VALUE`` (-1000) are absent documents (their id is skipped).
        input_shape: the caller batch shape; only ``B`` and ``S`` (the first two entries) are used.
        alignment: every document starts at a multiple of it and ``S_al`` is a multiple of it (``>= 1``).
        sync_across_ranks: when True and ``torch.distributed`` is initialised, ``S_al`` is MAX-all-reduced over
            ``group`` (WORLD when None) so every rank gets the same width (HybridEP needs equal token counts).
            This is a collective: every rank of ``group`` must call it. Ranks must pass the same ``alignment``.
        seq_lens_padded: optional physical spans, same shape as ``seq_lens``, including padding the caller
            already put after each document (dropped by the layout); None = documents are concatenated.
        minimum_length: lower bound for ``S_al`` before rounding up to ``alignment``.
        group: process group for ``sync_across_ranks``.

    Returns:
        :class:`PackedSequenceLayout` with ``S_al = round_up(max(minimum_length, 1, max row length), alignment)``
        where a row's length is the sum of its present documents' lengths, each rounded up to ``alignment``.

    Raises:
        ValueError: naming the argument, the row / document column and the numbers, for: ``alignment < 1``,
            a non-integer dtype, a bad rank or shape, an absent document with a physical span, a negative length,
            ``span < length``, or documents that run past the caller width ``S``. Everything is validated
            before anything is built (and before the all-reduce).
    """
    # ---- scalar arguments
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

    # ---- tensor arguments: dtype and shape
    lengths = _check_int_tensor(seq_lens, "seq_lens")
    spans = lengths if seq_lens_padded is None else _check_int_tensor(seq_lens_padded, "seq_lens_padded")
    if lengths.dim() == 1:
        lengths = lengths.unsqueeze(0)
    if spans.dim() == 1:
        spans = spans.unsqueeze(0)
    if lengths.dim() != 2:
        raise ValueError(f"seq_lens must be [B, D] or [D], got shape {tuple(seq_lens.shape)}")
    if lengths.shape[0] != batch:
        raise ValueError(f"seq_lens has {lengths.shape[0]} rows (shape {tuple(lengths.shape)}) but input_shape "
                         f"has batch size {batch} (input_shape {tuple(dims)})")
    if spans.shape != lengths.shape:
        raise ValueError(f"seq_lens_padded has shape {tuple(spans.shape)}, expected the shape of seq_lens "
                         f"{tuple(lengths.shape)}")
    device = lengths.device
    lengths = lengths.to(torch.int64)
    spans = spans.to(device=device, dtype=torch.int64)
    num_docs = lengths.shape[1]

    # ---- per-document values (device side, no sync)
    pad = _SEQ_LENS_PADDING_VALUE
    absent = (lengths == 0) | (lengths == pad)
    span_absent = (spans == 0) | (spans == pad)
    present = ~absent
    eff_len = torch.where(present, lengths, 0)
    eff_span = torch.where(present, spans, 0)
    old_end = eff_span.cumsum(1)
    old_start = old_end - eff_span
    aligned_len = (eff_len + (alignment - 1)) // alignment * alignment
    new_end = aligned_len.cumsum(1)
    new_start = new_end - aligned_len

    err_absent_span = absent & ~span_absent
    err_negative = present & (lengths < 0)
    err_short_span = present & (spans < lengths)
    err_overflow = present & (old_end > width)
    row_max = new_end[:, -1].max() if num_docs and batch else lengths.new_zeros(())
    summary = torch.stack([
        err_absent_span.any(), err_negative.any(), err_short_span.any(), err_overflow.any(),
    ]).to(torch.int64)
    flags = torch.cat([summary, row_max.reshape(1)]).tolist()  # the one host sync

    # ---- validation errors, in the order of the reference (first offending entry is reported)
    if flags[0]:
        b, d = _first_index(err_absent_span)
        raise ValueError(
            f"seq_lens_padded: absent packed document cannot have a physical span: row {b}, document column {d} "
            f"has seq_lens {int(lengths[b, d])} (absent: 0 or {pad}) but seq_lens_padded {int(spans[b, d])} "
            f"(must be 0 or {pad} too)")
    if flags[1]:
        b, d = _first_index(err_negative)
        raise ValueError(f"seq_lens: negative document length {int(lengths[b, d])} at row {b}, document column "
                         f"{d} (only 0 and {pad} mark absent documents)")
    if flags[2]:
        b, d = _first_index(err_short_span)
        raise ValueError(f"seq_lens_padded: span {int(spans[b, d])} is shorter than seq_lens {int(lengths[b, d])} "
                         f"at row {b}, document column {d} (span must be >= length)")
    if flags[3]:
        b, d = _first_index(err_overflow)
        start, span = int(old_start[b, d]), int(eff_span[b, d])
        raise ValueError(f"seq_lens{'_padded' if seq_lens_padded is not None else ''}: document at row {b}, "
                         f"document column {d} starts at caller column {start} with span {span}, ending at "
                         f"{start + span} > input width S={width} (input_shape {tuple(dims)})")

    # ---- aligned width
    s_al = max(minimum_length, 1, int(flags[4]))
    s_al = -(-s_al // alignment) * alignment
    if sync_across_ranks and dist.is_available() and dist.is_initialized():
        s_al = all_reduce_max(s_al, group=group, device=_reduce_device(group))
        s_al = -(-s_al // alignment) * alignment  # no-op when every rank uses the same alignment

    # ---- build: one sentinel absent document at the end keeps every lookup in range (also for D == 0)
    zero_col = lengths.new_zeros((batch, 1))
    eff_len_x = torch.cat([eff_len, zero_col], 1)
    old_start_x = torch.cat([old_start, old_end[:, -1:] if num_docs else zero_col], 1)
    new_start_x = torch.cat([new_start, new_end[:, -1:] if num_docs else zero_col], 1)
    old_end_c = old_end.contiguous() if num_docs else zero_col
    new_end_c = new_end.contiguous() if num_docs else zero_col

    # aligned side: slot j of row b lies in the first document whose aligned end exceeds j
    cols = torch.arange(s_al, device=device).expand(batch, s_al).contiguous()
    doc = torch.searchsorted(new_end_c, cols, right=True).clamp_max(num_docs)
    offset = cols - new_start_x.gather(1, doc)
    real = offset < eff_len_x.gather(1, doc)
    source_indices = torch.where(real, old_start_x.gather(1, doc) + offset, -1)
    position_ids = torch.where(real, offset, 0)
    sequence_ids = torch.where(real, doc + 1, 0)

    # caller side: column k of row b lies in the first document whose physical end exceeds k
    kcols = torch.arange(width, device=device).expand(batch, width).contiguous()
    kdoc = torch.searchsorted(old_end_c, kcols, right=True).clamp_max(num_docs)
    koff = kcols - old_start_x.gather(1, kdoc)
    kreal = koff < eff_len_x.gather(1, kdoc)
    input_positions = torch.where(kreal, new_start_x.gather(1, kdoc) + koff, -1)

    return PackedSequenceLayout(
        source_indices=source_indices,
        input_positions=input_positions,
        position_ids=position_ids,
        sequence_ids=sequence_ids,
    )
