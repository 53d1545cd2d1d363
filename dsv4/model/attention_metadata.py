"""Per-forward attention metadata: positions, documents, RoPE tables, windows, and what CP must exchange.

Built once per forward by :func:`build_attention_metadata` and shared by every layer (MTP layers included).
The model sees context parallelism only through the ``cp`` argument
(:class:`~dsv4.model.context_parallel.ContextParallel`); everything here is derived from the token metadata, so it
is identical on every rank of a CP group.

Single rank (``cp`` None or size 1): keys are this block's rows and windows; ``halo == 0``.

CP of size C: a row of ``S`` columns is cut into ``V = cp.num_chunks`` chunks of ``l`` columns
(``l % shard_multiple == 0``), this rank holds ``k = cp.chunks_per_rank`` of them, and every local row ``[k B, l]`` is
one chunk ``v`` of one whole row ``b`` (``cp.local_rows``; contiguous split: ``k = 1``, chunk = rank). Which rows
travel where is planned by ``cp.plan_routes`` from the document runs resolved here:

* Token metadata crosses ranks as one int64 per chunk (:mod:`~dsv4.model.chunk_summary`, one all-gather per
  forward); the halo's own metadata only when a caller's padding lies inside a document (``metadata_halo``). Never
  the row's token metadata. (Multi-token prediction receives the ids and labels it shifts in, ``mtp_metadata``.)
* Window keys: ``halo = sliding_window - 1`` K/V rows of chunk ``v - 1`` precede each local row (``kv_*`` fields are
  ``[k B, halo + l]``); they travel only to a row whose first token continues a document from chunk ``v - 1``
  (``routes.halo``), and only that document's rows: a document that began ``d < halo`` columns before the chunk
  sends its ``d`` (right-aligned). The slots nothing fills are zeros marked as padding.
* Compressed keys: local row ``(b, v)`` needs only the earlier windows of the document its first token belongs to
  (documents are contiguous, so no other earlier window is visible to any of its queries): global windows
  ``[start, v l / ratio)``, received point to point (``routes.preceding[ratio]``), then its own. Rows needing fewer are
  left-padded with invisible windows (document id 0) to the rank's longest need; ``key_floors[ratio]`` tells the
  kernels where each row's visible keys begin, per query chunk, so the padding costs no scoring work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from dsv4.config import DSV4Config, check_cp_length
from dsv4.model.chunk_summary import chunk_summaries, misaligned_error, misaligned_windows, row_runs
from dsv4.model.compressor import WindowMetadata, window_metadata
from dsv4.model.context_parallel import ContextParallel, CPRoutes, is_parallel
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
    ``real_tokens``: ``[N]`` flat indices of the local non-padding tokens (None without padding): the tokens
    every MoE layer routes, found once per forward (a host sync on GPUs) instead of once per layer.
    ``routes``: under CP, the forward's exchanges (:class:`~dsv4.model.context_parallel.CPRoutes`: the halo route,
    only rows whose document continues across a chunk boundary; the causal gathers of compressed rows; the route
    multi-token prediction reads the next chunk's first tokens through); None on a single rank.
    ``next_rows`` ``[R]`` bool: under CP, which local rows' documents continue into the next chunk; None on a single
    rank.
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
    real_tokens: Tensor | None = None
    routes: CPRoutes | None = None
    next_rows: Tensor | None = None


def check_cp_layout(config: DSV4Config, local_len: int, cp: ContextParallel) -> int:
    """Validate a CP forward before any collective runs; return the halo.

    Every chunk of the layout has the same ``l`` columns, so every rank raises (or not) together.
    """
    chunks = cp.num_chunks
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


def build_attention_metadata(
    config: DSV4Config,
    position_ids: Tensor,
    packed_seq_ids: Tensor | None = None,
    padding_mask: Tensor | None = None,
    cp: ContextParallel | None = None,
) -> AttentionMetadata:
    """Build the per-token attention metadata for one forward (reused by every layer).

    Args:
        config: the model config (rope dims/thetas, active ratios, window, attention chunk size).
        position_ids: ``[R, L]`` int, document-local positions (global positions for unpacked rows).
        packed_seq_ids: ``[R, L]`` int, 1-based document ids, 0 = pack padding; None = one document per row.
        padding_mask: ``[R, L]`` bool, True = a key no query may see; None = no padding.
        cp: ``None`` or a :class:`~dsv4.model.context_parallel.ContextParallel`; with more than one rank the local
            rows are the rank's chunks (``cp.local_rows``) and the chunks' summaries are gathered once.
    Raises:
        ValueError: bad shapes; under CP a local length that is not a multiple of the shard multiple or shorter
            than the halo, or a row count that is not a multiple of the chunks per rank (before any collective); a
            document whose windows are not aligned to its ratio; under CP, positions that do not restart at 0 per
            document or count up by one inside it (on every rank, before any layer).
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

    parallel = is_parallel(cp)
    per_row = cp.chunks_per_rank if parallel else 1
    if rows % per_row:
        raise ValueError(f"build_attention_metadata: {rows} local rows under cp_balance={cp.balance!r} must be "
                         f"{per_row} chunks per whole row (cut the batch with the same layout)")
    batch, chunks = rows // per_row, (cp.num_chunks if parallel else 1)
    ratios = list(config.active_ratios)
    halo = check_cp_layout(config, length, cp) if parallel else 0
    local = cp.local_rows(batch) if parallel else [(b, 0) for b in range(rows)]

    rope_dim = config.qk_rope_head_dim
    inv_main = rope_inv_freq(rope_dim, config.rope_theta)
    inv_compress = rope_inv_freq(rope_dim, config.compress_rope_theta, config.rope_scaling)
    windows: dict[int, WindowMetadata] = {}
    for ratio in ratios:
        win_seq, win_pos = window_metadata(seq_ids, position_ids, ratio)
        windows[ratio] = WindowMetadata(ratio=ratio, seq_ids=win_seq, positions=win_pos,
                                        rope=rope_table(win_pos * ratio, inv_compress))

    # under CP one gather of one int64 per chunk (not the row's tokens), read to the host with the chunk starts
    chunk_starts = chunk_document_starts(seq_ids, position_ids, config.attention_chunk_size)  # [R, n_chunks]
    if parallel:
        summary = chunk_summaries(seq_ids, position_ids, padding, ratios, config.shard_multiple)  # [R] int64
        shared = cp.gather_rows(summary[:, None], kind="metadata")  # [B, V]
    else:
        shared = misaligned_windows(seq_ids, position_ids, ratios)
    host = torch.cat([chunk_starts.reshape(-1).cpu(), shared.reshape(-1).long().cpu()]).tolist()  # one host sync
    per_row_chunks = chunk_starts.shape[1]
    chunk_start_rows = [host[i * per_row_chunks:(i + 1) * per_row_chunks] for i in range(rows)]
    flat = host[rows * per_row_chunks:]
    if parallel:
        summaries = [flat[b * chunks:(b + 1) * chunks] for b in range(batch)]
        runs = row_runs(summaries, length, ratios, config.shard_multiple)
    elif any(flat):
        raise misaligned_error(ratios, config.shard_multiple)

    key_windows = dict(windows)
    key_floors: dict[int, list[list[int]]] = {}
    routes = next_rows = None
    kv_seq, kv_pad = seq_ids, padding
    if parallel:
        need = {ratio: [[runs.need(b, v, ratio) for v in range(chunks)] for b in range(batch)] for ratio in ratios}
        # per chunk, how many columns of the document its first token continues precede it (0: it starts fresh): no
        # halo carries more rows than that, since no query reads an earlier document's rows or padding
        depths = [[0 if runs.start[b][v] is None else v * length - runs.start[b][v] for v in range(chunks)]
                  for b in range(batch)]
        routes = cp.plan_routes(batch, length, depths, need)
        # per local row, the column where the document its first token continues began (-1: it starts fresh)
        continued_from = torch.tensor([-1 if runs.start[b][v] is None else runs.start[b][v] for b, v in local],
                                      dtype=torch.long, device=device)
        # the halo's own metadata: the continued document's tokens from its start on, all real; only a caller's padding
        # inside a document makes it travel (with the halo route)
        span = max(halo, max((r for r in ratios if r == 4), default=0))
        if runs.caller_padding:
            tail = torch.stack((seq_ids[:, length - span:], (~padding[:, length - span:]).long()), dim=-1).int()
            received = cp.halo_exchange(tail, span, dim=1, kind="metadata_halo", route=routes.halo)  # [R, span, 2]
            h_seq, h_real = received[..., 0].long(), received[..., 1].bool()
        else:
            firsts = torch.tensor([v * length for _, v in local], dtype=torch.long, device=device)
            cols = firsts[:, None] - span + torch.arange(span, device=device)
            h_real = (continued_from[:, None] >= 0) & (cols >= continued_from[:, None])
            h_seq = torch.where(h_real, seq_ids[:, :1], torch.zeros_like(cols))
        kv_seq = torch.cat((h_seq[:, span - halo:], seq_ids), 1)
        kv_pad = torch.cat((~h_real[:, span - halo:], padding), 1)
        for ratio in ratios:
            if ratio == 4:  # the window before the chunk: valid when its 4 tokens share an id > 0
                before = h_seq[:, span - ratio:]
                valid = (before[:, 0] > 0) & (before == before[:, :1]).all(-1)
                windows[ratio].prev_seq_ids = torch.where(valid, before[:, 0], torch.zeros_like(before[:, 0]))
        # multi-token prediction reads the first tokens of the chunk a row continues into, from that chunk
        next_rows = torch.zeros(rows, dtype=torch.bool, device=device)
        next_rows[list(routes.continues_next)] = True
        for ratio in ratios:
            n, width = length // ratio, routes.preceding_width[ratio]
            earlier = [v * n - need[ratio][b][v] for b, v in local]
            key_windows[ratio] = _key_windows(windows[ratio], seq_ids[:, 0], continued_from, local, need[ratio], width,
                                              ratio, length)
            key_floors[ratio] = document_floors(chunk_start_rows, width, n, ratio, earlier)
    for ratio in ratios:
        if ratio not in key_floors:
            n = windows[ratio].seq_ids.shape[1]
            key_floors[ratio] = document_floors(chunk_start_rows, n, n, ratio)
    return AttentionMetadata(
        position_ids=position_ids,
        seq_ids=seq_ids,
        padding=None if padding_mask is None else padding,
        rope_main=rope_table(position_ids, inv_main),
        rope_compress=rope_table(position_ids, inv_compress),
        kv_seq_ids=kv_seq,
        kv_padding=kv_pad,
        windows=windows,
        key_windows=key_windows,
        halo=halo,
        key_floors=key_floors,
        real_tokens=None if padding_mask is None else non_padding_tokens(padding),
        routes=routes,
        next_rows=next_rows,
    )


def _key_windows(own: WindowMetadata, first_ids: Tensor, start: Tensor, local: list[tuple[int, int]],
                 need: list[list[int]], width: int, ratio: int, length: int) -> WindowMetadata:
    """The compressed keys of each local row ``(b, v)``: left padding (id 0), the received windows ``[need, v n)``
    of the document its first token continues (``first_ids``, beginning at column ``start``, -1 for none; valid
    where the whole window lies in that document, positions counted from its start), then its own windows."""
    n = length // ratio
    device = own.seq_ids.device
    earlier = width - n
    w = torch.arange(earlier, device=device) + torch.tensor([v * n - earlier for _, v in local], device=device)[:, None]
    first = torch.tensor([need[b][v] for b, v in local], device=device)
    inside = (start[:, None] >= 0) & (w >= first[:, None]) & (w * ratio >= start[:, None])
    seq = torch.where(inside, first_ids[:, None], torch.zeros_like(w))
    pos = torch.where(inside, (w * ratio - start[:, None]) // ratio, torch.zeros_like(w))
    return WindowMetadata(ratio=ratio, seq_ids=torch.cat((seq, own.seq_ids), 1),
                          positions=torch.cat((pos, own.positions), 1))
