"""Reading what transformers' ``save_pretrained`` writes for ``DeepseekV4ForCausalLM`` (config fields and tensor
names), checked against transformers' own forward; and the config refusals (a field the model uses is read from the
file or refused by name)."""

import dataclasses
import json
import logging
import subprocess
import sys

import pytest
import torch

from dsv4.checkpoint import CheckpointDir, load_hf_checkpoint, load_model_from_hf
from dsv4.checkpoint.hf_config import config_from_hf
from dsv4.checkpoint.layouts import detect_layout, transformers_to_release
from dsv4.model import DSV4ForCausalLM
from tests.unit.checkpoint.hf_reference import C, H, S, indexer_ties, random_hf_model, relative_error, tiny_hf_config

L = 96


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A random transformers model and its save_pretrained directory (HCA ratio 8, so L=96 compresses)."""
    model = random_hf_model(tiny_hf_config())
    path = tmp_path_factory.mktemp("hf_saved")
    model.save_pretrained(str(path))
    return model, str(path)


def test_save_pretrained_layout_is_read(saved):
    _, path = saved
    keys = CheckpointDir.open(path).tensors
    assert detect_layout(keys) == "transformers"
    assert {"model.embed_tokens.weight", "model.hc_head.hc_fn", "head.weight", "model.layers.1.attn.norm.weight",
            "model.layers.2.ffn.experts.7.w2.weight"} <= set(keys) and not any(k.startswith("mtp.") for k in keys)
    assert transformers_to_release("model.layers.1.attn.norm.weight") == "layers.1.attn.kv_norm.weight"
    assert transformers_to_release("model.layers.1.attn.compressor.norm.weight") == "layers.1.attn.compressor.norm.weight"
    assert transformers_to_release("model.hc_head.hc_scale") == "hc_head_scale"
    cfg = config_from_hf(path)
    assert cfg.compress_ratios == [0, 4, 8, 4, 0] and cfg.num_hash_layers == 1 and cfg.qk_rope_head_dim == 16
    assert cfg.rope_scaling == {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64,
                                "beta_fast": 32.0, "beta_slow": 1.0}
    assert (cfg.rope_theta, cfg.compress_rope_theta, cfg.topk_method) == (10000.0, 160000.0, "noaux_tc")


def test_save_pretrained_loads_with_transformers_logits(saved, caplog):
    model, path = saved
    # transformers builds no MTP block: the model's MTP depth is refused, naming the ways out, before any read
    with pytest.raises(ValueError) as err:
        load_model_from_hf(path, attention_chunk_size=64)
    assert (f"{path} (transformers layout) holds no weights for MTP depth(s) [0] of the 1 the model builds "
            "(model.num_nextn_predict_layers=1; no key mtp.0.*): set model.num_nextn_predict_layers=0 to build only "
            "the depths it holds, or model.init_missing_mtp=true") in str(err.value)
    # asked for, it keeps its initialisation and says which depth
    with caplog.at_level(logging.INFO, logger="dsv4"):
        ours = load_model_from_hf(path, attention_chunk_size=64, init_missing_mtp=True).eval()
    assert (f"{path} (transformers layout) holds no weights for MTP depth(s) [0]: they keep their initialisation "
            "(32 tensors; model.init_missing_mtp=true)") in caplog.text
    ids = torch.randint(0, 256, (2, L), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), indexer_ties(model) as ties:
        want = model(ids).logits
        got = ours(ids).logits
    assert ties and not any(ties), ties  # the comparison is free of exact indexer ties (see hf_reference)
    err = relative_error(got, want)
    assert err < 1e-5, err


def test_no_mtp_from_the_file(saved):
    _, path = saved
    ours = DSV4ForCausalLM(config_from_hf(path, num_nextn_predict_layers=0, attention_chunk_size=64))
    report = load_hf_checkpoint(ours, path)
    assert report.layout == "transformers" and report.fresh == [] and report.skipped == []
    assert not any(name.startswith("mtp.") for name in ours.state_dict())


def test_no_yarn_is_no_yarn_and_says_so(tmp_path, caplog):
    model = random_hf_model(tiny_hf_config(rope_parameters=None, num_nextn_predict_layers=0))
    model.save_pretrained(str(tmp_path))
    assert model.config.rope_parameters["compress"]["rope_type"] == "default"
    with caplog.at_level(logging.WARNING, logger="dsv4"):
        ours = load_model_from_hf(str(tmp_path), attention_chunk_size=64).eval()
    assert ours.config.rope_scaling is None and "no YaRN" in caplog.text
    ids = torch.randint(0, 256, (1, L), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), indexer_ties(model) as ties:
        want = model(ids).logits
    assert not any(ties)
    assert relative_error(ours(ids).logits.detach(), want) < 1e-5


def test_release_config_without_rope_scaling_is_no_yarn(caplog):
    from tests.unit.checkpoint.test_keys_and_config import FLASH_JSON

    data = {k: v for k, v in FLASH_JSON.items() if k != "rope_scaling"}
    with caplog.at_level(logging.WARNING, logger="dsv4"):
        cfg = config_from_hf(data)
    assert cfg.rope_scaling is None and "no rope_scaling: no YaRN" in caplog.text


@pytest.mark.parametrize("drop", ["hidden_size", "compress_ratios", "topk_method", "rms_norm_eps", "torch_dtype"])
def test_a_missing_field_is_refused_by_name(drop):
    from tests.unit.checkpoint.test_keys_and_config import FLASH_JSON

    data = {k: v for k, v in FLASH_JSON.items() if k not in (drop, "dtype")}
    if drop != "torch_dtype":
        data["dtype"] = "bfloat16"
    with pytest.raises(KeyError, match=rf"no \['{drop}'\]"):
        config_from_hf(data)


@pytest.mark.parametrize("change, message", [
    ({"compress_rates": {C: 8, H: 128}}, "compress_rates['compressed_sparse_attention']=8"),
    ({"compress_rates": {C: 4, H: 4}}, "compress_rates['heavily_compressed_attention']=4"),
    ({"mlp_layer_types": ["moe", "hash_moe", "moe", "moe"]}, "mlp_layer_types must be hash_moe layers first"),
    ({"rope_parameters": {"main": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                                   "original_max_position_embeddings": 64},
                          "compress": {"rope_type": "default", "rope_theta": 1.6e5}}},
     "rope_parameters['main']['rope_type']='yarn'"),
    ({"layer_types": [S, C, H]}, "layer_types has 3 entries, num_hidden_layers=4"),
])
def test_transformers_config_refusals_name_the_field(change, message):
    data = tiny_hf_config().to_dict()
    data.update(change)
    with pytest.raises(ValueError) as err:
        config_from_hf(data)
    assert message in str(err.value)


def test_attention_factor_other_than_one_is_refused():
    data = tiny_hf_config().to_dict()
    data["rope_parameters"]["compress"]["attention_factor"] = 1.277
    with pytest.raises(ValueError, match=r"\['attention_factor'\]=1.277"):
        config_from_hf(data)


def test_norm_topk_prob_false_is_refused():
    from tests.unit.checkpoint.test_keys_and_config import FLASH_JSON

    with pytest.raises(ValueError, match="norm_topk_prob: must be true, got False"):
        config_from_hf({**FLASH_JSON, "norm_topk_prob": False})


def test_inspect_names_the_layout(saved):
    _, path = saved
    out = subprocess.run([sys.executable, "-m", "dsv4.checkpoint", "inspect", path, "--json"], capture_output=True,
                         text=True, check=True)
    info = json.loads(out.stdout)
    assert info["layout"] == "transformers" and info["has_mtp"] is False and info["config_valid"] is True
    assert info["num_tensors"] == len(CheckpointDir.open(path).tensors)
    assert info["dsv4_config"]["compress_ratios"] == [0, 4, 8, 4, 0] and info["dsv4_config"]["num_hash_layers"] == 1


def test_in_memory_names_with_fused_experts_load_the_same(saved, tmp_path):
    """``save_pretrained(save_original_format=False)``: transformers' module names, experts fused per layer."""
    model, path = saved
    model.save_pretrained(str(tmp_path), save_original_format=False)
    keys = CheckpointDir.open(str(tmp_path)).tensors
    assert {"lm_head.weight", "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight",
            "model.layers.1.mlp.experts.gate_up_proj"} <= set(keys)
    native = load_model_from_hf(str(tmp_path), attention_chunk_size=64, num_nextn_predict_layers=0)
    reverted = load_model_from_hf(path, attention_chunk_size=64, num_nextn_predict_layers=0)
    a, b = native.state_dict(), reverted.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a if not k.startswith("mtp."))
    # each expert is a byte range of the fused tensor: an EP rank reads its own experts only
    half = DSV4ForCausalLM(config_from_hf(str(tmp_path), attention_chunk_size=64, num_nextn_predict_layers=0))
    report = load_hf_checkpoint(half, str(tmp_path), ep_rank=1, ep_size=2)
    experts = [k for k in report.keys_read if ".ffn.experts." in k]
    assert len(experts) == 4 * 4 * 3 and all(int(k.split(".")[4]) >= 4 for k in experts)
    for name, t in half.state_dict().items():
        if name.startswith("model.") and name.endswith(("experts.w1", "experts.w2", "experts.w3")):
            assert torch.equal(t[4:], b[name][4:]), name


def test_a_model_that_computes_differently_from_the_file_is_refused(saved):
    """What no shape shows (YaRN, the window, routing) must agree with config.json too: `model.checkpoint=` with a
    preset that differs is refused naming each field and the file's value."""
    _, path = saved
    cfg = config_from_hf(path, attention_chunk_size=64, num_nextn_predict_layers=0)
    other = DSV4ForCausalLM(dataclasses.replace(cfg, rope_scaling=None, sliding_window=32))
    with pytest.raises(ValueError) as err:
        load_hf_checkpoint(other, path)
    assert "model.sliding_window=16 (the model has 32)" in str(err.value)
    assert 'model.rope_scaling={"type": "yarn", "factor": 16.0' in str(err.value) and "(the model has null)" in str(
        err.value)
