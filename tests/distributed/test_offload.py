"""Host offload (FSDP2's CPU offload policy) on 2 gloo ranks with EP 2 (alltoall; experts on the edp mesh).

One run per rank of three AdamW steps with gradient clipping, wrapped without and with ``offload``: the same losses,
gradient norms and parameters (on CPU the host is the device, so the numbers must not change); the same for a LoRA
model computing in bf16 (frozen base shards stored in bf16, trainable adapters with fp32 masters). After the offloaded
step, what FSDP recorded (the policy on every unit, ``offload_to_cpu`` on every sharded parameter, no pinning
without CUDA), where the shards, gradients and optimizer state are, and their bytes against the memory plan's
host term for the same layout (rank 0, the rank the plan plans).
"""

import pytest
import torch

from dsv4.launch import run_on_ranks

pytestmark = pytest.mark.distributed

STEPS = 3


def _run(rank, world_size, offload, lora=False):
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM
    from dsv4.parallel.expert_shard import apply_expert_parallel
    from dsv4.parallel.mesh import ParallelDims, build_meshes
    from dsv4.parallel.wrap import apply_fsdp, clip_grad_norm_, offload_policies

    meshes = build_meshes(ParallelDims(world_size=world_size, cp=2, ep=2), "cpu")
    torch.manual_seed(0)
    model = DSV4ForCausalLM(DSV4Config.preset("tiny"))
    if lora:
        from dsv4.peft import LoRAConfig, adapter_state, apply_lora

        apply_lora(model, LoRAConfig(rank=4, alpha=8.0))
        with torch.no_grad():  # B starts at zero: give every adapter a gradient from the first step
            for p in adapter_state(model).values():
                p.normal_(0, 0.05)
    apply_expert_parallel(model, "alltoall", meshes.ep.get_group(), "cpu")
    apply_fsdp(model, meshes, offload=offload, compute_dtype=torch.bfloat16 if lora else torch.float32)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(100 + rank)
    losses, norms = [], []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        ids = torch.randint(0, 256, (1, 128), generator=g)
        out = model(ids, labels=ids.roll(-1, dims=1), return_logits=False)
        out.loss.backward()
        norms.append(clip_grad_norm_(model.parameters(), 0.5))
        optimizer.step()
        losses.append(out.loss.detach())
    params = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    result = {"losses": torch.stack(losses), "norms": torch.stack(norms), "params": params}
    if offload and not lora:
        fsdp_params = [fp for m in model.modules() if isinstance(m, FSDPModule)
                       for group in [m._get_fsdp_state()._fsdp_param_group] if group is not None
                       for fp in group.fsdp_params]
        states = [t.to_local() if isinstance(t, DTensor) else t for s in optimizer.state.values()
                  for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0]  # the moments, not the steps
        grads = [p.grad.to_local() for p in model.parameters() if p.grad is not None]
        result.update(
            policies=[type(p).__name__ for p in offload_policies(model)],
            units=sum(isinstance(m, FSDPModule) for m in model.modules()),
            offload_to_cpu=all(fp.offload_to_cpu for fp in fsdp_params),
            pinned=any(fp.pin_memory for fp in fsdp_params),
            devices={t.device.type for t in [*params.values(), *grads, *states]},
            buffer_devices={b.device.type for b in model.buffers()},
            parameter_bytes=sum(p.to_local().numel() * p.element_size() for p in model.parameters()),
            gradient_bytes=sum(t.numel() * t.element_size() for t in grads),
            optimizer_bytes=sum(t.numel() * t.element_size() for t in states),
        )
    return result


def _body(rank, world_size):
    return {"none": _run(rank, world_size, False), "offload": _run(rank, world_size, True),
            "lora_none": _run(rank, world_size, False, lora=True),
            "lora_offload": _run(rank, world_size, True, lora=True)}


@pytest.fixture(scope="module")
def two_ranks():
    return run_on_ranks(_body, 2)


@pytest.mark.parametrize("model", ["full", "lora_bf16"])
def test_offload_gives_the_same_steps(two_ranks, model):
    prefix = "" if model == "full" else "lora_"
    for rank, res in enumerate(two_ranks):
        plain, host = res[prefix + "none"], res[prefix + "offload"]
        assert torch.equal(host["losses"], plain["losses"]), (rank, host["losses"], plain["losses"])
        assert torch.equal(host["norms"], plain["norms"]), (rank, host["norms"], plain["norms"])
        assert (plain["norms"] > 0.5).all()  # clipping acted on every step
        assert host["params"].keys() == plain["params"].keys()
        for name, value in plain["params"].items():
            assert torch.equal(host["params"][name], value), (rank, name)


def test_fsdp_records_the_offload_and_the_plan_counts_its_bytes(two_ranks):
    from dsv4.config import DSV4Config
    from dsv4.plan.plan import GIB, PlanSetup, memory_plan

    for res in two_ranks:
        host = res["offload"]
        assert host["policies"] == ["CPUOffloadPolicy"] * host["units"]  # every unit holds parameters
        assert host["offload_to_cpu"] and not host["pinned"]  # no CUDA here: nothing pinned
        assert host["devices"] == {"cpu"} and host["buffer_devices"] == {"cpu"}
    rank0 = two_ranks[0]["offload"]
    plan = memory_plan(PlanSetup(DSV4Config.preset("tiny"), seq_len=256, cp=2, ep=2, device_memory_bytes=GIB,
                                 offload="optimizer"))
    o = plan.offload
    assert (o.parameters, o.gradients, o.optimizer) == (
        rank0["parameter_bytes"], rank0["gradient_bytes"], rank0["optimizer_bytes"])
    assert plan.host_offload_bytes == rank0["parameter_bytes"] + rank0["gradient_bytes"] + rank0["optimizer_bytes"]
