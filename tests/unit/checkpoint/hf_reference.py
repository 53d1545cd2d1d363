"""transformers' own DeepSeek-V4 (``transformers.models.deepseek_v4``) as the reference for the checkpoint and adapter
interop tests: tiny configs, randomised weights, and the indexer-tie check.

Exact ties in the CSA indexer's top-k: dsv4 takes the lowest window index (``stable_topk``), transformers'
``torch.topk`` leaves the order unspecified, so a tie at the k-th place may select different windows. The tests avoid
ties by construction (8 indexer heads, so a window rarely scores exactly 0 = ReLU of every head, and inputs for
which no query has a tie at its k-th place) and check it: :func:`indexer_ties` counts, from transformers' own scores,
the queries whose k-th and (k+1)-th visible scores are equal, and the tests assert there are none.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4

S, C, H = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0}


def tiny_hf_config(**overrides) -> DeepseekV4Config:
    values = dict(
        vocab_size=256, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
        partial_rotary_factor=0.5, q_lora_rank=32, o_lora_rank=32, o_groups=2, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, layer_types=[S, C, H, C],
        compress_rates={C: 4, H: 8}, sliding_window=16, index_head_dim=32, index_n_heads=8, index_topk=8,
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"], num_nextn_predict_layers=1, max_position_embeddings=1024,
        rope_parameters=dict(YARN))
    values.update(overrides)
    return DeepseekV4Config(**values)


@torch.no_grad()
def random_hf_model(config: DeepseekV4Config, seed: int = 0) -> DeepseekV4ForCausalLM:
    """A float32 transformers model whose every tensor is random (transformers initialises sinks, position biases,
    HC biases and router biases to zero and the hash table to expert 0; those are randomised too)."""
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)
        elif name.endswith("tid2eid"):
            b.copy_(torch.rand(b.shape[0], config.n_routed_experts, generator=g).argsort(-1)[:, : b.shape[1]])
    return model


@contextlib.contextmanager
def indexer_ties(model: torch.nn.Module):
    """Counts, over every CSA indexer of a transformers model run inside the block, the queries whose k-th and
    (k+1)-th causally visible scores are equal (``counts`` holds one number per indexer call; all must be 0)."""
    counts: list[int] = []
    hooks = []

    def hook(scorer, args, scores):  # scores [B, S, T]; q positions 0..S-1 (no cache)
        indexer = next(m for m in model.modules() if isinstance(m, hf_v4.DeepseekV4Indexer) and m.scorer is scorer)
        k, ratio, t = indexer.index_topk, indexer.compress_rate, scores.shape[-1]
        if t <= k:
            counts.append(0)
            return
        visible = torch.arange(t).view(1, 1, -1) < ((torch.arange(scores.shape[1]) + 1) // ratio).view(1, -1, 1)
        top = scores.masked_fill(~visible, float("-inf")).topk(k + 1, dim=-1).values
        counts.append(int(((top[..., k - 1] == top[..., k]) & torch.isfinite(top[..., k - 1])).sum()))

    for m in model.modules():
        if isinstance(m, hf_v4.DeepseekV4IndexerScorer):
            hooks.append(m.register_forward_hook(hook))
    try:
        yield counts
    finally:
        for h in hooks:
            h.remove()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())
