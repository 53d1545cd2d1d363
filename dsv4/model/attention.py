"""DSV4 attention layer: queries, the shared K=V head, compressed rows, the indexer, sparse attention, output.

Per layer with compress ratio ``r`` (0 = SWA, 4 = CSA, other = HCA-style full compressed set):

* Q: ``q_lat = RMSNorm_q(x @ Wq_a)``, ``q = q_lat @ Wq_b -> [B, L, H, D]``, weightless per-head RMSNorm, RoPE.
* K = V: ``kv = RMSNorm_kv(x @ Wkv) -> [B, L, D]`` (one shared head), RoPE.
* ``config.fake_quant`` (DeepSeek-V4 inference's KV cache numerics, straight-through): the window KV and the
  compressed rows are rounded by :func:`~dsv4.model.fake_quant.fake_quant_v4_kv` (FP8, blocks of 64, power-of-two
  scales, the non-RoPE channels only) right after RoPE, before any CP exchange, so a rank receives the rows its
  predecessor rounded (the rounding is per row: CP=N equals CP=1); the indexer rounds its queries and keys
  (:class:`~dsv4.model.indexer.Indexer`).
* RoPE table: main theta for ``r == 0``; compress theta (+ YaRN) for ``r > 0`` (main Q/KV, compressor, indexer).
* Keys: sliding window over raw kv; ``r > 0`` adds compressed rows (``Compressor``); ``r == 4`` restricts them to
  the ``Indexer`` top-k. The sparse-attention kernel (``config.attention_backend``: the torch reference or the
  Triton kernels, :mod:`dsv4.model.attention_backend`) does the softmax with the learned per-head sink (zero-init,
  fp32). With ``config.indexer_loss_coeff > 0`` (training) a CSA layer also keeps its indexer KL sum
  (:mod:`dsv4.model.indexer_loss`) in ``indexer_loss`` for the model to collect (a module attribute, not the
  metadata: FSDP's hooks may hand a block a copy of its arguments).
* Output: inverse RoPE, grouped low-rank ``wo_a`` (block-diagonal, ``o_groups`` groups of ``H/G`` heads each
  ``H/G*D -> o_lora_rank``), then ``wo_b: G*o_lora_rank -> d_m``.

Per-token metadata (document ids, doc-local positions, key padding, RoPE tables, window metadata per ratio) is
built once per forward by :func:`build_attention_metadata` (``attention_metadata.py``) and shared by every layer.

Context parallelism only ADDS exchanges to this path, through the ``CPContext`` verbs (nothing of size
``[L, S]`` is built and raw tokens are never all-gathered):

* ``halo``: the previous chunk's last ``sliding_window - 1`` K/V rows (already normed and RoPE'd by their owner),
  prepended to the window keys (the kernel's ``query_offset``); only for the local rows whose document continues
  across the chunk boundary (``meta.routes.halo``: a row whose first token starts a document or is padding
  receives nothing, zeros stand in);
* ``compressor_halo`` / ``index_compressor_halo`` (ratio 4): the previous window's first-half softmax summary, so
  the first local window pools its overlap exactly as on one rank;
* ``compressed_gather`` / ``index_key_gather``: the earlier compressed rows / index keys of the document each
  local row's first token belongs to, received point-to-point from their owners (``meta.routes.preceding``).

Each exchange starts as soon as its input exists and is waited for where its result is first needed: the halo and
both compressor boundaries overlap the query projections and the compressors, the compressed-row gather overlaps
the index keys and the indexer (``CPContext.overlap``; the backward exchanges run where autograd reaches them).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dsv4.config import DSV4Config
from dsv4.model.attention_backend import attend
from dsv4.model.attention_metadata import AttentionMetadata
from dsv4.model.compressor import Compressor
from dsv4.model.context_parallel import ContextParallel, ReadyRows
from dsv4.model.fake_quant import fake_quant_v4_kv
from dsv4.model.indexer import Indexer
from dsv4.model.indexer_loss import indexer_kl_sum, zero_gradient
from dsv4.model.norm import RMSNorm
from dsv4.model.recompute import is_recomputing
from dsv4.model.rope import apply_rope


def start_preceding(rows: Tensor, meta: AttentionMetadata, ratio: int, cp: ContextParallel | None, kind: str):
    """``rows [B, n, *]`` (this chunk's own windows of ``ratio``) with the needed earlier windows of
    ``meta.key_windows[ratio]`` before them, started: ``.wait()`` gives ``[B, P, *]``; the rows themselves on one
    rank. Used by the V4 and V4.1 attention layers."""
    if meta.routes is None:
        return ReadyRows(rows)
    return cp.start_exchange_rows(rows, meta.routes.preceding[ratio], dim=1, kind=kind)


class AttentionSink(nn.Module):
    """The learned per-head sink logits ``[H]`` (fp32, zero-init); a module of its own so that mixed precision can
    keep it fp32 (``dsv4.parallel.wrap``). ``forward()`` returns a copy: a sharded module's parameter storage is
    released after its forward, so the parameter itself must not escape it."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(heads, dtype=torch.float32))

    def forward(self) -> Tensor:
        return self.logits.clone()


def block_diagonal_linear(x: Tensor, weight: Tensor, groups: int) -> Tensor:
    """``x [..., G, in_g]`` times block ``g`` of ``weight [G * out_g, in_g]`` (rows ``g*out_g .. (g+1)*out_g``) ->
    ``[..., G, out_g]``: the grouped low-rank output projection ``wo_a``."""
    return torch.einsum("...gi,goi->...go", x, weight.view(groups, -1, weight.shape[-1]).to(x.dtype))


class BlockDiagonalLinear(nn.Linear):
    """``wo_a``: ``groups`` independent blocks stored as one ``[G * out_g, in_g]`` weight (the released layout);
    ``forward(x [..., G, in_g]) -> [..., G, out_g]``."""

    def __init__(self, in_features: int, out_features: int, groups: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.groups = groups

    def forward(self, x: Tensor) -> Tensor:
        return block_diagonal_linear(x, self.weight, self.groups)


class DSV4Attention(nn.Module):
    """One DSV4 attention layer; ``layer_idx`` selects its compress ratio (MTP layers beyond the list: 0)."""

    def __init__(self, config: DSV4Config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.ratio = config.ratio_for_layer(layer_idx)
        self.n_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.fake_quant = config.fake_quant
        self.rope_dim = config.qk_rope_head_dim
        self.n_groups = config.o_groups
        d_m, eps = config.hidden_size, config.rms_norm_eps
        group_in = self.n_heads * self.head_dim // self.n_groups

        self.wq_a = nn.Linear(d_m, config.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(config.q_lora_rank, eps)
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.q_head_norm = RMSNorm(self.head_dim, eps, weight=False)
        self.wkv = nn.Linear(d_m, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, eps)
        self.sink = AttentionSink(self.n_heads)
        self.wo_a = BlockDiagonalLinear(group_in, self.n_groups * config.o_lora_rank, self.n_groups)
        self.wo_b = nn.Linear(self.n_groups * config.o_lora_rank, d_m, bias=False)
        self.compressor = Compressor(d_m, self.head_dim, self.ratio, eps) if self.ratio > 0 else None
        self.indexer = Indexer(config) if self.ratio == 4 else None
        self.indexer_loss: Tensor | None = None  # this forward's indexer KL sum (training the indexer), see forward
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Linear weights ~ N(0, initializer_range); norms 1; ape and sinks 0."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        nn.init.zeros_(self.sink.logits)

    # ---------------------------------------------------------------- CP exchanges (none on a single rank)
    # Each exchange is started as soon as its input exists and waited for where its result is needed, so the work in
    # between (the query projections, the compressors, the indexer) overlaps the transfer (``CPContext.overlap``).
    @staticmethod
    def _start_prev_features(module, x: Tensor, meta: AttentionMetadata, cp: ContextParallel | None, kind: str):
        """An overlap compressor's boundary features of the previous chunk, started (``.wait()`` is None on a
        single rank)."""
        if not meta.halo or not module.overlap:
            return ReadyRows(None)
        boundary = module(x, boundary=True)  # [B, 1, 2D]: the last window's softmax summary
        return cp.start_halo_exchange(boundary, boundary.shape[1], dim=1, kind=kind, route=meta.routes.halo)

    # ---------------------------------------------------------------- forward
    def forward(self, x: Tensor, meta: AttentionMetadata, cp: ContextParallel | None = None) -> Tensor:
        """Attention over the sliding window and the compressed rows.

        Args:
            x: ``[B, L, hidden]`` (input-layernormed), this rank's tokens.
            meta: the per-forward :func:`build_attention_metadata` result (positions, document ids, padding, RoPE
                tables, windows and what CP must exchange).
            cp: None or the :class:`~dsv4.model.context_parallel.ContextParallel` view (each local row is one chunk
                of a whole row, ``cp.local_rows``).
        Returns:
            ``[B, L, hidden]`` in ``x.dtype``.
        """
        b, length, _ = x.shape
        rope = meta.rope_compress if self.ratio else meta.rope_main
        train_indexer = self.indexer is not None and self.indexer.trainable and torch.is_grad_enabled()
        # the indexer loss reaches the indexer only: no gradient flows back into the main model
        x_i = zero_gradient(x) if train_indexer else x

        kv = self._kv_numerics(apply_rope(self.kv_norm(self.wkv(x)), rope))  # [B, L, D]
        halo = cp.start_halo_exchange(kv, meta.halo, dim=1, kind="halo", route=meta.routes.halo) if meta.halo else None
        if self.ratio > 0:
            prev = self._start_prev_features(self.compressor, x, meta, cp, "compressor_halo")
        if self.indexer is not None:
            prev_i = self._start_prev_features(self.indexer.compressor, x_i, meta, cp, "index_compressor_halo")

        q_lat = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_lat).view(b, length, self.n_heads, self.head_dim)
        q = apply_rope(self.q_head_norm(q), rope)

        compressed = comp_seq = comp_pos = topk = local_windows = student = None
        if self.ratio > 0:
            windows, key_windows = meta.windows[self.ratio], meta.key_windows[self.ratio]
            local_windows = windows.seq_ids.shape[1]  # this block's own windows, the last rows of key_windows
            rows = self._kv_numerics(self.compressor(x, windows, prev_features=prev.wait()))
            compressed = start_preceding(rows, meta, self.ratio, cp, "compressed_gather")
            comp_seq, comp_pos = key_windows.seq_ids, key_windows.positions
            if self.indexer is not None:
                q_lat_i = zero_gradient(q_lat) if train_indexer else q_lat
                index_keys = start_preceding(self.indexer.keys(x_i, windows, prev_features=prev_i.wait()), meta,
                                                   self.ratio, cp, "index_key_gather").wait()
                topk = self.indexer(
                    x_i, q_lat_i, meta.rope_compress, meta.seq_ids, meta.position_ids, index_keys, comp_seq,
                    comp_pos, local_windows=local_windows, with_scores=train_indexer,
                    key_floors=meta.key_floors[self.ratio],
                )
                if train_indexer:
                    topk, student = topk
            compressed = compressed.wait()
        if halo is not None:
            kv = torch.cat((halo.wait(), kv), dim=1)  # [B, halo + L, D]

        tuning = {"compressed_probs": True} if student is not None else {}  # the indexer loss's teacher
        out = attend(self.config, q, kv, self.sink(), meta, ratio=self.ratio, compressed=compressed, topk=topk,
                     local_windows=local_windows, **tuning)
        if student is not None:
            out, teacher = out
            loss = indexer_kl_sum(teacher, student)  # a recompute saves what the forward saved: compute it again,
            if not is_recomputing():  # but count it once
                self.indexer_loss = loss
        out = apply_rope(out, rope, inverse=True)
        return self.wo_b(self._grouped_wo_a(out))

    def _kv_numerics(self, kv: Tensor) -> Tensor:
        """``kv [B, *, D]`` (RoPE'd window or compressed rows) as the served cache holds it (``fake_quant``)."""
        return fake_quant_v4_kv(kv, self.rope_dim) if self.fake_quant else kv

    def _grouped_wo_a(self, out: Tensor) -> Tensor:
        """Block-diagonal ``wo_a``: ``[B, L, H, D] -> [B, L, G * o_lora_rank]``, group g uses heads of group g."""
        b, length = out.shape[:2]
        return self.wo_a(out.reshape(b, length, self.n_groups, -1)).reshape(b, length, -1)  # heads of group g
