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

How it is built: every aligned span is a whole number of ``pad_multiple``-slot blocks, so a block lies in one
document and holds that document's tokens from one caller column on. The per-token outputs are the per-block
values (document, first caller column, real slots) broadcast over the block's slots, one pass per output; only the
requested columns are built (the CP entry point builds just its rank's slice). The caller-to-aligned map is one
cumulative sum over per-document steps. A constant number of host reads per call (none per document), and bad input
raises before the caller's batch is touched (a labelled token the repad would drop, lengths past the row, negative
or non-integer lengths, a missing or duplicated primary, missing labels).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from dsv4.batch import IGNORE_INDEX
from dsv4.cp.seed.seq_ids import _SEQ_LENS_PADDING_VALUE, _check_lengths, _pad_length
from dsv4.distributed import all_reduce_max, reduce_device
from dsv4.packing import DocumentTable, document_table


def primary_key(batch: dict) -> str:
    """``"input_ids"`` or ``"inputs_embeds"``; ValueError unless exactly one of them is in ``batch``."""
    present = [k for k in ("input_ids", "inputs_embeds") if batch.get(k) is not None]
    if len(present) != 1:
        raise ValueError(
            "the batch must contain exactly one of `input_ids` and `inputs_embeds`, "
            f"found {present or 'neither'}"
        )
    return present[0]


@contextmanager
def _on_calling_thread(device: torch.device):
    """On CPU, run the enclosed torch ops on the calling thread alone (its intra-op thread count is restored after).

    The repad's passes are memory-bound over a few MiB: intra-op threads gain little there, and on a busy machine
    every parallel region waits for descheduled workers (milliseconds per pass). Other threads' settings are
    untouched (the setting is the calling thread's).
    """
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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


@dataclass(frozen=True)
class _Plan:
    """The validated placement of one batch: documents (compacted, seed order), their count and the row width."""

    docs: DocumentTable  # real lengths, caller strides and aligned slots of the compacted documents
    count: torch.Tensor  # [B] documents per row
    d_max: int  # the widest row's document count
    input_len: int  # caller width S
    total: int  # aligned width T


def _labelled_outside(docs: DocumentTable, labels: torch.Tensor, input_len: int) -> torch.Tensor:
    """Number of labelled caller columns outside every document's real span (0-d long; no host read).

    A prefix count of labelled columns, read at each real span's two ends: labelled tokens - labelled kept.
    """
    if input_len == 0 or labels.shape[0] == 0:
        return labels.new_zeros((), dtype=torch.long)
    prefix = (labels != IGNORE_INDEX).cumsum(1)  # prefix[b, c] = labelled columns in [0, c]

    def labelled_before(column: torch.Tensor) -> torch.Tensor:  # labelled columns in [0, column)
        column = column.clamp(0, input_len)
        return prefix.gather(1, (column - 1).clamp_min(0)) * (column > 0)

    kept = (labelled_before(docs.starts + docs.lengths) - labelled_before(docs.starts)).sum()
    return prefix[:, -1].sum() - kept


def _plan(
    seq_lens: torch.Tensor,
    seq_lens_padded: torch.Tensor | None,
    *,
    input_len: int,
    labels: torch.Tensor | None,
    cp_size: int,
    pad_multiple: int,
    sync_packed_length: bool,
    sync_group,
) -> _Plan:
    """Validate the packed metadata (and, with ``labels``, that no labelled token is dropped); place the documents."""
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
    dropped = _labelled_outside(docs, labels, input_len) if labels is not None else real.new_zeros(())
    flags = torch.stack([overflow.any().long(), row_max, d_max, dropped.to(device)]).tolist()  # one host read
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
    if flags[3]:
        dropped_at = (_input_positions(docs, input_len) < 0) & (labels != IGNORE_INDEX)
        b, i = (int(x) for x in dropped_at.nonzero()[0])
        raise ValueError(
            f"{int(dropped_at.sum())} labelled token(s) (label != {IGNORE_INDEX}) lie outside every document "
            f"declared by `seq_lens` and would be dropped by the repad; first at row {b}, column {i} "
            f"(label {int(labels[b, i])}); fix `seq_lens`/`seq_lens_padded` or set those labels to {IGNORE_INDEX}"
        )
    return _Plan(docs, count, int(flags[2]), int(input_len), int(total))


def _input_positions(docs: DocumentTable, input_len: int) -> torch.Tensor:
    """``[B, S]`` long: the aligned column of every caller column, -1 where it holds no real token.

    Inside document ``d``'s real span the map is ``column + aligned_start_d - start_d``; elsewhere it is
    ``column + far`` with ``far = -(S + 1)``, clamped to -1. The per-column offset is one cumulative sum of its
    changes at the spans' ends.
    """
    batch = docs.lengths.shape[0]
    device = docs.lengths.device
    far = -(input_len + 1)
    shift = docs.aligned_starts - docs.starts
    step = torch.where(docs.lengths > 0, shift - far, torch.zeros_like(shift))
    where = torch.cat([docs.starts, docs.starts + docs.lengths], 1).clamp(0, input_len)
    changes = torch.zeros((batch, input_len + 1), dtype=torch.long, device=device)
    changes[:, 0] = far
    changes.scatter_add_(1, where, torch.cat([step, -step], 1))
    offset = changes[:, :input_len].cumsum(1)
    return offset.add_(torch.arange(input_len, device=device)).clamp_min_(-1)


class _Slots:
    """The aligned columns ``[first, first + n)`` of a plan (``first`` and ``n`` multiples of the pad multiple)."""

    def __init__(self, plan: _Plan, first: int, n: int) -> None:
        docs, m = plan.docs, plan.docs.multiple
        batch, num_docs = docs.lengths.shape
        device = docs.lengths.device
        blocks = n // m
        # per-block values; one sentinel document (column num_docs) stands for the trailing pack padding
        zero = docs.lengths.new_zeros((batch, 1))
        lengths = torch.cat([docs.lengths, zero], 1)
        starts = torch.cat([docs.starts, zero], 1)
        aligned_starts = torch.cat([docs.aligned_starts, zero], 1)
        block_first = torch.arange(first, first + n, m, device=device).expand(batch, blocks).contiguous()
        doc = torch.searchsorted(docs.aligned_ends.contiguous(), block_first, right=True) if num_docs else \
            torch.zeros_like(block_first)
        in_span = doc < num_docs
        offset = torch.where(in_span, block_first - aligned_starts.gather(1, doc), 0)  # slot 0's document position
        real = (lengths.gather(1, doc) - offset).clamp_(0, m)  # real slots at the block's head
        source = starts.gather(1, doc) + offset  # caller column of slot 0
        ids = torch.where(in_span, doc + 1, 0)  # documents are compacted: the column is the seed's 0-based id
        slot = torch.arange(m, device=device)
        shape = (batch, blocks, m)
        self.batch, self.n, self.input_len = batch, n, plan.input_len
        self.padding_mask = (slot >= real.unsqueeze(-1)).view(batch, n)
        self.position_ids = torch.addcmul(offset.unsqueeze(-1), in_span.unsqueeze(-1), slot).view(batch, n)
        self.packed_seq_ids = ids.unsqueeze(-1).expand(shape).reshape(batch, n).contiguous()
        # caller column of every slot; a pad slot reads some column in range and is overwritten
        self._index = (source.unsqueeze(-1) + slot).view(batch, n).clamp_(0, max(plan.input_len - 1, 0))

    def take(self, values: torch.Tensor, fill) -> torch.Tensor:
        """``values [B, S, ...]`` at these slots, ``fill`` on the padding slots (differentiable)."""
        trailing = tuple(values.shape[2:])
        mask = self.padding_mask.to(values.device)
        if self.input_len == 0:  # nothing to read: every slot is padding
            return values.new_full((self.batch, self.n) + trailing, fill)
        index = self._index.to(values.device)
        if trailing:  # whole rows of the trailing dims, by flat row index
            flat = index + torch.arange(self.batch, device=index.device).unsqueeze(1) * self.input_len
            out = values.reshape((-1,) + trailing).index_select(0, flat.view(-1)).view((self.batch, self.n) + trailing)
            return out.masked_fill_(mask.view(mask.shape + (1,) * len(trailing)), fill)
        return values.gather(1, index).masked_fill_(mask, fill)


def _repad(
    batch: dict,
    *,
    cp_size: int,
    pad_multiple: int,
    padding_token_id: int,
    sync_packed_length: bool,
    loss_mask: torch.Tensor | None,
    sync_group,
    shard_rank: int | None,
) -> tuple[torch.Tensor | None, torch.Tensor, int]:
    """Repad ``batch`` in place, keeping the whole row (``shard_rank`` None) or only CP rank ``shard_rank``'s
    contiguous slice of it; return ``(loss_mask, input_positions, T)`` (see :func:`_repad_dsv4_packed_batch`)."""
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
    with _on_calling_thread(labels.device):
        plan = _plan(
            batch["seq_lens"], batch.get("seq_lens_padded"), input_len=primary.shape[1], labels=labels,
            cp_size=cp_size, pad_multiple=pad_multiple, sync_packed_length=sync_packed_length, sync_group=sync_group,
        )
        if shard_rank is None:
            slots = _Slots(plan, 0, plan.total)
        else:
            local = plan.total // cp_size
            slots = _Slots(plan, shard_rank * local, local)
        m = plan.docs.multiple
        real = plan.docs.lengths
        batch[key] = slots.take(primary, padding_token_id if key == "input_ids" else 0)
        batch["labels"] = slots.take(labels, IGNORE_INDEX)
        if loss_mask is not None:
            loss_mask = slots.take(loss_mask, 0)
        batch["position_ids"] = slots.position_ids
        batch["padding_mask"] = slots.padding_mask
        batch["packed_seq_ids"] = slots.packed_seq_ids
        batch["seq_lens"] = _lengths_table(real, plan.count, plan.d_max)
        batch["seq_lens_padded"] = _lengths_table((real + m - 1) // m * m, plan.count, plan.d_max)
        batch["qkv_format"] = "thd"
        return loss_mask, _input_positions(plan.docs, plan.input_len), plan.total


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
    loss_mask, input_positions, _ = _repad(
        batch, cp_size=cp_size, pad_multiple=pad_multiple, padding_token_id=padding_token_id,
        sync_packed_length=sync_packed_length, loss_mask=loss_mask, sync_group=sync_group, shard_rank=None,
    )
    return batch, loss_mask, input_positions


def _repad_dsv4_packed_shard(
    batch: dict,
    *,
    cp_size: int,
    cp_rank: int,
    pad_multiple: int,
    padding_token_id: int,
    sync_packed_length: bool = False,
    loss_mask: torch.Tensor | None = None,
    sync_group=None,
) -> tuple[dict, torch.Tensor | None, torch.Tensor, int]:
    """:func:`_repad_dsv4_packed_batch` followed by the contiguous CP cut, building only rank ``cp_rank``'s columns.

    The per-token keys (and the returned ``loss_mask``) hold columns ``[r*T/C, (r+1)*T/C)`` of the repadded row;
    ``seq_lens`` / ``seq_lens_padded`` and ``input_positions`` describe the whole row. Returns
    ``(batch, loss_mask, input_positions, T)``.
    """
    loss_mask, input_positions, total = _repad(
        batch, cp_size=cp_size, pad_multiple=pad_multiple, padding_token_id=padding_token_id,
        sync_packed_length=sync_packed_length, loss_mask=loss_mask, sync_group=sync_group, shard_rank=cp_rank,
    )
    return batch, loss_mask, input_positions, total
