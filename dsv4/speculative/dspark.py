"""Packed, frozen forward of a DSpark target: :func:`dspark_packed_forward` and :func:`capture_dspark_features`.

A DSpark draft trains on hidden states of a frozen target (the residual stream entering a few layers and the
final-norm output); it never uses the target's logits. So the target forward here

* packs the caller rows with :func:`dsv4.packing.aligned_packed_layout` at the model's shard multiple
  (``config.shard_multiple``: 2 for V4.1 ratios {2, 1}, 128 for ratios {4, 128} because the overlapping ratio-4
  compressor counts as 8) and runs the model on the aligned rows;
* runs under ``torch.no_grad()`` in eval mode (the previous mode is restored afterwards);
* projects only the last position through the output head (``logits_to_keep=1``): the head still runs, so
  hooks and wrappers see the same call order, but no ``[B, S, vocab]`` logits are materialised;
* with a MoE dispatcher that needs uniform token counts (``allgather``), every rank pads its
  aligned rows to the longest aligned row of all ranks (one MAX all-reduce), so all ranks run the same width.

The hidden states themselves are read by hooks (:class:`dsv4.speculative.capture.FeatureCapture`) on the
aligned rows; the returned layout's ``restore`` maps them back to caller coordinates ``[B, S, ...]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from dsv4.packing import PackedSequenceLayout, aligned_packed_layout
from dsv4.speculative.capture import FeatureCapture, split_documents


def model_needs_uniform_tokens(model: nn.Module) -> bool:
    """True when any MoE layer of ``model`` uses a dispatcher that declares ``needs_uniform_tokens`` (the same token
    count on every rank: ``allgather``)."""
    return any(getattr(getattr(m, "dispatcher", None), "needs_uniform_tokens", False) for m in model.modules())


def dspark_packed_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    seq_lens_padded: torch.Tensor | None = None,
    sync_across_ranks: bool | None = None,
    group: Any = None,
) -> PackedSequenceLayout:
    """Frozen packed forward of ``model`` on caller rows ``input_ids [B, S]`` holding documents ``seq_lens``.

    Args:
        model: a ``DSV4ForCausalLM`` (hooks registered on it record what they need).
        input_ids: ``[B, S]`` caller rows, documents back to back (each optionally followed by the padding
            described by ``seq_lens_padded``).
        seq_lens: ``[B, D]`` (or ``[D]``) document lengths; 0 / -1000 = absent.
        sync_across_ranks: pad to the longest aligned row of all ranks of ``group``; None = decide from the
            model's dispatchers (:func:`model_needs_uniform_tokens`). A collective when True and distributed.
        group: process group of the MAX all-reduce (WORLD when None).
    Returns:
        The :class:`PackedSequenceLayout` the forward ran on: ``restore`` maps ``[B, S_al, ...]`` captures to
        ``[B, S, ...]``.
    """
    if sync_across_ranks is None:
        sync_across_ranks = model_needs_uniform_tokens(model)
    layout = aligned_packed_layout(seq_lens, input_ids.shape, model.config.shard_multiple,
                                   bool(sync_across_ranks), seq_lens_padded=seq_lens_padded, group=group)
    device = input_ids.device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            model(layout.pack(input_ids), position_ids=layout.position_ids.to(device),
                  packed_seq_ids=layout.sequence_ids.to(device), padding_mask=layout.padding_mask.to(device),
                  logits_to_keep=1)
    finally:
        model.train(was_training)
    return layout


@dataclass
class DSparkFeatures:
    """Captured target features in caller coordinates (caller padding columns are 0).

    ``hidden_states [B, S, len(layer_ids) * d]`` (layer streams, hc-averaged, concatenated in ``layer_ids``
    order), ``last_hidden_state [B, S, d]`` (final-norm output), ``layout`` (the packed layout used)."""

    hidden_states: torch.Tensor
    last_hidden_state: torch.Tensor
    layer_ids: list[int]
    layout: PackedSequenceLayout

    def documents(self, seq_lens: torch.Tensor, seq_lens_padded: torch.Tensor | None = None) -> list[dict]:
        """One dict per present document: ``row``, ``column``, ``hidden_states [len, n*d]``,
        ``last_hidden_state [len, d]``."""
        hs = split_documents(self.hidden_states, seq_lens, seq_lens_padded)
        last = split_documents(self.last_hidden_state, seq_lens, seq_lens_padded)
        return [{"row": b, "column": d, "hidden_states": h, "last_hidden_state": l}
                for (b, d, h), (_, _, l) in zip(hs, last)]


def capture_dspark_features(
    model: nn.Module,
    input_ids: torch.Tensor,
    seq_lens: torch.Tensor,
    layer_ids: Sequence[int],
    **forward_kwargs: Any,
) -> DSparkFeatures:
    """:func:`dspark_packed_forward` with a :class:`FeatureCapture` on ``layer_ids``; features restored."""
    with FeatureCapture(model, layer_ids) as cap:
        layout = dspark_packed_forward(model, input_ids, seq_lens, **forward_kwargs)
    return DSparkFeatures(cap.hidden_states(layout), cap.last_hidden_state(layout), list(cap.layer_ids), layout)
