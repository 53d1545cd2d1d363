"""One DeepSeek-V4.1 block: Engram (at ``engram_layer_ids``), then the attention and FFN sites of single-pass
hyper-connections (:mod:`dsv4.model.v41.hyper_connections`).

    X = engram(X, ngram_ids, active)                       # Engram layers only, on all hc streams
    mix_a = attn_hc(X)                                     # its input: the DSpark target features
    y, state = self_attn(input_layernorm(collapse(X, carry)), meta, state)
    X = expand(X, y, mix_a.post, mix_a.comb)
    mix_f = ffn_hc(X)
    X = expand(X, mlp(post_attention_layernorm(collapse(X, mix_a.pre))), mix_f.post, mix_f.comb)
    carry = mix_f.pre

``forward(X [B, L, hc, d], carry [B, L, hc] fp32, state, meta, engram_inputs, cp) -> (X, carry, state)``;
``engram_inputs``: ``({layer_id: ngram_ids [B, L, n_buckets]}, active [B, L])`` of the forward
(:class:`~dsv4.model.v41.engram_hash.EngramHashing`), None without Engram layers. ``state`` is
the CSA2 shared state (:mod:`dsv4.model.v41.shared_state`), passed from block to block and never modified in place,
so ``activation_checkpointing`` (``block`` / ``selective``, :mod:`dsv4.model.recompute`) recomputes a block from its
inputs exactly. ``cp`` (None or the :class:`~dsv4.model.context_parallel.ContextParallel` view) reaches only the
attention, whose exchanges it runs (a recomputed block runs them again, with the same data, on every rank).
"""

from __future__ import annotations

import torch
from torch import nn

from dsv4.model.attention_metadata import AttentionMetadata
from dsv4.model.context_parallel import ContextParallel
from dsv4.model.norm import RMSNorm
from dsv4.model.recompute import recomputed
from dsv4.model.v41.attention import CSA2Attention
from dsv4.model.v41.engram import Engram
from dsv4.model.v41.hyper_connections import SinglePassHyperConnection
from dsv4.model.v41.moe import V41MoE
from dsv4.model.v41.shared_state import SharedState


def make_site(config) -> SinglePassHyperConnection:
    return SinglePassHyperConnection(config.hc_mult, config.hidden_size, sinkhorn_iters=config.hc_sinkhorn_iters,
                                     hc_eps=config.hc_eps, norm_eps=config.rms_norm_eps,
                                     init_std=config.initializer_range)


def make_engram(config, layer_idx: int) -> Engram | None:
    """The Engram module of an ``engram_layer_ids`` layer, else None."""
    return Engram(config, layer_idx) if layer_idx in config.engram_layer_ids else None


class DSV41Block(nn.Module):
    """Block ``layer_idx`` of the V4.1 backbone (see the module docstring)."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.engram = make_engram(config, layer_idx)
        self.attn_hc = make_site(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = CSA2Attention(config, layer_idx)
        self.ffn_hc = make_site(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = V41MoE(config, layer_idx)
        self.activation_checkpointing = config.activation_checkpointing

    def forward(self, x: torch.Tensor, carry: torch.Tensor, state: SharedState | None, meta: AttentionMetadata,
                engram_inputs=None, cp: ContextParallel | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, SharedState | None]:
        if self.activation_checkpointing == "block" and torch.is_grad_enabled():
            return recomputed(self._forward, x, carry, state, meta, engram_inputs, cp)
        return self._forward(x, carry, state, meta, engram_inputs, cp)

    def _forward(self, x, carry, state, meta: AttentionMetadata, engram_inputs, cp):
        selective = self.activation_checkpointing == "selective" and torch.is_grad_enabled()
        if self.engram is not None:
            ngram_ids, active = engram_inputs
            x = self.engram(x, ngram_ids[self.layer_idx], active)
        mix_a = self.attn_hc(x)
        h = self.input_layernorm(self.attn_hc.collapse(x, carry))
        y, state = recomputed(self.self_attn, h, meta, state, cp) if selective else self.self_attn(h, meta, state, cp)
        x = self.attn_hc.expand(x, y, mix_a.post, mix_a.comb)
        mix_f = self.ffn_hc(x)
        y = self._ffn(self.ffn_hc.collapse(x, mix_a.pre), meta.real_tokens, selective)
        return self.ffn_hc.expand(x, y, mix_f.post, mix_f.comb), mix_f.pre, state

    def _ffn(self, h: torch.Tensor, real_tokens, selective: bool) -> torch.Tensor:
        if selective:
            return recomputed(lambda t: self.mlp(self.post_attention_layernorm(t), None, real_tokens=real_tokens), h)
        return self.mlp(self.post_attention_layernorm(h), None, real_tokens=real_tokens)
