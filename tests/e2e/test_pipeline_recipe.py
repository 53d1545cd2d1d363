"""End-to-end: `recipes/finetune.py pp=2` (2 gloo ranks: 1F1B, FSDP2 inside each stage, V4 tiny with its MTP depth,
so the embedding lives on both stages) against the same run in one process (`pp=1`: the 4 rows of a step as 4
accumulated micro-batches), both 3 steps of AdamW at lr 1e-2 on the bundled corpus:

* the same `train/loss` at every step, and the same `val/loss` after steps 2 and 3 (held-out rows, forward only
  through the schedule in groups of a step's microbatches), 1e-6 relative;
* the `pp=2` checkpoint of step 2 resumes at `pp=1` (the loop's step count carried from the pipeline's manual
  optimizer steps) and trains exactly one more step, to the one-process run's third loss (1e-6);
* the `pp=2` run's `export.hf_dir` (its final checkpoint converted by rank 0: each rank holds only its stages) loads
  in transformers' DeepSeek-V4 with every tensor, and its logits equal those of our model loaded from the same
  files within 1e-5 relative.

The two runs' weights after 3 AdamW steps differ by more than rounding where a gradient sums microbatches of
opposite sign (up to 1e-3 relative in a hyper-connection base): the trajectories are compared by their losses, the
export against the weights it holds. The model has 8 indexer heads and the probe 64 tokens, so that transformers'
indexer breaks no top-k tie (tests/unit/checkpoint/test_export_to_transformers.py); its top-k still chooses (16
compressed rows, 8 kept)."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.helpers import FAST, losses, run_recipe

pytestmark = pytest.mark.e2e


def test_pp2_recipe_equals_one_process_resumes_at_pp1_and_exports_for_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from dsv4.checkpoint import load_model_from_hf

    from tests.unit.checkpoint.hf_reference import indexer_ties, relative_error

    common = [*(a for a in FAST if not a.startswith("scheduler.")), "scheduler=constant", "optim.lr=1e-2",
              "global_batch_size=4", "trainer.max_steps=3", "model.index_n_heads=8", "export.dtype=float32",
              "data.val_fraction=0.2", "trainer.val_check_interval=2", "trainer.limit_val_batches=3"]
    one, piped, resumed = tmp_path / "one", tmp_path / "pp2", tmp_path / "resumed"
    run_recipe([*common, "checkpoint.every_n_steps=0"], one)
    run_recipe([*common, "pp=2", "trainer.devices=2", "checkpoint.every_n_steps=2", f"export.hf_dir={tmp_path / 'pp2-hf'}"],
               piped)
    want, got = losses(one), losses(piped)
    assert len(want) == 3 and sorted(got) == sorted(want), (got, want)
    for step, loss in want.items():
        assert abs(got[step] - loss) <= 1e-6 * loss, (step, got, want)
    want_val, got_val = _val_losses(one), _val_losses(piped)
    assert len(want_val) == 2 and sorted(got_val) == sorted(want_val), (got_val, want_val)
    for step, loss in want_val.items():
        assert abs(got_val[step] - loss) <= 1e-6 * loss, (step, got_val, want_val)
    run_recipe([*common, "checkpoint.every_n_steps=0", f"checkpoint.resume={piped / 'checkpoints' / 'step2.ckpt'}"],
               resumed)
    third = max(want)
    again = losses(resumed)
    assert list(again) == [third] and abs(again[third] - want[third]) <= 1e-6 * want[third], (again, want)

    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(2))
    hf, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "pp2-hf"), dtype=torch.float32,
                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"] and not info["unexpected_keys"], info
    with torch.no_grad(), indexer_ties(hf) as ties:
        theirs = hf.eval()(ids).logits
    assert not any(ties), ties
    with torch.no_grad():
        ours = load_model_from_hf(str(tmp_path / "pp2-hf")).eval()(ids).logits
    assert relative_error(theirs, ours) < 1e-5


def _val_losses(run_dir) -> dict[int, float]:
    """``{step: val/loss}`` from the CSV logger."""
    import csv

    with open(run_dir / "csv" / "metrics.csv") as f:
        return {int(row["step"]): float(row["val/loss"]) for row in csv.DictReader(f) if row.get("val/loss")}
