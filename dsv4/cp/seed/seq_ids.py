"""Document ids of packed rows and the small length helpers of the seed API, with ``dsv4_cp_local_seq_multiple``
(a wrapper of :func:`dsv4.config.shard_multiple`).

Seed conventions: ``seq_lens`` / ``seq_lens_padded`` are ``[B, D]`` (or ``[D]``)
integer tensors whose entries equal to ``_SEQ_LENS_PADDING_VALUE`` (-1000) right-pad the document axis and are
skipped everywhere. Document ids are 1-based within each row, 0 marks pack padding that belongs to no document,
and a zero-length document still uses up an id (ids may skip numbers).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from dsv4.config import shard_multiple
from dsv4.packing import SEQ_LENS_PAD

_SEQ_LENS_PADDING_VALUE = SEQ_LENS_PAD


def _check_lengths(name: str, lengths: torch.Tensor, padding_value: int = _SEQ_LENS_PADDING_VALUE) -> torch.Tensor:
    """Validate a ``[B, D]`` / ``[D]`` length tensor and return it as ``[B, D]`` int64.

    Raises ValueError for a non-integer dtype, more than 2 dims, or a negative entry other than the sentinel.
    """
    if not isinstance(lengths, torch.Tensor):
        lengths = torch.as_tensor(lengths)
    if lengths.dtype.is_floating_point or lengths.dtype.is_complex or lengths.dtype == torch.bool:
        raise ValueError(f"`{name}` must have an integer dtype (int32/int64), got {lengths.dtype}")
    if lengths.dim() == 1:
        lengths = lengths.unsqueeze(0)
    if lengths.dim() != 2:
        raise ValueError(f"`{name}` must be [B, D] or [D], got shape {tuple(lengths.shape)}")
    lengths = lengths.long()
    bad = (lengths < 0) & (lengths != padding_value)
    if bool(bad.any()):
        b, d = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"`{name}`[{b}, {d}] = {int(lengths[b, d])} is negative; lengths must be >= 0 "
            f"({padding_value} pads the document axis)"
        )
    return lengths


def _valid_packed_lengths(row: torch.Tensor) -> list[int]:
    """Seed helper: drop ``-1000`` entries, clamp the rest to >= 0, as a Python list (host sync; not hot path)."""
    return [max(int(v), 0) for v in row.reshape(-1).tolist() if int(v) != _SEQ_LENS_PADDING_VALUE]


def _pad_1d(values: list[int], width: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Seed helper: right-pad a list with ``-1000`` up to ``width`` (never truncates); int64."""
    out = list(values) + [_SEQ_LENS_PADDING_VALUE] * max(width - len(values), 0)
    return torch.tensor(out, dtype=torch.int64, device=device)


def build_packed_seq_ids(
    seq_lens_padded: torch.Tensor,
    *,
    seq_len: int,
    device: torch.device | str | None = None,
    padding_value: int = _SEQ_LENS_PADDING_VALUE,
) -> torch.Tensor:
    """1-based document id of every column of packed rows; 0 for trailing pack padding.

    Args:
        seq_lens_padded: ``[B, D]`` or ``[D]`` integer stride of each document in the row; entries equal to
            ``padding_value`` are skipped and use no id; a zero length uses up an id (ids may skip numbers).
        seq_len: row width S.
    Returns:
        ``[B, S]`` int64 ids on ``device`` (the input's device when None).

    Vectorised: one ``searchsorted`` over the cumulative document ends, no per-document loop. Unlike the seed,
    documents that run past ``seq_len`` and negative lengths raise ``ValueError`` instead of being silently
    truncated or clamped.
    """
    lengths = _check_lengths("seq_lens_padded", seq_lens_padded, padding_value)
    device = device if device is not None else lengths.device
    lengths = lengths.to(device)
    present = lengths != padding_value
    strides = torch.where(present, lengths, torch.zeros_like(lengths))
    ends = strides.cumsum(dim=1)
    total = ends[:, -1] if ends.shape[1] else torch.zeros(lengths.shape[0], dtype=torch.long, device=device)
    if bool((total > seq_len).any()):
        b = int((total > seq_len).nonzero()[0, 0])
        raise ValueError(
            f"`seq_lens_padded` row {b} covers {int(total[b])} tokens but seq_len is {seq_len}; "
            "documents past the row end would be dropped"
        )
    ids_of_entry = present.long().cumsum(dim=1)  # 1-based id of each present entry
    columns = torch.arange(seq_len, device=device).expand(lengths.shape[0], seq_len).contiguous()
    entry = torch.searchsorted(ends.contiguous(), columns, right=True)  # first document ending after column
    in_doc = entry < lengths.shape[1]
    ids = torch.gather(
        torch.cat([ids_of_entry, ids_of_entry.new_zeros(lengths.shape[0], 1)], dim=1), 1, entry
    )
    return torch.where(in_doc, ids, torch.zeros_like(ids))


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
