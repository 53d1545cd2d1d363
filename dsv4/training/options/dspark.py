"""The drafter-training keys of ``conf/train_dspark.yaml``: ``mode``, ``features`` and the ``drafter`` group,
resolved into a :class:`DSparkSpec` (every check raises ``ValueError`` naming the key before anything starts).

* ``mode``: ``online`` (the frozen target runs beside the drafter on every micro-batch) or ``offline`` (the rows
  come with the features ``recipes/capture_dspark.py`` wrote into ``features``).
* ``drafter.init``: ``auto`` (the released ``mtp.*`` when ``drafter.checkpoint`` or ``model.checkpoint`` holds them,
  else random), ``release`` (refused without them) or ``random``.
* ``drafter.checkpoint``: where the released drafter is read from (default: ``model.checkpoint``).
* ``drafter.num_anchors``, ``gamma``, ``ce_alpha``, ``l1_alpha``, ``confidence_alpha``: the objective
  (:func:`dsv4.speculative.dspark_loss`); ``eval_every_n_steps`` / ``eval_prompts`` / ``eval_prompt_tokens`` /
  ``eval_new_tokens``: the decoding evaluation (always at the end of the run when there are prompts; 0 prompts: none).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

MODES = ("online", "offline")
INITS = ("auto", "release", "random")


@dataclass(frozen=True)
class DSparkSpec:
    """A drafter training run's own settings (module docstring). ``source``: the directory the released drafter
    is read from (``init == "release"``); ``vocab_limit``: the tokenizer's vocabulary when the model's is padded
    beyond it (the decoding evaluation stays inside it)."""

    mode: str = "online"
    features: str | None = None
    init: str = "random"
    source: str | None = None
    num_anchors: int = 64
    gamma: float | None = 4.0
    ce_alpha: float = 0.1
    l1_alpha: float = 0.9
    confidence_alpha: float = 1.0
    eval_every_n_steps: int | None = None
    eval_prompts: int = 4
    eval_prompt_tokens: int = 64
    eval_new_tokens: int = 32
    vocab_limit: int | None = None


def holds_drafter(path: str | None) -> bool:
    """Whether the checkpoint directory ``path`` indexes any ``mtp.*`` tensor (from its index or shard headers)."""
    if not path or not os.path.isdir(path):
        return False
    from dsv4.checkpoint.safetensors_io import CheckpointDir

    return any(k.startswith("mtp.") for k in CheckpointDir.open(path).tensors)


def dspark_spec(c: dict[str, Any], config, model_checkpoint: str | None, vocab_limit: int | None) -> DSparkSpec:
    """The :class:`DSparkSpec` of the composed config ``c`` (a plain dict) for the target ``config``."""
    from dsv4.model.v41.drafter import check_drafter_config

    if getattr(config, "model_type", None) != "deepseek_v41":
        raise ValueError(f"`model`: drafter training needs a DeepSeek-V4.1 target (model=v41_tiny, model=v41_flash, a "
                         f"V4.1 checkpoint), got model_type {config.model_type!r}")
    check_drafter_config(config)
    mode, d = c.get("mode", "online"), dict(c.get("drafter") or {})
    if mode not in MODES:
        raise ValueError(f"`mode`={mode!r} must be one of {list(MODES)}")
    features = c.get("features")
    if mode == "offline":
        if not features or not os.path.isfile(os.path.join(features, "index.json")):
            raise ValueError(f"`features`={features!r}: mode=offline needs a finished capture directory (its "
                             "index.json; recipes/capture_dspark.py writes it)")
        index = json.loads(open(os.path.join(features, "index.json")).read())
        if list(index.get("layer_ids", [])) != list(config.dspark_target_layer_ids):
            raise ValueError(f"`features`={features!r} holds layers {index.get('layer_ids')}, the drafter reads "
                             f"model.dspark_target_layer_ids={config.dspark_target_layer_ids}")
    elif features:
        raise ValueError(f"`features`={features!r} is read by mode=offline only (mode={mode!r})")
    init = d.get("init", "auto")
    if init not in INITS:
        raise ValueError(f"`drafter.init`={init!r} must be one of {list(INITS)}")
    source = d.get("checkpoint") or model_checkpoint
    if d.get("checkpoint") and not os.path.isdir(d["checkpoint"]):
        raise ValueError(f"`drafter.checkpoint`={d['checkpoint']!r} is not a directory")
    held = holds_drafter(source)
    if init == "release" and not held:
        raise ValueError(f"`drafter.init`=release: {source!r} holds no mtp.* tensors (set drafter.checkpoint to a V4.1 "
                         "release or a directory an exported drafter was written to, or drafter.init=random)")
    resolved = "release" if init == "release" or (init == "auto" and held) else "random"
    for key in ("num_anchors", "eval_prompt_tokens", "eval_new_tokens"):
        if int(d.get(key, 1)) < 1:
            raise ValueError(f"`drafter.{key}` must be >= 1, got {d.get(key)}")
    if int(d.get("eval_prompts", 4)) < 0:
        raise ValueError(f"`drafter.eval_prompts` must be >= 0 (0: no decoding evaluation), got {d['eval_prompts']}")
    for key in ("ce_alpha", "l1_alpha", "confidence_alpha"):
        if float(d.get(key, 0.0)) < 0:
            raise ValueError(f"`drafter.{key}` must be >= 0, got {d.get(key)}")
    gamma = d.get("gamma")
    if gamma is not None and float(gamma) < 0:
        raise ValueError(f"`drafter.gamma` must be >= 0 or null (no decay), got {gamma}")
    every = d.get("eval_every_n_steps")
    if every is not None and int(every) < 1:
        raise ValueError(f"`drafter.eval_every_n_steps` must be >= 1 or null, got {every}")
    return DSparkSpec(mode=mode, features=features, init=resolved, source=source if resolved == "release" else None,
                      num_anchors=int(d.get("num_anchors", 64)), gamma=None if gamma is None else float(gamma),
                      ce_alpha=float(d.get("ce_alpha", 0.1)), l1_alpha=float(d.get("l1_alpha", 0.9)),
                      confidence_alpha=float(d.get("confidence_alpha", 1.0)),
                      eval_every_n_steps=None if every is None else int(every),
                      eval_prompts=int(d.get("eval_prompts", 4)), eval_prompt_tokens=int(d.get("eval_prompt_tokens", 64)),
                      eval_new_tokens=int(d.get("eval_new_tokens", 32)), vocab_limit=vocab_limit)


def check_export_beside(path: str, config, overwrite: bool) -> None:
    """``export.hf_dir`` holding a checkpoint: its ``config.json`` must describe this drafter, and a drafter already
    in its index is replaced only with ``export.overwrite=true`` (``ValueError`` naming the key, at start-up)."""
    from dsv4.checkpoint.hf_config import INDEX_FILE, config_from_hf
    from dsv4.speculative.drafter_checkpoint import DRAFTER_FIELDS

    if not os.path.isfile(os.path.join(path, INDEX_FILE)):
        return
    held = config_from_hf(path)
    diffs = [f"{f}={getattr(held, f, None)!r} there, {getattr(config, f)!r} here" for f in DRAFTER_FIELDS
             if getattr(held, f, None) != getattr(config, f)]
    if diffs:
        raise ValueError(f"`export.hf_dir`={path!r} holds a checkpoint of another model: " + "; ".join(diffs))
    if holds_drafter(path) and not overwrite:
        raise ValueError(f"`export.hf_dir`={path!r} already holds a drafter (mtp.* in its index); set "
                         "export.overwrite=true to replace it, or choose another directory")
