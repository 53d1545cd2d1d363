"""LoRA under parallelism on gloo: CP 2 equals CP 1 and EP 2 (alltoall) equals the local experts.

The model is the tiny preset with LoRA r=4 on every target and the base kept in FP8 / FP4 (``base_dtype=fp8``,
the path with the most machinery: kept buffers, re-dequantisation in backward, per-expert adapters sliced with
their experts). Adapters get random values so that every A and B has a gradient. Oracle: the same model in one
process.

* CP: the packed rows of ``test_cp_parity`` (a document across the rank boundary, one shorter than the window, a
  rank holding only padding). Asserted: the token-mean loss, and each adapter gradient summed over ranks.
* EP: every rank its own tokens; the owner's expert-adapter gradient equals the matching slice of the local run's
  gradients summed over the EP group; attention / shared-expert adapter gradients equal per rank.
"""

import copy

import pytest
import torch
import torch.distributed as dist

from dsv4.launch import run_on_ranks
from tests.distributed.test_cp_parity import _packed_batch, packed_reference

pytestmark = pytest.mark.distributed

LORA = dict(rank=4, alpha=8.0, base_dtype="fp8")


def _lora_model():
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM
    from dsv4.peft import LoRAConfig, adapter_state, apply_lora

    torch.manual_seed(0)
    model = DSV4ForCausalLM(DSV4Config.preset("tiny"))
    apply_lora(model, LoRAConfig(**LORA))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in adapter_state(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _adapter_grads(model):
    from dsv4.peft import adapter_state

    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for n, p in adapter_state(model).items()}


def _cp_part(world_size):
    from dsv4.cp import CPContext, dsv4_cp_sharder
    from dsv4.training.loss import reduce_token_loss

    group = dist.new_group(list(range(world_size)))
    model = _lora_model()
    _, local = dsv4_cp_sharder(model.config, group).shard(_packed_batch())
    out = model(**local, cp=CPContext(group))
    loss = reduce_token_loss(out.loss_sum, out.label_count, group)
    loss.loss.backward()
    return {"loss": loss.value.detach(), "grads": _adapter_grads(model)}


def _ep_part(rank, world_size):
    from dsv4.model.moe import set_dispatcher
    from dsv4.parallel.dispatch import build_dispatcher
    from dsv4.parallel.expert_shard import shard_experts

    base = _lora_model()
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(0, 256, (1, 128), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    group = dist.new_group(list(range(world_size)))
    out = {}
    for name in ("local", "alltoall"):
        model = copy.deepcopy(base)
        if name != "local":
            shard_experts(model, group)
            set_dispatcher(model, build_dispatcher(name, group))
        res = model(ids, labels=labels)
        res.loss.backward()
        out[name] = {"logits": res.logits.detach(), "loss": res.loss.detach(), "grads": _adapter_grads(model)}
    return out


def _body(rank, world_size):
    return {"cp": _cp_part(world_size), "ep": _ep_part(rank, world_size)}


@pytest.fixture(scope="module")
def two_ranks():
    return run_on_ranks(_body, 2)


def test_lora_cp2_equals_cp1(two_ranks):
    model = _lora_model()
    out, _ = packed_reference(model)
    out.loss.backward()
    reference = _adapter_grads(model)
    results = [r["cp"] for r in two_ranks]
    for res in results:
        torch.testing.assert_close(res["loss"], out.loss.detach(), atol=1e-6, rtol=0)
    # 5 blocks (4 + MTP) x (5 attention + 3 shared + 3 stacked routed projections) x (A, B)
    assert set(results[0]["grads"]) == set(reference) and len(reference) == 110
    for name, ref in reference.items():
        total = sum(r["grads"][name] for r in results)
        err = ((total - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        assert err < 1e-4 or (total - ref).abs().max() < 1e-9, f"{name}: relative gradient error {err:.2e}"


def test_lora_ep2_alltoall_equals_local(two_ranks):
    results = [r["ep"] for r in two_ranks]
    for rank, res in enumerate(results):
        local, ep = res["local"], res["alltoall"]
        torch.testing.assert_close(ep["logits"], local["logits"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ep["loss"], local["loss"], atol=1e-6, rtol=0)
        for name, grad in ep["grads"].items():
            if ".experts." in name:  # this rank's 4 experts; their gradient sums both ranks' tokens
                expected = sum(results[s]["local"]["grads"][name][4 * rank: 4 * rank + 4] for s in range(2))
                assert grad.shape[0] == 4
            else:
                expected = local["grads"][name]
            torch.testing.assert_close(grad, expected, atol=1e-5, rtol=1e-5, msg=f"rank {rank} {name}")
