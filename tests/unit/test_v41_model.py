"""DeepSeek-V4.1 in dsv4 against the independent reference (NeMo Automodel 0.7.0's ``deepseek_v41``, CPU, fp32).

One module-scoped case: the tiny V4.1 (``v41_tiny`` on a small BPE tokenizer: every attention role, window 0-1,
Full 2/4/6, Reuse 3/5/7/9/11, Reindex 8/10 inside layer 6's candidate blocks; Engram at 1 and 4) with
well-conditioned weights (tests/v41_reference.py) copied into dsv4 by name. Asserted: logits of an unpacked odd-length row and of a packed
row of uneven documents (``seq_lens`` and dsv4's own aligned ``packed_seq_ids`` / ``position_ids``) within 1e-5 of
the largest logit; gradients of a loss within 1e-4 (per tensor, relative to its largest entry), hyper-connection
parameters and Engram's ``wkv`` included; the DSpark target features (and those of Engram layer 4: after its update); the fake quantisation bit for bit; a packed row equals its
documents run alone; a second forward of the same model on other tokens of the first row's shape equals the
reference on them (no selection or shared state kept from an earlier forward); and that the case is well
conditioned (no near top-k tie, 1e-7 noise moves logits far less than the tolerance, every role, Engram and the
hyper-connections move them far more).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4.model import build_causal_lm
from dsv4.model.v41.indexer import CSA2Indexer
from dsv4.packing import aligned_packed_layout
from tests.v41_reference import build_reference, dsv4_names, engram_tokenizer, load_into, tiny_config

SEED = 13  # a conditioned draw (test_the_case_is_well_conditioned); several others are not
LOGIT_TOL = 1e-5  # of the largest |logit|
GRAD_TOL = 1e-4  # of each tensor's largest |gradient|
UNPACKED_LEN = 23
DOCS = [11, 6, 7]  # a packed row of uneven documents; the second ends on the alignment, no pad before the third
TARGETS = [4, 9, 10, 11]  # v41_tiny's dspark_target_layer_ids and Engram layer 4
VOCAB = 300  # the test tokenizer's (image_token_id 383 lies outside it)


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def _loss_weights(shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(7))


def _differ(a: torch.Tensor, b: torch.Tensor, tol: float) -> str:
    """The error and the share of positions whose logits differ by more than ``tol`` (relative)."""
    scale = b.abs().max()
    err = (a - b).abs() / scale
    bad = (err.amax(-1) > tol).float().mean().item()
    return f"max error {err.max().item():.3g} of the largest logit; {bad:.0%} of positions differ"


def _features(modules):
    store = {}
    handles = [m.register_forward_pre_hook(lambda mod, args, i=i: store.__setitem__(i, args[0].detach().clone()))
               for i, m in zip(TARGETS, modules)]
    return store, handles


@pytest.fixture(scope="module")
def case():
    tokenizer = engram_tokenizer()
    config = tiny_config(tokenizer, engram_trainable=True)  # the reference trains its tables: compare their grads
    assert config.vocab_size == VOCAB and config.dspark_target_layer_ids == TARGETS[1:]
    ref = build_reference(config, SEED, tokenizer)
    model = build_causal_lm(config, tokenizer=tokenizer).eval()
    load_into(model, ref)
    out = {"config": config, "ref": ref, "model": model, "tokenizer": tokenizer}
    ids = _ids(UNPACKED_LEN, 1)
    weights = _loss_weights((1, UNPACKED_LEN, config.vocab_size))
    # unpacked: logits, features, gradients of one loss, both models
    ref_feats, handles = _features(ref.get_dspark_target_feature_modules(TARGETS))
    logits = ref(ids).logits
    (logits * weights).sum().backward()
    [h.remove() for h in handles]
    out["ref_logits"], out["ref_feats"] = logits.detach(), ref_feats
    out["ref_grads"] = dsv4_names({n: p.grad for n, p in ref.named_parameters() if p.grad is not None})
    feats, handles = _features(model.feature_modules(TARGETS))
    logits = model(ids).logits
    (logits * weights).sum().backward()
    [h.remove() for h in handles]
    out["logits"], out["feats"] = logits.detach(), feats
    out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    out["ids"] = ids
    # packed: the reference with seq_lens, dsv4 with seq_lens and with its own aligned packed arguments
    pids, lens = _ids(sum(DOCS), 2), torch.tensor([DOCS])
    with torch.no_grad():
        out["ref_packed"] = ref(pids, seq_lens=lens).logits
        out["packed_seq_lens"] = model(pids, seq_lens=lens).logits
        layout = aligned_packed_layout(lens, tuple(pids.shape), config.shard_multiple)
        aligned = model(layout.pack(pids, fill=0), position_ids=layout.position_ids,
                        packed_seq_ids=layout.sequence_ids, padding_mask=layout.padding_mask).logits
        out["packed_own"] = layout.restore(aligned)
    out["pids"] = pids
    return out


def test_unpacked_logits_equal_the_reference(case):
    ref, got = case["ref_logits"], case["logits"]
    assert ref.shape == got.shape == (1, UNPACKED_LEN, VOCAB)
    assert ((got - ref).abs().max() <= LOGIT_TOL * ref.abs().max()), _differ(got, ref, LOGIT_TOL)


def test_packed_logits_equal_the_reference(case):
    ref = case["ref_packed"]
    for name in ("packed_seq_lens", "packed_own"):
        got = case[name]
        assert got.shape == ref.shape == (1, sum(DOCS), VOCAB)
        assert (got - ref).abs().max() <= LOGIT_TOL * ref.abs().max(), f"{name}: {_differ(got, ref, LOGIT_TOL)}"


def test_gradients_equal_the_reference(case):
    """Per tensor within 1e-4 of its largest entry. The closest are the hyper-connection ``scale`` gradients
    (three sums over every token and mix with much cancellation): fp32 rounding alone moves them by ~1e-4 (both
    implementations differ from a float64 run of dsv4 by about that), every other tensor agrees within 5e-5."""
    ref, got = case["ref_grads"], case["grads"]
    assert set(got) == set(ref), (sorted(set(got) ^ set(ref)))
    for part in ("attn_hc.fn", "ffn_hc.base", "compressor.wgate.weight", "engram.wkv.weight", "engram.q_weight"):
        assert any(n.endswith(part) for n in got), part
    assert any(n.endswith("engram.embed.weight") for n in got)
    assert not any(".indexer." in n for n in got)  # frozen in both
    bad = {n: ((got[n] - ref[n]).abs().max() / ref[n].abs().max()).item() for n in ref
           if (got[n] - ref[n]).abs().max() > GRAD_TOL * ref[n].abs().max()}
    assert not bad, bad


def test_dspark_target_features_equal_the_reference(case):
    for i in TARGETS:
        ref, got = case["ref_feats"][i], case["feats"][i]
        assert got.shape == ref.shape == (1, UNPACKED_LEN, 4, 64)
        assert (got - ref).abs().max() <= LOGIT_TOL * ref.abs().max(), i


def test_fake_quantisation_is_the_reference_rounding_bit_for_bit():
    from nemo_automodel.components.models.deepseek_v41.quantization import quantize_cache

    from dsv4.model.fake_quant import fake_quant_fp4, fake_quant_fp8

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 3, 64, generator=gen) * torch.logspace(-3, 3, 8)[:, None, None]
    x[0, 0, :32] = torch.arange(32) * 0.25  # every E2M1 midpoint, in one block of scale 1
    x[1, 0, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0]) * 2.0**-4
    assert torch.equal(fake_quant_fp8(x, 32), quantize_cache(x, format="fp8", block_size=32))
    assert torch.equal(fake_quant_fp4(x, 16, "e4m3"), quantize_cache(x, format="nvfp4", block_size=16))
    assert torch.equal(fake_quant_fp4(x, 32, "pow2"), quantize_cache(x, format="mxfp4", block_size=32))
    assert not torch.equal(fake_quant_fp4(x, 32, "pow2"), x)
    leaf = x.clone().requires_grad_()
    fake_quant_fp8(leaf, 32).backward(x)  # straight through
    assert torch.equal(leaf.grad, x)


def _selections(model, ids) -> dict[int, torch.Tensor]:
    """The top-k selection each Full and Reindex layer publishes in the shared state for ``ids``."""
    found = {}
    handles = [layer.self_attn.register_forward_hook(
        lambda _module, _args, out, i=i: found.__setitem__(i, out[1].topk.clone()))
        for i, layer in enumerate(model.model.layers) if layer.self_attn.indexer is not None]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        [h.remove() for h in handles]
    return found


def test_a_second_forward_with_new_tokens_of_the_same_shape_equals_the_reference(case):
    """The same model object, after the case's forwards (the first of them on ``ids`` of this very shape), on other
    token ids of the same shape: the reference's logits for those tokens. Nothing of an earlier forward's selection or
    shared state may survive into the next (e.g. a Reuse or Reindex layer keeping a top-k cached by shape). The new
    tokens make other selections than the first ids in every Full and Reindex layer, and are as well conditioned as
    the case (no top-k choice within 1e-5 of a tie)."""
    model, ref, first = case["model"], case["ref"], case["ids"]
    new = _ids(UNPACKED_LEN, 3)
    assert new.shape == first.shape and not torch.equal(new, first)
    with torch.no_grad():
        want = ref(new).logits
        model(first)  # the first shape's tokens again, right before
        got = model(new).logits
    assert got.shape == want.shape == (1, UNPACKED_LEN, VOCAB)
    assert (got - want).abs().max() <= LOGIT_TOL * want.abs().max(), _differ(got, want, LOGIT_TOL)
    # the case: other logits, other selections everywhere, no near tie
    assert (want - case["ref_logits"]).abs().max() > 100 * LOGIT_TOL * want.abs().max()
    before, after = _selections(model, first), _selections(model, new)
    assert sorted(before) == [2, 4, 6, 8, 10]  # Full 2/4/6, Reindex 8/10
    for i in before:
        assert before[i].shape == after[i].shape and not torch.equal(before[i], after[i]), i
    gaps = _top_gaps(model, new)
    assert len(gaps) == 5 + 1 + 12 and min(gaps) > 1e-5, min(gaps)


def test_packed_row_equals_its_documents_run_alone(case):
    model, pids, packed = case["model"], case["pids"], case["packed_seq_lens"]
    start = 0
    with torch.no_grad():
        for n in DOCS:
            alone = model(pids[:, start:start + n]).logits
            part = packed[:, start:start + n]
            assert (part - alone).abs().max() <= LOGIT_TOL * alone.abs().max(), (n, _differ(part, alone, LOGIT_TOL))
            start += n


def _top_gaps(model, ids, **kwargs) -> list[float]:
    """The smallest relative gap between the k-th and (k+1)-th score of every top-k choice of a forward: the
    indexer selections and candidate blocks, and the MoE routing."""
    gaps = []
    original = CSA2Indexer.top

    def recording(scores, k):
        finite = scores.masked_fill(torch.isposinf(scores), float("nan"))
        scale = finite.nan_to_num(0.0, neginf=0.0).abs().amax()
        values = scores.sort(dim=-1, descending=True).values
        if values.shape[-1] > k:
            kth, nxt = values[..., k - 1], values[..., k]
            real = torch.isfinite(kth) & torch.isfinite(nxt)
            if real.any():
                gaps.append(((kth - nxt)[real].min() / scale).item())
        return original(scores, k)

    def routing(gate, args):
        scores = torch.nn.functional.softplus(args[0].float() @ gate.weight.float().t()).sqrt()
        values = (scores + gate.e_score_correction_bias).sort(dim=-1, descending=True).values
        gaps.append(((values[:, gate.top_k - 1] - values[:, gate.top_k]).min() / values.abs().max()).item())

    handles = [layer.mlp.gate.register_forward_pre_hook(routing) for layer in model.model.layers]
    CSA2Indexer.top = staticmethod(recording)
    try:
        with torch.no_grad():
            model(ids, **kwargs)
    finally:
        CSA2Indexer.top = staticmethod(original)
        [h.remove() for h in handles]
    return gaps


def test_the_case_is_well_conditioned(case):
    """No top-k choice within 1e-5 (relative) of a tie (100 times the two implementations' score differences);
    noise of 1e-7 (relative) on every block's input moves the logits of both rows by less than a tenth of the
    tolerance; every attention role, Engram and the hyper-connections move them by far more. (Draws that fail the
    noise check exist: seed 1 passes it, yet one FP4 rounding of a compressed row differs between the two
    implementations in the packed row; seeds 2 and 3 fail it.)"""
    model, ids, base = case["model"], case["ids"], case["logits"]
    packed = {"seq_lens": torch.tensor([DOCS])}
    gaps = _top_gaps(model, ids), _top_gaps(model, case["pids"], **packed)
    for found in gaps:  # 5 index layers, the candidate source, 12 MoE
        assert len(found) == 5 + 1 + 12 and min(found) > 1e-5, min(found)

    def moved(hooks, row=None) -> float:
        handles = [module.register_forward_hook(hook) if kind == "post" else module.register_forward_pre_hook(hook)
                   for kind, module, hook in hooks]
        try:
            with torch.no_grad():
                if row is None:
                    logits, reference = model(ids).logits, base
                else:
                    logits, reference = model(case["pids"], **packed).logits, case["packed_seq_lens"]
        finally:
            [h.remove() for h in handles]
        return ((logits - reference).abs().max() / reference.abs().max()).item()

    gen = torch.Generator().manual_seed(5)

    def noise(_module, args):
        x = args[0]
        return (x + 1e-7 * x.abs().amax() * torch.randn(x.shape, generator=gen),) + args[1:]

    layers = model.model.layers
    for row in (None, "packed"):
        assert moved([("pre", layer, noise) for layer in layers], row) < LOGIT_TOL / 10, row

    def silence(_module, _args, out):
        return torch.zeros_like(out[0]), out[1]

    config = case["config"]
    for role in ("window", "full", "reindex", "reuse"):
        sites = [("post", layer.self_attn, silence) for i, layer in enumerate(layers)
                 if config.attention_role(i) == role]
        assert moved(sites) > 1e-3, role

    def flat_mix(_module, args):
        return (torch.ones_like(args[0]),)  # every site's coefficients from a constant input

    assert moved([("pre", layer.attn_hc, flat_mix) for layer in layers]) > 1e-3

    def no_memory(_module, args, _out):
        return args[0]

    assert moved([("post", layer.engram, no_memory) for layer in layers if layer.engram is not None]) > 1e-3


def test_activation_checkpointing_gives_the_same_gradients(case):
    """Recomputing blocks (or their attention and FFN) in backward reproduces the shared state exactly: the same
    logits and gradients as a run that keeps every activation."""
    runs = {}
    for mode in ("none", "block", "selective"):
        config = dataclasses.replace(case["config"], activation_checkpointing=mode)
        model = build_causal_lm(config, tokenizer=case["tokenizer"]).eval()
        model.load_state_dict(case["model"].state_dict())
        logits = model(case["ids"]).logits
        (logits * _loss_weights(logits.shape)).sum().backward()
        runs[mode] = logits.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    logits, grads = runs.pop("none")
    assert set(grads) == set(case["grads"])
    for mode, (got, got_grads) in runs.items():
        assert torch.equal(got, logits), mode
        assert got_grads.keys() == grads.keys(), mode
        for name, grad in got_grads.items():
            assert torch.equal(grad, grads[name]), (mode, name)


def test_refusals(case):
    """Image tokens, a missing Engram tokenizer, the indexer loss and the V4 class on a V4.1 config are refused
    with ValueErrors naming the cause."""
    from dsv4.model import DSV4ForCausalLM

    model, config = case["model"], case["config"]
    ids = case["ids"].clone()
    ids[0, 3] = config.image_token_id
    with pytest.raises(ValueError, match=r"text only: input_ids hold image_token_id=383 at 1 positions"):
        model(ids)
    with pytest.raises(ValueError, match=r"Engram layers \[1, 4\] hash n-grams"):
        build_causal_lm(config)(case["ids"])
    with pytest.raises(ValueError, match="indexer_loss_coeff=0.1 is not supported"):
        build_causal_lm(dataclasses.replace(config, indexer_loss_coeff=0.1))
    with pytest.raises(ValueError, match=r"config.model_type is 'deepseek_v41'.*build_causal_lm"):
        DSV4ForCausalLM(config)
