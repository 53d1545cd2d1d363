"""DSpark drafter checkpoints against NeMo Automodel 0.7.0's ``DeepseekV41DSparkStateDictAdapter`` (the independent
reader and writer of the release's ``mtp.*`` layout).

The release directory is a real client's output: the tiny V4.1 drafter of NeMo Automodel (well-conditioned weights,
tests/v41_reference.py), renamed by its own adapter and quantised into the adapter's own release placeholders
(tests/v41_release.py: FP8 32 x 32 tiles, FP4 experts), beside a few backbone tensors, with NeMo's nested
``config.json``. Asserted: ``load_dspark_drafter`` equals the reference adapter's ``from_hf`` tensor for tensor and
reads none of the backbone's keys; a quantised export reloads to the release's values (and its codes wherever
the recomputed scale is the release's); float32 and bfloat16 exports
reload exactly; the adapter reads dsv4's exports (float32 and quantised) into the values dsv4 holds; an export
beside a target merges into its index (the target and the drafter both load from it) and refuses to replace a
drafter or to describe another one unless asked.
"""

from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
from safetensors.torch import load_file

from dsv4.checkpoint import load_model_from_hf
from dsv4.checkpoint.export import export_hf_checkpoint
from dsv4.checkpoint.hf_config import INDEX_FILE
from dsv4.config import DSV4Config
from dsv4.model import build_causal_lm
from dsv4.model.v41.drafter import DSparkDrafter
from dsv4.speculative import export_dspark_drafter, load_dspark_drafter
from tests.v41_reference import build_drafter_reference, drafter_names, reference_config
from tests.v41_release import release_fp8, release_tensors, write_release_dir

RELEASE_QUANT = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                 "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
BACKBONE = ("layers.0.attn.wq_a.weight", "layers.0.attn.wq_a.scale", "norm.weight")  # a load must skip them


# what the release keeps in F32, and stores quantised (reference/dspark.md); the rest is BF16
F32_PARTS = ("_hc.", "sink", "gate.e_score_correction_bias", "gate.bias_vl", "confidence_head", "lm_head")
QUANTISED_PARTS = tuple(f"self_attn.{w}." for w in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")) + (
    "main_proj", "shared_experts", "mlp.experts.")


def _as_stored(name: str, value: torch.Tensor, dtype: str) -> torch.Tensor:
    """What an export of ``dtype`` reloads to for the drafter tensor ``name`` (quantised values come back exactly:
    the export re-quantises values that were loaded from the same formats)."""
    exact = dtype == "float32" or any(p in name for p in F32_PARTS) or (
        dtype == "quantized" and any(p in name for p in QUANTISED_PARTS))
    return value if exact else value.bfloat16().float()


def _config():
    return DSV4Config.preset("v41_tiny", engram_layer_ids=[], engram_num_embeddings=[])


def _read_dir(path: str) -> dict[str, torch.Tensor]:
    with open(os.path.join(path, INDEX_FILE)) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    out: dict[str, torch.Tensor] = {}
    for name in files:
        out.update(load_file(os.path.join(path, name)))
    return out


def _indexed(path: str) -> dict[str, torch.Tensor]:
    """The tensors the directory's index names, from the files it names for them."""
    with open(os.path.join(path, INDEX_FILE)) as f:
        weight_map = json.load(f)["weight_map"]
    files = {name: load_file(os.path.join(path, name)) for name in set(weight_map.values())}
    return {key: files[name][key] for key, name in weight_map.items()}


def _reference_reads(ref, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the reference adapter makes of on-disk ``tensors``, under dsv4's names."""
    return drafter_names(ref.state_dict_adapter.from_hf(dict(tensors)))


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    config = _config()
    ref = build_drafter_reference(config, 2, 4)
    tensors = release_tensors(ref.state_dict_adapter, ref.state_dict())
    gen = torch.Generator().manual_seed(1)
    q, s = release_fp8(torch.randn(16, 64, generator=gen), 32, 32)
    tensors.update({BACKBONE[0]: q, BACKBONE[1]: s, BACKBONE[2]: torch.ones(64, dtype=torch.bfloat16)})
    path = str(tmp_path_factory.mktemp("dspark_release"))
    data = reference_config(config).to_dict()
    data["quantization_config"] = dict(RELEASE_QUANT)
    write_release_dir(path, tensors, data, shards=3)
    drafter_keys = {k: v for k, v in tensors.items() if k not in BACKBONE}
    return {"path": path, "ref": ref, "config": config, "tensors": tensors,
            "expected": _reference_reads(ref, drafter_keys)}


@pytest.fixture(scope="module")
def loaded(release):
    return load_dspark_drafter(release["path"])


def test_the_release_loads_as_the_reference_reads_it(release, loaded):
    state = loaded.state_dict()
    expected = release["expected"]
    assert set(state) == set(expected)
    for name, value in expected.items():
        assert state[name].dtype == torch.float32, name
        assert torch.equal(state[name], value.float()), name
    assert not loaded.embed_tokens.weight.requires_grad and not loaded.lm_head.weight.requires_grad
    assert loaded.layers[0].self_attn.wq_a.weight.requires_grad


def test_the_load_reads_no_backbone_key(release):
    from dsv4.checkpoint import load_hf_checkpoint

    report = load_hf_checkpoint(DSparkDrafter(release["config"]), release["path"])
    assert set(BACKBONE[::2]) <= set(report.skipped)
    assert len(report.keys_read) == sum(1 for k in release["tensors"] if k not in BACKBONE)


def test_quantised_export_gives_the_release_values_back(release, loaded, tmp_path):
    """Re-quantising the loaded release reloads to the same values, and every block whose recomputed scale is the
    release's holds the release's codes. (A scale may come out a power of two smaller than the release's: it was
    chosen from the block's largest weight before rounding, the export sees it after: an FP4 block whose largest
    weight rounds to 3 scales down by 2, which holds the same values; about a third of this release's FP4 blocks.)"""
    export_dspark_drafter(loaded, str(tmp_path / "q"), dtype="quantized")
    ours, theirs = _read_dir(str(tmp_path / "q")), release["tensors"]
    assert set(ours) == {k for k in theirs if k not in BACKBONE}
    same = differ = 0
    for key in (k for k in theirs if k.endswith(".scale") and k not in BACKBONE):
        weight = key[: -len("scale")] + "weight"
        ours_s, theirs_s = ours[key].view(torch.uint8), theirs[key].view(torch.uint8)
        assert ours[weight].dtype == theirs[weight].dtype and ours_s.shape == theirs_s.shape, key
        assert ((ours_s == theirs_s) | (ours_s == theirs_s - 1)).all(), key  # the same, or half
        rows = (ours_s == theirs_s).all(-1) if ours[weight].dtype == torch.int8 else None
        if rows is None:  # FP8 32 x 32 tiles: compare whole tensors whose tiles all agree
            if torch.equal(ours_s, theirs_s):
                assert torch.equal(ours[weight].view(torch.uint8), theirs[weight].view(torch.uint8)), weight
                same += 1
            continue
        blocks = (ours_s == theirs_s).repeat_interleave(16, dim=-1)  # one scale per 32 values = 16 packed bytes
        assert torch.equal(ours[weight].view(torch.uint8)[blocks], theirs[weight].view(torch.uint8)[blocks]), weight
        same += int(rows.sum())
        differ += int((~(ours_s == theirs_s)).sum())
    assert same > 100 and differ > 0, (same, differ)
    again = load_dspark_drafter(str(tmp_path / "q")).state_dict()
    for name, value in loaded.state_dict().items():
        assert torch.equal(again[name], _as_stored(name, value, "quantized")), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_and_reload_are_exact(loaded, tmp_path, dtype):
    export_dspark_drafter(loaded, str(tmp_path / dtype), dtype=dtype)
    again = load_dspark_drafter(str(tmp_path / dtype)).state_dict()
    for name, value in loaded.state_dict().items():
        assert torch.equal(again[name], _as_stored(name, value, dtype)), name


@pytest.mark.parametrize("dtype", ["float32", "quantized"])
def test_the_reference_adapter_reads_our_export(loaded, tmp_path, dtype):
    path = str(tmp_path / dtype)
    export_dspark_drafter(loaded, path, dtype=dtype)
    ref = build_drafter_reference(_config(), 5, 4)
    read = _reference_reads(ref, _read_dir(path))
    ours = load_dspark_drafter(path).state_dict()
    assert set(read) == set(ours)
    for name, value in read.items():
        assert torch.equal(value.float(), ours[name]), name
    if dtype == "float32":
        for name, value in loaded.state_dict().items():
            assert torch.equal(read[name].float(), value), name


def test_export_beside_a_target(release, tmp_path):
    config = _config()
    torch.manual_seed(0)
    target = build_causal_lm(config)
    path = str(tmp_path / "hf")
    export_hf_checkpoint(target, path, dtype="float32")
    drafter = DSparkDrafter(config)
    drafter.copy_target_embeddings(target)
    report = export_dspark_drafter(drafter, path, dtype="float32")
    assert report.files == ["dspark-00001-of-00001.safetensors"]
    assert not any(k in report.weight_map for k in ("embed.weight", "head.weight"))  # the target's are there
    index = json.load(open(os.path.join(path, INDEX_FILE)))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in _indexed(path).values())
    assert any(k.startswith("mtp.2.markov_head") for k in index["weight_map"])
    back = load_dspark_drafter(path).state_dict()
    for name, value in drafter.state_dict().items():
        assert torch.equal(back[name], value), name
    reloaded = load_model_from_hf(path)  # the target loads from the same directory, skipping mtp.*
    for name, value in target.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], value), name
    with pytest.raises(ValueError, match="overwrite=True"):
        export_dspark_drafter(drafter, path)
    with torch.no_grad():
        drafter.last.norm.weight.add_(1.0)
    export_dspark_drafter(drafter, path, dtype="float32", overwrite=True)
    assert sorted(n for n in os.listdir(path) if n.startswith("dspark-")) == ["dspark-00001-of-00001.safetensors"]
    assert torch.equal(load_dspark_drafter(path).last.norm.weight, drafter.last.norm.weight)
    other = DSparkDrafter(DSV4Config.preset("v41_tiny", engram_layer_ids=[], engram_num_embeddings=[],
                                            dspark_markov_rank=8))
    with pytest.raises(ValueError, match="dspark_markov_rank=16 there, 8 in the drafter"):
        export_dspark_drafter(other, path, overwrite=True)


def test_replacing_a_released_drafter_in_place(release, loaded):
    with tempfile.TemporaryDirectory() as path:
        write_release_dir(path, release["tensors"], json.load(open(os.path.join(release["path"], "config.json"))))
        with pytest.raises(ValueError, match="already holds"):
            export_dspark_drafter(loaded, path, dtype="float32")
        export_dspark_drafter(loaded, path, dtype="float32", overwrite=True)
        held = _indexed(path)
        assert held["mtp.0.attn.wq_a.weight"].dtype == torch.float32  # the new drafter's, not the release's FP8
        assert BACKBONE[0] in held  # the rest of the directory is untouched
        back = load_dspark_drafter(path).state_dict()
        for name, value in loaded.state_dict().items():
            assert torch.equal(back[name], value), name


def test_refusals(release, tmp_path):
    torch.manual_seed(0)
    v4 = str(tmp_path / "v4")
    export_hf_checkpoint(build_causal_lm(DSV4Config.preset("tiny")), v4)
    with pytest.raises(ValueError, match="deepseek_v4"):
        load_dspark_drafter(v4)
    partial = str(tmp_path / "partial")
    tensors = {k: v for k, v in release["tensors"].items() if not k.startswith("mtp.2.markov_head.head")}
    write_release_dir(partial, tensors, json.load(open(os.path.join(release["path"], "config.json"))))
    with pytest.raises(KeyError, match="mtp.2.markov_head.head.weight"):
        load_dspark_drafter(partial)
    with pytest.raises(ValueError, match="compress_ratios needs 15 entries whose last 3"):
        DSparkDrafter(DSV4Config.preset("v41_tiny", compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 1]))
