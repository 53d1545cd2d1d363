"""The DSpark drafter and its loss against the independent reference: NeMo Automodel 0.7.0's
``DeepseekV41DSparkModel`` and ``compute_dspark_loss`` (CPU, fp32, eager attention).

One module-scoped case: the drafter of ``v41_tiny`` (3 stages, blocks of 5, window 4, 8 experts top-2, Markov rank
16) with the reference's weights drawn well conditioned (tests/v41_reference.py) and copied into dsv4 by name; two
rows of 24 positions with random target features, fixed anchors: one at 0 (no context), one with a partial
window, whole windows, blocks whose labels pass the row end, a supervision hole inside a block, and an unused slot
(-1). Asserted: draft and confidence logits within 1e-5 of the largest; the four loss terms within 1e-5, without
and with the per-position decay; every drafter parameter's gradient within 1e-4 of its largest entry; the
acceptance estimates; and that the case is well conditioned (no routing choice near a tie, 1e-7 noise moves the
logits far less than the tolerance, the context, the Markov head and every stage move them far more).
"""

from __future__ import annotations

import pytest
import torch

from dsv4.config import DSV4Config
from dsv4.model.v41.drafter import DSparkDrafter
from dsv4.speculative import dspark_loss
from tests.v41_reference import build_drafter_reference, drafter_names, fixed_anchors

SEED = 2  # a conditioned draw (test_the_case_is_well_conditioned)
LOGIT_TOL = 1e-5  # of the largest |logit|
LOSS_TOL = 1e-5  # relative
GRAD_TOL = 1e-4  # of each tensor's largest |gradient|
LENGTH = 24
ANCHORS = torch.tensor([[0, 2, 9, -1], [5, 14, 21, 23]])
GAMMAS = (None, 4.0)


def _config():
    return DSV4Config.preset("v41_tiny", engram_layer_ids=[], engram_num_embeddings=[])


def _inputs(config):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, config.vocab_size, (2, LENGTH), generator=gen)
    features = torch.randn(2, LENGTH, 3 * config.hidden_size, generator=gen)
    last = torch.randn(2, LENGTH, config.hidden_size, generator=gen)
    mask = torch.ones(2, LENGTH, dtype=torch.bool)
    mask[0, 12] = False  # inside the block at 9: its slots 2.. are cut
    mask[1, :4] = False
    return ids, features, last, mask


@pytest.fixture(scope="module")
def case():
    from nemo_automodel.components.speculative.dspark.loss import compute_dspark_loss

    config = _config()
    ref = build_drafter_reference(config, SEED, ANCHORS.shape[1])
    model = DSparkDrafter(config).eval()
    model.load_state_dict(drafter_names(ref.state_dict()), strict=True)
    ids, features, last, mask = _inputs(config)
    out = {"config": config, "ref": ref, "model": model, "inputs": (ids, features, last, mask)}
    for gamma in GAMMAS:
        ref.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        with fixed_anchors(ANCHORS):
            ref_out = ref(ids, features, mask, last)
        loss, terms = compute_dspark_loss(outputs=ref_out, loss_decay_gamma=gamma, ce_loss_alpha=0.1,
                                          l1_loss_alpha=0.9, confidence_head_alpha=1.0, return_terms=True)
        loss.backward()
        got = model(ids, features, ANCHORS)
        ours = dspark_loss(got, ids, ANCHORS, last, mask, gamma=gamma)
        ours["loss"].backward()
        out[gamma] = {
            "ref_out": ref_out, "ref_loss": loss.detach(), "ref_terms": terms, "out": got, "terms": ours,
            "ref_grads": drafter_names({n: p.grad for n, p in ref.named_parameters() if p.grad is not None}),
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        }
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_draft_and_confidence_logits_equal_the_reference(case):
    run = case[None]
    got, ref = run["out"], run["ref_out"]
    assert got.draft_logits.shape == ref.draft_logits.shape == (2, 4, 5, case["config"].vocab_size)
    assert got.confidence_logits.shape == (2, 4, 5)
    assert _rel(got.draft_logits, ref.draft_logits) <= LOGIT_TOL
    assert _rel(got.confidence_logits, ref.confidence_pred) <= LOGIT_TOL


@pytest.mark.parametrize("gamma", GAMMAS)
def test_loss_terms_equal_the_reference(case, gamma):
    run = case[gamma]
    ours, ref = run["terms"], run["ref_terms"]
    pairs = {"loss": run["ref_loss"], "ce": ref["ce_loss"], "l1": ref["l1_loss"], "confidence": ref["confidence_loss"]}
    for name, expected in pairs.items():
        assert abs(ours[name].item() - expected.item()) <= LOSS_TOL * abs(expected.item()), (name, ours[name], expected)
    assert all(v.item() > 0 for v in pairs.values())  # every term counts in this case


@pytest.mark.parametrize("gamma", GAMMAS)
def test_every_gradient_equals_the_reference(case, gamma):
    run = case[gamma]
    got, ref = run["grads"], run["ref_grads"]
    trainable = {n for n, p in case["model"].named_parameters() if p.requires_grad}
    assert set(got) == set(ref) == trainable, sorted(set(got) ^ set(ref))
    assert "embed_tokens.weight" not in got and "lm_head.weight" not in got  # the frozen copies
    for part in ("attn_hc.fn", "self_attn.sink.logits", "mlp.experts.w2", "main_proj.weight", "markov_head.embed.weight",
                 "confidence_head.proj.weight", "mlp.gate.weight"):
        assert any(n.endswith(part) for n in got), part
    bad = {n: _rel(got[n], ref[n]) for n in ref if _rel(got[n], ref[n]) > GRAD_TOL}
    assert not bad, bad


def test_acceptance_estimates_equal_the_reference(case):
    for gamma in GAMMAS:
        ours, ref = case[gamma]["terms"], case[gamma]["ref_terms"]
        torch.testing.assert_close(ours["accept_rate"], ref["accept_rate_per_pos_num"] / ref["accept_rate_per_pos_den"],
                                   rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours["tau"], ref["tau_num"] / ref["tau_den"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ours["confidence_abs_error"],
                                   ref["confidence_abs_error_num"] / ref["confidence_diag_den"], rtol=1e-5, atol=1e-6)


def _gaps(model, inputs) -> list[float]:
    """The smallest relative gap between the k-th and (k+1)-th routing score of every stage's gate."""
    gaps = []

    def routing(gate, args):
        scores = torch.nn.functional.softplus(args[0].float() @ gate.weight.float().t()).sqrt()
        values = (scores + gate.e_score_correction_bias).sort(dim=-1, descending=True).values
        gaps.append(((values[:, gate.top_k - 1] - values[:, gate.top_k]).min() / values.abs().max()).item())

    handles = [stage.mlp.gate.register_forward_pre_hook(routing) for stage in model.layers]
    try:
        with torch.no_grad():
            model(inputs[0], inputs[1], ANCHORS)
    finally:
        [h.remove() for h in handles]
    return gaps


def test_the_case_is_well_conditioned(case):
    """No routing choice within 1e-4 (relative) of a tie; noise of 1e-7 (relative) on every stage's streams and on
    the features moves the draft logits by less than a tenth of the tolerance (no FP8 rounding or routing choice
    flips); silencing the context, the Markov bias or any stage moves them by far more; the fp32 gradients lie
    within a quarter of the tolerance of a float64 run of the same weights (hyper-connection ``scale`` / ``base``
    gradients are sums with much cancellation: with seed 11 the reference's fp32 rounding alone moves one by 4e-4,
    dsv4's by 6e-5)."""
    model, (ids, features, _, _) = case["model"], case["inputs"]
    base = case[None]["out"].draft_logits
    gaps = _gaps(model, case["inputs"])
    assert len(gaps) == 3 and min(gaps) > 1e-4, gaps
    gen = torch.Generator().manual_seed(5)

    def noisy(x: torch.Tensor) -> torch.Tensor:
        return x + 1e-7 * x.abs().amax() * torch.randn(x.shape, generator=gen)

    def moved(hooks, feats=features) -> float:
        handles = [module.register_forward_hook(hook) if kind == "post" else module.register_forward_pre_hook(hook)
                   for kind, module, hook in hooks]
        try:
            with torch.no_grad():
                return _rel(model(ids, feats, ANCHORS).draft_logits, base)
        finally:
            [h.remove() for h in handles]

    noise = [("pre", stage, lambda _m, args: (noisy(args[0]),) + args[1:]) for stage in model.layers]
    assert moved(noise, noisy(features)) < LOGIT_TOL / 10
    assert moved([], torch.zeros_like(features)) > 1e-3  # the context
    assert moved([("post", model.last.markov_head, lambda _m, _a, out: (torch.zeros_like(out[0]), out[1]))]) > 1e-3
    for stage in model.layers:
        assert moved([("post", stage.self_attn, lambda _m, _a, out: torch.zeros_like(out))]) > 1e-3
    double = DSparkDrafter(case["config"]).double().eval()
    double.load_state_dict(model.state_dict())
    ids, features, last, mask = case["inputs"]
    dspark_loss(double(ids, features.double(), ANCHORS), ids, ANCHORS, last.double(), mask)["loss"].backward()
    grads = case[None]["grads"]
    worst = max(_rel(grads[n], p.grad.float()) for n, p in double.named_parameters() if p.grad is not None)
    assert worst < GRAD_TOL / 4, worst


def test_a_bfloat16_drafter_takes_the_float32_target_features(case):
    """Under FSDP2 mixed precision the drafter computes in bf16 while the frozen target hands it fp32 features: the
    projection reads them in its own dtype, as if they had come in bf16."""
    import copy

    model = copy.deepcopy(case["model"]).to(torch.bfloat16)
    ids, features, _, _ = case["inputs"]
    with torch.no_grad():
        got = model(ids, features, ANCHORS)
        want = model(ids, features.to(torch.bfloat16), ANCHORS)
    assert got.draft_logits.dtype == torch.float32
    assert torch.equal(got.draft_logits, want.draft_logits)
    assert torch.equal(got.confidence_logits, want.confidence_logits)
