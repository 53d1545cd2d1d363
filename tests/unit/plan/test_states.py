"""Training-state bytes per rank: FSDP2's dim-0 chunks, EP slices, frozen parameters, the optimizer's state."""

import math

import pytest
import torch

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
    # torch's AdamW: one fp32 copy of every shard under foreach; per tensor two copies, and the previous tensor's
    # denom kept while the next one's is made
    assert temp == {"all": 4 * trainable, "per_tensor": 12 * largest, "none": 0}


@pytest.mark.parametrize("state_dtype,lora", [("float32", False), ("bfloat16", False), ("8bit", False),
                                              ("8bit", True)])
def test_optimizer_term_is_the_real_state_after_one_step(state_dtype, lora):
    """The plan's optimizer term (measured per shard size on the factory) equals the storage bytes of the real
    optimizer's state after one step of the tiny model: fp32 / bf16 moments, torchao's 8-bit codes, block scales
    and maps for the tensors of >= 4096 elements and a multiple of 256, fp32 for the others, and step counters;
    under LoRA the adapters' state only. The plan's step temporary equals the peak a second real step allocates
    (one tensor at a time: the largest tensor's temporaries; torchao's eager 8-bit update makes ~14 fp32 copies)."""
    from functools import partial

    from dsv4.peft import LoRAConfig, apply_lora
    from dsv4.plan.trace import AllocationTracer
    from dsv4.training.optimizer import adamw, optimizer_state_bytes

    factory = partial(adamw, lr=1e-3, betas=[0.9, 0.95], weight_decay=0.0, state_dtype=state_dtype)
    profile = optimizer_profile(factory)
    assert profile.state_dtype == state_dtype
    assert profile.state_bytes == {"float32": 8, "bfloat16": 4, "8bit": 2 * (1 + 4 / 256)}[state_dtype]
    meta, model = _meta_model(), DSV4ForCausalLM(DSV4Config.preset("tiny"))
    if lora:
        for m in (meta, model):
            apply_lora(m, LoRAConfig(rank=8))
    planned = state_bytes(meta, world=1, ep=1, compute_dtype=torch.float32, optimizer=profile)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = factory(trainable)
    for p in trainable:
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    assert optimizer_state_bytes(optimizer) == planned.optimizer
    with AllocationTracer() as tracer:
        optimizer.step()
    assert tracer.peak == planned.step_temporary
    largest = max(p.numel() for p in trainable)
    # fp32 copies of the largest tensor: torch's AdamW two and the previous tensor's denom, ours two (m and v),
    # torchao's eager 8-bit update (dequantised moments, their new values, the codes' indices, ...) about 14
    copies = planned.step_temporary / (4 * largest)
    assert {"float32": copies == 3, "bfloat16": copies == 2, "8bit": 14 <= copies <= 15}[state_dtype], copies
    if lora:  # the adapters alone, some of them (the experts' stacked adapters) in 8 bits
        assert len(optimizer.state) == len(trainable) < sum(1 for _ in model.parameters())
        assert any(type(s["exp_avg"]).__name__ == "OptimState8bit" for s in optimizer.state.values())
