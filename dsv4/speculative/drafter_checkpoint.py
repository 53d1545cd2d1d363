"""DSpark drafter checkpoints in the DeepSeek-V4.1 release layout: load the released ``mtp.*`` drafter, write a
drafter back, alone or next to its target.

    drafter = load_dspark_drafter("/ckpt/DeepSeek-V4.1-Flash")          # the release: mtp.* + embed + head
    export_dspark_drafter(drafter, "/out/hf")                          # beside the target already in /out/hf
    export_dspark_drafter(drafter, "/out/drafter", dtype="quantized")  # alone: mtp.*, embed, head, config.json

Keys (:data:`dsv4.checkpoint.keys.DSPARK`): ``mtp.{i}.*`` are the drafter's stages, ``embed.weight`` /
``head.weight`` its frozen copies of the target's embedding and head; every other key of the directory (the text
backbone, the vision tower) is skipped, never read. Formats are the release's: attention projections,
``main_proj`` and shared experts FP8 (e4m3, 32 x 32 e8m0 tiles), routed experts packed FP4 (one e8m0 scale per 32
columns), ``hc_*``, ``attn_sink``, gate biases, ``confidence_head`` and ``head`` F32, the rest BF16. A load
dequantises into fp32 parameters (or casts BF16 / F32), through :func:`dsv4.checkpoint.load_hf_checkpoint`: every
key is checked against the drafter's shapes before anything is read, a missing key is a ``KeyError``.

Export (:func:`dsv4.checkpoint.export_hf_checkpoint`): ``bfloat16`` (the F32 tensors stay F32), ``float32`` or
``quantized`` (the release formats; re-quantising a loaded release gives its bytes back, since its power-of-two
scales are recomputed from the same tiles). Into a directory that holds a checkpoint (its
``model.safetensors.index.json``; the target, exported by fine-tuning or released) the drafter's ``mtp.*`` tensors
are added as ``dspark-0000i-of-0000n.safetensors`` shards merged into its index, where release loaders (NeMo
Automodel's ``DeepseekV41DSparkStateDictAdapter``, serving engines) look for them; the target's ``embed`` /
``head`` are the ones the drafter copies, so they are not written again, and the directory's ``config.json``
must describe the same drafter (``ValueError`` naming the field otherwise). Keys already there (a released
drafter) are replaced only with ``overwrite=True``. Into an empty or new directory the drafter is written alone
with ``embed`` / ``head`` and the V4.1 ``config.json``.
"""

from __future__ import annotations

import os

import torch

from dsv4.checkpoint.export import ExportReport, export_hf_checkpoint, model_sources
from dsv4.checkpoint.hf_config import INDEX_FILE, config_from_hf
from dsv4.checkpoint.load import LoadReport, load_hf_checkpoint
from dsv4.model.v41.drafter import DSparkDrafter

FROZEN_COPIES = ("embed_tokens.weight", "lm_head.weight")  # the target's, already in a target's directory
DRAFTER_FIELDS = ("hidden_size", "vocab_size", "num_hidden_layers", "num_nextn_predict_layers", "sliding_window",
                   "dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank",
                   "dspark_n_routed_experts", "dspark_num_experts_per_tok", "moe_intermediate_size",
                   "num_attention_heads", "head_dim", "qk_rope_head_dim", "rope_theta", "hc_mult")


def load_dspark_drafter(path: str, *, device: str | torch.device = "cpu", **overrides) -> DSparkDrafter:
    """The drafter of the V4.1 checkpoint directory ``path`` (a release, or a dsv4 export) as an fp32 module on
    ``device`` (frozen ``embed_tokens`` / ``lm_head``); ``overrides`` replace config fields (e.g.
    ``attention_backend``). ``ValueError`` when ``path`` is not a V4.1 checkpoint; ``KeyError`` naming missing
    drafter keys."""
    drafter = DSparkDrafter(config_from_hf(path, torch_dtype="float32", **overrides))
    load_dspark_drafter_into(drafter, path)
    return drafter.to(device)


def load_dspark_drafter_into(drafter: DSparkDrafter, path: str) -> LoadReport:
    """Fill ``drafter`` from the checkpoint directory ``path`` (see the module docstring)."""
    return load_hf_checkpoint(drafter, path)


def _check_same_drafter(drafter: DSparkDrafter, path: str) -> None:
    held = config_from_hf(path)
    diffs = [(f, getattr(held, f), getattr(drafter.config, f)) for f in DRAFTER_FIELDS
             if getattr(held, f, None) != getattr(drafter.config, f)]
    if diffs:
        raise ValueError(f"{path}: its config.json describes another drafter than the one exported: "
                         + "; ".join(f"{f}={h!r} there, {m!r} in the drafter" for f, h, m in diffs))


def export_dspark_drafter(drafter: DSparkDrafter, path: str, *, dtype: str = "bfloat16", overwrite: bool = False,
                          group=None) -> ExportReport:
    """Write ``drafter`` to ``path`` in the release layout, beside the checkpoint already there or alone (see the
    module docstring). Under ``torch.distributed`` every rank of ``group`` calls it."""
    beside = os.path.isfile(os.path.join(str(path), INDEX_FILE))
    sources = model_sources(drafter)
    if beside:
        _check_same_drafter(drafter, str(path))
        sources = [s for s in sources if s.name not in FROZEN_COPIES]
    return export_hf_checkpoint(drafter, path, dtype=dtype, sources=sources, group=group, overwrite=overwrite,
                                beside=beside, file_prefix="dspark" if beside else "model")
