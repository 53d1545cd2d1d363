"""DSV4 attention layer (dsv4-architecture.md 2.1-2.5) and the per-forward attention metadata.

Per layer with compress ratio ``r`` (0 = SWA, 4 = CSA, other = HCA-style full compressed set):

* Q: ``q_lat = RMSNorm_q(x @ Wq_a)``, ``q = q_lat @ Wq_b -> [B, L, H, D]``, weightless per-head RMSNorm, RoPE.
* K = V: ``kv = RMSNorm_kv(x @ Wkv) -> [B, L, D]`` (one shared head), RoPE.
* RoPE table: main theta for ``r == 0``; compress theta (+ YaRN) for ``r > 0`` (main Q/KV, compressor, indexer).
* Keys: sliding window over raw kv; ``r > 0`` adds compressed rows (``Compressor``); ``r == 4`` restricts them to
  the ``Indexer`` top-k. ``sparse_attention`` does the softmax with the learned per-head sink (zero-init, fp32).
* Output: inverse RoPE, grouped low-rank ``wo_a`` (block-diagonal, ``o_groups`` groups of ``H/G`` heads each
  ``H/G*D -> o_lora_rank``), then ``wo_b: G*o_lora_rank -> d_m``.

Per-token metadata (document ids, doc-local positions, key padding, RoPE tables, window metadata per ratio) is
built once per forward by :func:`build_attention_metadata` and shared by every layer.

Context parallelism (not implemented yet; ``cp`` of size > 1 raises ``NotImplementedError``) only ADDS to this path:
the halo rows of the attention input (``_halo_rows``; the single-rank path has ``halo == 0``), the all-gathers of
compressed rows and index keys (``_gather_rows``), and the metadata of the halo / gathered windows inside
``AttentionMetadata`` (``kv_*`` and ``key_windows``). The kernel and the compressor already take the halo
(``query_offset``, ``prev_x``), so no dense ``[L, S]`` tensor is ever needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dsv4.config import DSV4Config
from dsv4.model.compressor import Compressor, WindowMetadata, window_metadata
from dsv4.model.indexer import Indexer
from dsv4.model.norm import RMSNorm
from dsv4.model.rope import RopeTable, apply_rope, rope_inv_freq, rope_table
from dsv4.model.sparse_attention import sparse_attention


# Parameters kept in fp32 whatever the model dtype (suffixes of names inside an attention module).
FP32_PARAMETER_SUFFIXES = ("attn_sink", "compressor.wkv.weight", "compressor.wgate.weight", "compressor.ape")


@dataclass
class AttentionMetadata:
    """Everything about positions/documents an attention layer needs, built once per forward.

    Query side (this rank's ``L`` tokens): ``position_ids``/``seq_ids`` ``[B, L]`` (doc-local positions,
    1-based document ids, 0 = pack padding), ``rope_main``/``rope_compress`` ``[B, L, rope/2]``.
    Window-key side (``halo`` rows before the block, then the block): ``kv_seq_ids``/``kv_padding``
    ``[B, halo + L]`` and ``kv_rope_main``/``kv_rope_compress`` ``[B, halo + L, rope/2]``.
    ``windows[r]``: the block's complete windows for each active ratio ``r`` (compressor input);
    ``key_windows[r]``: every compressed key a query may index (all ranks' windows under CP; same as
    ``windows[r]`` on a single rank).
    """

    position_ids: Tensor
    seq_ids: Tensor
    rope_main: RopeTable
    rope_compress: RopeTable
    kv_seq_ids: Tensor
    kv_padding: Tensor
    kv_rope_main: RopeTable
    kv_rope_compress: RopeTable
    windows: dict[int, WindowMetadata]
    key_windows: dict[int, WindowMetadata]
    halo: int = 0


def _check_cp(cp: object | None) -> None:
    if cp is not None and getattr(cp, "size", 1) > 1:
        raise NotImplementedError(
            f"DSV4 attention: context parallelism (CP size {cp.size}) is not implemented yet; pass cp=None"
        )


def build_attention_metadata(
    config: DSV4Config,
    position_ids: Tensor,
    packed_seq_ids: Tensor | None = None,
    padding_mask: Tensor | None = None,
    cp: object | None = None,
) -> AttentionMetadata:
    """Build the per-token attention metadata for one forward (reused by every layer).

    Args:
        config: the model config (rope dims/thetas, active ratios).
        position_ids: ``[B, L]`` int, document-local positions (global positions for unpacked rows).
        packed_seq_ids: ``[B, L]`` int, 1-based document ids, 0 = pack padding; None = one document per row.
        padding_mask: ``[B, L]`` bool, True = a key no query may see; None = no padding.
        cp: ``None`` or a one-rank ``CPContext`` (larger contexts raise ``NotImplementedError`` for now).
    """
    _check_cp(cp)
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

    rope_dim = config.qk_rope_head_dim
    inv_main = rope_inv_freq(rope_dim, config.rope_theta)
    inv_compress = rope_inv_freq(rope_dim, config.compress_rope_theta, config.rope_scaling)
    rope_main = rope_table(position_ids, inv_main)
    rope_compress = rope_table(position_ids, inv_compress)

    windows: dict[int, WindowMetadata] = {}
    misaligned = []
    for ratio in config.active_ratios:
        win_seq, win_pos = window_metadata(seq_ids, position_ids, ratio)
        first_pos = position_ids[:, : win_seq.shape[1] * ratio : ratio]
        misaligned.append(((win_seq > 0) & (first_pos % ratio != 0)).any())
        windows[ratio] = WindowMetadata(
            ratio=ratio,
            seq_ids=win_seq,
            positions=win_pos,
            rope=rope_table(win_pos * ratio, inv_compress),
            prev_seq_ids=torch.zeros(b, dtype=torch.long, device=device),  # sequence start: no predecessor
        )
    if misaligned and bool(torch.stack(misaligned).any()):  # one host sync per forward
        raise ValueError(
            "build_attention_metadata: a compressor window starts at a document-local position that is not a "
            f"multiple of its ratio (ratios {config.active_ratios}); every document must start on a multiple of "
            f"{config.cp_shard_multiple} with positions counted from 0 (pack with the CP repad or "
            "dsv4.packing.aligned_packed_layout), otherwise compressed keys would leak future tokens"
        )
    # Single rank: no halo rows, and the compressed keys are this block's own windows.
    return AttentionMetadata(
        position_ids=position_ids,
        seq_ids=seq_ids,
        rope_main=rope_main,
        rope_compress=rope_compress,
        kv_seq_ids=seq_ids,
        kv_padding=padding,
        kv_rope_main=rope_main,
        kv_rope_compress=rope_compress,
        windows=windows,
        key_windows=windows,
        halo=0,
    )


class DSV4Attention(nn.Module):
    """One DSV4 attention layer; ``layer_idx`` selects its compress ratio (MTP layers beyond the list: 0)."""

    def __init__(self, config: DSV4Config, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.ratio = config.ratio_for_layer(layer_idx)
        self.n_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.window = config.sliding_window
        self.n_groups = config.o_groups
        d_m, eps = config.hidden_size, config.rms_norm_eps
        group_in = self.n_heads * self.head_dim // self.n_groups

        self.wq_a = nn.Linear(d_m, config.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(config.q_lora_rank, eps)
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.q_head_norm = RMSNorm(self.head_dim, eps, weight=False)
        self.wkv = nn.Linear(d_m, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, eps)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.wo_a = nn.Linear(group_in, self.n_groups * config.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(self.n_groups * config.o_lora_rank, d_m, bias=False)
        self.compressor = Compressor(d_m, self.head_dim, self.ratio, eps) if self.ratio > 0 else None
        self.indexer = Indexer(config) if self.ratio == 4 else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Linear weights ~ N(0, initializer_range); norms 1; ape and sinks 0."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=self.config.initializer_range)
        nn.init.zeros_(self.attn_sink)

    # ---------------------------------------------------------------- CP hooks (identity on a single rank)
    def _halo_rows(self, x: Tensor, meta: AttentionMetadata, cp: object | None) -> Tensor:
        """The ``meta.halo`` attention-input rows preceding this block (CP: the previous rank's last rows)."""
        if meta.halo == 0:
            return x[:, :0]
        return cp.halo_exchange(x, meta.halo, dim=1, kind="attn_halo")  # type: ignore[union-attr]

    def _gather_rows(self, rows: Tensor, cp: object | None, kind: str) -> Tensor:
        """All compressed rows visible to this rank (CP: differentiable all-gather along the sequence)."""
        if cp is None or getattr(cp, "size", 1) == 1:
            return rows
        return cp.all_gather(rows, dim=1, kind=kind)  # type: ignore[union-attr]

    # ---------------------------------------------------------------- forward
    def forward(
        self,
        x: Tensor,
        position_ids: Tensor | None,
        packed_seq_ids: Tensor | None,
        padding_mask: Tensor | None,
        cp: object | None = None,
        metadata: AttentionMetadata | None = None,
    ) -> Tensor:
        """Attention over the sliding window and the compressed rows.

        Args:
            x: ``[B, L, hidden]`` (input-layernormed).
            position_ids: ``[B, L]`` document-local positions (None = ``arange(L)``, single rank).
            packed_seq_ids: ``[B, L]`` 1-based document ids, 0 = pack padding (None = one document per row).
            padding_mask: ``[B, L]`` True = key no query may see (None = none).
            cp: None or a ``CPContext`` of size 1 (size > 1 raises ``NotImplementedError`` for now).
            metadata: optional prebuilt :func:`build_attention_metadata` result (then the three tensors above are
                ignored); lets the model build it once per forward.
        Returns:
            ``[B, L, hidden]`` in ``x.dtype``.
        """
        _check_cp(cp)
        if metadata is None and position_ids is None:
            position_ids = torch.arange(x.shape[1], device=x.device).expand(x.shape[0], -1)
        meta = metadata if metadata is not None else build_attention_metadata(
            self.config, position_ids, packed_seq_ids, padding_mask, cp
        )
        b, length, _ = x.shape
        rope = meta.rope_compress if self.ratio else meta.rope_main
        kv_rope = meta.kv_rope_compress if self.ratio else meta.kv_rope_main

        q_lat = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_lat).view(b, length, self.n_heads, self.head_dim)
        q = apply_rope(self.q_head_norm(q), rope)

        x_halo = self._halo_rows(x, meta, cp)
        kv = apply_rope(self.kv_norm(self.wkv(torch.cat((x_halo, x), dim=1))), kv_rope)  # [B, halo + L, D]

        compressed = comp_seq = comp_pos = topk = None
        if self.ratio > 0:
            windows, key_windows = meta.windows[self.ratio], meta.key_windows[self.ratio]
            prev_x = x_halo[:, -self.ratio :] if meta.halo >= self.ratio else None
            compressed = self._gather_rows(self.compressor(x, windows, prev_x), cp, "compressed_kv")
            comp_seq, comp_pos = key_windows.seq_ids, key_windows.positions
            if self.indexer is not None:
                index_keys = self._gather_rows(self.indexer.keys(x, windows, prev_x), cp, "index_keys")
                topk = self.indexer(
                    x, q_lat, meta.rope_compress, meta.seq_ids, meta.position_ids, index_keys, comp_seq, comp_pos
                )

        out = sparse_attention(
            q,
            kv,
            self.attn_sink,
            window=self.window,
            query_seq_ids=meta.seq_ids,
            query_positions=meta.position_ids,
            kv_seq_ids=meta.kv_seq_ids,
            kv_padding=meta.kv_padding,
            query_offset=meta.halo,
            compressed=compressed,
            compressed_seq_ids=comp_seq,
            compressed_positions=comp_pos,
            ratio=self.ratio,
            topk_indices=topk,
            chunk_size=self.config.attention_chunk_size,
        )
        out = apply_rope(out, rope, inverse=True)
        return self.wo_b(self._grouped_wo_a(out))

    def _grouped_wo_a(self, out: Tensor) -> Tensor:
        """Block-diagonal ``wo_a``: ``[B, L, H, D] -> [B, L, G * o_lora_rank]``, group g uses heads of group g."""
        b, length = out.shape[:2]
        grouped = out.reshape(b, length, self.n_groups, -1)  # [B, L, G, H/G * D]
        weight = self.wo_a.weight.view(self.n_groups, -1, grouped.shape[-1])  # [G, o_lora, H/G * D]
        return torch.einsum("blgi,goi->blgo", grouped, weight.to(grouped.dtype)).reshape(b, length, -1)
