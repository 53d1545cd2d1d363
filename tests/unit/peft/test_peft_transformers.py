"""The adapter export in transformers' module names: ``peft.PeftModel.from_pretrained(AutoModelForCausalLM
.from_pretrained(base), adapter_dir)`` gives the logits of the dsv4 LoRA model that wrote it, for every target group
(routed experts as the fused rank-2r gate_up_proj pair); ``load_peft_adapter`` reads it back, and still reads the
release-named layout of earlier exports."""

import json
import warnings

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from dsv4.checkpoint import export_hf_checkpoint
from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM
from dsv4.peft import LoRAConfig, adapter_state, apply_lora
from dsv4.peft.peft_format import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    export_peft_adapter,
    load_peft_adapter,
    release_to_transformers,
    transformers_to_release,
)
from tests.unit.checkpoint.hf_reference import indexer_ties, relative_error

L = 256
CONFIG = DSV4Config.preset("tiny", index_n_heads=8)


def _base() -> DSV4ForCausalLM:
    torch.manual_seed(0)
    return DSV4ForCausalLM(CONFIG).eval()


def _lora_model(lora: LoRAConfig, seed: int = 5) -> DSV4ForCausalLM:
    model = _base()
    apply_lora(model, lora)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_state(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    export_hf_checkpoint(_base(), str(path), dtype="float32")
    return str(path)


@pytest.mark.parametrize("targets", [("attention",), ("shared_experts",), ("routed_experts",),
                                     ("attention", "shared_experts", "routed_experts")])
def test_peft_model_applies_the_adapter_with_our_logits(base_dir, tmp_path, targets):
    lora = LoRAConfig(rank=4, alpha=8, targets=targets)
    model = _lora_model(lora)
    export_peft_adapter(model, str(tmp_path), lora, base_model=base_dir)
    hf = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with warnings.catch_warnings():  # peft warns that rank_pattern matched no *module* (it matched the parameter)
        warnings.simplefilter("ignore", RuntimeWarning)
        peft_model = PeftModel.from_pretrained(hf, str(tmp_path)).eval()
    ids = torch.randint(0, 256, (1, L), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), indexer_ties(peft_model) as ties:
        got = peft_model(ids).logits
        with peft_model.disable_adapter():
            plain = peft_model(ids).logits
        want = model(ids).logits
    assert ties and not any(ties), ties  # free of exact indexer ties (tests/unit/checkpoint/hf_reference.py)
    err = relative_error(got, want)
    assert err < 1e-5, err
    assert relative_error(plain, want) > 1e-2  # the adapter does change the logits: PEFT applied all of it
    # and dsv4 reads the same directory back into a fresh LoRA model, bit for bit
    fresh = _base()
    apply_lora(fresh, lora)
    report = load_peft_adapter(fresh, str(tmp_path))
    assert report.layout == "transformers" and not report.skipped and len(set(report.loaded)) == len(report.loaded)
    assert torch.equal(fresh(ids).logits, want)


def test_transformers_layout_names_and_config(tmp_path):
    lora = LoRAConfig(rank=4, alpha=8)
    keys = export_peft_adapter(_lora_model(lora), str(tmp_path), lora)
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    assert config["target_parameters"] == ["self_attn.o_a_proj.weight", "mlp.experts.gate_up_proj",
                                           "mlp.experts.down_proj"]
    assert config["rank_pattern"] == {"mlp.experts.gate_up_proj": 8} and config["alpha_pattern"] == {
        "mlp.experts.gate_up_proj": 16.0}
    prefix = "base_model.model.model.layers.1."
    assert {prefix + "self_attn.q_a_proj.lora_A.weight", prefix + "mlp.shared_experts.gate_proj.lora_B.weight",
            prefix + "mlp.experts.base_layer.lora_A.weight", prefix + "mlp.experts.lora_B.weight"} <= set(keys)
    assert "base_model.model.mtp.0.attn.wq_a.lora_A.weight" in keys  # no MTP in transformers: the release name


def test_fused_expert_pairs_round_trip_and_refuse_coupled_adapters():
    g = torch.Generator().manual_seed(0)
    release = {}
    for e in range(3):
        for w, (out, inp) in (("w1", (6, 5)), ("w3", (6, 5)), ("w2", (5, 6))):
            release[f"base_model.model.layers.2.ffn.experts.{e}.{w}.lora_A.weight"] = torch.randn(2, inp, generator=g)
            release[f"base_model.model.layers.2.ffn.experts.{e}.{w}.lora_B.weight"] = torch.randn(out, 2, generator=g)
    fused = release_to_transformers(release)
    b = fused["base_model.model.model.layers.2.mlp.experts.base_layer.lora_B.weight"]
    a = fused["base_model.model.model.layers.2.mlp.experts.base_layer.lora_A.weight"]
    assert a.shape == (3 * 4, 5) and b.shape == (12, 4 * 3)
    # PEFT's delta for expert e: B_e A_e with A_e = rows [4e, 4e + 4), B_e[:, j] = column j * E + e
    delta = b.view(12, 4, 3)[:, :, 1] @ a.view(3, 4, 5)[1]
    w1 = release["base_model.model.layers.2.ffn.experts.1.w1.lora_B.weight"] @ release[
        "base_model.model.layers.2.ffn.experts.1.w1.lora_A.weight"]
    w3 = release["base_model.model.layers.2.ffn.experts.1.w3.lora_B.weight"] @ release[
        "base_model.model.layers.2.ffn.experts.1.w3.lora_A.weight"]
    torch.testing.assert_close(delta, torch.cat([w1, w3]), rtol=0, atol=1e-6)
    back = transformers_to_release(fused, rank=2)
    assert back.keys() == release.keys() and all(torch.equal(back[k], release[k]) for k in release)
    b[0, 3 * 0 + 2 * 3] = 0.5  # row 0 (gate), rank column 2 (up's half) of expert 0: couples gate and up
    with pytest.raises(ValueError, match=r"lora_B.weight couples gate and up \(largest off-diagonal entry 0.5\)"):
        transformers_to_release(fused, rank=2)


def test_release_layout_still_loads(tmp_path):
    lora = LoRAConfig(rank=4, alpha=8)
    model = _lora_model(lora)
    keys = export_peft_adapter(model, str(tmp_path), lora, layout="release")
    assert "base_model.model.layers.1.ffn.experts.7.w2.lora_A.weight" in keys
    fresh = _base()
    apply_lora(fresh, lora)
    report = load_peft_adapter(fresh, str(tmp_path))
    assert report.layout == "release"
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(1))
    assert torch.equal(fresh(ids).logits, model(ids).logits)
    assert (tmp_path / ADAPTER_WEIGHTS).exists()


def test_an_expert_parallel_rank_reads_its_experts_from_the_fused_pairs(tmp_path):
    from dsv4.parallel.expert_shard import shard_experts

    lora = LoRAConfig(rank=4, alpha=8, targets=("routed_experts",))
    model = _lora_model(lora)
    export_peft_adapter(model, str(tmp_path), lora)
    part = _base()
    apply_lora(part, lora)
    shard_experts(part, ep_rank=1, ep_size=2)
    report = load_peft_adapter(part, str(tmp_path))
    # 5 blocks x 4 other-rank experts x 3 projections x (A, B) skipped
    assert len(report.skipped) == 5 * 4 * 3 * 2 and all(".experts." in k for k in report.skipped)
    full, half = adapter_state(model), adapter_state(part)
    assert half.keys() == full.keys()
    for name, value in half.items():
        assert torch.equal(value, full[name][4:8]), name
