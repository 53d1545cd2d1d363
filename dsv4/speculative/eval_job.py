"""The job behind ``recipes/eval_dspark.py``: speculative decoding of a V4.1 target with a DSpark drafter over
prompts from a dataset, measuring real acceptance (:mod:`dsv4.speculative.decoding`).

* target: ``model`` (a preset, its overrides, ``model.checkpoint``: an HF-format directory or a safetensors state
  dict; a seeded init without one), frozen;
* drafter: ``drafter.checkpoint`` (a V4.1 directory holding ``mtp.*``: a release, or
  :func:`~dsv4.speculative.drafter_checkpoint.export_dspark_drafter`'s output) or, null, a fresh drafter seeded by
  ``seed`` with the target's embedding and head (the random-init baseline); its sizes must match the target's
  config;
* prompts: ``num_prompts`` documents of ``data`` (the held-out ones with ``data.val_fraction``, split by ``seed`` as
  fine-tuning splits them), each cut to a prompt: a chat document's tokens before its first supervised (assistant)
  token, a text document's first ``prompt_tokens`` tokens; a chat prompt longer than ``prompt_tokens`` keeps its
  last ``prompt_tokens``; documents too short for a prompt of at least one token are passed over;
* decoding: within the tokenizer's vocabulary (a model vocabulary padded beyond it is masked for both models),
  ``max_new_tokens`` per prompt at ``temperature`` (0: greedy, the output equals the target's own greedy
  decoding; > 0: speculative rejection sampling, seeded by ``seed``), the whole block verified each step.

Output: one JSON line last on stdout (``acceptance_length``, ``acceptance_per_position``,
``conditional_acceptance_per_position``, the confidence calibration, ``prompts``, ``new_tokens``,
``target_forwards``, ``seconds``, ``tokens_per_s``), the same in ``<run dir>/eval_dspark.json``, and the scalar
metrics (per-position lists as ``<name>/<k>``) through the ``logger`` group (CSV / wandb) at step 0.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("dsv4")


def eval_job(cfg: Any) -> dict:
    """The validated job of the recipe's config (``ValueError`` naming the key before any model is built)."""
    from omegaconf import OmegaConf

    from dsv4.model.v41.drafter import check_drafter_config
    from dsv4.speculative.capture_job import job_data
    from dsv4.training.schema import model_config

    c = OmegaConf.to_container(cfg, resolve=True)
    config = model_config(c["model"])
    if getattr(config, "model_type", None) != "deepseek_v41":
        raise ValueError(f"`model`: the DSpark drafter evaluation needs a DeepSeek-V4.1 target (model=v41_tiny, "
                         f"model=v41_flash, a V4.1 checkpoint), got model_type {config.model_type!r}")
    check_drafter_config(config)
    for key in ("num_prompts", "prompt_tokens", "max_new_tokens"):
        if int(c[key]) < 1:
            raise ValueError(f"`{key}` must be >= 1, got {c[key]}")
    if not float(c["temperature"]) >= 0 or math.isinf(float(c["temperature"])):
        raise ValueError(f"`temperature` must be a finite number >= 0 (0 = greedy), got {c['temperature']}")
    data = job_data(c["data"], c["model"].get("checkpoint"), config)
    return {"model": config.to_dict(), "model_type": config.model_type, "data": data, "seed": int(c["seed"]),
            "checkpoint": c["model"].get("checkpoint"), "drafter_checkpoint": c["drafter"]["checkpoint"],
            "val_fraction": c["data"].get("val_fraction"), "num_prompts": int(c["num_prompts"]),
            "prompt_tokens": int(c["prompt_tokens"]), "max_new_tokens": int(c["max_new_tokens"]),
            "temperature": float(c["temperature"]), "eos_token_id": c.get("eos_token_id"),
            "max_documents": c.get("max_documents"), "max_document_tokens": None, "threads": c.get("threads", 1)}


def prompts_of(documents, count: int, prompt_tokens: int) -> list[torch.Tensor]:
    """The first ``count`` prompts of ``documents`` (see the module docstring)."""
    prompts = []
    for doc in documents:
        ids = list(doc.ids)
        if doc.loss_mask is not None and any(doc.loss_mask):
            end = list(doc.loss_mask).index(True)
            prompt = ids[:end][-prompt_tokens:]
        else:
            prompt = ids[:prompt_tokens]
        if prompt:
            prompts.append(torch.tensor(prompt, dtype=torch.long))
        if len(prompts) == count:
            break
    return prompts


def build_drafter(job: dict, target):
    """The drafter of ``job``: loaded from ``drafter_checkpoint`` (its config must match the target's), or seeded
    with the target's embedding and head."""
    from dsv4.model.v41.drafter import DSparkDrafter
    from dsv4.speculative.drafter_checkpoint import load_dspark_drafter

    if job["drafter_checkpoint"]:
        drafter = load_dspark_drafter(job["drafter_checkpoint"])
        fields = ("hidden_size", "vocab_size", "dspark_target_layer_ids", "dspark_block_size", "sliding_window")
        diffs = [f"{f}: drafter {getattr(drafter.config, f)!r}, target {getattr(target.config, f)!r}" for f in fields
                 if getattr(drafter.config, f) != getattr(target.config, f)]
        if diffs:
            raise ValueError(f"`drafter.checkpoint`={job['drafter_checkpoint']!r} holds a drafter for another target: "
                             + "; ".join(diffs))
    else:
        torch.manual_seed(job["seed"])
        drafter = DSparkDrafter(target.config)
        drafter.copy_target_embeddings(target)
    return drafter.eval().requires_grad_(False)


def flat_metrics(summary: dict) -> dict[str, float]:
    """The summary's numbers as one flat mapping (a list ``name [K]`` as ``name/0 .. name/K-1``)."""
    out = {}
    for key, value in summary.items():
        if isinstance(value, list):
            out.update({f"{key}/{k}": float(v) for k, v in enumerate(value) if isinstance(v, (int, float))})
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = float(value)
    out = {k: v for k, v in out.items() if not math.isnan(v)}
    return out


def run_eval(cfg: Any, output_dir: str | Path) -> dict:
    """Validate, build the target and the drafter, decode every prompt; report (module docstring)."""
    from hydra.utils import instantiate

    from dsv4.data.tokenizers import build_tokenizer
    from dsv4.data.validation import split_documents
    from dsv4.speculative.capture_job import build_target, job_documents
    from dsv4.speculative.decoding import AcceptanceStats, DSparkProposer, TargetRunner, speculative_generate

    job = eval_job(cfg)
    torch.set_num_threads(max(1, int(job["threads"] or 1)))
    documents = job_documents(job)
    if job["val_fraction"] is not None:
        documents = split_documents(documents, job["val_fraction"], job["seed"])[1]
    prompts = prompts_of(documents, job["num_prompts"], job["prompt_tokens"])
    if not prompts:
        raise ValueError(f"data: no document gives a prompt (of {len(documents)} documents)")
    target = build_target(job)
    drafter = build_drafter(job, target)
    generator = torch.Generator().manual_seed(job["seed"])
    vocab = build_tokenizer(job["data"]["tokenizer"]).vocab_size  # a padded model vocabulary: decode within it
    runner = TargetRunner(target, target.config.dspark_target_layer_ids, vocab)
    proposer = DSparkProposer(drafter, job["temperature"], generator, vocab)
    stats = AcceptanceStats(drafter.block_size)
    new_tokens, start = 0, time.perf_counter()
    for i, prompt in enumerate(prompts):
        out = speculative_generate(runner, proposer, prompt, job["max_new_tokens"], temperature=job["temperature"],
                                   generator=generator, eos_token_id=job["eos_token_id"], stats=stats)
        new_tokens += out.new_tokens
        log.info("prompt %d/%d: %d tokens after %d; accepted length so far %.3f", i + 1, len(prompts),
                 out.new_tokens, prompt.numel(), stats.summary()["acceptance_length"])
    seconds = time.perf_counter() - start
    summary = {**stats.summary(), "prompts": len(prompts), "new_tokens": new_tokens,
               "target_forwards": runner.forwards, "temperature": job["temperature"],
               "drafter": job["drafter_checkpoint"] or "random", "seconds": seconds,
               "tokens_per_s": new_tokens / max(seconds, 1e-9)}
    out_dir = Path(output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "eval_dspark.json").write_text(json.dumps(json_safe(summary), indent=1))
    logger_cfg = cfg.get("logger")
    if logger_cfg is not None:
        logger = instantiate(logger_cfg, save_dir=str(out_dir))
        logger.log_metrics(flat_metrics(summary), step=0)
        logger.finalize("success")
    print(json.dumps(json_safe(summary)), flush=True)
    return summary


def json_safe(value):
    """``value`` with every NaN float as None (strict JSON)."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return None if isinstance(value, float) and math.isnan(value) else value
