"""LoRA on the tiny model: what trains, merging, the PEFT format, and the base kept in the release's FP8 / FP4 form.

Oracles: the plain model (a zero adapter changes nothing), the merged plain model (``W + s B A``), a fresh model
loaded from the exported adapter, and the plain model loaded from the same quantised checkpoint (the kept base
dequantised once at load, the reference the kept base must equal exactly in fp32).
"""

import copy
import json
import re

import pytest
import torch

from dsv4.checkpoint import CheckpointDir, export_hf_checkpoint, load_hf_checkpoint
from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM
from dsv4.model.moe import GroupedExperts
from dsv4.peft import LoRAConfig, LoRAGroupedExperts, LoRALinear, adapter_state, apply_lora, merged_tensors
from dsv4.peft.apply import requantization_loss
from dsv4.peft.peft_format import ADAPTER_CONFIG, export_peft_adapter, load_peft_adapter

L = 256


def _model(**overrides) -> DSV4ForCausalLM:
    torch.manual_seed(0)
    return DSV4ForCausalLM(DSV4Config.preset("tiny", **overrides))


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 256, (1, L), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    return ids, labels


def _randomize_adapters(model, std=0.05, seed=5):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_state(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * std)


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory):
    """The tiny model exported in the release formats (FP8 linears, FP4 experts, e8m0 scales)."""
    path = tmp_path_factory.mktemp("quantized")
    export_hf_checkpoint(_model(), str(path), dtype="quantized")
    return str(path)


# ---------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("kwargs, message", [
    ({"rank": 0}, "`peft.rank` must be an integer >= 1, got 0"),
    ({"alpha": 0}, "`peft.alpha` must be > 0"),
    ({"dropout": 1.0}, "`peft.dropout` must be in [0, 1)"),
    ({"targets": ["attention", "indexer"]}, "unknown: ['indexer']"),
    ({"targets": []}, "and at least one"),
    ({"base_dtype": "fp4"}, "`peft.base_dtype`='fp4' must be one of ['bf16', 'fp8']"),
])
def test_config_errors_name_the_key(kwargs, message):
    with pytest.raises(ValueError) as err:
        LoRAConfig(**kwargs)
    assert message in str(err.value)


def test_from_mapping():
    assert LoRAConfig.from_mapping({"name": "none", "rank": 4}) is None
    cfg = LoRAConfig.from_mapping({"name": "lora", "rank": 4, "alpha": 2.0, "targets": ["attention"]})
    assert cfg.scaling == 0.5 and cfg.targets == ("attention",)
    with pytest.raises(ValueError, match="`peft.name`='qlora' must be none or lora"):
        LoRAConfig.from_mapping({"name": "qlora"})


# ---------------------------------------------------------------------------------------------- structure
def test_targets_and_freezing():
    model = _model()
    counts = apply_lora(model, LoRAConfig(rank=4, targets=("attention", "routed_experts")))
    cfg = model.config
    blocks = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    assert counts["adapted"] == 5 * blocks and counts["experts"] == blocks and counts["kept"] == 0
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(re.search(r"lora_[AB]$", n) for n in trainable)
    assert not any("shared_experts" in n or "indexer" in n or "compressor" in n or "gate" in n for n in trainable)
    assert isinstance(model.model.layers[1].self_attn.wo_a, LoRALinear) and model.model.layers[1].self_attn.wo_a.groups == cfg.o_groups
    assert isinstance(model.model.layers[1].mlp.experts, LoRAGroupedExperts)
    assert type(model.model.layers[1].mlp.shared_experts.w1) is torch.nn.Linear  # not a target, bf16 base: untouched
    assert counts["adapter_parameters"] == sum(p.numel() for p in model.parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="already has LoRA modules"):
        apply_lora(model, LoRAConfig())


def test_v41_targets_and_the_frozen_kept_base():
    """DeepSeek-V4.1: every target linear of each block adapted (attention wq_a / wq_b / wkv / wo_a / wo_b, shared
    experts, routed experts); with base_dtype=fp8 every linear V4.1's release stores in FP8 is kept, the Engram
    projections and the indexer's wq_b without an adapter; the Engram tables, compressors, indexers, routers,
    hyper-connections and norms are frozen."""
    from dsv4.model import build_causal_lm

    torch.manual_seed(0)
    model = build_causal_lm(DSV4Config.preset("v41_tiny"))
    counts = apply_lora(model, LoRAConfig(rank=4, base_dtype="fp8"))
    cfg = model.config
    n = cfg.num_hidden_layers
    full_or_reindex = len(cfg.index_source_layer_ids)
    assert counts["adapted"] == 8 * n and counts["experts"] == n
    assert counts["kept"] == 8 * n + full_or_reindex + len(cfg.engram_layer_ids)  # + indexer wq_b, engram.wkv
    for i in cfg.engram_layer_ids:
        engram = model.model.layers[i].engram
        assert isinstance(engram.wkv, LoRALinear) and engram.wkv.keep == "fp8" and engram.wkv.rank == 0
        assert not engram.embed.weight.requires_grad
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(re.search(r"lora_[AB]$", n) for n in trainable)
    assert not any(part in n for n in trainable for part in ("engram", "indexer", "compressor", "gate", "hc"))
    assert counts["adapter_parameters"] == sum(p.numel() for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("base_dtype", ["bf16", "fp8"])
def test_a_fresh_adapter_changes_nothing(base_dtype, quantized_dir):
    plain = _model()
    load_hf_checkpoint(plain, quantized_dir)
    lora = copy.deepcopy(plain)
    apply_lora(lora, LoRAConfig(base_dtype=base_dtype))
    if base_dtype == "fp8":
        load_hf_checkpoint(lora, quantized_dir)
    ids, _ = _batch()
    assert torch.equal(lora(ids).logits, plain(ids).logits)


# ---------------------------------------------------------------------------------------------- training
@pytest.mark.parametrize("base_dtype", ["bf16", "fp8"])
def test_only_adapters_change_and_the_loss_falls(base_dtype):
    model = _model()
    apply_lora(model, LoRAConfig(rank=8, alpha=16, base_dtype=base_dtype))
    frozen = {k: v.clone() for k, v in model.state_dict().items() if not re.search(r"lora_[AB]$", k)}
    adapters = {k: v.detach().clone() for k, v in adapter_state(model).items()}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids, labels = _batch()
    losses = []
    for _ in range(6):
        optimizer.zero_grad()
        out = model(ids, labels=labels)
        out.loss.backward()
        assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
        optimizer.step()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0] - 0.1, losses
    after = model.state_dict()
    for key, value in frozen.items():  # every base tensor (parameters and buffers, router bias too) bit-identical
        assert torch.equal(after[key], value), key
    changed = [k for k, v in adapter_state(model).items() if not torch.equal(v.detach(), adapters[k])]
    assert len(changed) == len(adapters)  # every A and every B moved (B from zero, A once B is non-zero)


def test_adapter_gradients_equal_between_kept_and_dequantised_base(quantized_dir):
    """The kept FP8 / FP4 base gives the same adapter gradients as the same weights dequantised at load (fp32)."""
    ids, labels = _batch()
    grads = {}
    for base_dtype in ("bf16", "fp8"):
        model = _model()
        load_hf_checkpoint(model, quantized_dir)
        apply_lora(model, LoRAConfig(base_dtype=base_dtype))
        load_hf_checkpoint(model, quantized_dir)
        _randomize_adapters(model)
        model(ids, labels=labels).loss.backward()
        grads[base_dtype] = {k: p.grad for k, p in adapter_state(model).items()}
    assert grads["bf16"].keys() == grads["fp8"].keys()
    for key, g in grads["bf16"].items():
        torch.testing.assert_close(grads["fp8"][key], g, rtol=1e-5, atol=1e-7, msg=key)


def test_recompute_gives_the_same_adapter_gradients():
    ids, labels = _batch()
    grads = {}
    for mode in ("none", "block"):
        model = _model(activation_checkpointing=mode)
        apply_lora(model, LoRAConfig(base_dtype="fp8"))
        _randomize_adapters(model)
        model(ids, labels=labels).loss.backward()
        grads[mode] = {k: p.grad for k, p in adapter_state(model).items()}
    for key, g in grads["none"].items():
        torch.testing.assert_close(grads["block"][key], g, rtol=1e-5, atol=1e-7, msg=key)


def test_the_kept_base_is_never_saved_dequantised(monkeypatch):
    """Structural: no dequantised kept weight is saved for backward (the kept projection dequantises again in
    backward), so the whole base never exists in the compute dtype, whatever the number of layers."""
    import dsv4.peft.frozen as frozen

    made = []
    original = frozen.dequantize_kept

    def recording(weight, scale, dtype, *scheme):
        out = original(weight, scale, dtype, *scheme)
        made.append(out)  # kept alive, so that no later tensor can reuse its address
        return out

    monkeypatch.setattr(frozen, "dequantize_kept", recording)
    model = _model()
    apply_lora(model, LoRAConfig(base_dtype="fp8"))
    saved = []
    ids, labels = _batch()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.untyped_storage().data_ptr()) or t,
                                                  lambda t: t):
        loss = model(ids, labels=labels).loss
    forward_dequantised = len(made)
    loss.backward()
    assert forward_dequantised > 0 and len(made) > forward_dequantised  # dequantised again in backward
    assert saved and not {t.untyped_storage().data_ptr() for t in made[:forward_dequantised]} & set(saved)


# ---------------------------------------------------------------------------------------------- the kept base
def test_kept_base_forward_equals_the_dequantised_base_exactly(quantized_dir):
    plain = _model()
    load_hf_checkpoint(plain, quantized_dir)  # dequantised once, into fp32 parameters
    kept = _model()
    apply_lora(kept, LoRAConfig(base_dtype="fp8"))
    load_hf_checkpoint(kept, quantized_dir)  # the checkpoint's bytes as they are
    reference = copy.deepcopy(plain)
    apply_lora(reference, LoRAConfig(base_dtype="bf16"))
    _randomize_adapters(kept)
    _randomize_adapters(reference)
    ids, _ = _batch()
    assert torch.equal(kept(ids).logits, reference(ids).logits)


def test_kept_base_bytes_are_the_checkpoints_bytes(quantized_dir):
    kept = _model()
    apply_lora(kept, LoRAConfig(base_dtype="fp8"))
    load_hf_checkpoint(kept, quantized_dir)
    quantized = (torch.float8_e4m3fn, torch.int8, torch.float8_e8m0fnu)
    resident = sum(b.numel() * b.element_size() for b in kept.buffers() if b.dtype in quantized)
    on_disk = sum(t.nbytes for t in CheckpointDir.open(quantized_dir).tensors.values()
                  if t.dtype in ("F8_E4M3", "I8", "F8_E8M0"))
    assert on_disk > 0 and resident <= 1.1 * on_disk, (resident, on_disk)
    assert not any(p.dtype in quantized for p in kept.parameters())


def test_a_bf16_checkpoint_is_quantised_into_a_kept_base(tmp_path):
    """A checkpoint that stores the kept tensors unquantised is quantised on load: equal to loading the
    quantised export of the same weights."""
    source = _model()
    export_hf_checkpoint(source, str(tmp_path / "f32"), dtype="float32")
    export_hf_checkpoint(source, str(tmp_path / "q"), dtype="quantized")
    a, b = _model(), _model()
    for model, path in ((a, "f32"), (b, "q")):
        apply_lora(model, LoRAConfig(base_dtype="fp8"))
        load_hf_checkpoint(model, str(tmp_path / path))
    kept_a = {k: v.view(torch.uint8) for k, v in a.state_dict().items() if v.dtype.itemsize == 1}
    kept_b = {k: v.view(torch.uint8) for k, v in b.state_dict().items() if v.dtype.itemsize == 1}
    assert kept_a.keys() == kept_b.keys() and len(kept_a) > 40  # weights and scales of every kept tensor
    for key, value in kept_a.items():
        assert torch.equal(value, kept_b[key]), key


# ---------------------------------------------------------------------------------------------- merge / export
@pytest.mark.parametrize("base_dtype", ["bf16", "fp8"])
def test_merged_model_equals_the_adapter_model(base_dtype, tmp_path):
    model = _model()
    apply_lora(model, LoRAConfig(rank=4, alpha=8, base_dtype=base_dtype))
    _randomize_adapters(model)
    merged = DSV4ForCausalLM(model.config)
    merged.load_state_dict(dict(merged_tensors(model)))  # strict: exactly the plain model's keys
    ids, _ = _batch()
    expected = model(ids).logits
    torch.testing.assert_close(merged(ids).logits, expected, rtol=0, atol=1e-5)
    # and through the HF export (export.merge=true) and a plain load
    export_hf_checkpoint(model, str(tmp_path), dtype="float32", tensors=merged_tensors(model))
    loaded = DSV4ForCausalLM(model.config)
    load_hf_checkpoint(loaded, str(tmp_path))
    torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=1e-5)


def test_peft_adapter_round_trip(tmp_path):
    peft = pytest.importorskip("peft")
    lora = LoRAConfig(rank=4, alpha=8, targets=("attention", "shared_experts", "routed_experts"))
    model = _model()
    apply_lora(model, lora)
    _randomize_adapters(model)
    keys = export_peft_adapter(model, str(tmp_path), lora, layout="release")  # the layout of earlier exports
    config = peft.PeftConfig.from_pretrained(str(tmp_path))
    assert type(config).__name__ == "LoraConfig" and config.r == 4 and config.lora_alpha == 8
    modules = {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in keys}
    assert all(re.fullmatch(config.target_modules, m) for m in modules)
    assert "layers.1.ffn.experts.7.w2" in modules and "layers.0.attn.wo_a" in modules and "mtp.0.attn.wq_a" in modules
    assert not any(re.fullmatch(config.target_modules, m) for m in ("layers.1.attn.indexer.wq_b", "layers.1.ffn.gate",
                                                                    "layers.1.attn.compressor.wkv"))
    fresh = _model()
    apply_lora(fresh, lora)
    report = load_peft_adapter(fresh, str(tmp_path))
    assert len(report.loaded) == len(keys)
    ids, _ = _batch()
    assert torch.equal(fresh(ids).logits, model(ids).logits)


def test_peft_adapter_load_errors(tmp_path):
    lora = LoRAConfig(rank=4, alpha=8)
    model = _model()
    apply_lora(model, lora)
    export_peft_adapter(model, str(tmp_path), lora)
    other = _model()
    apply_lora(other, LoRAConfig(rank=8, alpha=8))
    with pytest.raises(ValueError, match=r"r=4, lora_alpha=8.0 differ from the model's adapters \(rank \[8\]"):
        load_peft_adapter(other, str(tmp_path))
    narrow = _model()
    apply_lora(narrow, LoRAConfig(rank=4, alpha=8, targets=("attention",)))
    # 5 blocks x (3 shared + 8 experts x 3) adapted linears x (A, B) = 270 keys the narrow model lacks
    with pytest.raises(KeyError, match=r"0 adapter keys missing.*; 270 unexpected \(the model has no such adapter: check peft.targets\)"):
        load_peft_adapter(narrow, str(tmp_path))
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({**config, "use_rslora": True}))
    with pytest.raises(ValueError, match="use_rslora=True is not supported"):
        load_peft_adapter(model, str(tmp_path))


def test_requantising_a_merge_measures_what_it_loses():
    model = _model()
    apply_lora(model, LoRAConfig(rank=4, alpha=8, base_dtype="fp8"))
    assert requantization_loss(model) is None  # B = 0: nothing to lose
    _randomize_adapters(model, std=1e-4)  # a small update: FP8 / FP4 steps are far larger
    small = requantization_loss(model)
    _randomize_adapters(model, std=1.0)  # an update as large as the weights
    large = requantization_loss(model)
    assert small > 0.9 and large < 0.5, (small, large)


def test_expert_sharding_slices_adapters_and_kept_scales():
    from dsv4.parallel.expert_shard import shard_experts

    model = _model()
    apply_lora(model, LoRAConfig(base_dtype="fp8"))
    full = copy.deepcopy(model.model.layers[1].mlp.experts)
    shard_experts(model, ep_rank=1, ep_size=2)
    part = model.model.layers[1].mlp.experts
    assert isinstance(part, GroupedExperts) and part.expert_offset == 4 and part.num_local_experts == 4
    for name in full.stacked_names():
        a, b = getattr(part, name), getattr(full, name)[4:8]
        assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                           b.view(torch.uint8) if b.dtype.itemsize == 1 else b), name
        assert isinstance(a, torch.nn.Parameter) == isinstance(getattr(full, name), torch.nn.Parameter)
        assert a.requires_grad == getattr(full, name).requires_grad
