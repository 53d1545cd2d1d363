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
  aligned rows to the longest aligned row of all ranks (one MAX all-reduce), so all ranks run the same width;
* with context parallelism (``cp``, a :class:`~dsv4.cp.CPContext`; every rank of the group passes the same rows),
  the aligned rows are padded on the right to a multiple of ``cp.size x shard multiple`` and each rank runs its
  contiguous slice; :func:`capture_dspark_features` all-gathers the captured slices over the group, so every rank
  returns the whole rows, equal to the single-rank capture.

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
    cp: Any = None,
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
        cp: a ``CPContext``: this rank runs its contiguous slice of the aligned rows (padded to a multiple of
            ``cp.size x shard multiple``); None or one rank = the whole rows.
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
    rows = (layout.pack(input_ids), layout.position_ids.to(device), layout.sequence_ids.to(device),
            layout.padding_mask.to(device))
    if cp is not None and cp.size > 1:
        rows = _cp_slice(rows, cp, model.config.shard_multiple)
    ids, positions, seq_ids, padding = rows
    try:
        with torch.no_grad():
            model(ids, position_ids=positions, packed_seq_ids=seq_ids, padding_mask=padding, logits_to_keep=1,
                  cp=cp if cp is not None and cp.size > 1 else None)
    finally:
        model.train(was_training)
    return layout


def _cp_slice(rows: tuple[torch.Tensor, ...], cp: Any, multiple: int) -> tuple[torch.Tensor, ...]:
    """This CP rank's contiguous slice of the aligned ``(ids, positions, document ids, padding)`` rows, after right
    padding (document id 0, padding True) to a multiple of ``cp.size * multiple``."""
    width = rows[0].shape[1]
    padded = -(-width // (cp.size * multiple)) * cp.size * multiple
    fill = (0, 0, 0, True)
    rows = tuple(torch.nn.functional.pad(t, (0, padded - width), value=v) for t, v in zip(rows, fill))
    local = padded // cp.size
    return tuple(t[:, cp.rank * local:(cp.rank + 1) * local] for t in rows)


def _gather_rows(local: torch.Tensor, cp: Any, width: int) -> torch.Tensor:
    """The CP group's slices ``[B, L, ...]`` put back into whole rows, trimmed to the aligned ``width``."""
    return cp.all_gather(local.contiguous(), dim=1, kind="dspark_features")[:, :width]


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
    cp = forward_kwargs.get("cp")
    with FeatureCapture(model, layer_ids) as cap:
        layout = dspark_packed_forward(model, input_ids, seq_lens, **forward_kwargs)
    hidden, last = cap.hidden_states(), cap.last_hidden_state()
    if cp is not None and cp.size > 1:  # every rank holds its slice: the whole aligned rows on every rank
        width = layout.position_ids.shape[1]
        hidden, last = _gather_rows(hidden, cp, width), _gather_rows(last, cp, width)
    return DSparkFeatures(layout.restore(hidden), layout.restore(last), list(cap.layer_ids), layout)
