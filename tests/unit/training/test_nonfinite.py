"""Non-finite steps: a NaN gradient or loss stops the run naming the step, the parameter and the last good
checkpoint, with nothing of the bad step saved; ``trainer.skip_nonfinite_steps`` skips such steps without any
update (weights, router biases and LR schedule as before the step) and the next one beyond it stops the run."""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import lightning as L
import pytest
import torch

from dsv4.training import module as module_lib
from dsv4.training.checkpointing import checkpoint_step
from dsv4.training.module import DSV4LightningModule
from dsv4.training.nonfinite import NonFiniteError, first_nonfinite_gradient, last_good_checkpoint
from dsv4.training.run import run_finetune
from tests.unit.training.test_run import FAST, _compose

BAD = "model.layers.1.self_attn.wq_a.weight"


def _metric(run: Path, name: str) -> dict[int, float]:
    with open(run / "csv" / "metrics.csv") as f:
        return {int(r["step"]): float(r[name]) for r in csv.DictReader(f) if r.get(name)}


def _inject_nan_gradient(monkeypatch, steps: set[int], name: str) -> list[str]:
    """NaN in one element of parameter ``name``'s gradient at the optimizer steps ``steps`` (1-based)."""
    names: list[str] = []
    original = DSV4LightningModule.on_after_backward

    def on_after_backward(self):
        original(self)
        names[:] = [n for n, _ in self.model.named_parameters()]
        if self.trainer.global_step + 1 in steps:
            grad = dict(self.model.named_parameters())[name].grad
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            local.view(-1)[3] = float("nan")

    monkeypatch.setattr(DSV4LightningModule, "on_after_backward", on_after_backward)
    return names


def _inject_nan_loss(monkeypatch, steps: set[int]) -> None:
    """A NaN loss (so NaN gradients too) at the optimizer steps ``steps`` (1-based)."""
    current: dict = {}
    original_step, original_forward = DSV4LightningModule.training_step, module_lib.forward_outputs

    def training_step(self, batch, batch_idx):
        current["step"] = self.trainer.global_step + 1
        return original_step(self, batch, batch_idx)

    def forward_outputs(model, batch, cp=None):
        out = original_forward(model, batch, cp=cp)
        if current["step"] in steps:
            out.loss_sum = out.loss_sum * float("nan")
        return out

    monkeypatch.setattr(DSV4LightningModule, "training_step", training_step)
    monkeypatch.setattr(module_lib, "forward_outputs", forward_outputs)


class _Snapshots(L.Callback):
    """The model's state (parameters and buffers: the router biases) after every optimizer step."""

    def __init__(self):
        self.after: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_start(self, trainer, pl_module):
        self.after[trainer.global_step] = self._state(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.after[trainer.global_step] = self._state(pl_module)

    @staticmethod
    def _state(pl_module):
        return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone()
                for k, v in pl_module.model.state_dict().items()}


def test_a_nan_gradient_stops_the_run_naming_the_step_the_parameter_and_the_last_good_checkpoint(
        tmp_path, one_rank_group, monkeypatch):
    names = _inject_nan_gradient(monkeypatch, {2}, BAD)
    run = tmp_path / "run"
    run.mkdir()
    with pytest.raises(NonFiniteError) as err:
        run_finetune(_compose([*FAST, "trainer.max_steps=3", "checkpoint.every_n_steps=1"]), run)
    message = str(err.value)
    assert BAD in names and names.index(BAD) > 0  # not simply the first parameter
    assert "non-finite values at optimizer step 2:" in message, message
    assert f"first non-finite gradient: {BAD} (rank 0)" in message, message
    assert f"last good checkpoint: {run / 'checkpoints' / 'step1.ckpt'}." in message, message
    # nothing of step 2 was saved (step 1's asynchronous save was committed before the message named it)
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "step1.ckpt"]
    assert checkpoint_step(ckpts / "last.ckpt") == 1


def test_a_nan_loss_at_the_first_step_stops_with_no_checkpoint_yet(tmp_path, one_rank_group, monkeypatch):
    _inject_nan_loss(monkeypatch, {1})
    with pytest.raises(NonFiniteError, match=r"optimizer step 1: train/loss nan, .*last good checkpoint: none yet"):
        run_finetune(_compose([*FAST, "trainer.max_steps=2"]), tmp_path)
    assert not any((tmp_path / "checkpoints").glob("*.ckpt"))


def test_skip_nonfinite_steps_skips_without_an_update_and_the_run_finishes(tmp_path, one_rank_group, monkeypatch,
                                                                           caplog):
    from dataclasses import replace

    from dsv4.training.run import FINETUNE

    snapshots = _Snapshots()

    def with_snapshots(cfg):
        spec = FINETUNE.build_spec(cfg)
        return replace(spec, callbacks=(*spec.callbacks, snapshots))

    _inject_nan_gradient(monkeypatch, {2}, BAD)
    caplog.set_level(logging.WARNING, logger="dsv4")
    run = tmp_path / "run"
    run.mkdir()
    run_finetune(_compose([*FAST, "trainer.max_steps=4", "checkpoint.every_n_steps=0",
                           "trainer.skip_nonfinite_steps=1"]), run,
                 recipe=replace(FINETUNE, build_spec=with_snapshots))
    assert "skipping optimizer step 2 (1 of trainer.skip_nonfinite_steps=1)" in caplog.text
    assert f"first non-finite gradient: {BAD} (rank 0)" in caplog.text
    before, skipped, next_ = snapshots.after[1], snapshots.after[2], snapshots.after[3]
    for key in before:  # weights and router biases exactly as before the skipped step
        assert torch.equal(before[key], skipped[key]), key
    assert any(not torch.equal(skipped[k], next_[k]) for k in skipped)  # the next step trains again
    assert any("e_score_correction_bias" in k for k in before)
    assert _metric(run, "train/skipped_nonfinite") == {0: 0.0, 1: 1.0, 2: 1.0, 3: 1.0}
    lrs = _metric(run, "train/lr")
    assert lrs[2] == lrs[1] and lrs[3] != lrs[2]  # the skipped step did not advance the schedule
    assert checkpoint_step(run / "checkpoints" / "last.ckpt") == 4  # the step counter did advance


def test_a_non_finite_step_beyond_skip_nonfinite_steps_stops_the_run(tmp_path, one_rank_group, monkeypatch):
    _inject_nan_loss(monkeypatch, {1, 3})
    with pytest.raises(NonFiniteError, match=r"optimizer step 3 after skipping 1 \(trainer.skip_nonfinite_steps=1\)"
                                             r": train/loss nan"):
        run_finetune(_compose([*FAST, "trainer.max_steps=4", "checkpoint.every_n_steps=1",
                               "trainer.skip_nonfinite_steps=1"]), tmp_path)


def _two_ranks(rank, world_size):
    """Rank 0's first bad gradient is parameter 2, rank 1's parameter 1: both name parameter 1 on rank 1."""
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(3)]
    for p in params:
        p.grad = torch.ones(4)
    params[2 if rank == 0 else 1].grad[1] = float("inf")
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    found = first_nonfinite_gradient(named)
    for p in params:
        p.grad = torch.ones(4)
    return found, first_nonfinite_gradient(named)


@pytest.mark.distributed
def test_every_rank_names_the_same_first_nonfinite_gradient():
    from dsv4.launch import run_on_ranks

    assert run_on_ranks(_two_ranks, world_size=2) == [(("p1", 1), None)] * 2


def test_last_good_checkpoint_is_the_newest_complete_one(tmp_path):
    assert last_good_checkpoint(None) is None and last_good_checkpoint(tmp_path / "none") is None
    for name, files in (("step1.ckpt", ("meta.pt", ".metadata")), ("step2.ckpt", (".metadata",))):
        (tmp_path / name).mkdir()
        for f in files:
            (tmp_path / name / f).write_bytes(b"x")
    (tmp_path / "last.ckpt").symlink_to(tmp_path / "step1.ckpt")
    assert last_good_checkpoint(tmp_path) == tmp_path / "step1.ckpt"


def test_skip_nonfinite_steps_is_checked():
    from dsv4.training.spec import build_run_spec

    assert build_run_spec(_compose([*FAST, "trainer.skip_nonfinite_steps=2"])).skip_nonfinite_steps == 2
    with pytest.raises(ValueError, match=r"`trainer.skip_nonfinite_steps`=-1 must be a whole number of steps >= 0"):
        build_run_spec(_compose([*FAST, "trainer.skip_nonfinite_steps=-1"]))
