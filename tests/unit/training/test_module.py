"""DSV4LightningModule in a one-device Trainer: the logged loss is the model's loss on the batch, the step
statistics are the batch's, the configured optimizer / schedule / clipping are the ones used."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from dsv4.batch import TokenBatch
from dsv4.config import DSV4Config
from dsv4.data import build_packed_dataset
from dsv4.flops import document_training_flops
from dsv4.training.module import DSV4LightningModule
from dsv4.training.spec import RunSpec
from dsv4.training.schedule import warmup_cosine_schedule
from dsv4.training.strategy import DSV4Strategy, ParallelState

CONFIG = DSV4Config.preset("tiny")


def _loader(rows=4, seq_len=256, batch_size=2):
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(1, CONFIG.vocab_size, (int(n),), generator=g).tolist() for n in (200, 90, 170, 60, 130)]
    dataset = build_packed_dataset(docs, seq_len, CONFIG.shard_multiple)
    return DataLoader(dataset, batch_size=batch_size, collate_fn=TokenBatch.stack), dataset


def _trainer(strategy, steps, **kwargs):
    return L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


class _Record(L.Callback):
    def __init__(self):
        self.losses, self.stats = [], []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train/loss"]))
        self.stats.append(module.last_step_stats)


def test_logged_loss_and_statistics_are_the_batchs(one_rank_group):
    """lr = 0 and no MoE bias step keep the weights: the logged loss must equal the model's own loss on the batch."""
    loader, dataset = _loader()
    spec = RunSpec(CONFIG, optimizer=functools.partial(torch.optim.SGD, lr=0.0), bias_update_rate=0.0)
    module = DSV4LightningModule(spec)
    record = _Record()
    _trainer(DSV4Strategy(), 2, callbacks=[record]).fit(module, train_dataloaders=loader)
    assert module.parallel.cp is None
    batches = list(loader)
    for loss, stats, batch in zip(record.losses, record.stats, batches):
        with torch.no_grad():
            expected = module.model(batch.input_ids, position_ids=batch.positions, packed_seq_ids=batch.seq_ids,
                                    padding_mask=batch.padding, labels=batch.labels).loss
        assert loss == pytest.approx(float(expected), rel=1e-6)
        lengths = batch.document_lengths()
        assert (stats.rows, stats.slots, stats.real_tokens) == (2, 512, sum(lengths))
        assert stats.label_tokens == int(batch.label_count())
        aligned = sum(-(-n // 128) * 128 for n in lengths)
        assert (stats.alignment_padding, stats.pack_padding) == (aligned - sum(lengths), 512 - aligned)
        assert stats.model_flops == pytest.approx(sum(document_training_flops(CONFIG, n) for n in lengths))
        assert (stats.cp, stats.dp, stats.world_size) == (1, 1, 1) and stats.step_time_s > 0
    assert dataset.stats.real_tokens >= sum(s.real_tokens for s in record.stats)


def test_optimizer_schedule_and_clipping_come_from_the_factories(one_rank_group):
    loader, _ = _loader()
    schedule = functools.partial(warmup_cosine_schedule, warmup_steps=2, total_steps=4, min_lr_ratio=0.5)
    spec = RunSpec(CONFIG, optimizer=functools.partial(torch.optim.AdamW, lr=1e-2), scheduler=schedule)
    module = DSV4LightningModule(spec)
    trainer = _trainer(DSV4Strategy(), 3, gradient_clip_val=1e-3)
    trainer.fit(module, train_dataloaders=loader)
    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["lr"] == 1e-2
    # after 3 scheduler steps: warm-up done (2 steps), then 1 of 2 cosine steps down to 0.5 -> 0.75 x lr
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.75)
    assert float(trainer.callback_metrics["train/grad_norm"]) > 1e-3  # the norm before clipping is logged


def test_module_trains_under_a_plain_strategy_without_parallelism():
    """Any Lightning strategy works: the module then sees a single process and does not parallelize."""
    loader, _ = _loader()
    module = DSV4LightningModule(RunSpec(CONFIG, optimizer=functools.partial(torch.optim.AdamW, lr=3e-3)))
    record = _Record()
    _trainer("auto", 4, callbacks=[record]).fit(module, train_dataloaders=loader)
    assert module.parallel == ParallelState()
    assert not any(isinstance(p, torch.distributed.tensor.DTensor) for p in module.model.parameters())
    assert len(record.losses) == 4 and record.losses[-1] < record.losses[0]


def test_configure_model_is_idempotent():
    module = DSV4LightningModule(RunSpec(CONFIG, optimizer=torch.optim.SGD))
    module.configure_model()
    model = module.model
    module.configure_model()
    assert module.model is model and module.config == CONFIG
