"""The seed's dense additive attention masks (API compatibility and test oracles only).

Never used on the model path: they are O(L_local x S) in memory. Value convention: ``[B, 1, S_q, S_k]`` of
``dtype``, 0.0 where attention is allowed and ``torch.finfo(dtype).min`` where it is masked; a non-float dtype
raises (as in the seed, from ``finfo``).
"""

from __future__ import annotations

import torch

from dsv4.cp.seed.groups import dsv4_cp_all_gather_metadata, dsv4_cp_size
from dsv4.distributed import ProcessGroup


def _as_2d_long(t: torch.Tensor, device) -> torch.Tensor:
    t = t.unsqueeze(0) if t.dim() == 1 else t
    return t.to(device=device, dtype=torch.long)


def _key_padding(padding_mask: torch.Tensor, device, cp_group) -> torch.Tensor:
    """The all-gathered ``[B, S]`` key padding (True = pad) of a local ``[B, S_loc]`` / ``[S_loc]`` mask."""
    pad = padding_mask.unsqueeze(0) if padding_mask.dim() == 1 else padding_mask
    return dsv4_cp_all_gather_metadata(pad.to(device).bool(), 1, cp_group)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    min_value = torch.finfo(dtype).min
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, min_value).unsqueeze(1)


def build_dsv4_cp_causal_padding_mask(
    *,
    position_ids: torch.Tensor,
    key_len: int,
    dtype: torch.dtype,
    device: torch.device | str | None,
    cp_group: ProcessGroup | None,
    padding_mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Non-packed CP mask ``[B, 1, S_loc, key_len]``: local queries against the global key columns.

    Allowed(b, i, j) iff ``j <= q[b, i]``, ``q[b, i] - j < sliding_window`` (when given) and key ``j`` is not
    padding (the all-gathered ``padding_mask``, whose width must equal ``key_len``). Causality compares the position
    *value* with the key *index* (seed semantics), so positions must be global token indices. Padded query rows
    are not masked.
    """
    torch.finfo(dtype)  # seed: non-float dtypes raise here
    q = _as_2d_long(position_ids, device)
    keys = torch.arange(key_len, device=q.device)
    allowed = keys.view(1, 1, -1) <= q.unsqueeze(-1)
    if sliding_window is not None:
        allowed &= (q.unsqueeze(-1) - keys.view(1, 1, -1)) < sliding_window
    if padding_mask is not None:
        full_pad = _key_padding(padding_mask, q.device, cp_group)
        if full_pad.shape[-1] != key_len:
            raise ValueError(
                f"`padding_mask` gathered over {dsv4_cp_size(cp_group)} ranks has width {full_pad.shape[-1]}, "
                f"expected key_len={key_len}"
            )
        allowed &= ~full_pad.view(full_pad.shape[0], 1, key_len)
    return _additive(allowed, dtype)


def build_dsv4_cp_packed_causal_padding_mask(
    *,
    position_ids: torch.Tensor,
    packed_seq_ids: torch.Tensor,
    dtype: torch.dtype,
    device: torch.device | str | None,
    cp_group: ProcessGroup | None,
    padding_mask: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Packed CP mask ``[B, 1, S_loc, S_loc * C]`` from document-local positions and document ids.

    Metadata is all-gathered in the seed's order: positions, then ids, then the padding mask (if given).
    Allowed(b, i, j) iff ``q_seq > 0``, ``q_seq == k_seq``, ``k_pos <= q_pos``, ``q_pos - k_pos < sliding_window``
    (when given) and key ``j`` is not padding. Query rows of pack padding (id 0) have no allowed key.
    """
    torch.finfo(dtype)
    q_pos = _as_2d_long(position_ids, device)
    q_seq = _as_2d_long(packed_seq_ids, device)
    k_pos = dsv4_cp_all_gather_metadata(q_pos, 1, cp_group)
    k_seq = dsv4_cp_all_gather_metadata(q_seq, 1, cp_group)
    qp, qs = q_pos.unsqueeze(-1), q_seq.unsqueeze(-1)
    kp, ks = k_pos.unsqueeze(1), k_seq.unsqueeze(1)
    allowed = (qs > 0) & (qs == ks) & (kp <= qp)
    if sliding_window is not None:
        allowed &= (qp - kp) < sliding_window
    if padding_mask is not None:
        allowed &= ~_key_padding(padding_mask, q_pos.device, cp_group).unsqueeze(1)
    return _additive(allowed, dtype)
