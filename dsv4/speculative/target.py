"""The frozen target of DSpark work (feature capture, drafter training, speculative decoding), built once.

:func:`build_frozen_target`: the causal LM of ``config`` (a seeded init), V4.1's Engram hashing through the run's
tokenizer, loaded from ``checkpoint``: an HF-format directory (the release's layout or transformers'; MTP depths it
lacks keep their init: a DSpark target never runs them), or a safetensors file of a dsv4 state dict. A directory
that stores its weights quantised (FP8 / FP4, the release) is held as stored (:func:`dsv4.peft.keep_base_quantized`:
the release's bytes and scales, FP8 in the family's tiles, dequantised on the fly; Engram tables a release stores in
FP8 kept so), not dequantised into float copies; the forward is the same. Eval mode, nothing requires a gradient.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger("dsv4")


def stores_quantized_weights(path: str) -> bool:
    """Whether the checkpoint directory ``path`` stores any weight quantised (FP8 e4m3 or packed FP4 with a
    ``.scale``), from its shard headers."""
    from dsv4.checkpoint.layouts import release_view
    from dsv4.checkpoint.safetensors_io import CheckpointDir

    ckpt, _ = release_view(CheckpointDir.open(path))
    return any(info.dtype in ("F8_E4M3", "I8") and key[: -len("weight")] + "scale" in ckpt.tensors
               for key, info in ckpt.tensors.items() if key.endswith(".weight"))


def store_in_compute_dtype(model: torch.nn.Module, compute_dtype: torch.dtype) -> torch.nn.Module:
    """Store a frozen ``model``'s float parameters as a fine-tuning run under FSDP2 mixed precision computes with
    them: in ``compute_dtype``, except the modules the release keeps in fp32 (:data:`dsv4.parallel.wrap.FP32_MODULES`)
    and the Engram tables; kept FP8 / FP4 weights and the buffers stay as they are. In place; returns ``model``."""
    from dsv4.parallel.wrap import fsdp_units, store_frozen_in_compute_dtype

    if compute_dtype != torch.float32:
        store_frozen_in_compute_dtype(fsdp_units(model, compute_dtype))
    return model


def build_frozen_target(config, *, checkpoint: str | None = None, tokenizer="byte", seed: int = 0,
                        keep_quantized: bool = True, before_load=None, ep_rank: int | None = None,
                        ep_size: int | None = None, compute_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The frozen target (module docstring); ``keep_quantized=False`` dequantises a quantised checkpoint instead.
    ``before_load(model)`` runs before the checkpoint is read (a run's Engram row sharding: each rank then reads
    its rows); ``ep_rank`` / ``ep_size``: read only that expert-parallel rank's routed experts (the caller shards
    them next); ``compute_dtype``: the float weights stored as a run in that dtype computes
    (:func:`store_in_compute_dtype`; float32: as loaded)."""
    from dsv4.model import build_causal_lm

    torch.manual_seed(seed)
    model = build_causal_lm(config)
    if getattr(config, "engram_layer_ids", None):  # V4.1: Engram hashes through the run's tokenizer
        from dsv4.data.tokenizers import build_tokenizer

        model.set_engram_tokenizer(build_tokenizer(tokenizer))
    if checkpoint and Path(checkpoint).is_dir():
        from dsv4.checkpoint import load_hf_checkpoint
        from dsv4.checkpoint.load import keep_engram_tables_as_stored

        if keep_quantized and stores_quantized_weights(checkpoint):
            from dsv4.peft.apply import keep_base_quantized

            counts = keep_base_quantized(model)
            log.info("target: the FP8 / FP4 weights of %s kept as stored (%d linears, %d expert groups)", checkpoint,
                     counts["kept"], counts["experts"])
        if before_load is not None:
            before_load(model)
        keep_engram_tables_as_stored(model, checkpoint)
        load_hf_checkpoint(model, checkpoint, init_missing_mtp=True, ep_rank=ep_rank, ep_size=ep_size)
    elif checkpoint:  # a safetensors file holding the dsv4 state dict
        from safetensors.torch import load_file

        model.load_state_dict(load_file(checkpoint), strict=True)
    elif before_load is not None:
        before_load(model)
    model.requires_grad_(False)
    return store_in_compute_dtype(model, compute_dtype).eval()
