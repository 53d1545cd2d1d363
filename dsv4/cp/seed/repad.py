"""Seed ``_repad_dsv4_packed_batch``: compression-safe repad of a packed batch dict, over :mod:`dsv4.packing`.

Every document moves to a multiple of ``pad_multiple`` (the aligned layout of :mod:`dsv4.packing`) and the rows are
right-padded to ``T``, a multiple of ``cp_size * pad_multiple``, so every contiguous CP shard starts on a window
boundary too. On top of the layout this module only applies the seed's conventions:

* documents are the non-sentinel entries of ``seq_lens`` (a zero-length one still uses up an id); a document's
  caller stride is ``max(seq_lens_padded, seq_lens)``, and a ``seq_lens_padded`` with fewer entries is extended
  with the real lengths;
* a document's alignment pad slots keep its id (``packed_seq_ids``) and continue its positions, with
  ``padding_mask`` True and label -100; trailing pack padding has id 0 and position 0;
* ``build_packed_seq_ids(new seq_lens_padded, seq_len=T) == packed_seq_ids``; for every input column ``i`` with
  ``input_positions[b, i] >= 0``: ``out[b, input_positions[b, i]] == in[b, i]``.

Unlike the seed: a constant number of host reads per call, no per-document loop, and bad input raises before the
caller's batch is touched (a labelled token the repad would drop, lengths past the row, negative or non-integer
lengths, a missing or duplicated primary, missing labels).
"""

from __future__ import annotations

import torch

from dsv4.batch import IGNORE_INDEX
from dsv4.cp.seed.seq_ids import _SEQ_LENS_PADDING_VALUE, _check_lengths, _pad_length
from dsv4.distributed import all_reduce_max, reduce_device
from dsv4.packing import PackedSequenceLayout, build_layout, document_table


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


def _lengths_table(values: torch.Tensor, count: torch.Tensor, d_max: int) -> torch.Tensor:
    """``[B, d_max]`` of the first ``count[b]`` entries per row, -1000 padded."""
    k = torch.arange(d_max, device=values.device).expand(values.shape[0], d_max)
    return torch.where(k < count.unsqueeze(1), values[:, :d_max], torch.full_like(values[:, :d_max],
                                                                                   _SEQ_LENS_PADDING_VALUE))


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
) -> tuple[PackedSequenceLayout, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validate the packed metadata; return ``(layout, real lengths [B, D], document count [B], D_max)``.

    The layout maps the caller rows onto rows of ``T`` columns; nothing of the batch is modified.
    """
    device = labels.device if labels is not None else seq_lens.device
    real_in = _check_lengths("seq_lens", seq_lens).to(device)
    padded_in = real_in if seq_lens_padded is None else _check_lengths("seq_lens_padded", seq_lens_padded).to(device)
    if padded_in.shape[0] != real_in.shape[0]:
        raise ValueError(f"`seq_lens_padded` has {padded_in.shape[0]} rows but `seq_lens` has {real_in.shape[0]}")
    batch_size, width = real_in.shape
    if labels is not None and labels.shape[0] != batch_size:
        raise ValueError(f"`seq_lens` has {batch_size} rows but the batch has {labels.shape[0]}")
    real, count = _compact(real_in, width)
    padded, count_padded = _compact(padded_in, width)
    k = torch.arange(width, device=device).expand(batch_size, width)
    is_doc = k < count.unsqueeze(1)
    real = torch.where(is_doc, real, torch.zeros_like(real))
    padded = torch.where(k < count_padded.unsqueeze(1), padded, real)  # seed: extend with the real lengths
    stride = torch.where(is_doc, torch.maximum(padded, real), torch.zeros_like(real))
    m = max(int(pad_multiple), 1)
    docs = document_table(real, stride, m)
    overflow = is_doc & (docs.starts + real > input_len)
    row_max = docs.row_ends.max() if batch_size else real.new_zeros(())
    d_max = count.max() if batch_size else count.new_zeros(())
    flags = torch.stack([overflow.any().long(), row_max, d_max]).tolist()  # one host read
    if flags[0]:
        b, d = (int(i) for i in overflow.nonzero()[0])
        raise ValueError(
            f"packed metadata exceeds token row length: row {b} document {d} spans "
            f"[{int(docs.starts[b, d])}, {int(docs.starts[b, d] + real[b, d])}) but the row has {input_len} tokens "
            "(check `seq_lens` / `seq_lens_padded`)"
        )
    total = _pad_length(max(int(flags[1]), 1), cp_size * m)
    if sync_packed_length:
        total = all_reduce_max(total, group=sync_group, device=reduce_device(sync_group))
        if total % (cp_size * m):
            raise ValueError(
                f"sync_packed_length: the synchronised length {total} is not a multiple of "
                f"cp_size * pad_multiple = {cp_size * m}; every rank must use the same CP size and pad multiple"
            )
    layout = build_layout(docs, input_len, total)
    if labels is not None:
        dropped = (layout.input_positions < 0) & (labels != IGNORE_INDEX)
        if bool(dropped.any()):
            b, i = (int(x) for x in dropped.nonzero()[0])
            raise ValueError(
                f"{int(dropped.sum())} labelled token(s) (label != {IGNORE_INDEX}) lie outside every document "
                f"declared by `seq_lens` and would be dropped by the repad; first at row {b}, column {i} "
                f"(label {int(labels[b, i])}); fix `seq_lens`/`seq_lens_padded` or set those labels to {IGNORE_INDEX}"
            )
    return layout, real, count, int(flags[2])


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
    layout, real, count, d_max = plan_repad(
        batch["seq_lens"], batch.get("seq_lens_padded"), input_len=primary.shape[1], labels=labels,
        cp_size=cp_size, pad_multiple=pad_multiple, sync_packed_length=sync_packed_length, sync_group=sync_group,
    )
    m = max(int(pad_multiple), 1)
    span = layout.span_documents
    batch[key] = layout.pack(primary, fill=padding_token_id if key == "input_ids" else 0)
    batch["labels"] = layout.pack(labels, fill=IGNORE_INDEX)
    if loss_mask is not None:
        loss_mask = layout.pack(loss_mask, fill=0)
    batch["position_ids"] = layout.span_positions
    batch["padding_mask"] = layout.padding_mask
    batch["packed_seq_ids"] = span + 1  # documents are compacted: the column is the seed's 0-based id
    batch["seq_lens"] = _lengths_table(real, count, d_max)
    batch["seq_lens_padded"] = _lengths_table((real + m - 1) // m * m, count, d_max)
    batch["qkv_format"] = "thd"
    return batch, loss_mask, layout.input_positions
