"""Generic contiguous CP sharding of a batch (seed ``shard_batch_contiguous`` and helpers).

Rank r of C keeps columns ``[r*L, (r+1)*L)`` of every token tensor, ``L = P / C``, after right-padding the row to
``P`` = a multiple of ``C * max(pad_multiple, 2)``. Padding values: ``input_ids`` -> ``padding_token_id``,
``inputs_embeds`` -> 0, ``labels`` -> -100, ``padding_mask`` -> True, ``loss_mask`` -> 0, ``position_ids`` continue
from their last value, extra keys -> their own pad value (default 0). Unknown keys are left untouched.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F

from dsv4.batch import IGNORE_INDEX
from dsv4.cp.seed.groups import mesh_rank, mesh_size
from dsv4.cp.seed.layout import ShardLayout
from dsv4.cp.seed.repad import primary_key


def convert_attention_mask_to_padding_mask(batch: dict) -> dict:
    """Pop ``attention_mask``; when ``padding_mask`` is absent derive it (True = pad). In place, idempotent.

    A 4-D mask contributes head 0's diagonal: bool -> NOT diagonal, additive float -> diagonal != 0.
    """
    mask = batch.pop("attention_mask", None)
    if mask is None or batch.get("padding_mask") is not None:
        return batch
    if mask.dim() == 4:
        diag = mask[:, 0].diagonal(dim1=-2, dim2=-1)
        batch["padding_mask"] = ~diag if diag.dtype == torch.bool else diag != 0
    else:
        batch["padding_mask"] = ~mask.bool()
    return batch


def contiguous_local_indices(cp_mesh: Any, padded_len: int, device=None) -> torch.Tensor:
    """Global columns ``[r*P/C, (r+1)*P/C)`` owned by this rank; ValueError unless ``P % C == 0``."""
    size = mesh_size(cp_mesh)
    if padded_len % size:
        raise ValueError(f"padded length {padded_len} must be divisible by the CP size {size}")
    local = padded_len // size
    start = mesh_rank(cp_mesh) * local
    return torch.arange(start, start + local, device=device)


def _pad_seq(t: torch.Tensor, pad: int, dim: int, value) -> torch.Tensor:
    if pad <= 0:
        return t
    dim = dim % t.dim()
    spec = [0, 0] * (t.dim() - dim - 1) + [0, pad]
    if t.dtype == torch.bool:
        return F.pad(t.to(torch.uint8), spec, value=int(bool(value))).bool()
    return F.pad(t, spec, value=value)


def _pad_positions(t: torch.Tensor, pad: int, dim: int) -> torch.Tensor:
    """Continue positions from the last value: last+1, ..., last+pad."""
    if pad <= 0:
        return t
    last = t.narrow(dim, t.shape[dim] - 1, 1)
    steps_shape = [1] * t.dim()
    steps_shape[dim] = pad
    steps = torch.arange(1, pad + 1, dtype=t.dtype, device=t.device).view(steps_shape)
    return torch.cat([t, last + steps], dim=dim)


def shard_batch_contiguous(
    cp_mesh: Any,
    tp_mesh: Any,
    batch: dict,
    *,
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    pad_multiple: int = 1,
    extra_seq_keys: dict[str, int] | None = None,
    extra_pad_values: dict[str, Any] | None = None,
    shard_primary: bool = True,
):
    """Pad and slice ``batch`` to this rank's contiguous shard; return ``(nullcontext, batch, ShardLayout)``.

    ``extra_seq_keys`` maps further per-token keys to their sequence dim (e.g. ``{"packed_seq_ids": 1}``),
    ``extra_pad_values`` their pad values. Validation (one primary, labels) happens before the batch is changed.
    """
    key = primary_key(batch)
    primary = batch[key]
    if batch.get("labels") is None and loss_mask is None:
        raise KeyError("CP requires `labels`, or labels passed as `loss_mask`")
    size, rank = mesh_size(cp_mesh), mesh_rank(cp_mesh)
    seq_len = primary.shape[1]
    for name in ("labels", "padding_mask", "position_ids"):
        t = batch.get(name)
        length = t.shape[2 if t.dim() == 3 else 1] if isinstance(t, torch.Tensor) and t.dim() >= 2 else None
        if length is not None and length != seq_len:
            raise ValueError(f"`{name}` has sequence length {length} but `{key}` has {seq_len}")

    convert_attention_mask_to_padding_mask(batch)
    if batch.get("labels") is None:
        batch["labels"], loss_mask = loss_mask, None
    batch_size = primary.shape[0]
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(seq_len, device=primary.device).expand(batch_size, seq_len).contiguous()
    elif positions.dim() == 2 and positions.shape[0] == 1 and batch_size > 1:
        positions = positions.expand(batch_size, -1).contiguous()
    batch["position_ids"] = positions
    pos_dim = 2 if positions.dim() == 3 else 1

    table: dict[str, Any] = {"padding_mask": True}
    if shard_primary:
        table.update({"input_ids": padding_token_id, "inputs_embeds": 0})
    extra_seq_keys = {k: v for k, v in (extra_seq_keys or {}).items() if k in batch and k not in table}
    extra_pad_values = extra_pad_values or {}

    divisor = size * max(int(pad_multiple or 1), 2)
    pad = (-seq_len) % divisor
    padded_len = seq_len + pad
    if padded_len % size:
        raise ValueError(f"padded length {padded_len} is not divisible by the CP size {size}")
    local = padded_len // size
    start = rank * local

    def take(t: torch.Tensor, dim: int, value) -> torch.Tensor:
        t = _pad_seq(t, pad, dim, value) if value is not None else _pad_positions(t, pad, dim)
        return t.narrow(dim, start, local).contiguous()

    for name, value in table.items():
        if batch.get(name) is not None:
            batch[name] = take(batch[name], 1, value)
    batch["labels"] = take(batch["labels"], 1, IGNORE_INDEX)
    batch["position_ids"] = take(batch["position_ids"], pos_dim, None)
    for name, dim in extra_seq_keys.items():
        batch[name] = take(batch[name], dim, extra_pad_values.get(name, 0))
    if loss_mask is not None:
        batch["loss_mask"] = take(loss_mask, 1, 0)
    return nullcontext, batch, ShardLayout(original_seq_len=seq_len, padded_seq_len=padded_len)
