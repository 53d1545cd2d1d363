"""Per-forward attention metadata: positions, documents, RoPE tables, windows, and what CP must exchange.

Built once per forward by :func:`build_attention_metadata` and shared by every layer (MTP layers included).
The model sees context parallelism only through the ``cp`` argument (a ``CPContext``); everything here is
derived from the token metadata, so it is identical on every rank of a CP group.

Single rank (``cp`` None or size 1): keys are this block's rows and windows; ``halo == 0``.

CP of size C, rank r owning global tokens ``[r*L, (r+1)*L)`` (``L % shard_multiple == 0``):

* The token metadata (document ids, document-local positions, padding) is all-gathered once: O(S) integers.
* Window keys: ``halo = sliding_window - 1`` rows of K/V received from rank r-1 precede the block
  (``kv_*`` fields are ``[B, halo + L]``); rank 0's halo rows have document id 0 and are padding.
* Compressed keys: rank r needs only windows of the document its first token belongs to that started on an
  earlier rank (documents are contiguous, so no other earlier window is visible to any local query), i.e. the
  global windows ``[window_starts[ratio][r], (r+1)*L/ratio)``; ``key_windows[ratio]`` describes exactly those
  (received rows first, then the block's own). For one unpacked document this is every earlier window.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dsv4.config import DSV4Config, check_cp_length
from dsv4.model.compressor import WindowMetadata, window_metadata
from dsv4.model.moe import non_padding_tokens
from dsv4.model.rope import RopeTable, rope_inv_freq, rope_table
from dsv4.model.sparse_attention import chunk_document_starts


@dataclass
class AttentionMetadata:
    """Everything about positions/documents an attention layer needs, built once per forward.

    Query side (this rank's ``L`` tokens): ``position_ids``/``seq_ids`` ``[B, L]`` (doc-local positions,
    1-based document ids, 0 = pack padding), ``padding`` ``[B, L]`` bool or None (True = a slot no query may see
    and the MoE skips), ``rope_main``/``rope_compress`` ``[B, L, rope/2]``.
    Window-key side (``halo`` rows before the block, then the block): ``kv_seq_ids``/``kv_padding``
    ``[B, halo + L]`` (the halo rows arrive already RoPE'd by their owner).
    ``windows[r]``: the block's complete windows for each active ratio ``r`` (compressor input);
    ``key_windows[r]``: every compressed key a query may index (under CP: the needed earlier windows, then the
    block's); ``window_starts[r]``: per CP rank, the first global window it needs (empty on a single rank).
    ``full_seq_ids`` / ``full_padding``: ``[B, S]`` metadata of the whole row (the local tensors on one rank).
    ``real_tokens``: ``[N]`` flat indices of the local non-padding tokens (None without padding): the tokens
    every MoE layer routes, found once per forward (a host sync on GPUs) instead of once per layer.
    ``halo_rows``: under CP, ``(send, recv)``: the batch rows whose document continues from this rank into the next
    (their halo and compressor boundary go to the successor) and from the previous rank into this one (received);
    a row whose first local token starts a document or is padding needs nothing. None on a single rank.
    ``chunk_starts``: per query chunk of ``attention_chunk_size``, the local row where its earliest document begins
    (:func:`~dsv4.model.sparse_attention.chunk_document_starts`, read with the metadata's one host sync): the torch
    kernels score only the compressed rows of a chunk's own documents.
    """

    position_ids: Tensor
    seq_ids: Tensor
    padding: Tensor | None
    rope_main: RopeTable
    rope_compress: RopeTable
    kv_seq_ids: Tensor
    kv_padding: Tensor
    windows: dict[int, WindowMetadata]
    key_windows: dict[int, WindowMetadata]
    halo: int = 0
    window_starts: dict[int, list[int]] = field(default_factory=dict)
    full_seq_ids: Tensor | None = None
    full_padding: Tensor | None = None
    real_tokens: Tensor | None = None
    chunk_starts: list[int] | None = None
    halo_rows: tuple[list[int], list[int]] | None = None


def _continues_across(full_seq: Tensor, full_pad: Tensor, start: int, length: int) -> Tensor:
    """``[2, B]`` bool: whether each row's document continues across this block's end into the next rank (row 0)
    and across its start from the previous rank (row 1): the tokens on both sides are real (document id > 0, not
    padding) and of one document. False at the sequence's ends."""
    real = (full_seq > 0) & ~full_pad

    def across(boundary: int) -> Tensor:
        if boundary <= 0 or boundary >= full_seq.shape[1]:
            return torch.zeros(full_seq.shape[0], dtype=torch.bool, device=full_seq.device)
        return real[:, boundary] & real[:, boundary - 1] & (full_seq[:, boundary] == full_seq[:, boundary - 1])

    return torch.stack((across(start + length), across(start)))


def check_cp_layout(config: DSV4Config, local_len: int, cp) -> int:
    """Validate a CP forward before any collective runs; return the halo.

    Every rank of a contiguous shard has the same ``L``, so every rank raises (or not) together.
    """
    size = cp.size
    check_cp_length(local_len * size, size, config.shard_multiple, what="global sequence length")
    halo = config.sliding_window - 1  # K/V rows a rank needs from its predecessor
    if cp.halo is not None:
        if cp.halo < halo:
            raise ValueError(
                f"CPContext.halo={cp.halo} is smaller than the {halo} rows the sliding window "
                f"({config.sliding_window}) needs from the previous rank"
            )
        halo = cp.halo
    if halo > local_len:
        raise ValueError(
            f"context parallel forward: the local shard has L={local_len} tokens but each rank needs a halo of "
            f"{halo} rows (sliding_window - 1) from its predecessor; use fewer CP ranks ({size}) or a longer "
            "sequence"
        )
    return halo


def _run_starts(seq_ids: Tensor) -> Tensor:
    """``[B, S]``: index of the first token of the run of equal ids each token belongs to."""
    s = seq_ids.shape[1]
    idx = torch.arange(s, device=seq_ids.device).expand_as(seq_ids)
    change = torch.ones_like(seq_ids, dtype=torch.bool)
    change[:, 1:] = seq_ids[:, 1:] != seq_ids[:, :-1]
    return torch.where(change, idx, torch.zeros_like(idx)).cummax(dim=1).values


def window_starts(full_seq_ids: Tensor, ratio: int, local_len: int, cp_size: int) -> Tensor:
    """``[C]`` per rank: the first global window (of ``ratio``) a rank needs, ``<= rank * L / ratio``.

    Rank j needs the earlier windows of the document its first token belongs to (union over the batch rows);
    pack padding (id 0) needs none.
    """
    firsts = torch.arange(cp_size, device=full_seq_ids.device) * local_len  # [C]
    doc = full_seq_ids[:, firsts]  # [B, C]
    run_start = _run_starts(full_seq_ids)[:, firsts]  # [B, C]
    own = (firsts // ratio).expand_as(doc)
    need = torch.where(doc > 0, run_start // ratio, own)
    return need.min(dim=0).values


def build_attention_metadata(
    config: DSV4Config,
    position_ids: Tensor,
    packed_seq_ids: Tensor | None = None,
    padding_mask: Tensor | None = None,
    cp=None,
) -> AttentionMetadata:
    """Build the per-token attention metadata for one forward (reused by every layer).

    Args:
        config: the model config (rope dims/thetas, active ratios, window).
        position_ids: ``[B, L]`` int, document-local positions (global positions for unpacked rows).
        packed_seq_ids: ``[B, L]`` int, 1-based document ids, 0 = pack padding; None = one document per row.
        padding_mask: ``[B, L]`` bool, True = a key no query may see; None = no padding.
        cp: ``None`` or a ``CPContext``; with more than one rank the metadata is all-gathered once.
    Raises:
        ValueError: bad shapes; under CP a local length that is not a multiple of the shard multiple or shorter
            than the halo (before any collective); a document whose windows are not aligned to its ratio.
    """
    if position_ids.dim() != 2:
        raise ValueError(f"build_attention_metadata: position_ids must be [B, L], got {tuple(position_ids.shape)}")
    b, length = position_ids.shape
    device = position_ids.device
    position_ids = position_ids.long()
    seq_ids = torch.ones_like(position_ids) if packed_seq_ids is None else packed_seq_ids.long()
    padding = torch.zeros(b, length, dtype=torch.bool, device=device) if padding_mask is None else padding_mask.bool()
    for name, t in (("packed_seq_ids", seq_ids), ("padding_mask", padding)):
        if t.shape != (b, length):
            raise ValueError(f"build_attention_metadata: {name} shape {tuple(t.shape)} != position_ids {(b, length)}")

    cp_size = cp.size if cp is not None else 1
    if cp_size > 1:
        halo = check_cp_layout(config, length, cp)
        # one gather of int32 (ids and positions fit; 12 bytes per token) instead of three int64 gathers
        stacked = torch.stack((seq_ids, position_ids, padding.long()), dim=1).to(torch.int32)  # [B, 3, L]
        full = cp.all_gather_metadata(stacked, dim=2, kind="metadata").long()  # [B, 3, S]
        full_seq, full_pos, full_pad = full[:, 0], full[:, 1], full[:, 2].bool()
        start = cp.rank * length
    else:
        halo, start = 0, 0
        full_seq, full_pos, full_pad = seq_ids, position_ids, padding

    rope_dim = config.qk_rope_head_dim
    inv_main = rope_inv_freq(rope_dim, config.rope_theta)
    inv_compress = rope_inv_freq(rope_dim, config.compress_rope_theta, config.rope_scaling)
    rope_main = rope_table(position_ids, inv_main)
    rope_compress = rope_table(position_ids, inv_compress)

    if halo:
        lo = start - halo
        if lo >= 0:
            h_seq, h_pad = full_seq[:, lo:start], full_pad[:, lo:start]
        else:  # rank 0: the halo rows are zeros that no query may see
            h_seq = torch.zeros(b, halo, dtype=torch.long, device=device)
            h_pad = torch.ones(b, halo, dtype=torch.bool, device=device)
        kv_seq, kv_pad = torch.cat((h_seq, seq_ids), 1), torch.cat((h_pad, padding), 1)
    else:
        kv_seq, kv_pad = seq_ids, padding

    windows: dict[int, WindowMetadata] = {}
    key_windows: dict[int, WindowMetadata] = {}
    starts: dict[int, Tensor] = {}
    full_windows: dict[int, tuple[Tensor, Tensor]] = {}
    misaligned = []
    for ratio in config.active_ratios:
        full_win_seq, full_win_pos = full_windows[ratio] = window_metadata(full_seq, full_pos, ratio)
        first_pos = full_pos[:, : full_win_seq.shape[1] * ratio : ratio]
        misaligned.append(((full_win_seq > 0) & (first_pos % ratio != 0)).any())
        w0, n = start // ratio, length // ratio
        win_seq, win_pos = full_win_seq[:, w0 : w0 + n], full_win_pos[:, w0 : w0 + n]
        prev = full_win_seq[:, w0 - 1] if w0 > 0 else torch.zeros(b, dtype=torch.long, device=device)
        windows[ratio] = WindowMetadata(
            ratio=ratio,
            seq_ids=win_seq,
            positions=win_pos,
            rope=rope_table(win_pos * ratio, inv_compress),
            prev_seq_ids=prev,
        )
        key_windows[ratio] = windows[ratio]
        if cp_size > 1:
            starts[ratio] = window_starts(full_seq, ratio, length, cp_size)
    flags = torch.stack(misaligned).any().reshape(1) if misaligned else torch.zeros(1, dtype=torch.bool)
    chunk_starts = chunk_document_starts(seq_ids, position_ids, config.attention_chunk_size)
    continues = _continues_across(full_seq, full_pad, start, length) if cp_size > 1 else None
    extra = [chunk_starts] + ([] if continues is None else [continues.reshape(-1)])
    synced = torch.cat([flags.long().cpu()] + [t.long().cpu() for t in extra] + [s.cpu() for s in starts.values()])
    synced = synced.tolist()  # one host sync
    n_extra = sum(t.numel() for t in extra)
    chunk_start_list = synced[1:1 + chunk_starts.numel()]
    halo_rows = None
    if continues is not None:  # [2, B]: from me into my successor, from my predecessor into me
        flat = synced[1 + chunk_starts.numel():1 + n_extra]
        halo_rows = ([i for i in range(b) if flat[i]], [i for i in range(b) if flat[b + i]])
    synced = synced[:1] + synced[1 + n_extra:]
    if synced[0]:
        raise ValueError(
            "build_attention_metadata: a compressor window starts at a document-local position that is not a "
            f"multiple of its ratio (ratios {config.active_ratios}); every document must start on a multiple of "
            f"{config.shard_multiple} with positions counted from 0 (pack with dsv4.data.pack_documents or "
            "dsv4.packing.aligned_packed_layout), otherwise compressed keys would leak future tokens"
        )
    window_start_lists: dict[int, list[int]] = {}
    for i, ratio in enumerate(starts):
        window_start_lists[ratio] = synced[1 + i * cp_size : 1 + (i + 1) * cp_size]
        first, end = window_start_lists[ratio][cp.rank], (start + length) // ratio
        full_win_seq, full_win_pos = full_windows[ratio]
        key_windows[ratio] = WindowMetadata(
            ratio=ratio, seq_ids=full_win_seq[:, first:end], positions=full_win_pos[:, first:end]
        )
    return AttentionMetadata(
        position_ids=position_ids,
        seq_ids=seq_ids,
        padding=None if padding_mask is None else padding,
        rope_main=rope_main,
        rope_compress=rope_compress,
        kv_seq_ids=kv_seq,
        kv_padding=kv_pad,
        windows=windows,
        key_windows=key_windows,
        halo=halo,
        window_starts=window_start_lists,
        full_seq_ids=full_seq,
        full_padding=full_pad,
        real_tokens=None if padding_mask is None else non_padding_tokens(padding),
        chunk_starts=chunk_start_list,
        halo_rows=halo_rows,
    )
