"""The indexer loss under context parallelism: CP 2 and CP 4 on gloo equal CP 1 (the loss and every indexer
gradient).

The packed rows of ``test_cp_parity`` (a document across rank boundaries, one shorter than the window, a rank
holding only padding); tiny preset with ``indexer_loss_coeff`` 0.5 and ``index_topk`` 8, so selections are real
subsets. Each rank reduces ``(indexer_loss_sum, label_count)`` over the CP group like the LM loss and
backpropagates its share; the indexer gradients summed over ranks must equal the single-process ones (earlier
windows' index keys come from their owners, and their gradients go back to them).
"""

import pytest
import torch
import torch.distributed as dist

from dsv4.launch import run_on_ranks
from tests.distributed.test_cp_parity import _packed_batch, packed_reference

pytestmark = pytest.mark.distributed


def _model():
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM

    torch.manual_seed(0)
    return DSV4ForCausalLM(DSV4Config.preset("tiny", indexer_loss_coeff=0.5, index_topk=8))


def _indexer_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if ".indexer." in n and p.grad is not None}


def _body(rank, world_size):
    from dsv4.cp import CPContext, dsv4_cp_sharder
    from dsv4.training.loss import reduce_token_loss

    group = dist.new_group(list(range(world_size)))
    model = _model()
    _, local = dsv4_cp_sharder(model.config, group).shard(_packed_batch())
    out = model(**local, cp=CPContext(group))
    indexer = reduce_token_loss(out.indexer_loss_sum, out.label_count, group)
    total = reduce_token_loss(out.loss_sum, out.label_count, group)
    total.loss.backward()
    return {"indexer_loss": indexer.value, "loss": total.value, "grads": _indexer_grads(model)}


def _reference():
    model = _model()
    out, _ = packed_reference(model)
    out.loss.backward()
    count = out.label_count.clamp_min(1)
    return out.indexer_loss_sum.detach() / count, out.loss.detach(), _indexer_grads(model)


@pytest.mark.parametrize("world_size", [2, 4])
def test_indexer_loss_and_gradients_under_cp_equal_one_rank(world_size):
    results = run_on_ranks(_body, world_size)
    ref_indexer, ref_loss, ref_grads = _reference()
    assert ref_indexer > 0 and len(ref_grads) == 12  # two CSA layers x six indexer tensors
    for res in results:
        torch.testing.assert_close(res["indexer_loss"], ref_indexer.to(res["indexer_loss"].dtype), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(res["loss"], ref_loss.to(res["loss"].dtype), atol=1e-6, rtol=0)
    for name, ref in ref_grads.items():
        total = sum(r["grads"][name] for r in results if name in r["grads"])
        err = ((total - ref).norm() / ref.norm().clamp_min(1e-12)).item()
        assert err < 1e-4, f"{name}: relative gradient error {err:.2e}"
