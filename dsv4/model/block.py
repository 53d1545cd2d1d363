"""One DSV4 transformer block: hyper-connection sites around attention and the MoE FFN (spec sections 2, 5).

Residual state ``X [B, L, hc, d]`` (``hc = hc_mult`` streams). Per block:

    X = attn_hc(X, lambda h: self_attn(input_layernorm(h), position_ids, packed_seq_ids, padding_mask, cp))
    X = ffn_hc(X,  lambda h: mlp(post_attention_layernorm(h), input_ids, padding_mask))

Attention kind follows ``config.ratio_for_layer(layer_idx)`` (0 SWA, 4 CSA, 128 HCA); the MoE uses hash
routing when ``layer_idx < num_hash_layers``. Everything except attention is per token, so CP reaches the block
only through ``cp`` handed to the attention. The model builds the attention metadata (RoPE tables, window
metadata) once per forward with ``build_attention_metadata`` and hands it to every block.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.model.attention import AttentionMetadata, DSV4Attention
from dsv4.model.hyper_connections import HyperConnection
from dsv4.model.moe import MoE
from dsv4.model.norm import RMSNorm


def make_hyper_connection(config) -> HyperConnection:
    return HyperConnection(
        config.hc_mult,
        config.hidden_size,
        sinkhorn_iters=config.hc_sinkhorn_iters,
        hc_eps=config.hc_eps,
        norm_eps=config.rms_norm_eps,
        init_std=config.initializer_range,
    )


class DSV4Block(nn.Module):
    """Block ``layer_idx``: ``forward(X [B, L, hc, d], ...) -> X' [B, L, hc, d]``."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.compress_ratio = config.ratio_for_layer(layer_idx)
        self.attn_hc = make_hyper_connection(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DSV4Attention(config, layer_idx)
        self.ffn_hc = make_hyper_connection(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MoE(config, layer_idx)

    def forward(
        self,
        x: torch.Tensor,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor,
        packed_seq_ids: torch.Tensor,
        padding_mask: torch.Tensor | None,
        cp=None,
        attn_metadata: AttentionMetadata | None = None,
    ) -> torch.Tensor:
        """``attn_metadata``: the per-forward attention metadata built once by the model (built here if None)."""
        x = self.attn_hc(
            x,
            lambda h: self.self_attn(
                self.input_layernorm(h), position_ids, packed_seq_ids, padding_mask, cp=cp, metadata=attn_metadata
            ),
        )
        return self.ffn_hc(x, lambda h: self.mlp(self.post_attention_layernorm(h), input_ids, padding_mask))
