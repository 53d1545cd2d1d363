"""The memory plan's optimizer term against FSDP2 on 2 gloo ranks: after one real step of the tiny model sharded
over both ranks, rank 0 (the larger dim-0 chunks) holds exactly the planned optimizer state bytes, for fp32, bf16 and
8-bit moments (a tensor of >= 4096 elements whose shard is smaller stays fp32 under torchao's rule)."""

from functools import partial

import pytest
import torch

from dsv4.launch import run_on_ranks

pytestmark = pytest.mark.distributed
DTYPES = ("float32", "bfloat16", "8bit")


def _factory(state_dtype):
    from dsv4.training.optimizer import adamw

    return partial(adamw, lr=1e-3, betas=[0.9, 0.95], weight_decay=0.0, state_dtype=state_dtype)


def _rank(rank, world_size):
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM
    from dsv4.parallel.mesh import ParallelDims, build_meshes
    from dsv4.parallel.wrap import apply_fsdp
    from dsv4.training.optimizer import optimizer_state_bytes

    meshes = build_meshes(ParallelDims(world_size=world_size, cp=1), "cpu")
    out = {}
    for state_dtype in DTYPES:
        torch.manual_seed(0)
        model = apply_fsdp(DSV4ForCausalLM(DSV4Config.preset("tiny")), meshes)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = _factory(state_dtype)(trainable)
        for p in trainable:
            p.grad = torch.full_like(p, 1e-3)
        optimizer.step()
        out[state_dtype] = optimizer_state_bytes(optimizer)
    return out


def test_fsdp2_rank_state_is_the_planned_optimizer_term():
    from dsv4.config import DSV4Config
    from dsv4.model.model import DSV4ForCausalLM
    from dsv4.plan.states import optimizer_profile, state_bytes

    with torch.device("meta"):
        model = DSV4ForCausalLM(DSV4Config.preset("tiny"))
    results = run_on_ranks(_rank, 2)
    for state_dtype in DTYPES:
        planned = state_bytes(model, world=2, ep=1, compute_dtype=torch.float32,
                              optimizer=optimizer_profile(_factory(state_dtype))).optimizer
        assert results[0][state_dtype] == planned, state_dtype
        assert results[1][state_dtype] <= planned, state_dtype
