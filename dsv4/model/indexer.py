"""Lightning indexer of CSA layers (ratio 4): picks the top-k compressed keys per query.

* Keys: its own overlap compressor at ``index_head_dim`` -> ``K_I [B, P, D_I]`` (normalised, RoPE at ``p * 4``).
* Queries: ``q_I = q_lat @ Wq_b^I`` -> ``[B, L, H_I, D_I]``, RoPE (compress table) at the query positions.
* ``config.fake_quant`` (DeepSeek-V4 inference's indexer numerics, straight-through): keys and queries, after RoPE,
  go through :func:`~dsv4.model.fake_quant.fake_quant_v4_index` (the Hadamard rotation, then FP4 in blocks of 32
  with power-of-two scales); both stay in the rotated basis, where their dot products are the scores.
* Head weights: ``w = (x @ W_w) * H_I^-0.5`` -> ``[B, L, H_I]`` (fp32).
* Score: ``I[s, p] = D_I^-0.5 * sum_h w[s, h] * relu(q_I[s, h] . K_I[p])``; a key that the query may not see
  (``q_doc == 0``, other document / invalid window, or ``p_doc >= (q_pos_doc + 1) // 4``) scores -inf BEFORE the
  top-k; ``k = min(index_topk, P)``; selections that scored -inf become -1. Ties (common: a key whose dot
  product is negative for every head scores exactly 0) go to the lowest window index, so a packed row or a CP
  rank selects the same windows as the document run alone.

Memory: scores are computed per query chunk, so the largest intermediate is ``[B, chunk, H_I, P]``; nothing of
size ``[L, P]`` in fp32 besides the ``[B, L, k]`` int64 result. Given ``local_windows``, a chunk scores only the
windows of its own documents up to the causal prefix (on average half of a single document's windows; in a packed
row, not the other documents'), and selects with a top-k, not a sort of every key.

The indexer receives no gradient from the LM loss (top-k is discrete). With ``config.indexer_loss_coeff > 0`` it
learns from its KL loss against the main attention (:mod:`dsv4.model.indexer_loss`): ``forward(...,
with_scores=True)`` also returns the scores of the selected rows ``[B, L, k]`` (differentiable, -inf where nothing
is selected; recomputed per chunk in backward, so nothing of ``[L, k, D_I]`` is kept). Otherwise its parameters are
frozen (``requires_grad=False``) and it runs under ``no_grad``.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dsv4.config import DSV4Config
from dsv4.model.attention_backend import indexer_kernel
from dsv4.model.compressor import Compressor, WindowMetadata
from dsv4.model.fake_quant import fake_quant_v4_index
from dsv4.model.rope import RopeTable, apply_rope
from dsv4.model.sparse_attention import (
    by_floor_groups,
    causal_prefix,
    chunk_key_bounds,
    chunk_key_floors,
    compressed_key_allowed,
    floor_groups,
    overlapping_slices,
    stable_topk,
    within,
)

INDEX_RATIO = 4


class Indexer(nn.Module):
    """Scores compressed windows per query and returns top-k window indices (``-1`` = no selection)."""

    def __init__(self, config: DSV4Config) -> None:
        super().__init__()
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.topk = config.index_topk
        self.chunk_size = config.attention_chunk_size
        self.backend = config.attention_backend  # torch loop or the Triton kernel (dsv4.model.attention_backend)
        self.trainable = config.indexer_loss_coeff > 0
        self.fake_quant = config.fake_quant
        self.compressor = Compressor(config.hidden_size, self.head_dim, INDEX_RATIO, config.rms_norm_eps)
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        if not self.trainable:
            for param in self.parameters():
                param.requires_grad_(False)

    def keys(self, x: Tensor, windows: WindowMetadata, prev_features: Tensor | None = None) -> Tensor:
        """Index keys ``[B, P, index_head_dim]`` of the block's complete windows (see ``Compressor.forward``;
        with ``fake_quant`` rotated and FP4-rounded)."""
        with torch.set_grad_enabled(self.trainable and torch.is_grad_enabled()):
            return self._numerics(self.compressor(x, windows, prev_features))

    def _numerics(self, x: Tensor) -> Tensor:
        """RoPE'd index queries / keys ``[..., index_head_dim]`` as the served indexer holds them (``fake_quant``)."""
        return fake_quant_v4_index(x) if self.fake_quant else x

    def forward(
        self,
        x: Tensor,
        q_lat: Tensor,
        rope: RopeTable,
        query_seq_ids: Tensor,
        query_positions: Tensor,
        keys: Tensor,
        key_seq_ids: Tensor,
        key_positions: Tensor,
        local_windows: int | None = None,
        with_scores: bool = False,
        key_floors: list[list[int]] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Top-k compressed-key indices ``[B, L, min(index_topk, P)]`` (int64, ``-1`` = invalid); with
        ``with_scores`` also the selected rows' scores ``[B, L, k]`` fp32 (for the indexer loss).

        Args:
            x: ``[B, L, d_m]`` attention input; q_lat: ``[B, L, q_lora_rank]``; rope: compress table at the query
                positions ``[B, L, rope/2]``; query_seq_ids/query_positions: ``[B, L]`` (doc-local positions).
            keys: ``[B, P, index_head_dim]`` (all compressed windows visible to this rank);
                key_seq_ids/key_positions: ``[B, P]`` their window ids and doc-local window indices.
            local_windows: when the last ``local_windows`` keys are this block's own windows in order (window ``j``
                pools rows ``[4j, 4j + 4)``; :class:`~dsv4.model.attention.DSV4Attention` passes it), a chunk of
                queries ending at row ``end`` scores only the causal prefix ``P - local_windows + end // 4``: the
                later keys are future windows, which no query of the chunk may select (documents start on multiples
                of 4, as the model's metadata guarantees), and only from the first window of the chunk's
                earliest document on (rows with different floors are scored apart). None: every key.
            key_floors: ``AttentionMetadata.key_floors[4]`` (per row and query chunk, the first key a query of the
                chunk may see; read once per forward); None: derived here (one host read).
        """
        b, length, _ = x.shape
        with torch.set_grad_enabled(self.trainable and torch.is_grad_enabled()):
            q = self._numerics(apply_rope(self.wq_b(q_lat).view(b, length, self.n_heads, self.head_dim), rope))
            w = torch.nn.functional.linear(x.float(), self.weights_proj.weight.float()) * self.n_heads**-0.5
        floors = functools.partial(chunk_key_floors, query_seq_ids, query_positions, self.chunk_size, keys.shape[1],
                                   local_windows, INDEX_RATIO, key_floors)  # only where needed (not by Triton)
        with torch.no_grad():
            topk = self._select(q.detach(), w.detach(), keys.detach(), query_seq_ids, query_positions, key_seq_ids,
                                key_positions, local_windows, floors)
        if not with_scores:
            return topk
        bounds = chunk_key_bounds(keys.shape[1], local_windows, floors(), length, self.chunk_size, INDEX_RATIO)
        return topk, selected_scores(q, w, keys, topk, self.head_dim, self.chunk_size, bounds)

    def _select(self, q: Tensor, w: Tensor, keys: Tensor, query_seq_ids: Tensor, query_positions: Tensor,
                key_seq_ids: Tensor, key_positions: Tensor, local_windows: int | None,
                floors: Callable[[], list[list[int]]]) -> Tensor:
        """The top-k selection (no gradient): the Triton kernel where the backend has one, else chunks in torch
        (``floors()``: per row and query chunk, the first key a query of the chunk may see)."""
        kernel = indexer_kernel(self.backend, q.device)
        if kernel is not None:  # the same selection, fused (scores exact in fp32 from the same inputs)
            return kernel(q, w, keys, query_seq_ids, query_positions, key_seq_ids, key_positions, self.topk,
                          local_windows)
        b, length = q.shape[:2]
        p = keys.shape[1]
        k = min(self.topk, p)
        q, keys_f = q.float(), keys.float()
        floors = floors()
        out = []
        for chunk, start in enumerate(range(0, length, self.chunk_size)):
            end = min(start + self.chunk_size, length)
            hi = causal_prefix(p, local_windows, end, INDEX_RATIO)

            def select(lo: int, rows: list[int] | None, start=start, end=end, hi=hi) -> Tensor:
                pick = (lambda t: t) if rows is None else (lambda t: t[rows])
                lo = min(lo, hi)  # the windows of the chunk's documents only, up to the causal prefix
                # [B, C, H_I, hi - lo] -> weighted sum over heads -> [B, C, hi - lo]
                logits = torch.einsum("bchd,bpd->bchp", pick(q[:, start:end]), pick(keys_f[:, lo:hi])).relu()
                scores = torch.einsum("bchp,bch->bcp", logits, pick(w[:, start:end])) * self.head_dim**-0.5
                allowed = compressed_key_allowed(
                    pick(query_seq_ids[:, start:end]), pick(query_positions[:, start:end]),
                    pick(key_seq_ids[:, lo:hi]), pick(key_positions[:, lo:hi]), INDEX_RATIO,
                )
                scores = scores.masked_fill(~allowed, float("-inf"))
                # Equal scores (e.g. all heads ReLU'd to 0) pick the lowest window index, as a stable sort would, so
                # the choice does not depend on how many other keys (documents, ranks) sit in the row.
                idx = stable_topk(scores, k)
                idx = torch.where(idx >= 0, idx + lo, idx)
                if idx.shape[-1] < k:  # a short causal prefix: the rest selects nothing
                    idx = torch.nn.functional.pad(idx, (0, k - idx.shape[-1]), value=-1)
                return idx

            out.append(by_floor_groups(floor_groups([row[chunk] for row in floors], hi), select))
        if not out:
            return torch.empty(b, 0, k, dtype=torch.long, device=q.device)
        return torch.cat(out, dim=1)


def _chunk_selected_scores(q: Tensor, w: Tensor, keys: Tensor, topk: Tensor, head_dim: int,
                           offset: int = 0) -> Tensor:
    """``q [B, C, H, D]``, ``w [B, C, H]``, ``keys [B, P', D]`` (the keys from ``offset`` on), ``topk [B, C, k]``
    (indices of all keys) -> ``[B, C, k]`` scores."""
    topk = within(topk, offset, offset + keys.shape[1])
    if keys.shape[1] == 0:  # a slice without rows (nothing selected): a stand-in row keeps the gather defined
        keys = torch.cat((keys, keys.new_zeros(keys.shape[0], 1, keys.shape[2])), dim=1)
    batch = torch.arange(q.shape[0], device=q.device)[:, None, None]
    picked = keys[batch, topk.clamp(min=0)].float()  # [B, C, k, D]
    logits = torch.einsum("bchd,bckd->bchk", q.float(), picked).relu()
    scores = torch.einsum("bchk,bch->bck", logits, w.float()) * head_dim**-0.5
    return scores.masked_fill(topk < 0, float("-inf"))


def selected_scores(q: Tensor, w: Tensor, keys: Tensor, topk: Tensor, head_dim: int, chunk_size: int,
                    bounds: list[tuple[int, int]] | None = None) -> Tensor:
    """The indexer scores of the selected rows, ``[B, L, k]`` fp32 (-inf where ``topk`` is -1), differentiable in
    ``q``, ``w`` and ``keys``; each query chunk is recomputed in backward (the gathered ``[B, C, k, D]`` keys are
    never kept). ``bounds``: per query chunk, the key rows ``[lo, hi)`` holding every selection of the chunk
    (:func:`~dsv4.model.sparse_attention.chunk_key_bounds`); None: every key."""
    # split, not sliced: one backward node concatenates the chunks' gradients (a slice, or a gather from the whole
    # keys, per chunk would allocate a zero tensor of the whole input per chunk); the keys likewise through one node
    t_parts = topk.split(chunk_size, 1)
    if bounds is None:
        bounds = [(0, keys.shape[1])] * len(t_parts)
    k_parts = overlapping_slices(keys, bounds)
    out = [checkpoint(_chunk_selected_scores, q_part, w_part, k_part, t_part, head_dim, lo, use_reentrant=False)
           for q_part, w_part, k_part, t_part, (lo, _)
           in zip(q.split(chunk_size, 1), w.split(chunk_size, 1), k_parts, t_parts, bounds)]
    if not out:
        return q.new_zeros(*topk.shape, dtype=torch.float32)
    return torch.cat(out, dim=1)
