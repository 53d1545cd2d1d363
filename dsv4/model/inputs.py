"""What one forward runs on: :class:`ModelInputs`, resolved from the public call signature of the model.

``DSV4ForCausalLM.forward`` takes the public contract (``input_ids, position_ids, packed_seq_ids, padding_mask, cp,
labels``) and, so that ``model(**batch)`` works for code written against the seed API, the other keys of a seed
batch dict. :func:`resolve_inputs` turns every such call into one canonical set of tensors, so the model has a
single forward:

* ``position_ids`` default to ``rank * L + arange(L)``, ``packed_seq_ids`` to all 1 (one document per row);
* ``loss_mask`` (0 = do not train on this token) is folded into ``labels``;
* ``_dsv4_cp_group`` (the seed sharder's key) becomes the :class:`~dsv4.cp.context.CPContext` when ``cp`` is None;
* ``seq_lens`` / ``seq_lens_padded`` / ``qkv_format`` / ``cp_partition_mode`` of a sharded batch (global
  metadata with ``packed_seq_ids`` present) are ignored, as in the seed;
* ``seq_lens`` *without* ``packed_seq_ids`` (one rank): the rows are caller rows of back-to-back documents; they
  are moved onto the aligned layout of :mod:`dsv4.packing` (every document on a shard-multiple boundary) and the
  model restores its outputs to caller coordinates (:attr:`ModelInputs.layout`).

Unknown keyword arguments raise ``TypeError``; inconsistent shapes raise ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dsv4.config import DSV4Config
from dsv4.packing import PackedSequenceLayout

SEED_BATCH_KEYS = frozenset({"seq_lens", "seq_lens_padded", "qkv_format", "cp_partition_mode", "_dsv4_cp_group",
                             "loss_mask"})


@dataclass
class ModelInputs:
    """Canonical per-token inputs ``[B, L]`` of one forward; ``layout`` maps aligned rows back to the caller's."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    seq_ids: torch.Tensor
    padding: torch.Tensor | None
    labels: torch.Tensor | None
    cp: Any
    layout: PackedSequenceLayout | None = None


def _cp_from_batch(cp, batch_keys: dict):
    if "_dsv4_cp_group" not in batch_keys:
        return cp
    from dsv4.cp.context import CPContext  # the model touches CP only through CPContext

    from_batch = CPContext(batch_keys["_dsv4_cp_group"])
    if cp is None:
        return from_batch if from_batch.size > 1 else None
    if cp.size != from_batch.size:
        raise ValueError(
            f"the batch was sharded for a CP group of {from_batch.size} ranks but the forward got a CPContext of "
            f"{cp.size} ranks; build the CPContext from the same group as the sharder's mesh"
        )
    return cp


def _masked_labels(labels: torch.Tensor | None, loss_mask: torch.Tensor | None) -> torch.Tensor | None:
    if loss_mask is None:
        return labels
    if labels is None or loss_mask.shape != labels.shape:
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)} needs labels of the same shape, got "
                         f"{None if labels is None else tuple(labels.shape)}")
    return labels.masked_fill(loss_mask == 0, -100)


def resolve_inputs(
    config: DSV4Config,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    packed_seq_ids: torch.Tensor | None,
    padding_mask: torch.Tensor | None,
    cp,
    labels: torch.Tensor | None,
    batch_keys: dict,
) -> ModelInputs:
    """The canonical inputs of a forward call (see the module docstring)."""
    unknown = set(batch_keys) - SEED_BATCH_KEYS
    if unknown:
        raise TypeError(f"DSV4ForCausalLM.forward got unexpected keyword arguments {sorted(unknown)}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, L], got shape {tuple(input_ids.shape)}")
    cp = _cp_from_batch(cp, batch_keys)
    labels = _masked_labels(labels, batch_keys.get("loss_mask"))
    seq_lens = batch_keys.get("seq_lens")
    if packed_seq_ids is None and seq_lens is not None:
        return _aligned_inputs(config, input_ids, position_ids, padding_mask, cp, labels, seq_lens,
                               batch_keys.get("seq_lens_padded"))
    if position_ids is None:  # the global columns of each local row: its chunk's start + arange(L)
        b, length = input_ids.shape
        starts = [0] * b
        if cp is not None and cp.size > 1:
            k = cp.layout.chunks_per_rank
            if b % k:
                raise ValueError(f"input_ids has {b} rows but cp_balance={cp.balance!r} holds {k} chunks per row")
            starts = [v * length for _, v in cp.layout.local_rows(cp.rank, b // k)]
        position_ids = (torch.tensor(starts, device=input_ids.device)[:, None]
                        + torch.arange(length, device=input_ids.device))
    if packed_seq_ids is None:
        packed_seq_ids = torch.ones_like(input_ids)
    for name, t in (("position_ids", position_ids), ("packed_seq_ids", packed_seq_ids),
                    ("padding_mask", padding_mask), ("labels", labels)):
        if t is not None and t.shape != input_ids.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(input_ids.shape)} (input_ids)")
    return ModelInputs(input_ids, position_ids, packed_seq_ids, padding_mask, labels, cp)


def _aligned_inputs(config, input_ids, position_ids, padding_mask, cp, labels, seq_lens, seq_lens_padded):
    """Caller rows of back-to-back documents -> the aligned rows the model runs on (single rank)."""
    from dsv4.packing import aligned_packed_layout

    if cp is not None and cp.size > 1:
        raise ValueError("seq_lens without packed_seq_ids is the single-rank packed path; under context "
                         "parallelism shard the batch first (the sharder adds packed_seq_ids)")
    if position_ids is not None or padding_mask is not None:
        raise ValueError("with seq_lens (and no packed_seq_ids) the model builds position_ids and padding_mask "
                         "from the aligned packed layout; do not pass them")
    if labels is not None and labels.shape != input_ids.shape:
        raise ValueError(f"labels has shape {tuple(labels.shape)}, expected {tuple(input_ids.shape)}")
    layout = aligned_packed_layout(seq_lens, input_ids.shape, config.shard_multiple, seq_lens_padded=seq_lens_padded)
    return ModelInputs(
        input_ids=layout.pack(input_ids, fill=0),
        position_ids=layout.position_ids.to(input_ids.device),
        seq_ids=layout.sequence_ids.to(input_ids.device),
        padding=layout.padding_mask.to(input_ids.device),
        labels=None if labels is None else layout.pack(labels, fill=-100),
        cp=None,
        layout=layout,
    )
