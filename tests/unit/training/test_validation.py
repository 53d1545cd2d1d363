"""Validation in one process: the config keys are checked before any work, the schedule is in optimizer steps,
``val/loss`` is the token mean of the held-out rows (checked against the model's own forward), validating leaves
the training trajectory exactly as it is, and the best checkpoint's score is callback state that a resume keeps."""

from __future__ import annotations

import csv
import functools
import json
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from dsv4.batch import TokenBatch
from dsv4.config import DSV4Config
from dsv4.data import build_packed_dataset
from dsv4.data.validation import ValidationShard
from dsv4.training.checkpointing import StepCheckpoint, checkpoint_step
from dsv4.training.module import DSV4LightningModule
from dsv4.training.run import read_objective, run_finetune
from dsv4.training.spec import RunSpec, ValidationSpec, build_run_spec
from dsv4.training.strategy import DSV4Strategy
from dsv4.training.validation import ValidationResult, batch_limit, validation_due
from tests.unit.training.test_run import FAST, _compose

CONFIG = DSV4Config.preset("tiny")


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (["data.val={path:x}", "data.val_fraction=0.1"], ValueError, "`data.val` and `data.val_fraction`=0.1 are both set"),
        (["data.val_fraction=1.5"], ValueError, "`data.val_fraction`=1.5 must be a number in (0, 1)"),
        (["data.val_fraction=0"], ValueError, "`data.val_fraction`=0.0 must be a number in (0, 1)"),
        (["data.val={paht:x}"], KeyError, "`data.val.paht` cannot be set"),
        (["data.val={tokenizer:x}"], KeyError, "`data.val.tokenizer` cannot be set"),
        (["+trainer.val_check_interval=2"], ValueError, "`trainer.val_check_interval`=2 needs held-out data"),
        (["data.val_fraction=0.1", "trainer.val_check_interval=0"], ValueError,
         "`trainer.val_check_interval`=0 must be a whole number of optimizer steps >= 1"),
        (["data.val_fraction=0.1", "trainer.val_check_interval=0.5"], ValueError,
         "`trainer.val_check_interval`=0.5 must be a whole number of optimizer steps"),
        (["data.val_fraction=0.1", "trainer.limit_val_batches=0"], ValueError, "`trainer.limit_val_batches`=0 must be"),
        (["data.val_fraction=0.1", "trainer.limit_val_batches=1.5"], ValueError, "`trainer.limit_val_batches`=1.5"),
        (["trainer.limit_val_batches=2"], ValueError, "`trainer.limit_val_batches`=2 needs held-out data"),
        (["checkpoint.monitor=val/loss"], ValueError, "`checkpoint.monitor`=val/loss needs held-out data"),
        (["data.val_fraction=0.1", "checkpoint.monitor=train/loss"], ValueError,
         "`checkpoint.monitor`='train/loss' must be null or one of ['val/loss']"),
        (["objective=val/loss"], ValueError, "`objective`=val/loss needs held-out data"),
        (["objective=accuracy"], ValueError, "`objective`='accuracy' must be one of ['train/loss', 'val/loss']"),
        (["data.val_fraction=0.1", "trainer.max_steps=-1", "+trainer.max_epochs=1"], ValueError,
         "validation with `trainer.max_steps`=-1 needs `trainer.val_check_interval`"),
    ],
)
def test_bad_validation_keys_are_named_before_any_work(overrides, error, message):
    with pytest.raises(error) as err:
        build_run_spec(_compose([*FAST, *overrides]))
    assert message in str(err.value)


def test_the_validation_keys_resolve_into_the_spec_and_leave_the_trainer_keywords():
    spec = build_run_spec(_compose([*FAST, "data=jsonl", "data.path=train.jsonl", "data.val={path:val.jsonl}",
                                    "trainer.val_check_interval=5", "trainer.limit_val_batches=0.5",
                                    "checkpoint.monitor=val/loss", "objective=val/loss"]))
    assert spec.validation.source["path"] == "val.jsonl" and spec.validation.source["kind"] == "jsonl"
    assert spec.data["path"] == "train.jsonl" and "val" not in spec.data and "val_fraction" not in spec.data
    assert (spec.validation.every_n_steps, spec.validation.limit_batches) == (5, 0.5)
    assert "val_check_interval" not in spec.trainer and "limit_val_batches" not in spec.trainer
    assert spec.checkpoint.monitor == "val/loss" and spec.objective == "val/loss"
    default = build_run_spec(_compose(FAST))
    assert not default.validation.enabled and default.checkpoint.monitor is None and default.objective == "train/loss"


def test_the_schedule_counts_optimizer_steps_and_always_takes_the_last():
    assert [s for s in range(1, 11) if validation_due(s, 3, 10)] == [3, 6, 9, 10]
    assert [s for s in range(1, 11) if validation_due(s, None, 10)] == [10]
    assert [s for s in range(1, 7) if validation_due(s, 2, -1)] == [2, 4, 6]
    assert (batch_limit(10, None), batch_limit(10, 3), batch_limit(10, 30), batch_limit(10, 0.25),
            batch_limit(3, 0.1)) == (10, 3, 10, 2, 1)


# ------------------------------------------------------------------ the module in a one-device Trainer


def _rows(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(1, CONFIG.vocab_size, (int(n),), generator=g).tolist() for n in lengths]
    return build_packed_dataset(docs, 256, CONFIG.shard_multiple)


TRAIN = _rows((200, 90, 170, 60, 130, 220, 100), seed=0)
HELD_OUT = _rows((210, 40, 150, 250, 120), seed=1)


def _fit(spec, validate, steps, train=TRAIN, **kwargs):
    torch.manual_seed(0)
    module = DSV4LightningModule(spec, val_data=(
        (lambda: DataLoader(ValidationShard(HELD_OUT, micro_batch_size=2), batch_size=2,
                            collate_fn=TokenBatch.stack)) if validate else None))
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            value = trainer.callback_metrics.get("train/loss")  # under accumulation: after a step's last micro-batch
            losses.append(None if value is None else float(value))

    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=DSV4Strategy(), max_steps=steps,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Record()], **kwargs)
    trainer.fit(module, train_dataloaders=DataLoader(train, batch_size=1, collate_fn=TokenBatch.stack))
    return module, losses


def test_val_loss_is_the_token_mean_of_the_held_out_rows(one_rank_group, tmp_path):
    """lr = 0 and no bias step: after training the weights are the initial ones, so ``val/loss`` must equal the
    model's own loss over all held-out rows (summed token losses over the summed label count, not a mean of
    per-batch means); logged once per validation, in the row of the step it follows."""
    from lightning.pytorch.loggers import CSVLogger

    spec = RunSpec(CONFIG, optimizer=functools.partial(torch.optim.SGD, lr=0.0), bias_update_rate=0.0, max_steps=3,
                   validation=ValidationSpec(fraction=0.5, every_n_steps=2))
    module, _ = _fit(spec, True, 3, logger=CSVLogger(tmp_path, name="csv", version=""))
    batch = HELD_OUT.batch
    with torch.no_grad():
        module.model.eval()
        out = module.model(batch.input_ids, position_ids=batch.positions, packed_seq_ids=batch.seq_ids,
                           padding_mask=batch.padding, labels=batch.labels, return_logits=False)
        means = [float(module.model(r.input_ids, position_ids=r.positions, packed_seq_ids=r.seq_ids,
                                    padding_mask=r.padding, labels=r.labels).loss) for r in HELD_OUT]
    expected = float(out.loss_sum) / int(out.label_count)
    # the rows hold different label counts, so a mean of per-row means misses the tolerance below by 10x or more
    assert len({int(row.label_count()) for row in HELD_OUT}) > 1
    assert abs(sum(means) / len(means) - expected) > 10 * 1e-6 * expected
    assert module.last_validation.step == 3 and module.last_validation.tokens == int(batch.label_count())
    assert module.last_validation.loss == pytest.approx(expected, rel=1e-6)
    with open(tmp_path / "csv" / "metrics.csv") as f:
        rows = [(int(r["step"]), float(r["val/loss"])) for r in csv.DictReader(f) if r.get("val/loss")]
    assert [step for step, _ in rows] == [1, 2]  # after optimizer steps 2 and 3 (the last)
    assert all(value == pytest.approx(expected, rel=1e-6) for _, value in rows)


def test_validating_leaves_the_training_trajectory_and_the_router_biases_as_they_are(one_rank_group):
    spec = RunSpec(CONFIG, optimizer=functools.partial(torch.optim.AdamW, lr=3e-3), bias_update_rate=1e-3,
                   max_steps=3, validation=ValidationSpec(fraction=0.5, every_n_steps=1))
    plain, plain_losses = _fit(spec, False, 3, logger=False)
    checked, checked_losses = _fit(spec, True, 3, logger=False)
    assert checked.last_validation is not None and plain.last_validation is None
    assert checked_losses == plain_losses  # bit for bit
    ours, theirs = checked.model.state_dict(), plain.model.state_dict()
    for name, value in plain.model.state_dict().items():
        assert torch.equal(ours[name], theirs[name]), name  # weights and e_score_correction_bias


def test_under_accumulation_the_schedule_counts_optimizer_steps_across_epochs(one_rank_group, tmp_path):
    """7 micro-batches per epoch, 2 per optimizer step: the epoch's 4th step holds one. Validation after steps 2, 4
    and 5 (the last) falls on micro-batches 4, 7 and 9, which no fixed count of training batches describes."""
    from lightning.pytorch.loggers import CSVLogger

    spec = RunSpec(CONFIG, optimizer=functools.partial(torch.optim.SGD, lr=1e-3), max_steps=5,
                   validation=ValidationSpec(fraction=0.5, every_n_steps=2, limit_batches=1))
    seven = _rows((200, 150, 170, 180, 130, 220, 210), seed=2)  # one document per row
    assert len(seven) == 7
    module, losses = _fit(spec, True, 5, train=seven, accumulate_grad_batches=2,
                          logger=CSVLogger(tmp_path, name="csv", version=""))
    assert len(losses) == 9 and module.last_validation.step == 5
    with open(tmp_path / "csv" / "metrics.csv") as f:
        rows = [int(r["step"]) for r in csv.DictReader(f) if r.get("val/loss")]
    assert rows == [1, 3, 4]


# ------------------------------------------------------------------ the best checkpoint and resume


class _Trainer(SimpleNamespace):
    def __init__(self, step):
        super().__init__(global_step=step, saved=[], strategy=SimpleNamespace(broadcast=lambda value, src=0: value))

    def save_checkpoint(self, path):
        self.saved.append((self.global_step, path))


def test_the_best_score_is_callback_state_and_a_resume_keeps_it(tmp_path):
    first = StepCheckpoint(tmp_path, 2, best_of="val/loss")
    for step, loss in ((2, 3.0), (4, 2.5), (6, 2.7)):
        trainer = _Trainer(step)
        first._keep_best(trainer, SimpleNamespace(last_validation=ValidationResult(step, loss, 100)))
        first._keep_best(trainer, SimpleNamespace(last_validation=ValidationResult(step, loss, 100)))  # next micro-batch
        assert trainer.saved == ([(step, str(tmp_path / "best.ckpt"))] if step != 6 else [])
    assert (first.best_score, first.best_step) == (2.5, 4)
    state = first.state_dict()
    resumed = StepCheckpoint(tmp_path, 2, best_of="val/loss")
    resumed.load_state_dict(state)
    assert (resumed.best_score, resumed.best_step, resumed.best_path) == (2.5, 4, str(tmp_path / "best.ckpt"))
    trainer = _Trainer(8)
    resumed._keep_best(trainer, SimpleNamespace(last_validation=ValidationResult(8, 2.6, 100)))
    assert trainer.saved == [] and resumed.best_score == 2.5  # worse than the best before the resume
    resumed._keep_best(_Trainer(10), SimpleNamespace(last_validation=ValidationResult(10, 2.4, 100)))
    assert (resumed.best_score, resumed.best_step) == (2.4, 10)
    plain = StepCheckpoint(tmp_path, 2)  # no monitor: no best, whatever the state says
    plain.load_state_dict(state)
    assert plain.best_score is None


def test_a_run_validates_keeps_the_best_checkpoint_and_reports_val_loss(tmp_path, one_rank_group):
    run = tmp_path / "run"
    run.mkdir()
    overrides = [*FAST, "data.val_fraction=0.2", "trainer.val_check_interval=1", "trainer.limit_val_batches=2",
                 "checkpoint.monitor=val/loss", "objective=val/loss", "checkpoint.every_n_steps=0",
                 "trainer.max_steps=2"]
    value = run_finetune(_compose(overrides), run)
    with open(run / "csv" / "metrics.csv") as f:
        val = {int(r["step"]): float(r["val/loss"]) for r in csv.DictReader(f) if r.get("val/loss")}
    assert sorted(val) == [0, 1] and value == pytest.approx(val[1]) and read_objective(run) == pytest.approx(val[1])
    assert json.loads((run / "objective.json").read_text())["metric"] == "val/loss"
    best = run / "checkpoints" / "best.ckpt"
    assert (best / ".metadata").exists() and checkpoint_step(best) == min(val, key=val.get) + 1
    meta = torch.load(run / "checkpoints" / "last.ckpt" / "meta.pt", weights_only=False)
    state = next(v for k, v in meta["callbacks"].items() if k.startswith("StepCheckpoint"))
    assert state["best"]["score"] == pytest.approx(min(val.values())) and state["best"]["path"] == str(best)
