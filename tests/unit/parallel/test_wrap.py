"""FSDP2 wrapping on one gloo rank: mixed precision computes in bf16 with fp32 master weights, keeps the fp32
modules fp32, and stays close to the fp32 run."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM
from dsv4.parallel.mesh import ParallelDims, build_meshes
from dsv4.parallel.wrap import FP32_MODULES, apply_fsdp


def _step(compute_dtype):
    torch.manual_seed(0)
    model = DSV4ForCausalLM(DSV4Config.preset("tiny"))
    apply_fsdp(model, build_meshes(ParallelDims(world_size=1), "cpu"), compute_dtype=compute_dtype)
    seen = {}

    def record(module, args):  # after FSDP's own pre-forward hook: the parameters as the forward uses them
        for name, p in module.named_parameters(recurse=False):
            seen[f"{type(module).__name__.removeprefix('FSDP')}.{name}"] = p.dtype

    hooks = [m.register_forward_pre_hook(record) for m in model.modules()]
    ids = torch.randint(1, 256, (2, 256), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, 1)
    out = model(ids, labels=labels, return_logits=False)
    out.loss.backward()
    for h in hooks:
        h.remove()
    grads = torch.cat([p.grad.to_local().reshape(-1) for p in model.parameters() if p.grad is not None])
    return model, out.loss.detach(), grads, seen


def test_bf16_compute_fp32_master_and_fp32_modules(one_rank_group):
    model, loss, grads, seen = _step(torch.bfloat16)
    fp32_kinds = {cls.__name__ for cls in FP32_MODULES}
    assert seen["Linear.weight"] == torch.bfloat16 and seen["GroupedExperts.w1"] == torch.bfloat16
    for name, dtype in seen.items():
        if name.split(".")[0] in fp32_kinds:
            assert dtype == torch.float32, name  # compressors, hyper-connections, sinks compute in fp32
    for p in model.parameters():  # master weights and their gradients stay fp32
        assert isinstance(p, DTensor) and p.dtype == torch.float32
        assert p.grad is None or p.grad.dtype == torch.float32
    ref_model, ref_loss, ref_grads, ref_seen = _step(torch.float32)
    assert all(dtype == torch.float32 for dtype in ref_seen.values())
    # bf16 has 8 significant bits: the loss agrees to 1%, the gradient direction to cosine 0.99
    assert abs(loss - ref_loss) / ref_loss < 1e-2, (loss, ref_loss)
    cosine = torch.nn.functional.cosine_similarity(grads, ref_grads, dim=0)
    assert cosine > 0.99, cosine


def test_indexer_loss_and_gradients_survive_fsdp(one_rank_group):
    """Every CSA layer's indexer loss reaches the output and its gradients the sharded parameters under FSDP2 (whose
    hooks may hand a block a copy of its arguments: the layers keep their loss on themselves, not in the metadata)."""
    config = DSV4Config.preset("tiny", indexer_loss_coeff=0.5, index_topk=8)
    ids = torch.randint(1, 256, (1, 256), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, 1)
    results = []
    for wrap in (False, True):
        torch.manual_seed(0)
        model = DSV4ForCausalLM(config)
        if wrap:
            apply_fsdp(model, build_meshes(ParallelDims(world_size=1), "cpu"))
        out = model(ids, labels=labels, return_logits=False)
        out.loss_sum.backward()
        grads = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
                 for n, p in model.named_parameters() if ".indexer." in n and p.grad is not None}
        results.append((out.indexer_loss_sum.detach(), grads))
    (plain_loss, plain_grads), (fsdp_loss, fsdp_grads) = results
    torch.testing.assert_close(fsdp_loss, plain_loss)
    assert len(plain_grads) == 12 and fsdp_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fsdp_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
