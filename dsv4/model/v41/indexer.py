"""The CSA2 indexer of V4.1: picks each query's compressed rows, with a two-level top-k (frozen, no gradient).

No compressor of its own and no Hadamard rotation (V4's CSA indexer has both):

* keys (Full layers only): ``k_norm(wk(latent))`` from the layer's compressor latent (before RoPE), RoPE'd at each
  window's first position, FP4-rounded (:func:`fake_quant_fp4`, blocks of 32, power-of-two scales) ->
  ``[B, P, D_I]``; a Reindex layer scores against the keys of the Full layer before it;
* queries: ``wq_b(q_lat)`` (``q_lat``: the attention's ``q_norm(wq_a(x))``) -> ``[B, L, H_I, D_I]``, RoPE'd at the
  query positions (compress table), FP4-rounded;
* score: ``I[s, p] = sum_h w[s, h] * relu(q[s, h] . k[p])`` with ``w = weights_proj(x) * D_I^-0.5 * H_I^-0.5``; a
  row the query may not see (other document, invalid window, window not complete before the query:
  :func:`~dsv4.model.sparse_attention.compressed_key_allowed`) scores -inf;
* two-level top-k: the ``candidate_source_layer_id`` layer keeps, per query, the ``candidate_topk_blocks`` blocks of
  ``candidate_block_size`` consecutive compressed rows of the query's document (block ``j`` = document-local rows
  ``[j s, (j + 1) s)``) with the highest block maximum, the block of the newest visible row always among them;
  Reindex layers after it choose only inside those blocks; every index layer keeps its ``min(index_topk, P)`` best
  rows (-1 where fewer are visible). Exact ties (a row scores exactly 0 when every head's dot product is negative)
  go to the lowest row, as in V4's indexer; the released code leaves them to ``torch.topk``.

Candidates are kept as the first row of each chosen block ``[B, L, kb]`` (-1 = none), not as a ``[B, L, P]`` mask.
Queries run in chunks of ``attention_chunk_size``: the largest intermediate is ``[B, chunk, H_I, P]``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dsv4.model.compressor import WindowMetadata
from dsv4.model.fake_quant import fake_quant_fp4
from dsv4.model.norm import RMSNorm
from dsv4.model.rope import RopeTable, apply_rope
from dsv4.model.sparse_attention import compressed_key_allowed, stable_topk


def block_starts(key_positions: Tensor, block_size: int) -> Tensor:
    """``[B, P]``: the row of the first compressed row of each row's candidate block (rows of one document are
    consecutive, document-local positions counting from 0)."""
    rows = torch.arange(key_positions.shape[1], device=key_positions.device)
    return rows - key_positions % block_size


def candidate_mask(blocks: Tensor, starts: Tensor) -> Tensor:
    """``[B, C, P]`` bool: the rows whose block is among ``blocks [B, C, kb]`` (block first rows, -1 = none)."""
    b, c = blocks.shape[:2]
    p = starts.shape[1]
    chosen = torch.zeros(b, c, p + 1, dtype=torch.bool, device=blocks.device)  # slot P: where -1 lands
    chosen.scatter_(-1, torch.where(blocks >= 0, blocks, p), True)
    return chosen[..., :p].gather(-1, starts[:, None, :].expand(b, c, -1))


class CSA2Indexer(nn.Module):
    """The indexer of a Full (``owns_keys``) or Reindex layer. Parameters are frozen (``requires_grad=False``)."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.topk = config.index_topk
        self.chunk_size = config.attention_chunk_size
        self.fake_quant = config.fake_quant
        self.owns_keys = layer_idx in config.kv_source_layer_ids
        self.is_candidate_source = layer_idx == config.candidate_source_layer_id
        self.uses_candidates = 0 <= config.candidate_source_layer_id < layer_idx
        self.candidate_blocks = config.candidate_topk_blocks
        self.block_size = config.candidate_block_size
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        if self.owns_keys:
            self.wk = nn.Linear(config.head_dim, self.head_dim, bias=False)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.requires_grad_(False)

    def _fp4(self, x: Tensor) -> Tensor:
        return fake_quant_fp4(x, 32, "pow2") if self.fake_quant else x

    @torch.no_grad()
    def keys(self, latent: Tensor, windows: WindowMetadata) -> Tensor:
        """Index keys ``[B, P, D_I]`` from the Full layer's compressor latent ``[B, P, D]``."""
        return self._fp4(apply_rope(self.k_norm(self.wk(latent)), windows.rope))

    @torch.no_grad()
    def forward(self, x: Tensor, q_lat: Tensor, rope: RopeTable, query_seq_ids: Tensor, query_positions: Tensor,
                keys: Tensor, key_windows: WindowMetadata, ratio: int,
                candidates: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """``(topk [B, L, k], candidate blocks [B, L, kb] or None)`` for the queries of ``x [B, L, d]``.

        ``candidates``: the candidate source's blocks (the shared state's), read by a Reindex layer after it; the
        returned candidates are this layer's own on the candidate source, else ``candidates`` unchanged.
        """
        if self.uses_candidates and candidates is None:
            raise ValueError(f"V4.1 index layer {self.layer_idx} comes after the candidate source but the shared "
                             "state holds no candidates")
        b, length, _ = x.shape
        p = keys.shape[1]
        k = min(self.topk, p)
        starts = block_starts(key_windows.positions, self.block_size) if (
            self.is_candidate_source or self.uses_candidates) else None
        cos, sin = rope
        topks, blocks = [], []
        for lo in range(0, length, self.chunk_size):
            hi = min(lo + self.chunk_size, length)
            q = self.wq_b(q_lat[:, lo:hi]).view(b, hi - lo, self.n_heads, self.head_dim)
            q = self._fp4(apply_rope(q, (cos[:, lo:hi], sin[:, lo:hi])))
            w = self.weights_proj(x[:, lo:hi]) * (self.head_dim**-0.5 * self.n_heads**-0.5)
            scores = (torch.einsum("bchd,bpd->bchp", q, keys).relu() * w.unsqueeze(-1)).sum(dim=2).float()
            allowed = compressed_key_allowed(query_seq_ids[:, lo:hi], query_positions[:, lo:hi],
                                             key_windows.seq_ids, key_windows.positions, ratio)
            scores = scores.masked_fill(~allowed, float("-inf"))
            if self.is_candidate_source:
                blocks.append(self._candidate_blocks(scores, starts, query_seq_ids[:, lo:hi],
                                                     query_positions[:, lo:hi], key_windows, ratio))
            elif self.uses_candidates:
                scores = scores.masked_fill(~candidate_mask(candidates[:, lo:hi], starts), float("-inf"))
            topks.append(self.top(scores, k))
        topk = torch.cat(topks, dim=1) if topks else torch.empty(b, 0, k, dtype=torch.long, device=x.device)
        if self.is_candidate_source:
            kb = min(self.candidate_blocks, p)
            return topk, (torch.cat(blocks, dim=1) if blocks else
                          torch.empty(b, 0, kb, dtype=torch.long, device=x.device))
        return topk, candidates

    def _candidate_blocks(self, scores: Tensor, starts: Tensor, q_seq: Tensor, q_pos: Tensor,
                          key_windows: WindowMetadata, ratio: int) -> Tensor:
        """The chosen blocks of a query chunk ``[B, C, kb]``: the block maxima of ``scores [B, C, P]`` (indexed by
        the block's first row), the newest visible block forced in, the top ``kb``; -1 for blocks none visible."""
        b, c, p = scores.shape
        block_max = torch.full_like(scores, float("-inf")).scatter_reduce(
            -1, starts[:, None, :].expand(b, c, p), scores, reduce="amax", include_self=True)
        visible = torch.div(q_pos + 1, ratio, rounding_mode="floor")  # the query's complete windows
        newest = torch.div(visible - 1, self.block_size, rounding_mode="floor") * self.block_size
        is_newest = ((key_windows.seq_ids[:, None, :] == q_seq[:, :, None])
                     & (key_windows.positions[:, None, :] == newest[:, :, None])
                     & (visible[:, :, None] > 0) & (q_seq[:, :, None] > 0))
        return self.top(block_max.masked_fill(is_newest, float("inf")), min(self.candidate_blocks, p))

    @staticmethod
    def top(scores: Tensor, k: int) -> Tensor:
        """The indices of the ``k`` largest of ``scores [..., n]``, -1 where the score is -inf; exact ties go to the
        lowest row (:func:`~dsv4.model.sparse_attention.stable_topk`), so a document selects the same rows in a
        packed row as alone."""
        return stable_topk(scores, k)
