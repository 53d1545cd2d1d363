"""The V4.1 MoE: V4's (:class:`dsv4.model.moe.MoE`, no hash-routed layers) with a per-layer ``gate.bias_vl``.

``bias_vl [n_routed_experts]`` (fp32 buffer, as ``e_score_correction_bias``) is the selection bias of image tokens
(it takes the place of ``e_score_correction_bias`` for them in the released code). dsv4 trains text only: the
model refuses ``image_token_id`` in its input, so the bias is carried (loaded, exported) and never read.
"""

from __future__ import annotations

import torch

from dsv4.model.moe import MoE


class V41MoE(MoE):
    """``MoE`` whose gate also holds ``bias_vl`` (zeros until a checkpoint sets it)."""

    def __init__(self, config, layer_idx: int) -> None:
        if config.num_hash_layers:
            raise ValueError(f"V41MoE: V4.1 has no hash-routed layers, got num_hash_layers={config.num_hash_layers}")
        super().__init__(config, layer_idx)
        self.gate.register_buffer("bias_vl", torch.zeros(config.n_routed_experts, dtype=torch.float32))
