"""DeepSeek-V4.1's frozen base kept as released: ``peft.base_dtype=fp8`` (:func:`dsv4.peft.apply_lora`) and, without
adapters, :func:`dsv4.peft.keep_base_quantized` (the frozen target of DSpark drafter training).

The release: the well-conditioned tiny V4.1 of tests/v41_reference.py (NeMo Automodel 0.7.0, Engram on its small
tokenizer) written by tests/v41_release.py: NeMo's release names and placeholders, filled by a quantiser that is not
dsv4's (FP8 e4m3 with one e8m0 scale per 32 x 32 tile, Engram tables per row and 32 columns, routed experts packed
FP4 with one scale per 32 columns).

Oracles: the release's own bytes (every kept weight and scale is the release's tensor, byte for byte, in the
release's shape); the same directory loaded into a float model (``load_model_from_hf``: the base dequantised once at
load), whose forward with the same adapters the kept model's must equal exactly: in fp32 the kept projections
dequantise into the very values the float model holds and run the same ops on them, so the tolerance is zero (the
V4 kept-base test asserts the same); NeMo's ``dequantize_checkpoint_weight`` for the merged export's values.
"""

import copy
import os
from types import SimpleNamespace

import pytest
import torch

from dsv4.checkpoint import export_hf_checkpoint, load_hf_checkpoint, load_model_from_hf
from dsv4.checkpoint import keys as K
from dsv4.checkpoint.hf_config import config_from_hf
from dsv4.checkpoint.load import keep_engram_tables_as_stored, kept_scale_name
from dsv4.checkpoint.quant import kept_format
from dsv4.model import build_causal_lm
from dsv4.peft import LoRAConfig, LoRALinear, adapter_state, apply_lora, keep_base_quantized, merged_tensors
from dsv4.peft.apply import merged_sources

LORA = LoRAConfig(rank=4, alpha=8, base_dtype="fp8")  # every target group: attention, shared and routed experts
QUANTIZED = (torch.float8_e4m3fn, torch.int8, torch.float8_e8m0fnu)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The tiny quantised V4.1 release directory (module docstring), its tensors, and the float model of it."""
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import dequantize_checkpoint_weight

    from tests.unit.test_v41_checkpoint import RELEASE_QUANT
    from tests.v41_reference import build_reference, engram_tokenizer, tiny_config
    from tests.v41_release import release_tensors, write_release_dir

    tokenizer = engram_tokenizer()
    ref = build_reference(tiny_config(tokenizer), 0, tokenizer)
    tensors = release_tensors(ref.state_dict_adapter, ref.state_dict())
    data = ref.config.to_dict()
    data["quantization_config"] = dict(RELEASE_QUANT)
    path = str(tmp_path_factory.mktemp("v41_kept_release"))
    write_release_dir(path, tensors, data)
    tokenizer.save_pretrained(path)
    quantized = sorted(k for k in tensors if K.scale_key_of_weight(k) in tensors and K.skip_reason(k, K.V41) is None)
    assert {K.on_disk_format(k, K.V41) for k in quantized} == {"fp8", "fp8_rows", "fp4"}
    assert any(tensors[K.scale_key_of_weight(k)].shape[0] > 1 for k in quantized  # 32 x 32 tiles, several per axis
               if K.on_disk_format(k, K.V41) == "fp8")
    return SimpleNamespace(path=path, tensors=tensors, tokenizer=tokenizer, quantized=quantized,
                           plain=load_model_from_hf(path).eval(), nemo_dequantize=dequantize_checkpoint_weight)


def _build(release):
    return build_causal_lm(config_from_hf(release.path), tokenizer=release.tokenizer)


def _load_kept(model, release):
    """The recipe's order: the kept base applied, the frozen Engram tables kept as stored, then the load."""
    keep_engram_tables_as_stored(model, release.path)
    load_hf_checkpoint(model, release.path)
    return model.eval()


def _randomize_adapters(model, std=0.05, seed=5):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in adapter_state(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * std)


def _ids(length=23, seed=1):
    return torch.randint(0, 300, (1, length), generator=torch.Generator().manual_seed(seed))  # the tokenizer's ids


def _kept_tensors(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Release key -> (kept weight, kept scale) for every tensor ``model`` keeps quantised (each routed expert of a
    stacked group on its own)."""
    state = model.state_dict()
    out = {}
    for name, t in state.items():
        if kept_format(t) is None:
            continue
        scale = state[kept_scale_name(name)]
        if K.is_stacked_expert(name):
            out.update({K.ours_to_hf(name, e, K.V41): (t[e], scale[e]) for e in range(t.shape[0])})
        else:
            out[K.ours_to_hf(name, family=K.V41)] = (t, scale)
    return out


def _assert_the_releases_bytes(model, release) -> None:
    kept = _kept_tensors(model)
    assert sorted(kept) == release.quantized  # every quantised tensor of the release is kept, nothing else
    for key, (weight, scale) in kept.items():
        want_w, want_s = release.tensors[key], release.tensors[K.scale_key_of_weight(key)]
        assert (weight.dtype, scale.dtype) == (want_w.dtype, want_s.dtype), key
        assert weight.shape == want_w.shape and scale.shape == want_s.shape, (key, scale.shape, want_s.shape)
        assert torch.equal(weight.view(torch.uint8), want_w.view(torch.uint8)), key
        assert torch.equal(scale.view(torch.uint8), want_s.view(torch.uint8)), key


@pytest.fixture(scope="module")
def kept_lora(release):
    model = _build(release)
    apply_lora(model, LORA)
    return _load_kept(model, release)


# ---------------------------------------------------------------------------------------------- LoRA (base_dtype=fp8)
def test_kept_base_is_the_releases_bytes(release, kept_lora):
    """Every FP8 e4m3 weight with its 32 x 32 e8m0 scales, every FP4 expert with its scales (and the Engram tables'
    row scales) is the release's tensor byte for byte, in its shape; nothing of the base is a float parameter."""
    _assert_the_releases_bytes(kept_lora, release)
    fp8 = [m for m in kept_lora.modules() if isinstance(m, LoRALinear) and m.keep]
    assert fp8 and all(m.scheme.fp8_block == (32, 32) for m in fp8)
    assert not any(p.dtype in QUANTIZED for p in kept_lora.parameters())


def test_kept_forward_equals_the_dequantised_base(release, kept_lora):
    """The kept LoRA model's logits equal those of the same model on the float (dequantised) base with the same
    adapters, exactly (module docstring), and the adapter gradients agree within 1e-5 (the V4 kept-base test's
    bound: the kept projections' input gradient is computed by a different op)."""
    kept = copy.deepcopy(kept_lora)
    reference = copy.deepcopy(release.plain)
    apply_lora(reference, LoRAConfig(rank=4, alpha=8, base_dtype="bf16"))  # frozen fp32 parameters
    _randomize_adapters(kept)
    _randomize_adapters(reference)
    ids = _ids()
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = -100
    out = {}
    for name, model in (("kept", kept), ("reference", reference)):
        result = model(ids, labels=labels)
        result.loss.backward()
        out[name] = (result.logits.detach(), {k: p.grad for k, p in adapter_state(model).items()})
    assert torch.equal(out["kept"][0], out["reference"][0])
    assert out["kept"][1].keys() == out["reference"][1].keys()
    for key, grad in out["reference"][1].items():
        torch.testing.assert_close(out["kept"][1][key], grad, rtol=1e-5, atol=1e-7, msg=key)


def test_merged_export_of_the_kept_base_is_exact(release, kept_lora, tmp_path):
    """``export.merge`` of the kept base (fresh adapters): the float32 export holds every quantised tensor at NeMo's
    dequantised value of the release's, exactly, and so does the quantised export once NeMo dequantises it (the
    values are on the release's 32 x 32 grid and the export re-quantises in those tiles; its bytes may differ from
    the release's where the release chose a larger power-of-two scale than needed, the value staying the same)."""
    from safetensors.torch import load_file

    def files(path):
        out = {}
        for f in sorted(os.listdir(path)):
            if f.endswith(".safetensors"):
                out.update(load_file(os.path.join(path, f)))
        return out

    for dtype in ("float32", "quantized"):
        export_hf_checkpoint(kept_lora, str(tmp_path / dtype), dtype=dtype, sources=merged_sources(kept_lora))
    def dequantized(tensors, key):
        return release.nemo_dequantize(tensors[key], tensors[K.scale_key_of_weight(key)], dtype=torch.float32,
                                       rowwise=".engram.embed." in key)

    as_float, as_quantized = files(tmp_path / "float32"), files(tmp_path / "quantized")
    for key in release.quantized:
        want = dequantized(release.tensors, key)
        assert torch.equal(as_float[key], want), key
        assert as_quantized[key].dtype == release.tensors[key].dtype, key
        assert torch.equal(dequantized(as_quantized, key), want), key


def test_merged_tensors_with_adapters_equal_the_float_bases_merge(release, kept_lora):
    """``W + s B A`` of the kept base equals that of the float base with the same adapters, exactly."""
    kept = copy.deepcopy(kept_lora)
    reference = copy.deepcopy(release.plain)
    apply_lora(reference, LoRAConfig(rank=4, alpha=8, base_dtype="bf16"))
    _randomize_adapters(kept)
    _randomize_adapters(reference)
    got, want = dict(merged_tensors(kept)), dict(merged_tensors(reference))
    for name, tensor in want.items():
        if name.endswith(".engram.embed.weight"):  # the kept table's merge is its export source (table_sources)
            continue
        assert torch.equal(got[name].float(), tensor.float()), name


def test_converted_merge_equals_the_float_bases_merge(release, kept_lora, tmp_path):
    """``python -m dsv4.checkpoint export RUN --merge`` of a V4.1 LoRA run on the kept base (the base streamed from the
    run's model.checkpoint into a meta model kept in the family's tiles, one block at a time) writes, byte for byte,
    the float32 merged export of the float (dequantised) base with the same adapters."""
    import yaml
    from torch.distributed.checkpoint import FileSystemWriter, save

    from dsv4.checkpoint.convert import MODEL_PREFIX, export_run

    kept = copy.deepcopy(kept_lora)
    reference = copy.deepcopy(release.plain)
    apply_lora(reference, LoRAConfig(rank=4, alpha=8, base_dtype="bf16"))
    _randomize_adapters(kept)
    _randomize_adapters(reference)
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    ckpt.mkdir(parents=True)
    save({MODEL_PREFIX + k: v.detach() for k, v in adapter_state(kept).items()},
         storage_writer=FileSystemWriter(str(ckpt)), no_dist=True)
    torch.save({"dsv4": {"config": kept.config.to_dict(), "model_type": "deepseek_v41"}}, ckpt / "meta.pt")
    peft = {"name": "lora", **LORA.as_dict(), "adapter": None}
    (tmp_path / "run" / "resolved_config.yaml").write_text(
        yaml.safe_dump({"peft": peft, "model": {"checkpoint": release.path}}))
    export_run(tmp_path / "run", str(tmp_path / "converted"), merge=True, dtype="float32")
    export_hf_checkpoint(reference, str(tmp_path / "float"), dtype="float32", sources=merged_sources(reference))
    names = sorted(os.listdir(tmp_path / "float"))
    assert sorted(os.listdir(tmp_path / "converted")) == names and len(names) >= 3
    for name in names:
        assert (tmp_path / "converted" / name).read_bytes() == (tmp_path / "float" / name).read_bytes(), name


def test_a_base_kept_in_other_tiles_is_refused_before_reading(release):
    """A model whose kept FP8 scale is not the checkpoint family's shape (here V4's 128 x 128 tiles) is refused
    naming the key, before anything is read (no kept tensor changed)."""
    from dsv4.checkpoint.quant import V4_SCHEME, quantize_kept

    model = _build(release)
    apply_lora(model, LORA)
    wq_b = model.model.layers[0].self_attn.wq_b  # [128, 16]: 4 x 1 tiles of 32 x 32, 1 x 1 of 128 x 128
    q, s = quantize_kept(wq_b.base_weight(), "fp8", V4_SCHEME)
    wq_b.register_buffer("weight", q)
    wq_b.register_buffer("scale", s)
    before = {k: v.clone() for k, v in model.state_dict().items() if v.dtype in QUANTIZED}
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq_b\.weight: the model keeps it with a \[1, 1\] scale, "
                                         r"but deepseek_v41's fp8 \(32x32 tiles\) gives \[4, 1\]"):
        load_hf_checkpoint(model, release.path)
    after = model.state_dict()
    assert all(torch.equal(after[k].view(torch.uint8), v.view(torch.uint8)) for k, v in before.items())


# ---------------------------------------------------------------------------------------------- no adapters
def test_keep_base_quantized_frozen_target(release):
    """The DSpark target's form: a whole V4.1 model kept as released with no adapter (keep_base_quantized): the
    release's bytes, nothing trainable, logits equal to the float model's exactly."""
    model = _build(release)
    counts = keep_base_quantized(model)
    cfg = model.config
    assert counts["experts"] == cfg.num_hidden_layers and counts["kept"] > 8 * cfg.num_hidden_layers
    assert not any(p.requires_grad for p in model.parameters()) and not adapter_state(model)
    assert all(m.rank == 0 for m in model.modules() if isinstance(m, LoRALinear))
    with pytest.raises(ValueError, match="already has LoRA / kept modules"):
        keep_base_quantized(model)
    _load_kept(model, release)
    _assert_the_releases_bytes(model, release)
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, release.plain(ids).logits)


# ---------------------------------------------------------------------------------------------- memory plan
def test_the_plans_kept_base_is_the_releases_size(release):
    """The memory plan builds the model on meta and applies LoRA (dsv4.plan.plan.memory_plan) and counts every buffer
    at its bytes: the kept FP8 / FP4 buffers of that model have the release's shapes, scales in 32 x 32 tiles
    included, so the plan counts the release's bytes."""
    with torch.device("meta"):
        model = build_causal_lm(config_from_hf(release.path))
    apply_lora(model, LORA)
    kept = _kept_tensors(model)
    assert sorted(kept) == [k for k in release.quantized if K.on_disk_format(k, K.V41) != "fp8_rows"]
    planned = sum(b.numel() * b.element_size() for b in model.buffers() if b.dtype in QUANTIZED)
    on_disk = 0
    for key, (weight, scale) in kept.items():
        want_w, want_s = release.tensors[key], release.tensors[K.scale_key_of_weight(key)]
        assert weight.shape == want_w.shape and scale.shape == want_s.shape, (key, scale.shape, want_s.shape)
        on_disk += want_w.nbytes + want_s.nbytes
    assert planned == on_disk
