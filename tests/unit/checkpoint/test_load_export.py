"""Loading synthetic release-format checkpoints, the checks before loading, export round trips and inspect."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv4.checkpoint import CheckpointDir, export_hf_checkpoint, load_hf_checkpoint, load_model_from_hf
from dsv4.checkpoint import keys as K
from dsv4.checkpoint.__main__ import main as cli_main
from dsv4.checkpoint.hf_config import INDEX_FILE
from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM
from tests.unit.checkpoint.helpers import synthetic_release_checkpoint, write_raw_safetensors


def _model(seed=0, **overrides):
    torch.manual_seed(seed)
    return DSV4ForCausalLM(DSV4Config.preset("tiny", **overrides))


def _value(model, hf_key):
    mapped = K.hf_to_ours(hf_key)
    t = model.state_dict()[mapped.name]
    return t if mapped.expert is None else t[mapped.expert]


@pytest.fixture(scope="module")
def release_ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("release"))
    expected = synthetic_release_checkpoint(_model(0), path, num_shards=3)
    return path, expected


def test_release_checkpoint_dequantises_to_known_values(release_ckpt):
    path, expected = release_ckpt
    model = _model(1)
    report = load_hf_checkpoint(model, path)
    for key, value in expected.items():
        got = _value(model, key)
        assert got.dtype == (torch.int64 if key.endswith("tid2eid") else torch.float32), key
        assert torch.equal(got, value.to(got.dtype)), key
    ckpt = CheckpointDir.open(path)
    assert sorted(report.keys_read) == sorted(ckpt.tensors)  # every key once, scales included
    assert report.shards == sorted(ckpt.files) and report.bytes_read == sum(t.nbytes for t in ckpt.tensors.values())


def test_bf16_model_gets_the_same_values(release_ckpt):
    path, expected = release_ckpt
    model = _model(1).to(torch.bfloat16)
    load_hf_checkpoint(model, path)
    for key in ("layers.1.attn.wq_b.weight", "layers.2.ffn.experts.5.w2.weight", "mtp.0.e_proj.weight"):
        assert torch.equal(_value(model, key).float(), expected[key])  # exact: power-of-two scales


def test_expert_range_reads_only_those_keys(release_ckpt):
    path, expected = release_ckpt
    model = _model(1)
    report = load_hf_checkpoint(model, path, ep_rank=1, ep_size=2)
    experts = [k for k in report.keys_read if ".experts." in k]
    assert experts and all(4 <= int(k.split(".experts.")[1].split(".")[0]) < 8 for k in experts)
    assert len(experts) == 5 * 4 * 3 * 2  # 4 layers + 1 MTP, 4 experts, w1/w3/w2, weight + scale
    assert torch.equal(_value(model, "layers.3.ffn.experts.6.w1.weight"), expected["layers.3.ffn.experts.6.w1.weight"])


def test_mtp_keys_skipped_when_mtp_disabled(release_ckpt):
    path, _ = release_ckpt
    model = _model(1, num_nextn_predict_layers=0)
    report = load_hf_checkpoint(model, path)
    assert report.skipped and all(k.startswith("mtp.") for k in report.skipped)
    assert not any(k.startswith("mtp.") for k in report.keys_read)


def _copy_with(path, dst, drop=(), add=None, replace=None):
    ckpt = CheckpointDir.open(path)
    tensors = {}
    for name in ckpt.files:
        tensors.update(load_file(os.path.join(path, name)))
    for k in drop:
        tensors.pop(k)
    tensors.update(add or {})
    tensors.update(replace or {})
    os.makedirs(dst, exist_ok=True)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    return dst


def test_missing_key_is_named(release_ckpt, tmp_path):
    path, _ = release_ckpt
    bad = _copy_with(path, str(tmp_path / "m"), drop=["layers.2.attn.wo_a.weight", "layers.2.attn.wo_a.scale"])
    with pytest.raises(KeyError, match=r"missing key.*layers\.2\.attn\.wo_a\.weight"):
        load_hf_checkpoint(_model(1), bad)


def test_unexpected_key_is_named(release_ckpt, tmp_path):
    path, _ = release_ckpt
    bad = _copy_with(path, str(tmp_path / "u"), add={"layers.0.attn.bogus.weight": torch.zeros(2)})
    with pytest.raises(KeyError, match=r"unexpected key.*layers\.0\.attn\.bogus\.weight"):
        load_hf_checkpoint(_model(1), bad)


def test_shape_mismatch_is_named(release_ckpt, tmp_path):
    path, _ = release_ckpt
    bad = _copy_with(path, str(tmp_path / "s"), replace={"layers.1.attn.kv_norm.weight": torch.zeros(31)})
    with pytest.raises(ValueError, match=r"layers\.1\.attn\.kv_norm\.weight: shape \[31\].*\[32\]"):
        load_hf_checkpoint(_model(1), bad)
    with pytest.raises(ValueError, match=r"\.attn\.(wq_a|wq_b|q_norm)\.weight: shape .* does not match the model's"):
        load_hf_checkpoint(_model(1, q_lora_rank=48), path)  # config does not match the checkpoint


def test_fp4_scale_shape_mismatch_is_named(release_ckpt, tmp_path):
    path, _ = release_ckpt
    key = "layers.1.ffn.experts.0.w2.scale"
    bad = _copy_with(path, str(tmp_path / "sc"), replace={key: torch.ones(64, 2).to(torch.float8_e8m0fnu)})
    with pytest.raises(ValueError, match=r"experts\.0\.w2\.scale: scale shape \[64, 2\], expected \[64, 1\]"):
        load_hf_checkpoint(_model(1), bad)


def test_unknown_dtype_is_named(tmp_path):
    model = _model(0, num_nextn_predict_layers=0)
    export_hf_checkpoint(model, str(tmp_path), dtype="float32")
    index = json.load(open(tmp_path / INDEX_FILE))
    write_raw_safetensors(str(tmp_path / "extra.safetensors"), {"norm.weight": ("F4_WEIRD", [64], b"\0" * 32)})
    index["weight_map"]["norm.weight"] = "extra.safetensors"
    json.dump(index, open(tmp_path / INDEX_FILE, "w"))
    with pytest.raises(ValueError, match=r"norm\.weight: unknown dtype 'F4_WEIRD'"):
        load_hf_checkpoint(model, str(tmp_path))


def _bf16_valued(model):
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return model


def test_bf16_export_round_trip_identical_params_and_logits(tmp_path):
    model = _bf16_valued(_model(0))
    report = export_hf_checkpoint(model, str(tmp_path), dtype="bfloat16", max_shard_bytes=100_000)
    assert len(report.files) > 1 and os.path.exists(tmp_path / "config.json")
    index = json.load(open(tmp_path / INDEX_FILE))
    assert index["metadata"]["total_size"] == report.total_size and set(index["weight_map"]) == set(report.weight_map)
    ckpt = CheckpointDir.open(str(tmp_path))
    assert ckpt.tensors["layers.1.attn.wq_a.weight"].dtype == "BF16"
    assert ckpt.tensors["layers.1.hc_attn_fn"].dtype == "F32" and ckpt.tensors["layers.0.ffn.gate.tid2eid"].dtype == "I64"
    assert not any(K.is_scale_key(k) for k in ckpt.tensors)

    loaded = load_model_from_hf(str(tmp_path), torch_dtype="float32", attention_chunk_size=64)
    ref, got = model.state_dict(), loaded.state_dict()
    assert ref.keys() == got.keys()
    for k in ref:
        assert torch.equal(ref[k], got[k]), k
    ids = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(ids), loaded(ids)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.mtp_logits[0], b.mtp_logits[0])


def test_quantized_export_matches_release_layout_and_reloads(tmp_path):
    model = _model(0)
    export_hf_checkpoint(model, str(tmp_path), dtype="quantized")
    ckpt = CheckpointDir.open(str(tmp_path))
    assert ckpt.tensors["layers.1.attn.wo_b.weight"].dtype == "F8_E4M3"
    assert ckpt.tensors["layers.1.attn.wo_b.scale"].dtype == "F8_E8M0"
    assert ckpt.tensors["layers.1.ffn.experts.3.w1.weight"].shape == (32, 32)  # [I, H/2]
    assert ckpt.tensors["layers.1.ffn.experts.3.w1.scale"].shape == (32, 2)  # [I, H/32]
    assert ckpt.tensors["layers.1.attn.compressor.wkv.weight"].dtype == "BF16"
    assert json.load(open(tmp_path / "config.json"))["quantization_config"]["scale_fmt"] == "ue8m0"
    loaded = _model(1)
    load_hf_checkpoint(loaded, str(tmp_path))
    w = model.state_dict()["model.layers.1.mlp.experts.w1"]
    got = loaded.state_dict()["model.layers.1.mlp.experts.w1"]
    assert ((got - w).abs() <= w.abs().amax() * 0.2).all()  # FP4: at most a grid step at the group's scale
    w = model.state_dict()["model.layers.1.self_attn.wq_a.weight"]
    got = loaded.state_dict()["model.layers.1.self_attn.wq_a.weight"]
    assert ((got - w).abs() <= w.abs() * 2.0**-4 + w.abs().amax() * 2.0**-9).all()  # e4m3 rounding


def test_export_refuses_expert_sharded_model(tmp_path):
    from dsv4.parallel.expert_shard import shard_experts

    model = _model(0)
    shard_experts(model, ep_rank=0, ep_size=2)
    with pytest.raises(ValueError, match="unshard_experts"):
        export_hf_checkpoint(model, str(tmp_path))


def test_inspect_cli_reads_headers_only(release_ckpt, capsys):
    path, _ = release_ckpt
    assert cli_main(["inspect", path]) == 0
    text = capsys.readouterr().out
    assert "n_routed_experts: 8" in text and "F8_E4M3" in text and "I8" in text and "total size:" in text
    assert cli_main(["inspect", path, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    ckpt = CheckpointDir.open(path)
    assert info["num_tensors"] == len(ckpt.tensors) and info["num_shards"] == 3 and info["config_valid"]
    assert info["total_bytes"] == sum(t.nbytes for t in ckpt.tensors.values())
    assert cli_main(["inspect", path + "/nope"]) == 2


def test_a_missing_mtp_depth_is_refused_or_initialised_when_asked(tmp_path, caplog):
    """A checkpoint of one MTP depth, a model of two: refused before anything is read, naming the depth, the
    checkpoint and both ways out; with ``init_missing_mtp`` depth 1 keeps its initialisation (one INFO line) and
    everything else is the checkpoint's; with ``num_nextn_predict_layers=1`` it loads as it is."""
    import logging

    source = _model(0)
    export_hf_checkpoint(source, str(tmp_path), dtype="float32")
    model = _model(1, num_nextn_predict_layers=2)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError) as err:
        load_hf_checkpoint(model, str(tmp_path))
    assert (f"{tmp_path} (release layout) holds no weights for MTP depth(s) [1] of the 2 the model builds "
            "(model.num_nextn_predict_layers=2; no key mtp.1.*): set model.num_nextn_predict_layers=1 to build only "
            "the depths it holds, or model.init_missing_mtp=true") in str(err.value)
    assert all(torch.equal(v, init[k]) for k, v in model.state_dict().items())  # nothing was read
    with caplog.at_level(logging.INFO, logger="dsv4"):
        report = load_hf_checkpoint(model, str(tmp_path), init_missing_mtp=True)
    assert (f"{tmp_path} (release layout) holds no weights for MTP depth(s) [1]: they keep their initialisation "
            f"({len(report.fresh)} tensors; model.init_missing_mtp=true)") in caplog.text
    assert report.fresh == sorted(k for k in init if k.startswith("mtp.layers.1.")) and report.fresh
    want = source.state_dict()
    for k, v in model.state_dict().items():
        assert torch.equal(v, init[k] if k.startswith("mtp.layers.1.") else want[k]), k
    load_hf_checkpoint(_model(2, num_nextn_predict_layers=1), str(tmp_path))
