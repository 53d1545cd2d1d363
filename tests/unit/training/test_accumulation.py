"""``global_batch_size``: gradient accumulation derived from dp and ``micro_batch_size``.

Oracle: one large batch in one process. The gradients an optimizer step applies after accumulating micro-batches
(in one process, and on 2 gloo data-parallel ranks) equal the gradients of the token-mean loss of all those rows as
one batch, and the logged ``train/loss`` is that batch's token mean (not the mean of the micro-batch means: the
rows hold different numbers of labelled tokens).
"""

from __future__ import annotations

import functools
import os

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from dsv4.batch import TokenBatch
from dsv4.config import DSV4Config
from dsv4.data import DistributedPackedSampler, build_packed_dataset
from dsv4.model import DSV4ForCausalLM
from dsv4.training.module import DSV4LightningModule
from dsv4.training.spec import RunSpec, accumulation_steps
from dsv4.training.step import forward_outputs
from dsv4.training.strategy import DSV4Strategy

CONFIG = DSV4Config.preset("tiny")
SEQ_LEN = 256
ROWS = 8


def _dataset():
    """8 rows of 256 slots with different label counts (one or two documents each)."""
    g = torch.Generator().manual_seed(3)
    lengths = (250, 200, 120, 100, 180, 60, 230, 128, 90, 150, 128)
    docs = [torch.randint(1, CONFIG.vocab_size, (n,), generator=g).tolist() for n in lengths]
    dataset = build_packed_dataset(docs, SEQ_LEN, CONFIG.shard_multiple)
    assert len(dataset) == ROWS
    return dataset


def _reference(dataset):
    """Loss and parameter gradients of the token mean over all rows as ONE batch (the model seeded as the module)."""
    torch.manual_seed(0)
    model = DSV4ForCausalLM(CONFIG)
    batch = TokenBatch.stack([dataset[i] for i in range(len(dataset))])
    out = forward_outputs(model, batch)
    loss = out.loss_sum / out.label_count
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    per_row = [int(dataset[i].label_count()) for i in range(len(dataset))]
    return float(loss.detach()), grads, per_row


class RecordingSGD(torch.optim.SGD):
    """SGD (lr 0) that records the gradients it is asked to apply, after the closure (backward, rescale, clip)."""

    def __init__(self, params, record: list, lr: float = 0.0):
        super().__init__(params, lr=lr)
        self.record = record

    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = []
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is not None and hasattr(g, "full_tensor"):
                    g = g.full_tensor()
                grads.append(None if g is None else g.detach().clone())
        self.record.append(grads)
        super().step()
        return loss


class SeededModule(DSV4LightningModule):
    def configure_model(self) -> None:
        if self.model is None:
            torch.manual_seed(0)  # the same initial weights as the reference
        super().configure_model()


class _Losses(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if not trainer.fit_loop._should_accumulate():
            self.losses.append(float(trainer.callback_metrics["train/loss"]))


def _fit(dataset, micro_batch_size: int, accumulation: int, dp_rank: int = 0, dp_size: int = 1, devices: int = 1):
    record: list = []
    spec = RunSpec(CONFIG, optimizer=functools.partial(RecordingSGD, record=record), bias_update_rate=0.0,
                   micro_batch_size=micro_batch_size, seq_len=SEQ_LEN,
                   global_batch_size=micro_batch_size * dp_size * accumulation)
    module = SeededModule(spec)
    sampler = DistributedPackedSampler(len(dataset), dp_rank, dp_size, shuffle=False)
    loader = DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=TokenBatch.stack)
    losses = _Losses()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=DSV4Strategy(), max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, accumulate_grad_batches=spec.accumulation(devices),
                        callbacks=[losses])
    trainer.fit(module, train_dataloaders=loader)
    names = [n for n, p in module.model.named_parameters() if p.requires_grad]
    assert len(record) == 1  # one optimizer step
    return {n: g for n, g in zip(names, record[0]) if g is not None}, losses.losses, module.last_step_stats


def _assert_same_gradients(got: dict, expected: dict) -> None:
    assert sorted(got) == sorted(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("micro_batch_size, accumulation", [(1, 8), (2, 4)])
def test_accumulated_step_equals_one_large_batch(one_rank_group, micro_batch_size, accumulation):
    dataset = _dataset()
    loss, expected, per_row = _reference(dataset)
    assert len(set(per_row)) > 1  # rows of different label counts: the micro-batch means' mean differs
    grads, losses, stats = _fit(dataset, micro_batch_size, accumulation)
    _assert_same_gradients(grads, expected)
    assert losses == [pytest.approx(loss, rel=1e-6)]
    # the throughput callbacks see the whole global batch of the step
    assert (stats.step, stats.rows, stats.label_tokens) == (1, ROWS, sum(per_row))


def _dp_rank_body(rank: int, world_size: int) -> dict:
    # Lightning runs inside the already initialised gloo group as if launched by torchrun (it does not relaunch)
    os.environ.update({"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"})
    grads, losses, stats = _fit(_dataset(), micro_batch_size=1, accumulation=4, dp_rank=rank, dp_size=world_size,
                                devices=world_size)
    return {"grads": grads, "losses": losses, "rows": stats.rows, "labels": stats.label_tokens}


@pytest.mark.distributed
def test_global_batch_8_micro_1_dp_2_equals_one_8_row_batch():
    """global_batch_size=8 micro_batch_size=1 dp=2: 4 micro-batches per rank, one optimizer step."""
    from dsv4.launch import run_on_ranks

    dataset = _dataset()
    loss, expected, per_row = _reference(dataset)
    results = run_on_ranks(_dp_rank_body, world_size=2)
    for res in results:
        _assert_same_gradients(res["grads"], expected)
        assert (res["rows"], res["labels"]) == (ROWS, sum(per_row))
    assert results[0]["losses"] == [pytest.approx(loss, rel=1e-6)]


def test_accumulation_is_derived_and_refused_when_not_divisible():
    assert accumulation_steps(None, 4, 2) == 1
    assert accumulation_steps(8, 1, 2) == 4
    assert accumulation_steps(64, 2, 8) == 4
    with pytest.raises(ValueError, match=r"`global_batch_size`=10 must be a positive multiple of micro_batch_size x "
                                         r"dp = 2 x 2 = 4 .* e.g. global_batch_size=8 or 12"):
        accumulation_steps(10, 2, 2)
    spec = RunSpec(CONFIG, optimizer=torch.optim.SGD, micro_batch_size=1, global_batch_size=6)
    assert spec.accumulation(world_size=2) == 3
    with pytest.raises(ValueError, match="`global_batch_size`=6 must be a positive multiple of micro_batch_size x dp = "
                                         "1 x 4 = 4"):
        spec.accumulation(world_size=4)
