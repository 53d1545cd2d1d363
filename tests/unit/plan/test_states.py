"""Training-state bytes per rank: FSDP2's dim-0 chunks, EP slices, frozen parameters, the optimizer's state."""

import math

import pytest
import torch
from torch import nn

from dsv4.config import DSV4Config
from dsv4.model.model import DSV4ForCausalLM
from dsv4.parallel.expert_shard import shard_experts
from dsv4.plan.states import OptimizerProfile, optimizer_profile, shard_elements, state_bytes


def _meta_model(**overrides):
    with torch.device("meta"):
        return DSV4ForCausalLM(DSV4Config.preset("tiny", **overrides))


def test_shard_elements_pads_dim0_chunks():
    assert shard_elements(torch.empty(10, 3, device="meta"), 4) == 3 * 3  # chunks of ceil(10 / 4) = 3 rows
    assert shard_elements(torch.empty(8, 5, device="meta"), 4) == 2 * 5
    assert shard_elements(torch.empty(3, device="meta"), 8) == 1  # fewer rows than ranks: one (padded) row each
    assert shard_elements(torch.empty((), device="meta"), 8) == 1


def test_one_rank_holds_everything_in_fp32():
    model = _meta_model()
    params = list(model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    s = state_bytes(model, world=1, ep=1, compute_dtype=torch.float32)
    assert s.parameters == 4 * sum(p.numel() for p in params) + buffers
    assert s.gradients == 4 * trainable and s.optimizer == 8 * trainable
    assert trainable < sum(p.numel() for p in params)  # the frozen indexer has neither gradients nor moments


def test_world_and_expert_parallel_sharding():
    model = _meta_model()
    shard_experts(model, ep_rank=0, ep_size=2)
    s = state_bytes(model, world=4, ep=2, compute_dtype=torch.bfloat16)
    expected = 0
    for name, p in model.named_parameters():
        size = 2 if ".experts." in name else 4  # experts: the EP slice, sharded over edp = world / ep
        expected += math.ceil(p.shape[0] / size) * (p.numel() // p.shape[0]) * 4 if p.dim() else 4
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert s.parameters == expected + buffers
    assert s.gathered > 0 and s.reduce_buffer > 0 and s.root_gathered > 0


@pytest.mark.parametrize("build,expected", [
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3), OptimizerProfile(8, "all")),
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False), OptimizerProfile(8, "per_tensor")),
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), OptimizerProfile(8, "none")),
    (lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9), OptimizerProfile(4, "all")),
    (lambda ps: torch.optim.SGD(ps, lr=1e-3), OptimizerProfile(0, "none")),
])
def test_optimizer_profile_is_measured_on_the_optimizer(build, expected):
    assert optimizer_profile(build) == expected


def test_step_temporary_follows_the_profile():
    model = _meta_model()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    largest = max(p.numel() for p in model.parameters() if p.requires_grad)
    temp = {kind: state_bytes(model, world=1, ep=1, compute_dtype=torch.float32,
                              optimizer=OptimizerProfile(8, kind)).step_temporary for kind in ("all", "per_tensor", "none")}
    assert temp == {"all": 4 * trainable, "per_tensor": 8 * largest, "none": 0}
