"""End-to-end validation: `recipes/finetune.py data.val_fraction=0.2 trainer.val_check_interval=2
checkpoint.monitor=val/loss` on 2 CP ranks logs val/loss after optimizer steps 2 and 4 (metrics.csv rows 1 and 3,
the rows of those steps' train/loss), equal to a CP 1 run's; keeps best.ckpt; a resume from the step-2 checkpoint
validates at the same steps, with the same values, and keeps the best score. The first run prepares the split
(training and held-out rows) once; the second run (cp=1, the same key) maps it and tokenizes nothing."""

from __future__ import annotations

import csv
import re

import pytest
import torch

from tests.e2e.helpers import FAST, losses, run_recipe

pytestmark = pytest.mark.e2e

VALIDATE = [*FAST, "data.val_fraction=0.2", "trainer.val_check_interval=2", "trainer.limit_val_batches=3",
            "checkpoint.monitor=val/loss", "trainer.max_steps=4", "checkpoint.every_n_steps=2"]


def _val_losses(run):
    with open(run / "csv" / "metrics.csv") as f:
        return {int(r["step"]): float(r["val/loss"]) for r in csv.DictReader(f) if r.get("val/loss")}


def _best_state(checkpoint):
    meta = torch.load(checkpoint / "meta.pt", weights_only=False)
    return next(v for k, v in meta["callbacks"].items() if k.startswith("StepCheckpoint"))["best"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("validation")
    cache = {"DSV4_DATA_CACHE": str(base / "data-cache")}  # empty: another test may have prepared the same key
    for name in ("cp2", "cp1"):
        result = run_recipe([*VALIDATE, f"cp={name[-1]}"], base / name, env=cache)
        (base / f"{name}.log").write_text(result.stdout + result.stderr)
    return base


def test_the_split_is_prepared_once_and_a_second_start_tokenizes_nothing(runs):
    first, second = (runs / "cp2.log").read_text(), (runs / "cp1.log").read_text()
    prepared = re.findall(r"data: prepared dataset (\S+) \((\d+ training rows, \d+ held-out rows, \d+ tokens)\)",
                          first)
    assert len(prepared) == 1 and "data: tokenized" in first, prepared
    directory, counts = prepared[0]
    assert "data: tokenized" not in second and "data: prepared dataset" not in second
    assert f"data: reusing prepared dataset {directory} ({counts})" in second


def test_val_loss_is_logged_after_steps_2_and_4_and_equals_cp1(runs):
    two, one = _val_losses(runs / "cp2"), _val_losses(runs / "cp1")
    assert sorted(two) == [1, 3] and sorted(one) == [1, 3]
    for step in two:
        assert abs(two[step] - one[step]) <= 1e-5, (step, two[step], one[step])
    assert sorted(losses(runs / "cp2")) == [0, 1, 2, 3]


def test_the_best_checkpoint_is_kept(runs):
    val = _val_losses(runs / "cp2")
    best = runs / "cp2" / "checkpoints" / "best.ckpt"
    assert (best / ".metadata").exists()
    state = _best_state(runs / "cp2" / "checkpoints" / "last.ckpt")
    assert state["score"] == pytest.approx(min(val.values()), abs=1e-7)
    assert state["step"] == min(val, key=val.get) + 1 and state["path"] == str(best)


def test_a_resume_validates_at_the_same_steps_and_keeps_the_best_score(runs):
    run = runs / "cp2"
    reference, reference_best = _val_losses(run), _best_state(run / "checkpoints" / "last.ckpt")
    step2 = run / "checkpoints" / "step2.ckpt"
    assert _best_state(step2)["score"] == pytest.approx(reference[1], abs=1e-7)  # the step-2 validation is saved
    run_recipe([*VALIDATE, "cp=2", f"checkpoint.resume={step2}"], run)
    resumed = _val_losses(run)
    assert sorted(resumed) == [1, 3]
    assert resumed[1] == reference[1]  # the row before the checkpoint is kept
    assert abs(resumed[3] - reference[3]) <= 1e-5, (resumed[3], reference[3])
    state = _best_state(run / "checkpoints" / "last.ckpt")
    assert state["step"] == reference_best["step"]
    assert state["score"] == pytest.approx(reference_best["score"], abs=1e-5)
