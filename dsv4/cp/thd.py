"""Contiguous THD partition of an offline-packed batch with *global* sequence metadata.

Semantics follow Megatron-Bridge's ``deepseek_v4_step`` contiguous partition, with our house rules:

* A packed batch holds ``[B, L, ...]`` token tensors (``tokens``/``input_ids``, ``labels``, ``loss_mask``,
  ``position_ids``, ``padding_mask``, MTP inputs, ...) and THD metadata (``cu_seqlens*``, ``max_seqlen*``, ...).
* CP rank ``r`` of ``C`` owns the contiguous token window ``[r*L/C, (r+1)*L/C)`` of every token tensor
  (the compressor needs contiguous windows). ``L % C == 0`` is required.
* The sequence-length metadata (:data:`SEQLEN_KEYS`) stays **global and unsliced** on every rank: the compressor
  and attention need the global document boundaries, e.g. ``cu_seqlens [0, 4, 8]`` of an ``L = 8`` batch stays
  ``[0, 4, 8]`` on both ranks of CP 2.
* :func:`packed_metadata_for_forward` picks the metadata the model forward needs and, unlike the peer, keeps
  ``padding_mask`` so pad tokens stay out of MoE routing and expert-bias statistics.

Malformed input raises ``ValueError`` (bad values) or ``KeyError`` (missing keys) naming the key and numbers.
"""

from __future__ import annotations

import operator
from typing import Any, Mapping

import torch


CURRENT_METADATA_KEYS: tuple[str, ...] = ("cu_seqlens_q", "cu_seqlens_kv", "cu_seqlens_q_padded",
                                          "cu_seqlens_kv_padded", "max_seqlen_q", "max_seqlen_kv")
LEGACY_METADATA_KEYS: tuple[str, ...] = ("cu_seqlens", "cu_seqlens_unpadded", "cu_seqlens_argmin",
                                         "cu_seqlens_unpadded_argmin", "max_seqlen")
SEQLEN_KEYS: frozenset[str] = frozenset(
    CURRENT_METADATA_KEYS + LEGACY_METADATA_KEYS + ("total_tokens", "token_count", "attention_mask"))
"""Keys that are never sliced by :func:`partition_packed_batch_contiguous` (global sequence metadata)."""

LENGTH_KEYS: tuple[str, ...] = ("tokens", "input_ids", "labels")
"""Keys, in order of preference, whose tensor's ``size(1)`` defines the packed length ``L``."""

_EXTRA_FORWARD_KEYS: tuple[str, ...] = ("total_tokens", "cp_partition_mode", "padding_mask")


def _as_int(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None


def _packed_length(batch: Mapping[str, Any]) -> tuple[str, int]:
    """(key, L): the first of :data:`LENGTH_KEYS` present as a tensor in ``batch`` and its ``size(1)``."""
    for key in LENGTH_KEYS:
        value = batch.get(key)
        if isinstance(value, torch.Tensor):
            if value.dim() < 2:
                raise ValueError(f"batch[{key!r}] must be [B, L, ...] to define the packed length, got shape "
                                 f"{tuple(value.shape)}")
            return key, int(value.shape[1])
    raise KeyError(f"packed batch has none of the keys {list(LENGTH_KEYS)} (as tensors) that define the packed "
                   f"length L; keys present: {sorted(batch)}")


def _metadata_only(batch: Mapping[str, Any]) -> bool:
    """A pipeline stage's batch without token tensors: no length key and no ``[B, L, ...]`` tensor to slice."""
    return not any(isinstance(v, torch.Tensor) and (k in LENGTH_KEYS or (v.dim() >= 2 and k not in SEQLEN_KEYS))
                   for k, v in batch.items())


def partition_packed_batch_contiguous(batch: Mapping[str, Any], cp_size: int, cp_rank: int) -> dict[str, Any]:
    """Slice every token tensor of a packed batch to CP rank ``cp_rank``'s contiguous window.

    The packed length ``L`` is ``size(1)`` of the first tensor among ``tokens``, ``input_ids``, ``labels``
    (in that order; ``tokens`` is Megatron's name, ``input_ids`` ours). A value is a *token tensor* when it is a
    tensor with ``dim >= 2``, ``size(1) == L`` and its key is not in :data:`SEQLEN_KEYS`; it becomes the view
    ``value[:, r*L/C:(r+1)*L/C]`` (shares storage with the input). Metadata keys in :data:`SEQLEN_KEYS`
    (``cu_seqlens*``, ``max_seqlen*``, ``total_tokens``, ``token_count``, ``attention_mask``), tensors without a
    token dimension and non-tensor values are passed through unchanged.

    Returns a new dict (the input is not modified) with ``cp_partition_mode = "contiguous"`` added.
    ``cp_size == 1``, and a batch holding only metadata (a middle pipeline stage without token tensors, as in
    Megatron-Bridge), return the batch contents unchanged (plus the mode key) without looking for ``L``.

    Raises:
        ValueError: ``cp_size < 1``, ``cp_rank`` outside ``[0, cp_size)``, or ``L % cp_size != 0``.
        KeyError: ``cp_size > 1``, a ``[B, L, ...]`` tensor to slice but none of ``tokens``/``input_ids``/``labels``
            to say what ``L`` is.
    """
    cp_size = _as_int(cp_size, "cp_size")
    cp_rank = _as_int(cp_rank, "cp_rank")
    if cp_size < 1:
        raise ValueError(f"cp_size must be >= 1, got {cp_size}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size) = [0, {cp_size}), got {cp_rank}")

    out = dict(batch)
    out["cp_partition_mode"] = "contiguous"
    if cp_size == 1 or _metadata_only(batch):
        return out

    key, length = _packed_length(batch)
    if length % cp_size != 0:
        next_multiple = -(-length // cp_size) * cp_size
        raise ValueError(
            f"packed length L={length} (batch[{key!r}].size(1)) is not divisible by cp_size={cp_size}; "
            f"set the packing size (packed_sequence_size / seq_len) to a multiple of cp_size, "
            f"e.g. {next_multiple}")
    chunk = length // cp_size
    start, stop = cp_rank * chunk, (cp_rank + 1) * chunk
    for name, value in batch.items():
        if name in SEQLEN_KEYS or not isinstance(value, torch.Tensor):
            continue
        if value.dim() >= 2 and value.shape[1] == length:
            out[name] = value[:, start:stop]
    return out


def packed_metadata_for_forward(batch: Mapping[str, Any]) -> dict[str, Any]:
    """The packed-sequence metadata the model forward needs, picked from ``batch``.

    * ``cu_seqlens_q`` present: the current key set ``cu_seqlens_q``, ``cu_seqlens_kv``, ``cu_seqlens_q_padded``,
      ``cu_seqlens_kv_padded``, ``max_seqlen_q``, ``max_seqlen_kv``.
    * else ``cu_seqlens`` present: the legacy set ``cu_seqlens``, ``cu_seqlens_unpadded``, ``cu_seqlens_argmin``,
      ``cu_seqlens_unpadded_argmin``, ``max_seqlen``.
    * neither present (an unpacked batch): no sequence metadata.

    A key whose value is None counts as absent (also for choosing the key set).

    In every case ``total_tokens``, ``cp_partition_mode`` and ``padding_mask`` are added when present (the peer
    drops ``padding_mask``; we keep it so pad tokens stay out of MoE routing), so an unpacked batch yields only
    those extra keys, or an empty dict. Keys absent from the batch or whose value is None are omitted. Values are
    returned as-is (no copies).
    """
    if batch.get("cu_seqlens_q") is not None:
        keys = CURRENT_METADATA_KEYS
    elif batch.get("cu_seqlens") is not None:
        keys = LEGACY_METADATA_KEYS
    else:
        keys = ()
    return {k: batch[k] for k in keys + _EXTRA_FORWARD_KEYS if batch.get(k) is not None}
