"""Lightning indexer of CSA layers (ratio 4): picks the top-k compressed keys per query.

* Keys: its own overlap compressor at ``index_head_dim`` -> ``K_I [B, P, D_I]`` (normalised, RoPE at ``p * 4``).
* Queries: ``q_I = q_lat @ Wq_b^I`` -> ``[B, L, H_I, D_I]``, RoPE (compress table) at the query positions.
* Head weights: ``w = (x @ W_w) * H_I^-0.5`` -> ``[B, L, H_I]`` (fp32).
* Score: ``I[s, p] = D_I^-0.5 * sum_h w[s, h] * relu(q_I[s, h] . K_I[p])``; a key that the query may not see
  (``q_doc == 0``, other document / invalid window, or ``p_doc >= (q_pos_doc + 1) // 4``) scores -inf BEFORE the
  top-k; ``k = min(index_topk, P)``; selections that scored -inf become -1. Ties (common: a key whose dot
  product is negative for every head scores exactly 0) go to the lowest window index, so a packed row or a CP
  rank selects the same windows as the document run alone.

Memory: scores are computed per query chunk, so the largest intermediate is ``[B, chunk, H_I, P]``; nothing of
size ``[L, P]`` in fp32 besides the ``[B, L, k]`` int64 result. Given ``local_windows``, a chunk scores only the
causal prefix of the keys (on average half of them in a single-document row).

The indexer receives no gradient from the LM loss (top-k is discrete). Its parameters are frozen
(``requires_grad=False``) and it runs under ``no_grad`` unless ``config.train_indexer``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dsv4.config import DSV4Config
from dsv4.model.attention_backend import indexer_kernel
from dsv4.model.compressor import Compressor, WindowMetadata
from dsv4.model.rope import RopeTable, apply_rope
from dsv4.model.sparse_attention import causal_prefix, compressed_key_allowed

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
        self.train_indexer = config.train_indexer
        self.compressor = Compressor(config.hidden_size, self.head_dim, INDEX_RATIO, config.rms_norm_eps)
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        if not self.train_indexer:
            for param in self.parameters():
                param.requires_grad_(False)

    def keys(self, x: Tensor, windows: WindowMetadata, prev_features: Tensor | None = None) -> Tensor:
        """Index keys ``[B, P, index_head_dim]`` of the block's complete windows (see ``Compressor.forward``)."""
        with torch.set_grad_enabled(self.train_indexer and torch.is_grad_enabled()):
            return self.compressor(x, windows, prev_features)

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
    ) -> Tensor:
        """Top-k compressed-key indices ``[B, L, min(index_topk, P)]`` (int64, ``-1`` = invalid).

        Args:
            x: ``[B, L, d_m]`` attention input; q_lat: ``[B, L, q_lora_rank]``; rope: compress table at the query
                positions ``[B, L, rope/2]``; query_seq_ids/query_positions: ``[B, L]`` (doc-local positions).
            keys: ``[B, P, index_head_dim]`` (all compressed windows visible to this rank);
                key_seq_ids/key_positions: ``[B, P]`` their window ids and doc-local window indices.
            local_windows: when the last ``local_windows`` keys are this block's own windows in order (window ``j``
                pools rows ``[4j, 4j + 4)``; :class:`~dsv4.model.attention.DSV4Attention` passes it), a chunk of
                queries ending at row ``end`` scores only the causal prefix ``P - local_windows + end // 4``: the
                later keys are future windows, which no query of the chunk may select (documents start on multiples
                of 4, as the model's metadata guarantees). None: every key.
        """
        b, length, _ = x.shape
        p = keys.shape[1]
        k = min(self.topk, p)
        with torch.set_grad_enabled(self.train_indexer and torch.is_grad_enabled()):
            q = apply_rope(self.wq_b(q_lat).view(b, length, self.n_heads, self.head_dim), rope)
            w = torch.nn.functional.linear(x.float(), self.weights_proj.weight.float()) * self.n_heads**-0.5
            kernel = indexer_kernel(self.backend, x.device)
            if kernel is not None:  # the same selection, fused (scores exact in fp32 from the same inputs)
                return kernel(q, w, keys, query_seq_ids, query_positions, key_seq_ids, key_positions, self.topk,
                              local_windows)
            q = q.float()
            keys_f = keys.float()
            out = []
            for start in range(0, length, self.chunk_size):
                end = min(start + self.chunk_size, length)
                hi = causal_prefix(p, local_windows, end, INDEX_RATIO)
                # [B, C, H_I, hi] -> weighted sum over heads -> [B, C, hi]
                logits = torch.einsum("bchd,bpd->bchp", q[:, start:end], keys_f[:, :hi]).relu()
                scores = torch.einsum("bchp,bch->bcp", logits, w[:, start:end]) * self.head_dim**-0.5
                allowed = compressed_key_allowed(
                    query_seq_ids[:, start:end], query_positions[:, start:end], key_seq_ids[:, :hi],
                    key_positions[:, :hi], INDEX_RATIO,
                )
                scores = scores.masked_fill(~allowed, float("-inf"))
                # Stable descending sort: equal scores (e.g. all heads ReLU'd to 0) pick the lowest window index,
                # so the choice does not depend on how many other keys (documents, ranks) sit in the row.
                values, idx = scores.sort(dim=-1, descending=True, stable=True)
                idx = idx[..., :k].masked_fill(torch.isneginf(values[..., :k]), -1)
                if idx.shape[-1] < k:  # a short causal prefix: the rest selects nothing
                    idx = torch.nn.functional.pad(idx, (0, k - idx.shape[-1]), value=-1)
                out.append(idx)
        if not out:
            return torch.empty(b, 0, k, dtype=torch.long, device=x.device)
        return torch.cat(out, dim=1)
