"""The attention of a DSpark drafter stage: V4.1's window attention (:class:`~dsv4.model.v41.attention.CSA2Attention`,
its parameters and projections) over a block's own slots and the target context before its anchor.

Per stage, for slots ``x [B, N*K, d]`` (collapsed, normed) and the projected target features ``c [B, S, d]``:

* queries ``q = wq_b(q_norm(wq_a x))`` RoPE'd at the slot positions (main RoPE table, no YaRN);
* one K = V head for the context rows, ``kv_norm(wkv c)`` RoPE'd at their positions, and for the slots,
  ``kv_norm(wkv x)`` RoPE'd at the slot positions; both FP8-rounded in blocks of 32 (always: the served drafter's
  cache format, straight-through gradient);
* keys of a slot: the ``W`` context rows before its anchor (:meth:`~dsv4.model.v41.draft_blocks.DraftBlocks.
  context_index`) and the ``K`` slots of its own block; softmax with the per-head sink, scale ``D^-0.5``;
* output: inverse RoPE, grouped ``wo_a``, ``wo_b``.

The softmax runs in the backbone's sparse-attention kernel (:func:`~dsv4.model.attention_backend.attention_kernel`:
the torch reference, or Triton on CUDA) with one batch row per block: the block's gathered context window is the
kernel's window (``W`` rows, then ``K`` padding rows so every slot's band covers the whole window), and the
block's own slots are the kernel's HCA compressed rows under ratio 1 with one window id and position 0, which every
slot sees. Nothing of size ``[N*K, S]`` is built: the largest tensors are the gathered windows ``[B*N, W + K, D]``
and the scores ``[B*N, K, H, W + K + K + 1]``.

Context parallelism (:class:`ContextHalo`): the rows are a chunk extended by slots before (and after) it; the
context K = V of the slots before it are the previous chunk's, RoPE'd and FP8-rounded there and received row by row,
only as many per row as its blocks read (the route's counts); their gradients return to their owner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dsv4.model.attention_backend import attention_kernel
from dsv4.model.rope import RopeTable, rope_inv_freq, rope_table
from dsv4.model.v41.attention import CSA2Attention
from dsv4.model.v41.draft_blocks import DraftBlocks


@dataclass(frozen=True)
class ContextHalo:
    """Context parallelism as the drafter sees it: its rows are a chunk extended by ``rows`` slots before it (and
    some after it); the context K = V rows of those ``rows`` slots are the previous chunk's last ones, received
    through ``cp`` (:class:`~dsv4.model.context_parallel.ContextParallel`) along ``route`` (exact counts per row:
    only what the blocks read), then their gradients go back. ``local`` is the chunk's own length."""

    cp: Any
    route: Any
    rows: int
    local: int


@dataclass(frozen=True)
class DraftAttentionLayout:
    """What every stage's attention reads, built once per forward by :meth:`build`.

    ``context_rope`` ``[B, S, r/2]`` and ``slot_rope`` ``[B, N*K, r/2]`` tables; ``window_rows [B, N, W]`` (context
    rows of each block, clamped); ``window_seq [B*N, W + K]`` (1 = a context row the block sees, 0 = not; the
    ``K`` trailing rows are padding); ``window_padding [B*N, W + K]``; ``blocks`` N, ``block_size`` K, ``window`` W.
    """

    context_rope: RopeTable
    slot_rope: RopeTable
    window_rows: Tensor
    window_seq: Tensor
    window_padding: Tensor
    blocks: int
    block_size: int
    window: int
    halo: ContextHalo | None = None

    @classmethod
    def build(cls, config, blocks: DraftBlocks, position_ids: Tensor, packed_seq_ids: Tensor | None = None,
              halo: ContextHalo | None = None) -> "DraftAttentionLayout":
        """The layout of ``blocks`` over rows with ``position_ids [B, S]`` (and, for packed rows, document ids
        ``packed_seq_ids [B, S]``: a block sees only context rows of its anchor's document)."""
        window, k = config.sliding_window, blocks.block_size
        inv_freq = rope_inv_freq(config.qk_rope_head_dim, config.rope_theta)
        rows, valid = blocks.context_index(window)
        if packed_seq_ids is not None:
            anchor_doc = packed_seq_ids.gather(1, blocks.anchors)
            b, n, w = rows.shape
            valid = valid & (packed_seq_ids.gather(1, rows.view(b, n * w)).view(b, n, w) == anchor_doc[..., None])
        b, n, _ = rows.shape
        seq = torch.cat((valid.long(), valid.new_zeros(b, n, k, dtype=torch.long)), dim=-1).view(b * n, window + k)
        padding = torch.zeros(b * n, window + k, dtype=torch.bool, device=rows.device)
        padding[:, window:] = True
        return cls(rope_table(position_ids, inv_freq), rope_table(blocks.slot_positions(position_ids), inv_freq),
                   rows, seq, padding, n, k, window, halo)


class DSparkAttention(CSA2Attention):
    """``forward(x [B, N*K, d], context [B, S, d], layout) -> [B, N*K, d]`` (module docstring). Built as the
    window-only CSA2 layer ``num_hidden_layers + stage`` (its ``compress_ratios`` entry must be 0), so it holds
    exactly the released drafter attention's tensors."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        if self.role != "window":
            raise ValueError(f"DSpark drafter layer {layer_idx}: compress_ratios[{layer_idx}] must be 0 (the drafter "
                             f"attention is window-only), got {self.ratio}")
        self.fake_quant = True  # the drafter's KV is FP8-rounded whatever the backbone's setting

    def forward(self, x: Tensor, context: Tensor, layout: DraftAttentionLayout) -> Tensor:  # type: ignore[override]
        b, _, d_model = x.shape
        n, k, w = layout.blocks, layout.block_size, layout.window
        heads, d = self.n_heads, self.head_dim
        context_kv = self.project_kv(context, layout.context_rope)  # [B, S, D]
        if layout.halo is not None:  # the slots before the chunk: the previous chunk's own rows
            h = layout.halo
            received = h.cp.halo_exchange(context_kv[:, h.rows:h.rows + h.local], h.rows, dim=1,
                                          kind="dspark_context", route=h.route)
            context_kv = torch.cat((received, context_kv[:, h.rows:]), dim=1)
        slot_kv = self.project_kv(x, layout.slot_rope)  # [B, N*K, D]
        _, q = self.project_queries(x, layout.slot_rope)  # [B, N*K, H, D]
        windows = context_kv.gather(1, layout.window_rows.view(b, n * w, 1).expand(-1, -1, d)).view(b * n, w, d)
        kv = torch.cat((windows, windows.new_zeros(b * n, k, d)), dim=1)  # [B*N, W + K, D]
        ones = torch.ones(b * n, k, dtype=torch.long, device=x.device)
        kernel = attention_kernel(self.config.attention_backend, x.device)
        out = kernel(
            q.reshape(b * n, k, heads, d), kv, self.sink(),
            window=w + k, query_seq_ids=ones, query_positions=torch.zeros_like(ones),
            kv_seq_ids=layout.window_seq, kv_padding=layout.window_padding, query_offset=w,
            compressed=slot_kv.reshape(b * n, k, d), compressed_seq_ids=ones, compressed_positions=torch.zeros_like(ones),
            ratio=1, chunk_size=max(k, 1))
        return self.project_output(out.reshape(b, n * k, heads, d), layout.slot_rope).view(b, n * k, d_model)
