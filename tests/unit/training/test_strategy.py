"""DSV4Strategy in a one-device Trainer: the parallel state it publishes, what parallelize applies, its checks."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from dsv4.batch import TokenBatch
from dsv4.config import DSV4Config
from dsv4.data import build_packed_dataset
from dsv4.model.moe import MoE
from dsv4.parallel.dispatch import AllToAllDispatcher
from dsv4.training.module import DSV4LightningModule
from dsv4.training.spec import RunSpec
from dsv4.training.strategy import DSV4Strategy

CONFIG = DSV4Config.preset("tiny")


def _fit(strategy, steps=1):
    docs = [[3] * 150, [5] * 100, [7] * 60]
    loader = DataLoader(build_packed_dataset(docs, 256, CONFIG.shard_multiple), batch_size=1, collate_fn=TokenBatch.stack)
    module = DSV4LightningModule(RunSpec(CONFIG, optimizer=functools.partial(torch.optim.SGD, lr=0.0)))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, train_dataloaders=loader)
    return trainer, module


def test_parallel_state_meshes_and_fsdp(one_rank_group):
    trainer, module = _fit(DSV4Strategy())
    strategy = trainer.strategy
    state = strategy.parallel
    assert (state.cp, state.cp_rank, state.cp_size, state.dp_size, state.ep_rank, state.ep_size) == (None, 0, 1, 1,
                                                                                                      0, 1)
    assert state.dp_group is None and state.loss_group is not None
    assert strategy.meshes.world.mesh_dim_names == ("dp", "cp") and strategy.meshes.ep.size() == 1
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}
    assert all(isinstance(p, DTensor) for p in module.model.parameters())  # FSDP2 wrapped every parameter


def test_expert_parallel_dispatcher_is_installed(one_rank_group):
    _, module = _fit(DSV4Strategy(dispatcher="alltoall"))
    dispatchers = {type(m.dispatcher) for m in module.model.modules() if isinstance(m, MoE)}
    assert dispatchers == {AllToAllDispatcher}


def test_batches_move_whole(one_rank_group):
    strategy = DSV4Strategy()
    batch = TokenBatch(*(torch.ones(1, 8, dtype=torch.long) for _ in range(4)))
    moved = strategy.batch_to_device(batch, torch.device("cpu"))
    assert isinstance(moved, TokenBatch) and moved.shard.size == 1 and torch.equal(moved.input_ids, batch.input_ids)


def test_sizes_that_do_not_fit_the_world_are_refused(one_rank_group):
    with pytest.raises(ValueError, match=r"`cp`=2 does not divide the world size 1"):
        _fit(DSV4Strategy(cp=2))
