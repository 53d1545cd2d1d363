"""End-to-end: `recipes/finetune.py pp=2` (2 gloo ranks: 1F1B, FSDP2 inside each stage, V4 tiny with its MTP depth,
so the embedding lives on both stages) against the same run in one process (`pp=1`: the 4 rows of a step as 4
accumulated micro-batches), both 3 steps of AdamW at lr 1e-2 on the bundled corpus:

* the same `train/loss` at every step (1e-6 relative);
* the `pp=2` checkpoint of step 2 resumes at `pp=1` (the loop's step count carried from the pipeline's manual
  optimizer steps) and trains exactly one more step, to the one-process run's third loss (1e-6);
* the `pp=2` run's `export.hf_dir` (its final checkpoint converted by rank 0: each rank holds only its stages), read
  by transformers' DeepSeek-V4, gives the logits of the one-process run's own export within 1e-5 relative.

The model has 8 indexer heads, so that transformers' indexer breaks no top-k tie on these inputs
(tests/unit/checkpoint/test_export_to_transformers.py)."""

from __future__ import annotations

import pytest
import torch

from tests.e2e.helpers import FAST, losses, run_recipe

pytestmark = pytest.mark.e2e


def test_pp2_recipe_equals_one_process_resumes_at_pp1_and_exports_for_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.unit.checkpoint.hf_reference import indexer_ties, relative_error

    common = [*(a for a in FAST if not a.startswith("scheduler.")), "scheduler=constant", "optim.lr=1e-2",
              "global_batch_size=4", "trainer.max_steps=3", "model.index_n_heads=8", "export.dtype=float32"]
    one, piped, resumed = tmp_path / "one", tmp_path / "pp2", tmp_path / "resumed"
    run_recipe([*common, "checkpoint.every_n_steps=0", f"export.hf_dir={tmp_path / 'one-hf'}"], one)
    run_recipe([*common, "pp=2", "trainer.devices=2", "checkpoint.every_n_steps=2", f"export.hf_dir={tmp_path / 'pp2-hf'}"],
               piped)
    want, got = losses(one), losses(piped)
    assert len(want) == 3 and sorted(got) == sorted(want), (got, want)
    for step, loss in want.items():
        assert abs(got[step] - loss) <= 1e-6 * loss, (step, got, want)
    run_recipe([*common, "checkpoint.every_n_steps=0", f"checkpoint.resume={piped / 'checkpoints' / 'step2.ckpt'}"],
               resumed)
    third = max(want)
    again = losses(resumed)
    assert list(again) == [third] and abs(again[third] - want[third]) <= 1e-6 * want[third], (again, want)

    ids = torch.randint(0, 256, (2, 256), generator=torch.Generator().manual_seed(2))
    logits = []
    for name in ("pp2-hf", "one-hf"):
        hf, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / name), dtype=torch.float32,
                                                        output_loading_info=True)
        assert not info["missing_keys"] and not info["mismatched_keys"], info
        with torch.no_grad(), indexer_ties(hf) as ties:
            logits.append(hf.eval()(ids).logits)
        assert not any(ties), ties
    assert relative_error(logits[0], logits[1]) < 1e-5
