"""End-to-end: a run checkpointed under one data-parallel layout resumes under another (docs/scale.md#checkpoints).

One `dp=2` run (2 gloo processes, `cp=1`, 3 steps, a checkpoint after every step) is the uninterrupted reference;
its step-1 checkpoint resumes in one process at `dp=1` with the same `global_batch_size=2` (2 micro-batches of one
row accumulated per step) and trains to step 3.

Why the step-1 checkpoint: after one step of the dp=2 run Lightning has counted 1 micro-batch, which under dp=1 is
2. Resumed without rewriting that count, the first resumed step would end after one micro-batch (Lightning steps
when its count reaches a multiple of the accumulation), on half the rows; resumed from a data position taken per
replica rather than over all replicas, it would read rows the dp=2 run read in step 1. Either changes the loss.

Tolerances: the first resumed step starts from bit-identical weights and optimizer state (loaded) and reads the same
two rows; only the order of the fp32 reductions differs (one rank with 2 accumulated micro-batches, each with twice
the threads, against 2 ranks whose per-rank losses are all-reduced), a few ulp of a sum of 512 token losses:
relative 1e-6. The next step also carries the first step's gradients reduced in another order through AdamW: 1e-5,
the bound the repository's other trajectory comparisons (cp=1 against cp=2) use.
"""

from __future__ import annotations

import pytest
import torch

from tests.e2e.helpers import FAST, losses, run_recipe

pytestmark = pytest.mark.e2e

COMMON = [*FAST, "trainer.max_steps=3", "checkpoint.every_n_steps=1"]


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    run = tmp_path_factory.mktemp("dp2")
    run_recipe([*COMMON, "dp=2"], run)
    return run


def _meta(path):
    return torch.load(path / "meta.pt", map_location="cpu", weights_only=False)


def test_dp2_checkpoint_resumes_at_dp1_on_the_same_rows_and_trajectory(dp2, tmp_path):
    step1 = dp2 / "checkpoints" / "step1.ckpt"
    saved = _meta(step1)
    assert saved["dsv4_layout"] == {"dp": 2, "cp": 1, "ep": 1, "micro_batch_size": 1, "accumulation": 1}
    assert saved["DSV4DataModule"]["sampler"]["global_position"] == 2  # one row on each of 2 replicas

    proc = run_recipe([*COMMON, "dp=1", "global_batch_size=2", f"checkpoint.resume={step1}"], tmp_path)
    assert ("written under dp=2 cp=1 ep=1 (micro_batch_size=1, global_batch_size=2), under dp=1 cp=1 ep=1 "
            "(micro_batch_size=1, global_batch_size=2)") in proc.stdout + proc.stderr
    resumed, uninterrupted = losses(tmp_path), losses(dp2)
    assert sorted(uninterrupted) == [0, 1, 2] and sorted(resumed) == [1, 2]
    assert resumed[1] == pytest.approx(uninterrupted[1], rel=1e-6, abs=0)
    assert resumed[2] == pytest.approx(uninterrupted[2], rel=1e-5, abs=0)
    # the data position after step 3: both runs consumed the first 6 rows of the same global order
    end = _meta(tmp_path / "checkpoints" / "step3.ckpt")
    assert end["dsv4_layout"] == {"dp": 1, "cp": 1, "ep": 1, "micro_batch_size": 1, "accumulation": 2}
    reference = _meta(dp2 / "checkpoints" / "step3.ckpt")["DSV4DataModule"]["sampler"]
    assert end["DSV4DataModule"]["sampler"] == {**reference, "dp_size": 1} and reference["global_position"] == 6
