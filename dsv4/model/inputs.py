"""What one forward runs on: :class:`ModelInputs`, resolved from the public call signature of the model.

``DSV4ForCausalLM.forward`` takes the public contract (``input_ids, position_ids, packed_seq_ids, padding_mask, cp,
labels``) and, so that ``model(**batch)`` works for code written against the seed API, the other keys of a seed
batch dict. :func:`resolve_inputs` turns every such call into one canonical set of tensors, so the model has a
single forward:

* ``position_ids`` default to ``rank * L + arange(L)``, ``packed_seq_ids`` to all 1 (one document per row);
* ``loss_mask`` (0 = do not train on this token) is folded into ``labels``;
* a batch key registered with :func:`register_batch_key` is accepted: the compatible API's sharder registers the
  key naming its CP group (it resolves the forward's :class:`~dsv4.model.context_parallel.ContextParallel`) and the
  format keys its batches carry (ignored);
* ``seq_lens`` / ``seq_lens_padded`` of a sharded batch (global metadata with ``packed_seq_ids`` present) are
  ignored;
* ``seq_lens`` *without* ``packed_seq_ids`` (one rank): the rows are caller rows of back-to-back documents; they
  are moved onto the aligned layout of :mod:`dsv4.packing` (every document on a shard-multiple boundary) and the
  model restores its outputs to caller coordinates (:attr:`ModelInputs.layout`).

Unknown keyword arguments raise ``TypeError``; inconsistent shapes raise ``ValueError``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from dsv4.config import DSV4Config
from dsv4.model.context_parallel import ContextParallel, is_parallel
from dsv4.packing import PackedSequenceLayout

PACKED_BATCH_KEYS = frozenset({"seq_lens", "seq_lens_padded", "loss_mask"})

CPFromBatch = Callable[[Any, "ContextParallel | None"], "ContextParallel | None"]
_BATCH_KEYS: dict[str, CPFromBatch | None] = {}


def register_batch_key(name: str, resolve: CPFromBatch | None = None) -> None:
    """Accept batch key ``name`` in ``model(**batch)``. ``resolve(value, cp)``, when given, returns the context the
    forward runs with (``cp``: the one passed explicitly, or None) or raises ValueError when the two disagree; None
    accepts the key and ignores it. A batch API whose batches carry keys of their own (the compatible sharder's CP
    group and format keys) registers them here; the model itself knows only the typed inputs and the packed keys."""
    if name in PACKED_BATCH_KEYS:
        raise ValueError(f"register_batch_key: {name!r} is a packed-batch key of the model")
    _BATCH_KEYS[name] = resolve


@dataclass
class ModelInputs:
    """Canonical per-token inputs ``[B, L]`` of one forward; ``layout`` maps aligned rows back to the caller's."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    seq_ids: torch.Tensor
    padding: torch.Tensor | None
    labels: torch.Tensor | None
    cp: ContextParallel | None
    layout: PackedSequenceLayout | None = None


def _cp_from_batch(cp: ContextParallel | None, batch_keys: dict) -> ContextParallel | None:
    for name, resolve in _BATCH_KEYS.items():
        if resolve is not None and name in batch_keys:
            cp = resolve(batch_keys[name], cp)
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
    cp: ContextParallel | None,
    labels: torch.Tensor | None,
    batch_keys: dict,
) -> ModelInputs:
    """The canonical inputs of a forward call (see the module docstring)."""
    unknown = set(batch_keys) - PACKED_BATCH_KEYS - set(_BATCH_KEYS)
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
        if is_parallel(cp):
            k = cp.chunks_per_rank
            if b % k:
                raise ValueError(f"input_ids has {b} rows but cp_balance={cp.balance!r} holds {k} chunks per row")
            starts = [v * length for _, v in cp.local_rows(b // k)]
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

    if is_parallel(cp):
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
