"""FLOP model of one DSV4 training step, with the attention counted SPARSELY.

Conventions
-----------
* A multiply-add is 2 FLOPs. Only matrix products and the attention/indexer dot products are counted; norms,
  RoPE, softmax, SwiGLU, the Sinkhorn iterations, the compressor's softmax pooling and other element-wise work
  are not (they are < 1% of a Flash layer).
* "Per token" means per REAL token (padding slots are wasted work, not model FLOPs). A token's attention cost
  depends on its position; the numbers below are the exact MEAN over the positions ``0 .. S-1`` of one causal
  document of length ``S = seq_len``. A packed row is the sum over its documents,
  :func:`document_training_flops` of each document's own length (passing the row length overcounts).
* These are MODEL FLOPs (what the math needs), not hardware FLOPs: activation recomputation (the sparse
  attention and hyper-connection checkpoints) and keys a kernel visits but masks out are not counted.

Notation: ``d`` hidden_size, ``H`` num_attention_heads, ``D`` head_dim, ``q`` q_lora_rank, ``o`` o_lora_rank,
``G`` o_groups, ``E`` n_routed_experts, ``k`` num_experts_per_tok, ``n_s`` n_shared_experts, ``I``
moe_intermediate_size, ``V`` vocab_size, ``hc`` hc_mult, ``mix = (2 + hc) * hc``, ``H_I`` index_n_heads, ``D_I``
index_head_dim, ``K`` index_topk, ``W`` sliding_window, ``r`` a layer's compress ratio.

Dense matmuls per token (forward)
---------------------------------
* attention projections (every layer): ``2 d q + 2 q H D + 2 d D + 2 H D o + 2 G o d``
  (wq_a, wq_b, wkv, grouped wo_a: G blocks of ``H D / G -> o``, wo_b).
* compressor (``r > 0``): wkv and wgate ``d -> c D``: ``2 * 2 d c D`` with ``c = 2`` for ``r = 4`` (overlap)
  else ``c = 1``.
* indexer projections (``r = 4``): its overlap compressor ``2 * 2 d (2 D_I)`` + ``wq_b^I`` ``2 q H_I D_I`` +
  ``weights_proj`` ``2 d H_I``.
* MoE: router ``2 d E`` (also on hash layers: the weights are gathered from the scores), routed experts
  ``k * 6 d I``, shared experts ``n_s * 6 d I`` (SwiGLU: w1, w3, w2).
* hyper-connections, per site (2 per block): ``2 hc d mix`` (the ``fn`` projection) + ``2 hc d`` (collapse
  ``sum_i pre_i X_i``) + ``2 hc d + 2 hc^2 d`` (expand ``post_j y + sum_i comb_ij X_i``); per hyper-head (the
  model's and each MTP depth's): ``2 hc d hc + 2 hc d``.
* lm_head ``2 d V``, once for the main head and once per MTP depth.
* MTP depth: ``e_proj`` ``2 d^2`` + ``h_proj`` on every stream ``2 hc d^2`` + one full block (layer index
  ``num_hidden_layers + depth``, its ratio from ``config.ratio_for_layer``) + hyper-head + lm_head.

Attention (sparse), per token, one layer of ratio ``r``
-------------------------------------------------------
A (query, key) pair costs ``4 H D`` (``Q K^T`` and ``P V``, K = V shared by the heads). The query at position
``p`` (``n = p + 1``) sees

* window keys ``min(n, W)``; mean over the sequence ``Sw(S) / S`` with
  ``Sw(S) = sum_{n=1..S} min(n, W) = S (S + 1) / 2`` if ``S <= W`` else ``W (W + 1) / 2 + (S - W) W``
  (-> ``W`` per token for ``S >> W``: linear in S per sequence);
* HCA (``r`` not 4): every visible compressed key, ``floor(n / r)``; mean ``C_r(S) / S`` with
  ``C_r(S) = sum_{n=1..S} floor(n / r) = r m (m - 1) / 2 + m (S - m r + 1)``, ``m = floor(S / r)``
  (``= S / (2 r) - 1/2 + 1/r`` for ``S`` a multiple of ``r``, i.e. ~ ``S / 256`` keys for ``r = 128``);
* CSA (``r = 4``): the indexer's selection, ``min(K, floor(n / 4))`` keys (mean
  ``[C_4(min(S, 4 K)) + K max(0, S - 4 K)] / S`` -> ``K`` for long sequences), PLUS the indexer scoring of every
  visible compressed key, ``floor(n / 4)`` (mean ``C_4(S) / S`` ~ ``S / 8``), at ``2 H_I (D_I + 1)`` FLOPs per
  (query, key) pair (``H_I`` dot products of ``D_I`` and the weighted sum over heads).

So per token and layer: ``attention = 4 H D (window + compressed) [+ 2 H_I (D_I + 1) C_4(S) / S for CSA]``.
For comparison :func:`dense_equivalent_attention_flops_per_token` is dense causal attention over the raw tokens,
``4 H D (S + 1) / 2`` per token (quadratic in S per sequence).

Training
--------
``training = 3 * trainable_forward + 1 * forward_only``: backward costs twice the forward (input and weight
gradients). The indexer (its projections and its scoring) is forward-only unless ``config.indexer_loss_coeff > 0``
(its parameters are frozen and its top-k output carries no gradient).
"""

from __future__ import annotations

import re
from typing import Any

from dsv4.config import DSV4Config

CSA_RATIO = 4
BACKWARD_FACTOR = 2  # backward = 2 x forward (grad of the input and of the weight)

# Breakdown keys (see forward_flops_breakdown); the indexer ones are forward-only unless indexer_loss_coeff > 0.
BREAKDOWN_KEYS = (
    "attention_projections",
    "compressor",
    "indexer_projections",
    "indexer_scores",
    "attention_core",
    "router",
    "moe_routed",
    "moe_shared",
    "hyper_connections",
    "mtp_projections",
    "lm_head",
)
INDEXER_KEYS = ("indexer_projections", "indexer_scores")


# ---------------------------------------------------------------------------------------------- key counts
def window_keys_sum(seq_len: int, window: int) -> int:
    """``sum_{n=1..S} min(n, W)``: window keys summed over the queries of one causal document of length S."""
    s, w = int(seq_len), int(window)
    if s <= w:
        return s * (s + 1) // 2
    return w * (w + 1) // 2 + (s - w) * w


def compressed_keys_sum(seq_len: int, ratio: int, cap: int | None = None) -> int:
    """``sum_{n=1..S} min(cap, floor(n / r))``: visible compressed keys summed over one causal document.

    Without ``cap``: ``C_r(S) = r m (m - 1) / 2 + m (S - m r + 1)`` with ``m = floor(S / r)``. With ``cap = K``
    (the CSA top-k): ``C_r(min(S, K r)) + K max(0, S - K r)`` (``floor(n / r) >= K`` exactly when ``n >= K r``).
    """
    s, r = int(seq_len), int(ratio)
    if r < 1:
        raise ValueError(f"compressed_keys_sum: ratio must be >= 1, got {ratio}")
    if cap is not None:
        limit = int(cap) * r
        if s > limit:
            return compressed_keys_sum(limit, r) + int(cap) * (s - limit)
    m = s // r
    return r * m * (m - 1) // 2 + m * (s - m * r + 1)


def mean_window_keys(seq_len: int, window: int) -> float:
    """Mean window keys per query, ``window_keys_sum(S, W) / S``."""
    return window_keys_sum(seq_len, window) / max(int(seq_len), 1)


def mean_compressed_keys(seq_len: int, ratio: int, cap: int | None = None) -> float:
    """Mean visible (``cap``: selected) compressed keys per query, ``compressed_keys_sum(S, r, cap) / S``."""
    return compressed_keys_sum(seq_len, ratio, cap) / max(int(seq_len), 1)


# ---------------------------------------------------------------------------------------------- attention
def attention_core_flops_per_token(config: DSV4Config, seq_len: int, ratio: int) -> float:
    """Sparse attention core of one layer, per token: ``4 H D (mean window keys + mean compressed keys)``.

    Compressed keys: none for ``r = 0``; ``min(index_topk, floor(n / 4))`` for CSA; ``floor(n / r)`` otherwise.
    """
    pair = 4 * config.num_attention_heads * config.head_dim
    keys = mean_window_keys(seq_len, config.sliding_window)
    if ratio == CSA_RATIO:
        keys += mean_compressed_keys(seq_len, ratio, cap=config.index_topk)
    elif ratio > 0:
        keys += mean_compressed_keys(seq_len, ratio)
    return pair * keys


def indexer_score_flops_per_token(config: DSV4Config, seq_len: int, ratio: int) -> float:
    """CSA indexer scoring per token: ``2 H_I (D_I + 1) * C_4(S) / S`` (0 for ``r != 4``)."""
    if ratio != CSA_RATIO:
        return 0.0
    pair = 2 * config.index_n_heads * (config.index_head_dim + 1)
    return pair * mean_compressed_keys(seq_len, ratio)


def attention_flops_per_token(config: DSV4Config, seq_len: int, ratio: int) -> float:
    """Forward attention FLOPs per token of one layer of ratio ``r``, counted sparsely (no projections).

    ``4 H D (Sw(S) + Ck(S)) / S + [r = 4] 2 H_I (D_I + 1) C_4(S) / S`` where ``Sw`` is :func:`window_keys_sum`
    and ``Ck`` the compressed keys seen (:func:`compressed_keys_sum`, capped at ``index_topk`` for CSA).
    """
    return attention_core_flops_per_token(config, seq_len, ratio) + indexer_score_flops_per_token(
        config, seq_len, ratio
    )


def dense_equivalent_attention_flops_per_token(config: DSV4Config, seq_len: int) -> float:
    """Dense causal attention over the raw tokens of one layer, per token: ``4 H D (S + 1) / 2``.

    For comparison only: what the layer would cost with full causal attention at the same heads and head dim.
    """
    return 4 * config.num_attention_heads * config.head_dim * (int(seq_len) + 1) / 2


# ---------------------------------------------------------------------------------------------- dense parts
def _attention_projection_flops(c: DSV4Config) -> int:
    d, h, hd, q, o, g = c.hidden_size, c.num_attention_heads, c.head_dim, c.q_lora_rank, c.o_lora_rank, c.o_groups
    return 2 * d * q + 2 * q * h * hd + 2 * d * hd + 2 * h * hd * o + 2 * g * o * d


def _compressor_flops(d: int, head_dim: int, ratio: int) -> int:
    width = (2 if ratio == CSA_RATIO else 1) * head_dim
    return 2 * (2 * d * width)  # wkv and wgate


def _indexer_projection_flops(c: DSV4Config) -> int:
    return (
        _compressor_flops(c.hidden_size, c.index_head_dim, CSA_RATIO)
        + 2 * c.q_lora_rank * c.index_n_heads * c.index_head_dim
        + 2 * c.hidden_size * c.index_n_heads
    )


def _hc_site_flops(c: DSV4Config) -> int:
    hc, d = c.hc_mult, c.hidden_size
    mix = (2 + hc) * hc
    return 2 * hc * d * mix + 2 * hc * d + 2 * hc * d + 2 * hc * hc * d


def _hc_head_flops(c: DSV4Config) -> int:
    hc, d = c.hc_mult, c.hidden_size
    return 2 * hc * d * hc + 2 * hc * d


def block_flops_breakdown(config: DSV4Config, seq_len: int, layer_idx: int) -> dict[str, float]:
    """Forward FLOPs per token of block ``layer_idx`` (an MTP block when ``>= num_hidden_layers``), by part."""
    c = config
    ratio = c.ratio_for_layer(layer_idx)
    out = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
    out["attention_projections"] = float(_attention_projection_flops(c))
    if ratio > 0:
        out["compressor"] = float(_compressor_flops(c.hidden_size, c.head_dim, ratio))
    if ratio == CSA_RATIO:
        out["indexer_projections"] = float(_indexer_projection_flops(c))
    out["indexer_scores"] = indexer_score_flops_per_token(c, seq_len, ratio)
    out["attention_core"] = attention_core_flops_per_token(c, seq_len, ratio)
    out["router"] = float(2 * c.hidden_size * c.n_routed_experts)
    out["moe_routed"] = float(c.num_experts_per_tok * 6 * c.hidden_size * c.moe_intermediate_size)
    out["moe_shared"] = float(c.n_shared_experts * 6 * c.hidden_size * c.moe_intermediate_size)
    out["hyper_connections"] = float(2 * _hc_site_flops(c))
    return out


def forward_flops_breakdown(config: DSV4Config, seq_len: int) -> dict[str, float]:
    """Forward FLOPs per token of the whole model (backbone, heads, MTP depths), by part (keys ``BREAKDOWN_KEYS``)."""
    c = config
    total = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
    n_layers = c.num_hidden_layers + c.num_nextn_predict_layers
    for layer_idx in range(n_layers):
        for key, value in block_flops_breakdown(c, seq_len, layer_idx).items():
            total[key] += value
    heads = 1 + c.num_nextn_predict_layers  # the model's hyper-head + lm_head, and one per MTP depth
    total["hyper_connections"] += heads * _hc_head_flops(c)
    total["lm_head"] += heads * 2 * c.hidden_size * c.vocab_size
    d = c.hidden_size
    total["mtp_projections"] += c.num_nextn_predict_layers * (2 * d * d + 2 * c.hc_mult * d * d)
    return total


def forward_flops_per_token(config: DSV4Config, seq_len: int) -> float:
    """Forward FLOPs per real token (sum of :func:`forward_flops_breakdown`)."""
    return sum(forward_flops_breakdown(config, seq_len).values())


POSITION_DEPENDENT_KEYS = ("indexer_scores", "attention_core")  # the parts whose per-token cost grows with position


def training_flops_per_token(config: DSV4Config, seq_len: int, parts: tuple[str, ...] | None = None) -> float:
    """Forward + backward FLOPs per real token: ``3 x`` trainable parts, ``1 x`` the indexer unless it trains
    (``indexer_loss_coeff > 0``); ``parts``: only those breakdown keys (default all)."""
    breakdown = forward_flops_breakdown(config, seq_len)
    forward_only = set() if config.indexer_loss_coeff > 0 else set(INDEXER_KEYS)
    return sum(v * (1 if k in forward_only else 1 + BACKWARD_FACTOR) for k, v in breakdown.items()
               if parts is None or k in parts)


def document_training_flops(config: DSV4Config, length: int, parts: tuple[str, ...] | None = None) -> float:
    """Training FLOPs of one causal document of ``length`` tokens (its attention reach grows with its own
    length, not the row's): ``length * training_flops_per_token(config, length)``; 0 for an empty one."""
    return float(length) * training_flops_per_token(config, length, parts) if length > 0 else 0.0


def position_range_training_flops(config: DSV4Config, lo: int, hi: int, parts: tuple[str, ...] | None = None) -> float:
    """Training FLOPs of the queries at positions ``[lo, hi)`` of one causal document (at least ``hi`` long): the
    document's first ``hi`` positions minus its first ``lo`` (:func:`document_training_flops` is exact per prefix,
    so the difference is exactly these queries' work, the position-dependent attention and indexer terms included)."""
    return document_training_flops(config, hi, parts) - document_training_flops(config, lo, parts)


def cp_rank_training_flops(config: DSV4Config, seq_len: int, cp: int, balance: str = "none",
                           parts: tuple[str, ...] | None = None) -> list[float]:
    """Training FLOPs each of ``cp`` ranks does for one causal document of ``seq_len`` tokens cut by the layout
    ``balance`` (:class:`~dsv4.parallel.cp.layout.CPLayout`): the sum of :func:`position_range_training_flops` over the
    rank's chunks (``parts``: only those breakdown keys, e.g. :data:`POSITION_DEPENDENT_KEYS`). Their max / mean is
    the straggler factor of the step (every layer waits for the slowest rank)."""
    from dsv4.parallel.cp.layout import CPLayout

    layout = CPLayout(cp, balance)
    length = layout.chunk_length(seq_len)
    return [sum(position_range_training_flops(config, v * length, (v + 1) * length, parts) for v in layout.chunks(r))
            for r in range(cp)]


# ---------------------------------------------------------------------------------------------- peak FLOP/s
# bf16 tensor-core peak per device, DENSE (no 2:4 sparsity), from the vendors' data sheets. Checked in order
# against ``torch.cuda.get_device_name()`` (case-insensitive regex search), so specific names come first.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    (r"\bgb200\b", 2500e12),
    (r"\bb200\b", 2250e12),
    (r"\bb100\b", 1750e12),
    (r"\bh200\b.*\bnvl\b", 835e12),
    (r"\bgh200\b", 989e12),
    (r"\bh200\b", 989e12),
    (r"\bh100\b.*\bnvl\b", 835e12),
    (r"\bh100\b.*\bpcie\b", 756e12),
    (r"\bh100\b", 989e12),  # SXM (e.g. "NVIDIA H100 80GB HBM3")
    (r"\ba100\b", 312e12),
    (r"\bl40s\b", 362e12),
    (r"\bl4\b", 121e12),
)


def peak_flops_for_device_name(name: str) -> float | None:
    """bf16 dense peak FLOP/s for a CUDA device name, or None when the device is not in ``PEAK_BF16_FLOPS``."""
    lowered = name.lower()
    for pattern, flops in PEAK_BF16_FLOPS:
        if re.search(pattern, lowered):
            return flops
    return None


def peak_flops_per_device(device: Any = None) -> float | None:
    """bf16 dense peak FLOP/s of ``device`` (default: the current CUDA device); None on CPU or unknown GPUs."""
    import torch

    if device is None:
        if not torch.cuda.is_available():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops_for_device_name(torch.cuda.get_device_name(device))
