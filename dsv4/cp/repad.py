"""Compression-safe repad of packed DSV4 rows (seed ``_repad_dsv4_packed_batch``, vectorised).

Every document is moved to start at a multiple of ``pad_multiple`` and padded with its own pad slots (same
document id, document-local positions continue, ``padding_mask`` True, label -100), so no compressor window
straddles two documents. The rebuilt rows are right-padded to ``T``, a multiple of ``cp_size * pad_multiple``, so
every contiguous CP shard starts on a window boundary too.

Output invariants (``reference/cp-contract.md`` 2.7, 6):

* ``build_packed_seq_ids(new seq_lens_padded, seq_len=T) == packed_seq_ids``;
* ``T % (cp_size * pad_multiple) == 0``; document k of a row starts at a multiple of ``pad_multiple``;
* for every input column i with ``input_positions[b, i] >= 0``: ``out[b, input_positions[b, i]] == in[b, i]``.

Unlike the seed, the work is a handful of tensor ops (cumsum, searchsorted, gather, scatter) with a constant
number of host syncs per call (validation and the output width), no per-document Python loop, and bad input
raises before the caller's batch is touched: a real token (label != -100) that the repad would drop, lengths that
run past the row, negative lengths, non-integer lengths, a missing or duplicated primary, missing labels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv4.cp.collectives import all_reduce_max
from dsv4.cp.multiple import _pad_length
from dsv4.cp.seq_ids import _SEQ_LENS_PADDING_VALUE, _check_lengths

IGNORE_INDEX = -100


def primary_key(batch: dict) -> str:
    """``"input_ids"`` or ``"inputs_embeds"``; ValueError unless exactly one of them is in ``batch``."""
    present = [k for k in ("input_ids", "inputs_embeds") if batch.get(k) is not None]
    if len(present) != 1:
        raise ValueError(
            "the batch must contain exactly one of `input_ids` and `inputs_embeds`, "
            f"found {present or 'neither'}"
        )
    return present[0]


def _compact(lengths: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Move the non-sentinel entries of each row to the left (order kept); sentinel-fill to ``width`` columns."""
    b, d = lengths.shape
    present = lengths != _SEQ_LENS_PADDING_VALUE
    target = torch.where(present, present.long().cumsum(1) - 1, torch.full_like(lengths, width))
    out = torch.full((b, max(width, d) + 1), _SEQ_LENS_PADDING_VALUE, dtype=torch.long, device=lengths.device)
    out.scatter_(1, target, lengths)
    return out[:, :width], present.sum(1)


@dataclass
class RepadPlan:
    """Where every column of the rebuilt ``[B, T]`` rows comes from (all tensors on the batch's device; ``T`` is
    ``doc.shape[1]``).

    ``doc``: document index per output column (clamped); ``in_doc``: column belongs to a document (else pack
    padding); ``is_real``: column holds a real input token; ``source``: its input column (valid where
    ``is_real``); ``position``: document-local position; ``input_positions``: ``[B, S_in]`` output column of every
    input column, -1 where dropped; ``real`` / ``new_len``: ``[B, D]`` real and repadded lengths (sentinel past
    each row's ``count`` documents).
    """

    doc: torch.Tensor
    in_doc: torch.Tensor
    is_real: torch.Tensor
    source: torch.Tensor
    position: torch.Tensor
    input_positions: torch.Tensor
    real: torch.Tensor
    new_len: torch.Tensor
    count: torch.Tensor


def plan_repad(
    seq_lens: torch.Tensor,
    seq_lens_padded: torch.Tensor | None,
    *,
    input_len: int,
    labels: torch.Tensor | None,
    cp_size: int,
    pad_multiple: int,
    sync_packed_length: bool = False,
    sync_group=None,
) -> RepadPlan:
    """Validate the packed metadata and compute the repad plan (no batch tensor is modified)."""
    device = labels.device if labels is not None else seq_lens.device
    real_in = _check_lengths("seq_lens", seq_lens).to(device)
    padded_in = real_in if seq_lens_padded is None else _check_lengths("seq_lens_padded", seq_lens_padded).to(device)
    if padded_in.shape[0] != real_in.shape[0]:
        raise ValueError(
            f"`seq_lens_padded` has {padded_in.shape[0]} rows but `seq_lens` has {real_in.shape[0]}"
        )
    batch_size, width = real_in.shape
    if labels is not None and labels.shape[0] != batch_size:
        raise ValueError(f"`seq_lens` has {batch_size} rows but the batch has {labels.shape[0]}")
    real, count = _compact(real_in, width)
    padded, count_padded = _compact(padded_in, width)
    k = torch.arange(width, device=device).expand(batch_size, width)
    is_doc = k < count.unsqueeze(1)
    real = torch.where(is_doc, real, torch.zeros_like(real))
    # seed: a shorter seq_lens_padded is extended with the real lengths of the extra documents
    padded = torch.where(k < count_padded.unsqueeze(1), padded, real)
    stride = torch.where(is_doc, torch.maximum(padded, real), torch.zeros_like(real))
    old_off = stride.cumsum(1) - stride
    overflow = is_doc & (old_off + real > input_len)
    if bool(overflow.any()):
        b, d = (int(i) for i in overflow.nonzero()[0])
        raise ValueError(
            f"packed metadata exceeds token row length: row {b} document {d} spans "
            f"[{int(old_off[b, d])}, {int(old_off[b, d] + real[b, d])}) but the row has {input_len} tokens "
            "(check `seq_lens` / `seq_lens_padded`)"
        )
    m = max(int(pad_multiple), 1)
    new_len = torch.where(is_doc, (real + m - 1) // m * m, torch.zeros_like(real))
    new_end = new_len.cumsum(1)
    new_off = new_end - new_len
    row_len = new_end[:, -1] if width else torch.zeros(batch_size, dtype=torch.long, device=device)
    total = _pad_length(max(int(row_len.max()) if batch_size else 0, 1), cp_size * m)
    if sync_packed_length:
        total = all_reduce_max(total, group=sync_group, device=device)
        if total % (cp_size * m):
            raise ValueError(
                f"sync_packed_length: the synchronised length {total} is not a multiple of "
                f"cp_size * pad_multiple = {cp_size * m}; every rank must use the same CP size and pad multiple"
            )

    columns = torch.arange(total, device=device).expand(batch_size, total).contiguous()
    if width:
        doc = torch.searchsorted(new_end.contiguous(), columns, right=True)
    else:
        doc = torch.zeros_like(columns)
    in_doc = doc < width
    doc = doc.clamp(max=max(width - 1, 0))
    if width:
        position = columns - new_off.gather(1, doc)
        is_real = in_doc & (position < real.gather(1, doc))
        source = old_off.gather(1, doc) + position
    else:
        position = torch.zeros_like(columns)
        is_real = torch.zeros_like(columns, dtype=torch.bool)
        source = position
    position = torch.where(in_doc, position, torch.zeros_like(position))
    source = torch.where(is_real, source, torch.full_like(source, input_len))
    input_positions = torch.full((batch_size, input_len + 1), -1, dtype=torch.long, device=device)
    input_positions.scatter_(1, source, columns)
    input_positions = input_positions[:, :input_len].contiguous()
    source = source.clamp(max=max(input_len - 1, 0))

    if labels is not None:
        dropped = (input_positions < 0) & (labels != IGNORE_INDEX)
        if bool(dropped.any()):
            b, i = (int(x) for x in dropped.nonzero()[0])
            raise ValueError(
                f"{int(dropped.sum())} labelled token(s) (label != {IGNORE_INDEX}) lie outside every document "
                f"declared by `seq_lens` and would be dropped by the repad; first at row {b}, column {i} "
                f"(label {int(labels[b, i])}); fix `seq_lens`/`seq_lens_padded` or set those labels to {IGNORE_INDEX}"
            )
    return RepadPlan(doc, in_doc, is_real, source, position, input_positions, real, new_len, count)


def apply_plan(plan: RepadPlan, values: torch.Tensor, fill) -> torch.Tensor:
    """Rebuild ``values`` ``[B, S_in, ...]`` as ``[B, T, ...]``: real tokens moved, every other slot ``fill``."""
    index = plan.source
    mask = plan.is_real
    if values.dim() > 2:
        extra = values.shape[2:]
        index = index.view(*index.shape, *([1] * len(extra))).expand(*index.shape, *extra)
        mask = mask.view(*mask.shape, *([1] * len(extra)))
    gathered = values.gather(1, index)
    return torch.where(mask, gathered, torch.as_tensor(fill, dtype=values.dtype, device=values.device))


def _lengths_table(values: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``[B, Dmax]`` of the first ``count[b]`` entries per row, -1000 padded (Dmax = max count, at least 0)."""
    d_max = int(count.max()) if count.numel() else 0
    k = torch.arange(d_max, device=values.device).expand(values.shape[0], d_max)
    out = values[:, :d_max]
    return torch.where(k < count.unsqueeze(1), out, torch.full_like(out, _SEQ_LENS_PADDING_VALUE))


def _repad_dsv4_packed_batch(
    batch: dict,
    *,
    cp_size: int,
    pad_multiple: int,
    padding_token_id: int,
    sync_packed_length: bool = False,
    loss_mask: torch.Tensor | None = None,
    sync_group=None,
) -> tuple[dict, torch.Tensor | None, torch.Tensor]:
    """Repad a packed batch in place; return ``(batch, loss_mask, input_positions)``.

    Requires ``seq_lens`` (KeyError), ``labels`` (KeyError) and exactly one of ``input_ids`` / ``inputs_embeds``
    (ValueError). Writes ``input_ids``/``inputs_embeds``, ``labels``, ``position_ids`` (document-local),
    ``padding_mask`` (True = pad), ``packed_seq_ids`` (1-based, 0 = pack padding), ``seq_lens`` /
    ``seq_lens_padded`` (``[B, Dmax]``, -1000 padded) and ``qkv_format="thd"``. ``input_positions`` is ``[B, S_in]``
    long: the output column of every input column, -1 where the input slot held no real token. With
    ``sync_packed_length`` the row length is MAX-reduced over ``sync_group`` (WORLD when None, the seed's choice).
    """
    if "seq_lens" not in batch or batch["seq_lens"] is None:
        raise KeyError("packed DSV4 CP requires `seq_lens` in the batch")
    key = primary_key(batch)
    if batch.get("labels") is None:
        raise KeyError("DSV4 CP requires `labels` in the batch")
    primary, labels = batch[key], batch["labels"]
    if labels.shape != primary.shape[:2]:
        raise ValueError(f"`labels` has shape {tuple(labels.shape)} but `{key}` has {tuple(primary.shape)}")
    if loss_mask is not None and loss_mask.shape != labels.shape:
        raise ValueError(f"`loss_mask` has shape {tuple(loss_mask.shape)} but `labels` has {tuple(labels.shape)}")
    plan = plan_repad(
        batch["seq_lens"],
        batch.get("seq_lens_padded"),
        input_len=primary.shape[1],
        labels=labels,
        cp_size=cp_size,
        pad_multiple=pad_multiple,
        sync_packed_length=sync_packed_length,
        sync_group=sync_group,
    )
    batch[key] = apply_plan(plan, primary, padding_token_id if key == "input_ids" else 0)
    batch["labels"] = apply_plan(plan, labels, IGNORE_INDEX)
    if loss_mask is not None:
        loss_mask = apply_plan(plan, loss_mask, 0)
    batch["position_ids"] = plan.position
    batch["padding_mask"] = ~plan.is_real
    batch["packed_seq_ids"] = torch.where(plan.in_doc, plan.doc + 1, torch.zeros_like(plan.doc))
    batch["seq_lens"] = _lengths_table(plan.real, plan.count)
    batch["seq_lens_padded"] = _lengths_table(plan.new_len, plan.count)
    batch["qkv_format"] = "thd"
    return batch, loss_mask, plan.input_positions
