"""One DSV4 transformer block: hyper-connection sites around attention and the MoE FFN.

Residual state ``X [B, L, hc, d]`` (``hc = hc_mult`` streams). Per block:

    X = attn_hc(X, lambda h: self_attn(input_layernorm(h), meta, cp))
    X = ffn_hc(X,  lambda h: mlp(post_attention_layernorm(h), input_ids, real_tokens=meta.real_tokens))

Attention kind follows ``config.ratio_for_layer(layer_idx)`` (0 SWA, 4 CSA, 128 HCA); the MoE uses hash
routing when ``layer_idx < num_hash_layers``. Everything except attention is per token, so CP reaches the block
only through ``cp`` handed to the attention. ``meta`` is the attention metadata the model builds once per forward
(:func:`~dsv4.model.attention_metadata.build_attention_metadata`: positions, document ids, padding, RoPE tables,
windows).
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.model.attention import DSV4Attention
from dsv4.model.attention_metadata import AttentionMetadata
from dsv4.model.context_parallel import ContextParallel
from dsv4.model.hyper_connections import HyperConnection
from dsv4.model.moe import MoE
from dsv4.model.norm import RMSNorm
from dsv4.model.recompute import recomputed


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
        self.activation_checkpointing = config.activation_checkpointing

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor | None, meta: AttentionMetadata, cp: ContextParallel | None = None
    ) -> torch.Tensor:
        """``x [B, L, hc, d]`` -> ``[B, L, hc, d]``; ``input_ids [B, L]`` feed the hash router (None: no hash layer).

        ``activation_checkpointing`` (:mod:`dsv4.model.recompute`) applies while autograd records."""
        if self.activation_checkpointing == "block" and torch.is_grad_enabled():
            return recomputed(self._forward, x, input_ids, meta, cp)
        return self._forward(x, input_ids, meta, cp)

    def _forward(self, x, input_ids, meta: AttentionMetadata, cp: ContextParallel | None) -> torch.Tensor:
        if self.activation_checkpointing == "selective" and torch.is_grad_enabled():
            x = self.attn_hc(x, lambda h: recomputed(self._attention, h, meta, cp))
            return self.ffn_hc(x, lambda h: recomputed(self._ffn, h, input_ids, meta.real_tokens))
        x = self.attn_hc(x, lambda h: self._attention(h, meta, cp))
        return self.ffn_hc(x, lambda h: self._ffn(h, input_ids, meta.real_tokens))

    def _attention(self, h: torch.Tensor, meta: AttentionMetadata, cp: ContextParallel | None) -> torch.Tensor:
        return self.self_attn(self.input_layernorm(h), meta, cp)

    def _ffn(self, h: torch.Tensor, input_ids: torch.Tensor | None, real_tokens: torch.Tensor | None) -> torch.Tensor:
        return self.mlp(self.post_attention_layernorm(h), input_ids, real_tokens=real_tokens)
