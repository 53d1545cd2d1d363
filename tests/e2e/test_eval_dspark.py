"""recipes/eval_dspark.py: speculative decoding of the tiny V4.1 target (the recipe's seeded init, Engram on the byte
tokenizer) with an exported DSpark drafter; a V4 target is refused.

Asserted: with ``drafter.checkpoint`` a directory written by ``export_dspark_drafter`` (a seeded drafter holding the
embedding and head of the very target the recipe builds), the last stdout line is a JSON object whose
acceptance_length is in ``[1, K + 1]`` and whose acceptance_per_position has ``K`` shares in ``[0, 1]`` summing to
acceptance_length - 1, naming that drafter and carrying its fingerprint (a confidence head of zeros: every
confidence 0.5); ``<run dir>/eval_dspark.json`` holds the same and the CSV logger's ``csv/metrics.csv`` has
acceptance_length. ``model=tiny`` (DeepSeek-V4) exits non-zero before any decoding with a message naming ``model``.
"""

from __future__ import annotations

import csv
import json

import pytest
import torch

from tests.e2e.helpers import run_recipe

pytestmark = pytest.mark.e2e

SCRIPT = "recipes/eval_dspark.py"
ARGS = ["num_prompts=2", "max_new_tokens=8", "prompt_tokens=16", "logger=csv"]
SEED = 1234  # conf/eval_dspark.yaml's seed: the recipe's target is the seeded init of its model preset


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    """An exported drafter whose embedding and head are the recipe's target's (``build_target`` as the recipe calls
    it: the v41_tiny preset, Engram hashing through the byte tokenizer, ``torch.manual_seed(seed)`` before the init)."""
    from dsv4.config import DSV4Config
    from dsv4.model.v41.drafter import DSparkDrafter
    from dsv4.speculative.capture_job import build_target
    from dsv4.speculative.drafter_checkpoint import (
        export_dspark_drafter,
        load_dspark_drafter,
    )

    config = DSV4Config.preset("v41_tiny")
    assert config.engram_layer_ids  # the recipe's default target has Engram layers
    target = build_target({"model": config.to_dict(), "model_type": config.model_type, "seed": SEED,
                           "data": {"tokenizer": "byte"}})
    torch.manual_seed(5)
    drafter = DSparkDrafter(config)
    drafter.copy_target_embeddings(target)
    with torch.no_grad():  # a fingerprint: this drafter's confidence is exactly sigmoid(0) = 0.5 for every draft
        drafter.last.confidence_head.proj.weight.zero_()
    path = tmp_path_factory.mktemp("drafter")
    export_dspark_drafter(drafter, str(path), dtype="float32")
    loaded = load_dspark_drafter(str(path))
    assert torch.equal(loaded.embed_tokens.weight, target.model.embed_tokens.weight)
    assert torch.equal(loaded.lm_head.weight, target.lm_head.weight)
    return path


def test_eval_with_an_exported_drafter_reports_acceptance(tmp_path, drafter_dir):
    run_dir = tmp_path / "run"
    proc = run_recipe(ARGS + [f"drafter.checkpoint={drafter_dir}"], run_dir, script=SCRIPT)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    k = 5  # v41_tiny's dspark_block_size
    assert summary["block_size"] == k and summary["drafter"] == str(drafter_dir)
    # the exported drafter decoded (its confidence head's fingerprint), not a fresh one
    assert summary["confidence_mean_per_position"][0] == 0.5 and summary["confidence_brier"] == 0.25
    assert 1 <= summary["acceptance_length"] <= k + 1
    per = summary["acceptance_per_position"]
    assert len(per) == k and all(0 <= x <= 1 for x in per)
    assert summary["acceptance_length"] == pytest.approx(1 + sum(per))
    assert summary["prompts"] == 2 and summary["new_tokens"] == 16
    assert summary["target_forwards"] == 2 + summary["drafting_steps"]  # a prefill per prompt, one per block
    saved = json.loads((run_dir / "eval_dspark.json").read_text())
    assert saved["acceptance_length"] == summary["acceptance_length"]
    assert saved["acceptance_per_position"] == per
    with open(run_dir / "csv" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert float(rows[-1]["acceptance_length"]) == pytest.approx(summary["acceptance_length"])
    assert [float(rows[-1][f"acceptance_per_position/{i}"]) for i in range(k)] == pytest.approx(per)


def test_a_v4_target_is_refused_before_any_work(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_recipe(ARGS + ["model=tiny"], run_dir, script=SCRIPT, check=False)
    assert proc.returncode != 0
    assert "`model`" in proc.stderr and "deepseek_v4" in proc.stderr
    assert "prompt 1/" not in proc.stderr and not (run_dir / "eval_dspark.json").exists()
    assert not (run_dir / "csv").exists()
