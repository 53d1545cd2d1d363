"""Reference sparse attention kernel in plain torch: window band + compressed rows, per-head sink.

Every query ``i`` (kv row ``query_offset + i``) attends to

* the window band: kv rows ``j`` with ``q - W < j <= q`` (linear row indices), ``key_seq[j] == q_seq > 0`` and
  ``not key_padding[j]``. A chunk of ``C`` queries scores the contiguous slice of the ``C + W - 1`` kv rows
  their bands cover with one GEMM (BLAS) and masks it to each query's band: ``(C + W - 1) / W`` times the band's
  FLOPs, but no per-query gather, and never anything of ``[L, L]``;
* compressed rows (``ratio > 0``): either the CSA top-k list ``[chunk, k]`` (``-1`` = none) or, for HCA, all
  ``P`` rows; both under the compressed rule ``q_seq > 0 and comp_seq[p] == q_seq and
  comp_pos[p] < (q_pos + 1) // ratio`` (``q_pos`` document-local).

Softmax in fp32 with the per-head sink in the denominator only:
``p_j = exp(z_j) / (sum_allowed exp(z_k) + exp(sink_h))``, ``z = q . k * scale`` (``scale = D^-0.5``).
Output ``out[b, i, h] = sum_j p_j kv_j`` (K = V). A query without any allowed key outputs exactly 0 with finite
gradients.

Memory: queries run in chunks of ``chunk_size``; the largest intermediate is ``[B, chunk, H, chunk + W - 1 + k]``
(CSA, plus the gathered ``[B, chunk, k, D]`` selected rows) or ``[B, chunk, H, chunk + W - 1 + P]`` (HCA: the
compressed rows are one dense GEMM too). With ``checkpoint`` (default
when grads are needed) each chunk is recomputed in backward, so the saved activations are O(L * H * D), not
O(L * (W + P)).

For context parallelism the caller prepends halo rows to ``kv`` (``query_offset = halo``) and passes all-gathered
compressed rows and their metadata; nothing here depends on the rank.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint as _checkpoint


def _chunk_attention(
    q: Tensor,
    kv: Tensor,
    sink: Tensor,
    q_seq: Tensor,
    q_pos: Tensor,
    kv_seq: Tensor,
    kv_pad: Tensor,
    comp: Tensor | None,
    comp_seq: Tensor | None,
    comp_pos: Tensor | None,
    topk: Tensor | None,
    start: int,
    query_offset: int,
    window: int,
    ratio: int,
    scale: float,
    compressed_probs: bool = False,
    comp_offset: int = 0,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of the query chunk ``q [B, C, H, D]`` starting at query index ``start``; with
    ``compressed_probs`` (CSA) also the head mean of the probabilities of the selected rows ``[B, C, k]``
    (detached). ``comp`` holds the compressed rows from ``comp_offset`` on; ``topk`` indexes all of them (a
    selection outside ``comp`` is not allowed: :func:`within`)."""
    b, c, h, d = q.shape
    device = q.device
    qf = q.float()

    # Window band: the contiguous kv rows [lo, hi) that cover every query's band, scored as one GEMM [C*H, R]
    # (R <= C + W - 1) and masked to (q_row - W, q_row] per query.
    first = query_offset + start
    lo, hi = max(0, first - window + 1), first + c
    keys = kv[:, lo:hi]  # [B, R, D], a view
    q_rows = first + torch.arange(c, device=device)
    k_rows = torch.arange(lo, hi, device=device)
    band = (k_rows[None, :] <= q_rows[:, None]) & (q_rows[:, None] - k_rows[None, :] < window)  # [C, R]
    allowed = (
        band[None]
        & (kv_seq[:, lo:hi, None].transpose(1, 2) == q_seq[:, :, None])
        & (q_seq[:, :, None] > 0)
        & ~kv_pad[:, None, lo:hi]
    )  # [B, C, R]
    keys_f = keys.float()
    logits = torch.matmul(qf.reshape(b, c * h, d), keys_f.transpose(1, 2)).view(b, c, h, hi - lo) * scale
    parts = [logits.masked_fill(~allowed[:, :, None, :], float("-inf"))]

    if comp is not None:  # also with P == 0, so the compressor stays in the graph (zero grads, not None)
        if topk is not None:  # CSA: gather the selected rows per query -> [B, C, k, D]
            topk = within(topk, comp_offset, comp_offset + comp.shape[1])
            if comp.shape[1] == 0:  # a slice without rows (the chunk sees none): one stand-in row of id 0, never
                comp = torch.cat((comp, comp.new_zeros(b, 1, d)), dim=1)  # allowed, keeps the gather defined and
                comp_seq, comp_pos = comp_seq.new_zeros(b, 1), comp_pos.new_zeros(b, 1)  # the compressor in the graph
            sel_valid = topk >= 0
            sel = topk.clamp(min=0)
            batch = torch.arange(b, device=device)[:, None, None]
            ckeys = comp[batch, sel]
            c_allowed = sel_valid & compressed_key_allowed(
                q_seq, q_pos, comp_seq[batch, sel], comp_pos[batch, sel], ratio
            )
            c_logits = torch.einsum("bchd,bckd->bchk", qf, ckeys.float()) * scale
        else:  # HCA: every compressed row, causal/document rule -> [B, C, P]
            c_allowed = compressed_key_allowed(q_seq, q_pos, comp_seq, comp_pos, ratio)
            c_logits = torch.einsum("bchd,bpd->bchp", qf, comp.float()) * scale
        parts.append(c_logits.masked_fill(~c_allowed[:, :, None, :], float("-inf")))

    # Sink column: adds exp(sink) to the denominator; its value slot is dropped (value 0).
    sink_col = sink.float().view(1, 1, h, 1).expand(b, c, h, 1)
    probs = torch.softmax(torch.cat(parts + [sink_col], dim=-1), dim=-1)
    w = hi - lo
    out = torch.matmul(probs[..., :w].reshape(b, c * h, w), keys_f).view(b, c, h, d)
    if comp is not None:
        p_comp = probs[..., w:-1]
        if topk is not None:
            out = out + torch.einsum("bchk,bckd->bchd", p_comp, ckeys.float())
        else:
            out = out + torch.einsum("bchp,bpd->bchd", p_comp, comp.float())
    if compressed_probs:
        return out.to(q.dtype), p_comp.detach().mean(dim=2)
    return out.to(q.dtype)


@torch.no_grad()
def selected_row_probs(q: Tensor, compressed: Tensor, topk: Tensor, lse: Tensor, query_seq_ids: Tensor,
                       query_positions: Tensor, compressed_seq_ids: Tensor, compressed_positions: Tensor, ratio: int,
                       scale: float, chunk_size: int = 256) -> Tensor:
    """The head mean of the attention probabilities of the CSA-selected compressed rows, ``[B, L, k]`` fp32, from the
    softmax's log-normaliser ``lse [B, L, H]`` (window, selected rows and sink): ``mean_h exp(q_h . c_j * scale -
    lse_h)``; 0 where the selection is -1 or not allowed. What ``sparse_attention(..., compressed_probs=True)``
    returns, for a kernel that returns ``lse`` (the Triton one). Chunked over queries: ``[B, C, k, D]`` at a time."""
    b, length = topk.shape[:2]
    batch = torch.arange(b, device=q.device)[:, None, None]
    out = []
    for start in range(0, length, chunk_size):
        sel = topk[:, start:start + chunk_size]
        rows = sel.clamp(min=0)
        valid = (sel >= 0) & compressed_key_allowed(
            query_seq_ids[:, start:start + chunk_size], query_positions[:, start:start + chunk_size],
            compressed_seq_ids[batch, rows], compressed_positions[batch, rows], ratio)
        z = torch.einsum("bchd,bckd->bchk", q[:, start:start + chunk_size].float(), compressed[batch, rows].float())
        p = torch.exp(z * scale - lse[:, start:start + chunk_size, :, None])
        out.append(torch.where(valid[:, :, None, :], p, torch.zeros_like(p)).mean(dim=2))
    return torch.cat(out, dim=1) if out else q.new_zeros(b, 0, topk.shape[-1], dtype=torch.float32)


def compressed_key_allowed(
    query_seq_ids: Tensor, query_positions: Tensor, key_seq_ids: Tensor, key_positions: Tensor, ratio: int
) -> Tensor:
    """Compressed-key rule of section 3 as a bool mask ``[B, Lq, K]``.

    ``allowed(q, p) = q_doc > 0 and key_seq[p] == q_doc and key_pos[p] < (q_pos_doc + 1) // ratio``.
    Queries are ``[B, Lq]``; keys are ``[B, P]`` (shared by all queries) or ``[B, Lq, K]`` (gathered per query).
    """
    if key_seq_ids.dim() == 2:
        key_seq_ids, key_positions = key_seq_ids[:, None, :], key_positions[:, None, :]
    q_seq = query_seq_ids[:, :, None]
    limit = torch.div(query_positions + 1, ratio, rounding_mode="floor")[:, :, None]
    return (q_seq > 0) & (key_seq_ids == q_seq) & (key_positions < limit)


def causal_prefix(rows: int, local_rows: int | None, end: int, ratio: int) -> int:
    """How many of ``rows`` compressed rows a chunk of queries ending at local row ``end`` may see, when the last
    ``local_rows`` are this block's own windows in order (window ``j`` pools rows ``[r j, r (j + 1))``; documents
    start on multiples of ``r``): the earlier rows, then the block's complete windows before ``end``. None: all."""
    if local_rows is None:
        return rows
    return max(0, min(rows, rows - local_rows + end // ratio))


NO_DOCUMENT = 2**62  # chunk_document_starts of a chunk holding only padding


def chunk_document_starts(query_seq_ids: Tensor, query_positions: Tensor, chunk_size: int) -> Tensor:
    """For each row and chunk of ``chunk_size`` queries, the local row where the earliest document of its real
    queries begins: negative when that document began before this block (an earlier chunk of the row),
    :data:`NO_DOCUMENT` for a chunk of padding only. ``[B, n_chunks]`` int64 on the queries' device (no host read)."""
    b, length = query_seq_ids.shape
    n_chunks = -(-length // chunk_size)
    starts = torch.arange(length, device=query_positions.device) - query_positions  # each query's document start
    starts = torch.where(query_seq_ids > 0, starts, torch.full_like(starts, NO_DOCUMENT))
    starts = torch.nn.functional.pad(starts, (0, n_chunks * chunk_size - length), value=NO_DOCUMENT)
    return starts.view(b, n_chunks, chunk_size).amin(dim=2)


def document_floors(chunk_starts: list[list[int]], rows: int, local_rows: int | None, ratio: int,
                    earlier: list[int] | None = None) -> list[list[int]]:
    """Per row and chunk, the first of ``rows`` compressed rows any of its queries may see (every row before it
    belongs to other documents or is padding): the last ``local_rows`` rows are this block's windows in order (window
    ``j`` pools query rows ``[r j, r (j + 1))``; documents start on multiples of ``r``), the ``earlier[i]`` rows
    before them earlier windows of the document row ``i`` starts in (default: all ``rows - local_rows``; any rows
    before those are padding). ``chunk_starts``: :func:`chunk_document_starts` read to the host. A document begun
    before the block gives the first earlier row, a chunk of padding ``rows``; ``local_rows`` None gives 0
    everywhere."""
    if local_rows is None:
        return [[0] * len(starts) for starts in chunk_starts]
    own = rows - local_rows
    if earlier is None:
        earlier = [own] * len(chunk_starts)
    return [[rows if s >= NO_DOCUMENT else own - before if s < 0 else min(rows, own + s // ratio) for s in starts]
            for starts, before in zip(chunk_starts, earlier)]


def chunk_key_floors(query_seq_ids: Tensor, query_positions: Tensor, chunk_size: int, rows: int,
                     local_rows: int | None, ratio: int, given: list[list[int]] | None = None) -> list[list[int]]:
    """Per row and query chunk of ``chunk_size``, the first of ``rows`` compressed rows a query of the chunk may see:
    ``given`` when not None (``AttentionMetadata.key_floors``, read once per forward), else derived from the queries
    (:func:`chunk_document_starts`, one host read, then :func:`document_floors`); 0 everywhere without
    ``local_rows``."""
    if local_rows is None:
        b, length = query_seq_ids.shape
        return [[0] * -(-length // chunk_size)] * b
    if given is not None:
        return given
    starts = chunk_document_starts(query_seq_ids, query_positions, chunk_size).tolist()
    return document_floors(starts, rows, local_rows, ratio)


GROUP_GAIN = 1.5  # score rows apart only when batching them would score this many times the keys


def floor_groups(floors: list[int], end: int) -> list[tuple[int, list[int] | None]]:
    """The batch rows of one query chunk grouped by their key floor (keys ``[floor, end)``): ``[(min floor, None)]``
    (one batched call over the union of their keys) unless that would score more than :data:`GROUP_GAIN` times the
    keys the rows need on their own; then ``[(floor, rows)]`` per distinct floor, each row scoring only its keys
    (a call per group costs its own overhead, which small shapes feel)."""
    lowest = min(floors) if floors else 0
    union = len(floors) * max(end - lowest, 0)
    own = sum(max(end - f, 0) for f in floors)
    if union <= GROUP_GAIN * own or len(set(floors)) <= 1:
        return [(lowest, None)]
    groups: dict[int, list[int]] = {}
    for row, floor in enumerate(floors):
        groups.setdefault(floor, []).append(row)
    return sorted(groups.items())


class _OverlappingSlices(torch.autograd.Function):
    """Views ``x[:, lo:hi]`` for each ``(lo, hi)``; backward adds their gradients into one buffer of ``x``'s shape."""

    @staticmethod
    def forward(ctx, x, bounds):  # type: ignore[override]
        ctx.shape, ctx.bounds = x.shape, bounds
        return tuple(x[:, lo:hi] for lo, hi in bounds)

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[override]
        grad = None
        for (lo, hi), g in zip(ctx.bounds, grads):
            if g is not None:
                grad = g.new_zeros(ctx.shape) if grad is None else grad
                grad[:, lo:hi] += g
        return grad, None


def chunk_key_bounds(rows: int, local_rows: int | None, floors: list[list[int]] | None, length: int,
                     chunk_size: int, ratio: int) -> list[tuple[int, int]]:
    """Per query chunk of ``chunk_size`` (of ``length`` queries), the compressed rows ``[lo, hi)`` that hold every
    row any query of the chunk may see: ``hi`` the causal prefix (:func:`causal_prefix`), ``lo`` the lowest key
    floor of the batch rows (:func:`document_floors`, capped at ``hi``); ``(0, rows)`` everywhere when
    ``local_rows`` is None (no window order to rely on)."""
    bounds = []
    for chunk, start in enumerate(range(0, length, chunk_size)):
        if local_rows is None:
            bounds.append((0, rows))
            continue
        hi = causal_prefix(rows, local_rows, min(start + chunk_size, length), ratio)
        bounds.append((min(min((row[chunk] for row in floors), default=0), hi), hi))
    return bounds


def within(selection: Tensor, lo: int, hi: int) -> Tensor:
    """Row indices ``selection`` (``-1`` = none) made relative to the slice ``[lo, hi)``; rows outside it become -1
    (callers pass bounds outside which no query may see a row, so nothing allowed is dropped)."""
    return torch.where((selection >= lo) & (selection < hi), selection - lo, -1)


def overlapping_slices(x: Tensor, bounds: list[tuple[int, int]]) -> tuple[Tensor, ...]:
    """``x[:, lo:hi]`` for every ``(lo, hi)`` of ``bounds`` (dim 1), through one autograd node when ``x`` needs a
    gradient: backward allocates one gradient of ``x``'s size, not one per slice."""
    if not bounds or not x.requires_grad or not torch.is_grad_enabled():
        return tuple(x[:, lo:hi] for lo, hi in bounds)
    return _OverlappingSlices.apply(x, bounds)


def by_floor_groups(groups: list[tuple[int, list[int] | None]], run) -> Tensor | tuple[Tensor, ...]:
    """``run(floor, rows)`` for each of :func:`floor_groups`'s groups, the results put back in batch-row order
    (dim 0; ``run`` may return a tensor or a tuple of tensors)."""
    if len(groups) == 1:
        return run(groups[0][0], None)
    parts = [run(floor, rows) for floor, rows in groups]
    order = torch.tensor([row for _, rows in groups for row in rows])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(p)[inverse.to(p[0].device)] for p in zip(*parts))
    return torch.cat(parts)[inverse.to(parts[0].device)]


def stable_topk(scores: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` largest entries along the last axis, ordered by score (descending) and, among equal
    scores, by index (ascending): the first ``k`` of a stable descending sort, at top-k cost. ``-inf`` entries
    are returned as ``-1``. ``scores [..., n]`` -> ``[..., min(k, n)]`` int64."""
    n = scores.shape[-1]
    k = min(k, n)
    if k == 0:
        return torch.empty(*scores.shape[:-1], 0, dtype=torch.long, device=scores.device)
    threshold = scores.topk(k, dim=-1).values[..., -1:]
    above = scores > threshold
    ties = scores == threshold
    take = above | (ties & (ties.cumsum(-1) <= k - above.sum(-1, keepdim=True)))  # exactly k per row
    order = torch.arange(n, 0, -1, device=scores.device)  # earlier index = larger key
    idx = (take * order).topk(k, dim=-1).indices  # the taken entries, ascending index
    values = scores.gather(-1, idx)
    values, perm = values.sort(dim=-1, descending=True, stable=True)
    return idx.gather(-1, perm).masked_fill(torch.isneginf(values), -1)


def checked_query_offset(who: str, length: int, l_kv: int, query_offset: int | None, compressed: Tensor | None,
                         ratio: int) -> int:
    """The kv row of query 0 (default ``l_kv - length``: halo rows first); ``ValueError`` naming ``who`` when the
    queries fall outside the kv rows or compressed rows come without a ratio. Every kernel checks its call here."""
    if query_offset is None:
        query_offset = l_kv - length
    if query_offset < 0 or query_offset + length > l_kv:
        raise ValueError(f"{who}: queries [{query_offset}, {query_offset + length}) outside kv rows {l_kv}")
    if compressed is not None and ratio < 1:
        raise ValueError(f"{who}: compressed rows need ratio >= 1, got {ratio}")
    return query_offset


def sparse_attention(
    q: Tensor,
    kv: Tensor,
    sink: Tensor,
    *,
    window: int,
    query_seq_ids: Tensor,
    query_positions: Tensor,
    kv_seq_ids: Tensor,
    kv_padding: Tensor | None = None,
    query_offset: int | None = None,
    compressed: Tensor | None = None,
    compressed_seq_ids: Tensor | None = None,
    compressed_positions: Tensor | None = None,
    ratio: int = 0,
    topk_indices: Tensor | None = None,
    chunk_size: int = 256,
    scale: float | None = None,
    checkpoint: bool | None = None,
    compressed_local_rows: int | None = None,
    compressed_probs: bool = False,
    key_floors: list[list[int]] | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Sliding-window + compressed sparse attention. Returns ``[B, L, H, D]`` in ``q.dtype``; with
    ``compressed_probs`` (CSA only) also ``[B, L, k]`` fp32: for each selected compressed row, its attention
    probability averaged over the heads (the denominator holds the window, every selected row and the sink; an
    invalid selection has 0), detached. The indexer loss's teacher (:mod:`dsv4.model.indexer_loss`).

    Args:
        q: ``[B, L, H, D]`` queries (normalised, RoPE'd).
        kv: ``[B, L_kv, D]`` window K=V rows; query ``i`` sits at kv row ``query_offset + i``.
        sink: ``[H]`` per-head sink logits.
        window: sliding window W.
        query_seq_ids, query_positions: ``[B, L]`` document ids (0 = pack padding) and doc-local positions.
        kv_seq_ids: ``[B, L_kv]`` document ids of the kv rows; kv_padding: ``[B, L_kv]`` True = excluded key.
        query_offset: defaults to ``L_kv - L`` (halo rows first).
        compressed: ``[B, P, D]`` compressed K=V rows (``ratio > 0``) with ``compressed_seq_ids`` /
            ``compressed_positions`` ``[B, P]`` (window id, doc-local window index).
        topk_indices: ``[B, L, k]`` CSA selection (``-1`` = none); None with ``compressed`` means HCA (all P).
        chunk_size: queries per chunk; scale: defaults to ``D ** -0.5``;
        checkpoint: recompute each chunk in backward (default: when autograd is recording).
        compressed_local_rows: when the last ``compressed_local_rows`` compressed rows are this block's own windows
            in order (window ``j`` pools query rows ``[r j, r (j + 1))``), a chunk of queries ending at row ``end``
            takes only the causal prefix ``P - compressed_local_rows + end // r`` (later rows are future windows no
            query of the chunk may see; documents start on multiples of ``r``, as the model's metadata guarantees),
            from the first row of the chunk's earliest document on (:func:`document_floors`): HCA scores only those
            rows (a packed row costs what its documents cost; rows with different floors are scored apart), CSA
            gathers its selection from them (a selected row outside them is one no query may see: dropped), so
            backward accumulates only their gradients. None: every row.
        key_floors: per row and query chunk of ``chunk_size``, the first compressed row a query of the chunk may see
            (``AttentionMetadata.key_floors``, already on the host); None: derived here from the queries (one host
            read), every compressed row before the block's own counted as the earlier windows of its document.
    """
    b, length, h, d = q.shape
    l_kv = kv.shape[1]
    query_offset = checked_query_offset("sparse_attention", length, l_kv, query_offset, compressed, ratio)
    if kv_padding is None:
        kv_padding = torch.zeros(b, l_kv, dtype=torch.bool, device=kv.device)
    scale = d**-0.5 if scale is None else scale
    if checkpoint is None:
        checkpoint = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, kv, sink, compressed)
        )
    if compressed_probs and topk_indices is None:
        raise ValueError("sparse_attention: compressed_probs needs a CSA selection (topk_indices)")
    outs, probs = [], []
    bounded = compressed is not None and compressed_local_rows is not None
    csa = topk_indices is not None
    floors = chunk_key_floors(query_seq_ids, query_positions, chunk_size, compressed.shape[1], compressed_local_rows,
                              ratio, key_floors) if bounded else None
    # Every chunk's slices of q, kv and the compressed rows come from ONE autograd node per tensor, so backward adds
    # the chunks' gradients into one buffer: a slice (or a gather from the whole tensor) per chunk would allocate a
    # zero tensor of the whole input per chunk in backward (quadratic in the row length). Bounded, a chunk takes only
    # the compressed rows of its documents up to the causal prefix: HCA scores all of them (rows with different
    # floors apart, :func:`floor_groups`), CSA gathers its selection from them (one group: k rows per query either
    # way).
    plan = []  # (start, end, hi, groups)
    bounds = chunk_key_bounds(compressed.shape[1], compressed_local_rows, floors, length, chunk_size, ratio) \
        if bounded else None
    for chunk, start in enumerate(range(0, length, chunk_size)):
        end = min(start + chunk_size, length)
        groups, hi = [(0, None)], None
        if bounded:
            lo, hi = bounds[chunk]
            groups = [(lo, None)] if csa else floor_groups([row[chunk] for row in floors], hi)
        plan.append((start, end, hi, groups))
    q_parts = q.split(chunk_size, dim=1)
    kv_bounds = [(max(0, query_offset + start - window + 1), query_offset + end) for start, end, _, _ in plan]
    kv_parts = overlapping_slices(kv, kv_bounds)
    comp_parts = iter(overlapping_slices(compressed, [(min(lo, hi), hi) for _, _, hi, groups in plan
                                                      for lo, _ in groups]) if bounded else ())
    for (start, end, hi, groups), q_part, kv_part, (lo_kv, hi_kv) in zip(plan, q_parts, kv_parts, kv_bounds):

        def run(lo: int, rows: list[int] | None, start=start, end=end, hi=hi, q_part=q_part, kv_part=kv_part,
                lo_kv=lo_kv, hi_kv=hi_kv):
            pick = (lambda t: t) if rows is None else (lambda t: None if t is None else t[rows])
            comp, comp_seq, comp_pos = compressed, compressed_seq_ids, compressed_positions
            offset = 0
            if bounded:  # only the rows of the chunk's documents, up to the causal prefix
                offset = lo = min(lo, hi)
                comp, comp_seq, comp_pos = next(comp_parts), comp_seq[:, lo:hi], comp_pos[:, lo:hi]
            # the chunk takes only the kv rows its window bands cover (its first query's kv row moves by lo_kv)
            args = (
                pick(q_part), pick(kv_part), sink, pick(query_seq_ids[:, start:end]),
                pick(query_positions[:, start:end]), pick(kv_seq_ids[:, lo_kv:hi_kv]),
                pick(kv_padding[:, lo_kv:hi_kv]), pick(comp), pick(comp_seq), pick(comp_pos),
                None if topk_indices is None else pick(topk_indices[:, start:end]),
                start, query_offset - lo_kv, window, ratio, scale, compressed_probs, offset,
            )
            return _checkpoint(_chunk_attention, *args, use_reentrant=False) if checkpoint else _chunk_attention(*args)

        out = by_floor_groups(groups, run)
        if compressed_probs:
            out, p = out
            probs.append(p)
        outs.append(out)
    if not outs:
        out = q.new_zeros(b, 0, h, d)
        return (out, q.new_zeros(b, 0, topk_indices.shape[-1], dtype=torch.float32)) if compressed_probs else out
    out = torch.cat(outs, dim=1)
    return (out, torch.cat(probs, dim=1)) if compressed_probs else out
