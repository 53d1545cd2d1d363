"""The indexer's KL loss (``model.indexer_loss_coeff``): the formula by hand, the teacher against a dense softmax,
where the gradients go, recompute, packed rows against their documents, and that training lowers it.

Oracles: a hand-computed KL; the dense attention probabilities (every key scored, masked, softmax with the sink);
the same documents run one per row; the model without recompute.
"""

import math

import pytest
import torch

from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM
from dsv4.model.indexer_loss import indexer_kl_sum
from dsv4.model.sparse_attention import sparse_attention
from tests.unit.model.test_sparse_attention import D, make_case

L = 512


def _model(**overrides):
    torch.manual_seed(0)
    return DSV4ForCausalLM(DSV4Config.preset("tiny", indexer_loss_coeff=0.5, index_topk=8, **overrides))


def _batch(length=L, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (1, length), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    return ids, labels


def test_kl_by_hand():
    teacher = torch.tensor([[0.3, 0.1, 0.0], [0.0, 0.0, 0.0]])  # query 1 selected nothing
    scores = torch.tensor([[0.0, 2.0, float("-inf")], [float("-inf")] * 3], requires_grad=True)
    got = indexer_kl_sum(teacher, scores)
    m = 0.4
    log_z = math.log(1.0 + math.e**2)
    expected = 0.3 * (math.log(0.3 / m) - (0.0 - log_z)) + 0.1 * (math.log(0.1 / m) - (2.0 - log_z))
    assert got.item() == pytest.approx(expected, rel=1e-6)
    got.backward()
    # d/dI_j = m * softmax_j - t_j on query 0; zero (not NaN) for the query without a selection
    soft = torch.softmax(torch.tensor([0.0, 2.0]), 0)
    torch.testing.assert_close(scores.grad[0, :2], m * soft - torch.tensor([0.3, 0.1]))
    assert torch.equal(scores.grad[1], torch.zeros(3)) and scores.grad[0, 2] == 0


def test_kl_is_zero_when_the_indexer_agrees_with_the_teacher():
    teacher = torch.tensor([[0.2, 0.2, 0.1]])
    assert indexer_kl_sum(teacher, torch.log(teacher)).abs().item() < 1e-7


@pytest.mark.parametrize("packed", [False, True])
def test_teacher_is_the_dense_softmax_over_selected_rows(packed):
    case = make_case(45, packed, 4, True)
    window = 6
    _, teacher = sparse_attention(
        case["q"], case["kv"], case["sink"], window=window, query_seq_ids=case["q_seq"], query_positions=case["q_pos"],
        kv_seq_ids=case["kv_seq"], kv_padding=case["kv_pad"], compressed=case["comp"],
        compressed_seq_ids=case["comp_seq"], compressed_positions=case["comp_pos"], ratio=4,
        topk_indices=case["topk"], chunk_size=7, compressed_probs=True)
    # dense: every window key and every compressed row scored, masked, softmax with the sink
    q, kv, comp, topk = case["q"], case["kv"], case["comp"], case["topk"]
    b, length, p = q.shape[0], q.shape[1], comp.shape[1]
    rows = torch.arange(length)
    band = (rows[None, :] <= rows[:, None]) & (rows[:, None] - rows[None, :] < window)
    same = (case["q_seq"][:, :, None] == case["kv_seq"][:, None, :]) & (case["q_seq"][:, :, None] > 0)
    allowed_kv = band[None] & same & ~case["kv_pad"][:, None, :]
    limit = torch.div(case["q_pos"] + 1, 4, rounding_mode="floor")
    rule = ((case["q_seq"][:, :, None] > 0) & (case["comp_seq"][:, None, :] == case["q_seq"][:, :, None])
            & (case["comp_pos"][:, None, :] < limit[:, :, None]))
    picked = torch.zeros(b, length, p, dtype=torch.bool)
    for bi in range(b):
        for qi in range(length):
            picked[bi, qi, [i for i in topk[bi, qi].tolist() if i >= 0]] = True
    allowed = torch.cat((allowed_kv, rule & picked), dim=-1)
    scores = torch.einsum("blhd,bkd->blhk", q, torch.cat((kv, comp), 1)) * D**-0.5
    scores = scores.masked_fill(~allowed[:, :, None, :], float("-inf"))
    sink = case["sink"].view(1, 1, -1, 1).expand(b, length, -1, 1)
    probs = torch.softmax(torch.cat((scores, sink), -1), -1)[..., kv.shape[1]:-1].mean(2)  # [B, L, P] head mean
    expected = torch.zeros_like(teacher)
    for bi in range(b):
        for qi in range(length):
            for slot, i in enumerate(topk[bi, qi].tolist()):
                if i >= 0:
                    expected[bi, qi, slot] = probs[bi, qi, i]
    torch.testing.assert_close(teacher, expected, atol=1e-6, rtol=1e-5)
    assert (teacher.sum(-1) < 1).all()  # the window and the sink keep their share


def test_gradients_reach_only_the_indexer_and_the_lm_loss_never_does():
    model = _model()
    ids, labels = _batch()
    out = model(ids, labels=labels)
    assert out.indexer_loss_sum is not None and out.indexer_loss_sum > 0
    expected = out.ce_loss_sum + 0.1 * torch.stack(out.mtp_loss_sums).mean() + 0.5 * out.indexer_loss_sum
    torch.testing.assert_close(out.loss_sum, expected)
    out.indexer_loss_sum.backward(retain_graph=True)
    touched = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    indexer = {n for n, _ in model.named_parameters() if ".indexer." in n}
    assert touched == indexer, sorted(touched ^ indexer)
    model.zero_grad(set_to_none=True)
    (out.ce_loss_sum + torch.stack(out.mtp_loss_sums).sum()).backward()
    assert all(p.grad is None or p.grad.abs().sum() == 0 for n, p in model.named_parameters() if n in indexer)
    assert any(p.grad is not None for n, p in model.named_parameters() if n not in indexer)


def test_frozen_indexer_without_the_loss():
    model = DSV4ForCausalLM(DSV4Config.preset("tiny"))
    assert all(not p.requires_grad for n, p in model.named_parameters() if ".indexer." in n)
    ids, labels = _batch(256)
    assert model(ids, labels=labels).indexer_loss_sum is None
    trained = _model()
    assert all(p.requires_grad for n, p in trained.named_parameters() if ".indexer." in n)
    with torch.no_grad():  # evaluation: no loss, no teacher
        assert trained(ids, labels=labels).indexer_loss_sum is None


def test_block_recompute_gives_the_same_loss_and_indexer_gradients():
    ids, labels = _batch()
    results = {}
    for mode in ("none", "block"):
        model = _model(activation_checkpointing=mode)
        out = model(ids, labels=labels)
        out.loss_sum.backward()
        results[mode] = (out.indexer_loss_sum.detach(),
                         {n: p.grad for n, p in model.named_parameters() if ".indexer." in n})
    torch.testing.assert_close(results["block"][0], results["none"][0], rtol=1e-6, atol=1e-6)
    for name, grad in results["none"][1].items():
        torch.testing.assert_close(results["block"][1][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_packed_row_equals_its_documents_run_alone():
    """The loss sum of a row of two documents equals the sum of each document's run (per-layer means match too:
    both runs average the same CSA layers)."""
    model = _model()
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(1, 256, (n,), generator=g) for n in (256, 384)]
    ids = torch.cat(docs)[None]
    seq = torch.cat([torch.full((n,), i + 1) for i, n in enumerate((256, 384))])[None]
    pos = torch.cat([torch.arange(n) for n in (256, 384)])[None]
    labels = torch.cat([torch.cat((d[1:], torch.tensor([-100]))) for d in docs])[None]
    packed = model(ids, position_ids=pos, packed_seq_ids=seq, labels=labels).indexer_loss_sum
    alone = sum(model(d[None], labels=torch.cat((d[1:], torch.tensor([-100])))[None]).indexer_loss_sum for d in docs)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-6)


def test_training_the_indexer_lowers_its_loss():
    model = _model()
    optimizer = torch.optim.AdamW([p for n, p in model.named_parameters() if ".indexer." in n], lr=1e-2)
    ids, labels = _batch()
    history = []
    for _ in range(8):
        optimizer.zero_grad()
        out = model(ids, labels=labels)
        out.indexer_loss_sum.backward()
        optimizer.step()
        history.append(out.indexer_loss_sum.item())
    assert history[-1] < 0.7 * history[0], history
