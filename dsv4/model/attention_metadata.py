"""Per-forward attention metadata: positions, documents, RoPE tables, windows, and what CP must exchange.

Built once per forward by :func:`build_attention_metadata` and shared by every layer (MTP layers included).
The model sees context parallelism only through the ``cp`` argument (a ``CPContext``); everything here is
derived from the token metadata, so it is identical on every rank of a CP group.

Single rank (``cp`` None or size 1): keys are this block's rows and windows; ``halo == 0``.

CP of size C with layout ``cp.layout`` (:class:`~dsv4.cp.layout.CPLayout`): a row of ``S`` columns is cut into
``V`` chunks of ``l`` columns (``l % shard_multiple == 0``), this rank holds ``k = V / C`` of them, and every local
row ``[k B, l]`` is one chunk ``v`` of one whole row ``b`` (contiguous split: ``k = 1``, chunk = rank):

* The token metadata (document ids, document-local positions, padding) is gathered once into whole rows.
* Window keys: ``halo = sliding_window - 1`` K/V rows of chunk ``v - 1`` precede each local row (``kv_*`` fields are
  ``[k B, halo + l]``); they travel only to a row whose first token continues a document from chunk ``v - 1``
  (``halo_route``), the others get zeros marked as padding.
* Compressed keys: local row ``(b, v)`` needs only the earlier windows of the document its first token belongs to
  (documents are contiguous, so no other earlier window is visible to any of its queries): global windows
  ``[start, v l / ratio)``, received point to point (``preceding[ratio]``), then its own. Rows needing fewer are
  left-padded with invisible windows (document id 0) to the rank's longest need; ``key_floors[ratio]`` tells the
  kernels where each row's visible keys begin, per query chunk, so the padding costs no scoring work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dsv4.config import DSV4Config, check_cp_length
from dsv4.cp.collectives import HaloRoute, RowPlan, preceding_transfers, row_plan
from dsv4.cp.layout import CPLayout
from dsv4.model.compressor import WindowMetadata, window_metadata
from dsv4.model.moe import non_padding_tokens
from dsv4.model.rope import RopeTable, rope_inv_freq, rope_table
from dsv4.model.sparse_attention import chunk_document_starts, document_floors


@dataclass
class AttentionMetadata:
    """Everything about positions/documents an attention layer needs, built once per forward.

    Query side (this rank's ``R`` local rows of ``L`` tokens): ``position_ids``/``seq_ids`` ``[R, L]`` (doc-local
    positions, 1-based document ids, 0 = pack padding), ``padding`` ``[R, L]`` bool or None (True = a slot no query
    may see and the MoE skips), ``rope_main``/``rope_compress`` ``[R, L, rope/2]``.
    Window-key side (``halo`` rows before the block, then the block): ``kv_seq_ids``/``kv_padding``
    ``[R, halo + L]`` (the halo rows arrive already RoPE'd by their owner).
    ``windows[r]``: the block's complete windows for each active ratio ``r`` (compressor input);
    ``key_windows[r]``: every compressed key a query may index (under CP: the needed earlier windows, then the
    block's, left-padded with document id 0 to a common length); ``key_floors[r]``: per local row and query chunk of
    ``attention_chunk_size``, the first key row any of the chunk's queries may see (the rows before it are other
    documents' or padding; read with the metadata's one host sync), so the torch kernels score only a chunk's own
    documents.
    ``full_seq_ids`` / ``full_padding``: ``[B, S]`` metadata of the whole rows (the local tensors on one rank);
    ``columns`` ``[R, L]``: the global column of every local token and ``row_batch`` ``[R]`` its whole row.
    ``real_tokens``: ``[N]`` flat indices of the local non-padding tokens (None without padding): the tokens
    every MoE layer routes, found once per forward (a host sync on GPUs) instead of once per layer.
    ``halo_route``: under CP, which local rows feed which with their last rows (:class:`~dsv4.cp.collectives.
    HaloRoute`): only rows whose document continues across a chunk boundary; None on a single rank.
    ``preceding[r]``: under CP, this rank's part of the causal gather of compressed rows (:class:`~dsv4.cp.
    collectives.RowPlan`); empty on a single rank.
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
    key_floors: dict[int, list[list[int]]] = field(default_factory=dict)
    full_seq_ids: Tensor | None = None
    full_padding: Tensor | None = None
    columns: Tensor | None = None
    row_batch: Tensor | None = None
    real_tokens: Tensor | None = None
    halo_route: HaloRoute | None = None
    preceding: dict[int, RowPlan] = field(default_factory=dict)


def document_ids_without_trailing_padding(seq_ids: Tensor, padding: Tensor) -> Tensor:
    """``seq_ids`` with the padding that ends a row (every later slot padding too) set to 0: a slot no later query
    belongs to. Padding inside a document (a caller's mask) keeps its id, since later queries of the document may
    still need what precedes it."""
    trailing = padding.flip(1).long().cumprod(1).flip(1).bool()
    return seq_ids.masked_fill(trailing, 0)


def _continues_into(doc: Tensor, length: int, chunks: int) -> Tensor:
    """``[B, V]`` bool: whether chunk ``v``'s first token continues the document of chunk ``v - 1``'s last token
    (same id > 0 in ``doc``, :func:`document_ids_without_trailing_padding`); False for chunk 0."""
    firsts = torch.arange(1, chunks, device=doc.device) * length
    across = (doc[:, firsts] > 0) & (doc[:, firsts] == doc[:, firsts - 1])
    return torch.cat([torch.zeros_like(across[:, :1]), across], dim=1)


def check_cp_layout(config: DSV4Config, local_len: int, cp) -> int:
    """Validate a CP forward before any collective runs; return the halo.

    Every chunk of the layout has the same ``l`` columns, so every rank raises (or not) together.
    """
    chunks = cp.layout.num_chunks
    check_cp_length(local_len * chunks, chunks, config.shard_multiple, what="global sequence length")
    halo = config.sliding_window - 1  # K/V rows a chunk needs from its predecessor
    if cp.halo is not None:
        if cp.halo < halo:
            raise ValueError(
                f"CPContext.halo={cp.halo} is smaller than the {halo} rows the sliding window "
                f"({config.sliding_window}) needs from the previous rank"
            )
        halo = cp.halo
    if halo > local_len:
        raise ValueError(
            f"context parallel forward: each local chunk has L={local_len} tokens but needs a halo of "
            f"{halo} rows (sliding_window - 1) from its predecessor; use fewer CP ranks ({cp.size}) or a longer "
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


def window_starts(doc: Tensor, ratio: int, length: int, chunks: int) -> Tensor:
    """``[B, V]``: the first global window (of ``ratio``) chunk ``v`` of row ``b`` needs, ``<= v * length / ratio``:
    the earlier windows of the document its first token belongs to (``doc``: document ids without trailing padding;
    0 needs none)."""
    firsts = torch.arange(chunks, device=doc.device) * length  # [V]
    first_doc = doc[:, firsts]  # [B, V]
    run_start = _run_starts(doc)[:, firsts]
    return torch.where(first_doc > 0, run_start // ratio, (firsts // ratio).expand_as(first_doc))


def _rows_of(full: Tensor, row_batch: Tensor, cols: Tensor, fill) -> Tensor:
    """``full[row_batch[i], cols[i, j]]`` (``[R, n]``), ``fill`` where ``cols`` is outside ``full``."""
    inside = (cols >= 0) & (cols < full.shape[1])
    if not full.shape[1]:
        return torch.full(cols.shape, fill, dtype=full.dtype, device=full.device)
    picked = full[row_batch[:, None], cols.clamp(0, full.shape[1] - 1)]
    return torch.where(inside, picked, torch.full_like(picked, fill))


def build_attention_metadata(
    config: DSV4Config,
    position_ids: Tensor,
    packed_seq_ids: Tensor | None = None,
    padding_mask: Tensor | None = None,
    cp=None,
) -> AttentionMetadata:
    """Build the per-token attention metadata for one forward (reused by every layer).

    Args:
        config: the model config (rope dims/thetas, active ratios, window, attention chunk size).
        position_ids: ``[R, L]`` int, document-local positions (global positions for unpacked rows).
        packed_seq_ids: ``[R, L]`` int, 1-based document ids, 0 = pack padding; None = one document per row.
        padding_mask: ``[R, L]`` bool, True = a key no query may see; None = no padding.
        cp: ``None`` or a ``CPContext``; with more than one rank the metadata is gathered once and the local rows
            are the rank's chunks (``cp.layout``).
    Raises:
        ValueError: bad shapes; under CP a local length that is not a multiple of the shard multiple or shorter
            than the halo, or a row count that is not a multiple of the chunks per rank (before any collective); a
            document whose windows are not aligned to its ratio.
    """
    if position_ids.dim() != 2:
        raise ValueError(f"build_attention_metadata: position_ids must be [B, L], got {tuple(position_ids.shape)}")
    rows, length = position_ids.shape
    device = position_ids.device
    position_ids = position_ids.long()
    seq_ids = torch.ones_like(position_ids) if packed_seq_ids is None else packed_seq_ids.long()
    padding = torch.zeros(rows, length, dtype=torch.bool, device=device) if padding_mask is None else padding_mask.bool()
    for name, t in (("packed_seq_ids", seq_ids), ("padding_mask", padding)):
        if t.shape != (rows, length):
            raise ValueError(f"build_attention_metadata: {name} shape {tuple(t.shape)} != position_ids {(rows, length)}")

    layout = cp.layout if cp is not None and cp.size > 1 else CPLayout()
    if rows % layout.chunks_per_rank:
        raise ValueError(f"build_attention_metadata: {rows} local rows under cp_balance={layout.balance!r} must be "
                         f"{layout.chunks_per_rank} chunks per whole row (cut the batch with the same layout)")
    batch, chunks = rows // layout.chunks_per_rank, layout.num_chunks
    if layout.size > 1:
        halo = check_cp_layout(config, length, cp)
        # one gather of int32 (ids and positions fit; 12 bytes per token) instead of three int64 gathers
        stacked = torch.stack((seq_ids, position_ids, padding.long()), dim=-1).to(torch.int32)  # [R, L, 3]
        full = cp.gather_rows(stacked, kind="metadata").long()  # [B, S, 3]
        full_seq, full_pos, full_pad = full[..., 0], full[..., 1], full[..., 2].bool()
        local = layout.local_rows(cp.rank, batch)
    else:
        halo = 0
        full_seq, full_pos, full_pad = seq_ids, position_ids, padding
        local = [(b, 0) for b in range(rows)]
    row_batch = torch.tensor([b for b, _ in local], dtype=torch.long, device=device)
    row_start = torch.tensor([v * length for _, v in local], dtype=torch.long, device=device)
    columns = row_start[:, None] + torch.arange(length, device=device)

    rope_dim = config.qk_rope_head_dim
    inv_main = rope_inv_freq(rope_dim, config.rope_theta)
    inv_compress = rope_inv_freq(rope_dim, config.compress_rope_theta, config.rope_scaling)
    rope_main = rope_table(position_ids, inv_main)
    rope_compress = rope_table(position_ids, inv_compress)

    if halo:  # the halo rows' metadata; before the row's first column they are padding no query may see
        cols = row_start[:, None] - halo + torch.arange(halo, device=device)
        kv_seq = torch.cat((_rows_of(full_seq, row_batch, cols, 0), seq_ids), 1)
        kv_pad = torch.cat((_rows_of(full_pad, row_batch, cols, True), padding), 1)
    else:
        kv_seq, kv_pad = seq_ids, padding

    doc = document_ids_without_trailing_padding(full_seq, full_pad)
    windows: dict[int, WindowMetadata] = {}
    starts: dict[int, Tensor] = {}
    full_windows: dict[int, tuple[Tensor, Tensor]] = {}
    misaligned = []
    for ratio in config.active_ratios:
        full_win_seq, full_win_pos = full_windows[ratio] = window_metadata(full_seq, full_pos, ratio)
        first_pos = full_pos[:, : full_win_seq.shape[1] * ratio : ratio]
        misaligned.append(((full_win_seq > 0) & (first_pos % ratio != 0)).any())
        w0, n = row_start // ratio, length // ratio
        cols = w0[:, None] + torch.arange(n, device=device)
        win_pos = _rows_of(full_win_pos, row_batch, cols, 0)
        windows[ratio] = WindowMetadata(
            ratio=ratio,
            seq_ids=_rows_of(full_win_seq, row_batch, cols, 0),
            positions=win_pos,
            rope=rope_table(win_pos * ratio, inv_compress),
            prev_seq_ids=_rows_of(full_win_seq, row_batch, (w0 - 1)[:, None], 0)[:, 0],
        )
        if layout.size > 1:
            starts[ratio] = window_starts(doc, ratio, length, chunks)
    flags = torch.stack(misaligned).any().reshape(1) if misaligned else torch.zeros(1, dtype=torch.bool)
    chunk_starts = chunk_document_starts(seq_ids, position_ids, config.attention_chunk_size)  # [R, n_chunks]
    extra = [chunk_starts.reshape(-1)]
    if layout.size > 1:
        extra.append(_continues_into(doc, length, chunks).reshape(-1))
    extra += [starts[r].reshape(-1) for r in starts]
    synced = torch.cat([flags.long().cpu()] + [t.long().cpu() for t in extra]).tolist()  # one host sync
    if synced[0]:
        raise ValueError(
            "build_attention_metadata: a compressor window starts at a document-local position that is not a "
            f"multiple of its ratio (ratios {config.active_ratios}); every document must start on a multiple of "
            f"{config.shard_multiple} with positions counted from 0 (pack with dsv4.data.pack_documents or "
            "dsv4.packing.aligned_packed_layout), otherwise compressed keys would leak future tokens"
        )
    values = iter(synced[1:])
    take = lambda count: [next(values) for _ in range(count)]  # noqa: E731 - consume the synced list in order
    per_row_chunks = chunk_starts.shape[1]
    chunk_start_rows = [take(per_row_chunks) for _ in range(rows)]

    key_windows = dict(windows)
    key_floors: dict[int, list[list[int]]] = {}
    preceding: dict[int, RowPlan] = {}
    halo_route = None
    if layout.size > 1:
        continues = [take(chunks) for _ in range(batch)]  # [B][V]
        halo_route = HaloRoute(tuple(
            (*_local_row(layout, v - 1, b, batch), *_local_row(layout, v, b, batch))
            for v in range(1, chunks) for b in range(batch) if continues[b][v]
        ))
        owners = [layout.owner(v) for v in range(chunks)]
        rank_chunks = [layout.chunks(r) for r in range(layout.size)]
        for ratio in starts:
            need = [take(chunks) for _ in range(batch)]  # [B][V] first global window
            n = length // ratio
            transfers, out_len = preceding_transfers(need, rank_chunks, owners, n)
            width = out_len[cp.rank]
            preceding[ratio] = row_plan(transfers, cp.rank, rows, width)
            earlier = [v * n - need[b][v] for b, v in local]
            first = torch.tensor([v * n + n - width for _, v in local], dtype=torch.long, device=device)
            cols = first[:, None] + torch.arange(width, device=device)
            visible = cols >= torch.tensor([need[b][v] for b, v in local], device=device)[:, None]
            full_win_seq, full_win_pos = full_windows[ratio]
            key_windows[ratio] = WindowMetadata(
                ratio=ratio,
                seq_ids=_rows_of(full_win_seq, row_batch, cols, 0).masked_fill(~visible, 0),
                positions=_rows_of(full_win_pos, row_batch, cols, 0).masked_fill(~visible, 0),
            )
            key_floors[ratio] = document_floors(chunk_start_rows, width, n, ratio, earlier)
    for ratio in windows:
        if ratio not in key_floors:
            n = windows[ratio].seq_ids.shape[1]
            key_floors[ratio] = document_floors(chunk_start_rows, n, n, ratio)
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
        key_floors=key_floors,
        full_seq_ids=full_seq,
        full_padding=full_pad,
        columns=columns,
        row_batch=row_batch,
        real_tokens=None if padding_mask is None else non_padding_tokens(padding),
        halo_route=halo_route,
        preceding=preceding,
    )


def _local_row(layout: CPLayout, chunk: int, b: int, batch: int) -> tuple[int, int]:
    """``(rank, local row)`` holding chunk ``chunk`` of whole row ``b``."""
    rank, slot = layout.owner(chunk)
    return rank, slot * batch + b
