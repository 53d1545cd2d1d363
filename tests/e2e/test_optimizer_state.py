"""End-to-end: `optim.state_dtype` bfloat16 and 8bit under `cp=2 ep=2` (2 gloo ranks: FSDP2 shards over both, each
EP rank holding half of the experts): a run resumed from its step-2 distributed checkpoint logs exactly (==) the
losses of the uninterrupted run. The step-3 loss follows the step-2 update, which reads the restored moments (bf16
tensors; torchao's 8-bit codes and block scales inside the DTensors of FSDP2 and of the EP expert stacks), so a
moment lost, dequantised differently or restored at another expert's place changes it. The warm-up + cosine schedule
runs over the same 4 steps in both (it fills torchao's tensor learning rate in place)."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import FAST, losses, run_recipe

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("state_dtype", ["bfloat16", "8bit"])
def test_cp2_ep2_resume_follows_the_uninterrupted_trajectory(tmp_path, state_dtype):
    common = [*FAST, "cp=2", "ep=2", f"optim.state_dtype={state_dtype}", "optim.lr=1e-2", "trainer.max_steps=4"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    run_recipe([*common, "checkpoint.every_n_steps=2"], whole)
    step2 = whole / "checkpoints" / "step2.ckpt"
    proc = run_recipe([*common, "checkpoint.every_n_steps=0", f"checkpoint.resume={step2}"], resumed)
    assert "resuming from" in proc.stdout + proc.stderr
    uninterrupted, after = losses(whole), losses(resumed)
    assert sorted(uninterrupted) == [0, 1, 2, 3] and sorted(after) == [2, 3]
    assert after == {step: uninterrupted[step] for step in (2, 3)}
