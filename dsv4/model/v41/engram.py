"""The Engram module of DeepSeek-V4.1: hashed n-gram memory added to every hyper-connection stream.

At each layer in ``engram_layer_ids``, before the attention hyper-connection, with ``x [B, L, hc, d]`` the streams
and ``ids [B, L, n_buckets]`` the rows of :mod:`dsv4.model.v41.engram_hash`::

    e        = embed.lookup(ids).flatten(-2)                    [B, L, n_buckets * head_dim]
    k_1..k_hc, v = split(wkv(e))                                 hc keys and one value, each [B, L, d]
    s_i      = <x_i * q_weight_i * k_weight_i, k_i> / (rms(x_i) * rms(k_i) * sqrt(d))      fp32
    gate_i   = sigmoid(sign(s_i) * sqrt(max(|s_i|, 1e-6)))      0 where the token is not active
    x_i     += gate_i * v                                        in fp32, cast back to x's dtype

``rms(y) = sqrt(mean(y^2) + rms_norm_eps)``. The table, the projection and the dot product follow the released
inference code (through NeMo Automodel 0.7.0, the reference the tests compare with); there is no short
convolution. The table is frozen unless ``engram_trainable``; ``wkv``, ``q_weight`` and ``k_weight`` train.

``embed`` is an :class:`~dsv4.model.v41.engram_table.EngramTable`: a ``LocalEngramTable`` as built (every row
here), replaced by a row-sharded table under a process group (``dsv4.parallel.engram_table.shard_engram_tables``);
Engram only calls its ``lookup``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from dsv4.model.v41.engram_table import EngramTable, LocalEngramTable

__all__ = ["Engram"]

GATE_FLOOR = 1e-6
"""``|s|`` is clamped to at least this before the square root (no gradient below it)."""


class Engram(nn.Module):
    """One layer's Engram: parameters ``embed.weight [rows, head_dim]``, ``wkv.weight [(hc_mult + 1) * hidden,
    n_buckets * head_dim]``, ``q_weight`` and ``k_weight [hc_mult, hidden]`` (checkpoint names under
    ``layers.{i}.engram.``).

    ``config`` supplies ``hidden_size``, ``hc_mult``, ``rms_norm_eps``, ``initializer_range``, ``engram_layer_ids``,
    ``engram_num_embeddings``, ``engram_max_ngram_size``, ``engram_n_heads``, ``engram_head_dim`` and
    ``engram_trainable``; ``layer_id`` is the decoder layer index (one of ``engram_layer_ids``).
    """

    def __init__(self, config: Any, layer_id: int) -> None:
        super().__init__()
        layer_ids = [int(i) for i in config.engram_layer_ids]
        if layer_id not in layer_ids:
            raise ValueError(f"Engram: layer {layer_id} is not in engram_layer_ids {layer_ids}")
        self.layer_id = int(layer_id)
        self.rows = int(config.engram_num_embeddings[layer_ids.index(layer_id)])
        self.hidden_size = int(config.hidden_size)
        self.hc_mult = int(config.hc_mult)
        self.head_dim = int(config.engram_head_dim)
        self.n_buckets = (int(config.engram_max_ngram_size) - 1) * int(config.engram_n_heads)
        self.eps = float(config.rms_norm_eps)
        self.init_std = float(config.initializer_range)
        self.embed: EngramTable = LocalEngramTable(self.rows, self.head_dim, trainable=bool(config.engram_trainable))
        self.wkv = nn.Linear(self.n_buckets * self.head_dim, (self.hc_mult + 1) * self.hidden_size, bias=False)
        self.q_weight = nn.Parameter(torch.ones(self.hc_mult, self.hidden_size))
        self.k_weight = nn.Parameter(torch.ones(self.hc_mult, self.hidden_size))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Table and ``wkv`` ~ N(0, initializer_range); ``q_weight`` and ``k_weight`` ones."""
        self.embed.reset_parameters(self.init_std)
        nn.init.normal_(self.wkv.weight, std=self.init_std)
        nn.init.ones_(self.q_weight)
        nn.init.ones_(self.k_weight)

    def lookup(self, ngram_ids: torch.Tensor) -> torch.Tensor:
        """``rows [..., head_dim]`` of the table at ``ngram_ids [...]`` (every id in ``[0, rows)``), in the table's
        float dtype (bf16 for its FP8 form)."""
        return self.embed.lookup(ngram_ids)

    def forward(self, streams: torch.Tensor, ngram_ids: torch.Tensor,
                active: torch.Tensor | None = None) -> torch.Tensor:
        """``streams [B, L, hc_mult, hidden]`` plus the gated memory value; a new tensor of the same dtype.
        ``ngram_ids [B, L, n_buckets]`` int64 table rows; ``active [B, L]`` bool (None = all): where False the gate
        is exactly 0 and the stream comes back unchanged."""
        lead = tuple(streams.shape[:2])
        if streams.dim() != 4 or tuple(streams.shape[2:]) != (self.hc_mult, self.hidden_size):
            raise ValueError(f"Engram layer {self.layer_id}: streams must be [B, L, {self.hc_mult}, "
                             f"{self.hidden_size}], got {list(streams.shape)}")
        if tuple(ngram_ids.shape) != lead + (self.n_buckets,) or ngram_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"Engram layer {self.layer_id}: ngram_ids must be int [{lead[0]}, {lead[1]}, "
                             f"{self.n_buckets}], got {ngram_ids.dtype} {list(ngram_ids.shape)}")
        if ngram_ids.numel() and ngram_ids.device.type != "meta" and (int(ngram_ids.min()) < 0 or int(ngram_ids.max()) >= self.rows):
            raise ValueError(f"Engram layer {self.layer_id}: ngram_ids hold rows in [{int(ngram_ids.min())}, "
                             f"{int(ngram_ids.max())}] but the table has {self.rows}")
        if active is not None and (active.dtype != torch.bool or tuple(active.shape) != lead):
            raise ValueError(f"Engram layer {self.layer_id}: active must be bool [{lead[0]}, {lead[1]}], got "
                             f"{active.dtype} {list(active.shape)}")
        memory = self.embed.lookup(ngram_ids, streams.dtype).flatten(-2)
        keys, value = self.wkv(memory).split([self.hc_mult * self.hidden_size, self.hidden_size], dim=-1)
        keys = keys.float().unflatten(-1, (self.hc_mult, self.hidden_size))
        x = streams.float()
        inv_rms = torch.rsqrt(x.square().mean(-1) + self.eps) * torch.rsqrt(keys.square().mean(-1) + self.eps)
        score = (x * (self.q_weight.float() * self.k_weight.float()) * keys).sum(-1) * inv_rms
        score = score * self.hidden_size ** -0.5
        gate = torch.sigmoid(torch.copysign(score.abs().clamp_min(GATE_FLOOR).sqrt(), score))
        if active is not None:
            gate = gate.masked_fill(~active.unsqueeze(-1), 0.0)
        return (x + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)
