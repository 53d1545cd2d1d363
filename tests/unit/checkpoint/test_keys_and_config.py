"""Key adapter (both directions) and config.json <-> DSV4Config."""

import dataclasses

import pytest

from dsv4.checkpoint import keys as K
from dsv4.checkpoint.hf_config import config_from_hf, config_to_hf
from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM


@pytest.fixture(scope="module")
def tiny_model():
    return DSV4ForCausalLM(DSV4Config.preset("tiny"))


def test_every_model_key_round_trips(tiny_model):
    for name in tiny_model.state_dict():
        if K.is_stacked_expert(name):
            for e in (0, 7):
                hf = K.ours_to_hf(name, e)
                assert K.hf_to_ours(hf) == K.OurKey(name, e)
        else:
            hf = K.ours_to_hf(name)
            assert hf is not None and not hf.startswith("model."), name
            assert K.hf_to_ours(hf) == K.OurKey(name)


@pytest.mark.parametrize(
    "hf, ours",
    [
        ("embed.weight", "model.embed_tokens.weight"),
        ("head.weight", "lm_head.weight"),
        ("norm.weight", "model.norm.weight"),
        ("hc_head_scale", "model.hc_head.hc_scale"),
        ("layers.3.attn_norm.weight", "model.layers.3.input_layernorm.weight"),
        ("layers.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight"),
        ("layers.3.hc_attn_fn", "model.layers.3.attn_hc.fn"),
        ("layers.3.hc_ffn_scale", "model.layers.3.ffn_hc.scale"),
        ("layers.3.attn.attn_sink", "model.layers.3.self_attn.sink.logits"),
        ("layers.3.attn.compressor.ape", "model.layers.3.self_attn.compressor.ape"),
        ("layers.3.attn.indexer.compressor.norm.weight", "model.layers.3.self_attn.indexer.compressor.norm.weight"),
        ("layers.3.attn.indexer.wq_b.weight", "model.layers.3.self_attn.indexer.wq_b.weight"),
        ("layers.3.ffn.gate.bias", "model.layers.3.mlp.gate.e_score_correction_bias"),
        ("layers.0.ffn.gate.tid2eid", "model.layers.0.mlp.gate.tid2eid"),
        ("layers.3.ffn.shared_experts.w2.weight", "model.layers.3.mlp.shared_experts.w2.weight"),
        ("mtp.0.e_proj.weight", "mtp.layers.0.e_proj.weight"),
        ("mtp.0.norm.weight", "mtp.layers.0.norm.weight"),
        ("mtp.0.hc_head_fn", "mtp.layers.0.hc_head.hc_fn"),
        ("mtp.0.attn.wq_a.weight", "mtp.layers.0.self_attn.wq_a.weight"),
    ],
)
def test_named_renames(hf, ours):
    assert K.hf_to_ours(hf) == K.OurKey(ours)
    assert K.ours_to_hf(ours) == hf


def test_experts_and_unknown_keys():
    assert K.hf_to_ours("layers.2.ffn.experts.17.w3.weight") == K.OurKey("model.layers.2.mlp.experts.w3", 17)
    assert K.ours_to_hf("mtp.layers.0.mlp.experts.w2", 5) == "mtp.0.ffn.experts.5.w2.weight"
    with pytest.raises(ValueError, match="expert index"):
        K.ours_to_hf("model.layers.0.mlp.experts.w1")
    assert K.hf_to_ours("bogus.weight") is None
    assert K.hf_to_ours("layers.0.unknown") is None
    assert K.is_scale_key("layers.0.attn.wq_a.scale") and not K.is_scale_key("layers.0.hc_attn_scale")


def test_release_formats():
    assert K.on_disk_format("layers.1.attn.wo_b.weight") == "fp8"
    assert K.on_disk_format("layers.1.attn.indexer.wq_b.weight") == "fp8"
    assert K.on_disk_format("mtp.0.h_proj.weight") == "fp8"
    assert K.on_disk_format("layers.1.ffn.experts.3.w2.weight") == "fp4"
    assert K.on_disk_format("layers.1.attn.compressor.wkv.weight") == "bf16"
    assert K.on_disk_format("layers.1.attn.indexer.compressor.ape") == "f32"
    assert K.on_disk_format("layers.1.ffn.gate.bias") == "f32"
    assert K.on_disk_format("layers.0.ffn.gate.tid2eid") == "int"


FLASH_JSON = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 4096,
    "vocab_size": 129280, "num_hidden_layers": 43, "num_nextn_predict_layers": 1, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1024, "o_lora_rank": 1024,
    "o_groups": 8, "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc", "swiglu_limit": 10.0, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "num_hash_layers": 3, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "sliding_window": 128,
    "rope_theta": 10000, "compress_rope_theta": 160000, "rms_norm_eps": 1e-6, "max_position_embeddings": 1048576,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0], "dtype": "bfloat16", "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128]},
    "transformers_version": "4.57.0",
}


def test_flash_config_json_reads():
    cfg = config_from_hf(FLASH_JSON)
    assert cfg.n_routed_experts == 256 and cfg.num_hash_layers == 3 and cfg.torch_dtype == "bfloat16"
    assert len(cfg.compress_ratios) == 44 and cfg.compress_ratios[-1] == 0
    no_mtp = config_from_hf(FLASH_JSON, num_nextn_predict_layers=0)
    assert no_mtp.num_nextn_predict_layers == 0 and len(no_mtp.compress_ratios) == 43
    with pytest.raises(ValueError, match="unknown override"):
        config_from_hf(FLASH_JSON, bogus=1)


def test_config_round_trip():
    cfg = DSV4Config.preset("tiny")
    data = config_to_hf(cfg, quantized=True)
    assert data["quantization_config"]["weight_block_size"] == [128, 128] and "mtp_loss_weight" not in data
    # dsv4-only training knobs (attention_chunk_size, ...) are not part of the release config
    back = config_from_hf(data, torch_dtype=cfg.torch_dtype, attention_chunk_size=cfg.attention_chunk_size)
    # the release's compress_ratios carries one entry per MTP block (DeepSeek's inference code indexes
    # compress_ratios[n_layers + k]); quantized exports say the routed experts are FP4, as the release does
    assert data["compress_ratios"] == [0, 4, 128, 4, 0] and data["expert_dtype"] == "fp4"
    assert back == dataclasses.replace(cfg, compress_ratios=[0, 4, 128, 4, 0])
    assert "expert_dtype" not in config_to_hf(cfg)
