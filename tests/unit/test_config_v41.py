"""DSV41Config: V4.1-Flash defaults, the v41 presets and their family, role layout, validation messages, the
nested config.json, the Hydra model group."""

import pytest

from dsv4.config import DSV4Config, config_class
from dsv4.config_v41 import DSV41Config


def test_defaults_are_v41_flash_and_the_presets_pick_the_family():
    c = DSV41Config()
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.head_dim, c.q_lora_rank) == (
        5120, 40, 64, 512, 1280)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.num_hash_layers) == (384, 6, 2304, 0)
    assert c.compress_ratios == [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0] and c.rms_norm_eps == 1e-20
    assert (c.kv_source_layer_ids, c.index_source_layer_ids) == ([2, 8, 14, 20], [2, 8, 14, 20, 24, 28, 32, 36])
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (32, 128, 512)
    assert (c.candidate_source_layer_id, c.candidate_topk_blocks, c.candidate_block_size) == (20, 2048, 8)
    assert (c.engram_layer_ids, c.engram_num_embeddings) == ([1, 14], [384006168, 384016682])
    assert (c.engram_vocab_size, c.engram_n_heads, c.engram_head_dim, c.engram_compressed_vocab_size) == (
        16000000, 8, 256, 99092)
    assert (c.dspark_target_layer_ids, c.dspark_block_size, c.image_token_id) == ([37, 38, 39], 5, 129264)
    assert c.fake_quant is True and c.engram_trainable is False and c.shard_multiple == 2
    assert DSV4Config.preset("v41_flash") == c and type(DSV4Config.preset("v41_flash")) is DSV41Config
    assert (DSV41Config.model_type, DSV4Config.model_type) == ("deepseek_v41", "deepseek_v4")
    assert config_class("deepseek_v41") is DSV41Config and config_class("deepseek_v4") is DSV4Config
    assert type(DSV4Config.preset("v4_ratio2_tiny")) is DSV4Config
    with pytest.raises(ValueError, match=r"preset 'tiny' is a deepseek_v4 config"):
        DSV41Config.preset("tiny")
    with pytest.raises(ValueError, match=r"\['kv_source_layer_ids'\] are not fields of DSV4Config"):
        DSV4Config.preset("tiny", kv_source_layer_ids=[1])


def test_tiny_preset_has_every_role():
    c = DSV4Config.preset("v41_tiny")
    assert type(c) is DSV41Config and c.torch_dtype == "float32"
    roles = [c.attention_role(i) for i in range(c.num_hidden_layers)]
    assert roles == ["window", "window", "full", "reuse", "full", "reuse", "full", "reuse", "reindex", "reuse",
                     "reindex", "reuse"]
    assert [c.ratio_for_layer(i) for i in (2, 3, 6, 7)] == [2, 2, 1, 1]  # Reuse layers of both ratios
    # Reindex layers after the candidate source choose inside its candidates
    assert c.candidate_source_layer_id == 6 and [i for i in c.index_source_layer_ids if i > 6] == [8, 10]
    assert c.engram_num_embeddings == [53 + 59 + 61 + 67 + 71 + 73, 79 + 83 + 89 + 97 + 101 + 103]


@pytest.mark.parametrize(
    "overrides, field, numbers",
    [
        ({"compress_ratios": [0, 0, 4, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0]}, "compress_ratios", "(2, 4)"),
        ({"num_hash_layers": 1}, "num_hash_layers", "1"),
        ({"kv_source_layer_ids": [4, 6]}, "kv_source_layer_ids", "compressed layer 2 (ratio 2)"),
        ({"kv_source_layer_ids": [2, 4], "index_source_layer_ids": [2, 4, 8], "candidate_source_layer_id": 2},
         "kv_source_layer_ids", "compressed layer 6 (ratio 1) needs a preceding KV source of ratio 1; the last KV "
                                "source before it is layer 4 (ratio 2)"),
        ({"index_source_layer_ids": [4, 6, 8]}, "index_source_layer_ids", "missing [2]"),
        ({"index_source_layer_ids": [1, 2, 4, 6]}, "kv_source_layer_ids", "[1]"),
        ({"kv_source_layer_ids": [2, 2, 4, 6]}, "kv_source_layer_ids", "[2, 2, 4, 6]"),
        ({"engram_layer_ids": [1, 20], "engram_num_embeddings": [1, 2]}, "engram_layer_ids", "layer 20"),
        ({"candidate_source_layer_id": 8}, "candidate_source_layer_id", "layer 8"),
        ({"candidate_source_layer_id": 4}, "candidate_source_layer_id", "KV sources [6] come after"),
        ({"candidate_block_size": 0}, "candidate_block_size", "0"),
        ({"engram_num_embeddings": [384]}, "engram_num_embeddings", "1 entries"),
        ({"engram_num_embeddings": [384, 0]}, "engram_num_embeddings", "[384, 0]"),
        ({"engram_max_ngram_size": 1}, "engram_max_ngram_size", "1"),
        ({"engram_pad_token_id": 384}, "engram_pad_token_id", "384"),
        ({"qk_rope_head_dim": 32, "index_head_dim": 16}, "qk_rope_head_dim", "16"),
        ({"dspark_num_experts_per_tok": 9}, "dspark_num_experts_per_tok", "9"),
    ],
)
def test_validation_names_field_and_numbers(overrides, field, numbers):
    with pytest.raises(ValueError) as err:
        DSV4Config.preset("v41_tiny", **overrides)
    assert f"DSV41Config.{field}" in str(err.value) and numbers in str(err.value), str(err.value)


def test_nested_config_json_and_round_trip():
    c = DSV4Config.preset("v41_tiny")
    assert DSV41Config.from_dict(c.to_dict()) == c
    text = {k: v for k, v in c.to_dict().items() if k != "image_token_id"}
    nested = {"model_type": "deepseek_v41", "text_config": {**text, "model_type": "deepseek_v41_text"},
              "image_token_id": 7, "vision_config": {}}
    loaded = DSV41Config.from_dict(nested, ignore_unknown=True)
    assert loaded.image_token_id == 7 and loaded.kv_source_layer_ids == [2, 4, 6]
    with pytest.raises(ValueError, match="unknown keys"):
        DSV41Config.from_dict({**c.to_dict(), "model_type": "deepseek_v41_text"})


def test_model_group_overrides_v41_fields():
    from hydra import compose, initialize_config_dir

    from dsv4.training.schema import model_config, register_schema
    from tests.unit.test_conf import CONF

    register_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="finetune", overrides=["model=v41_tiny", "model.fake_quant=false",
                                                         "model.index_topk=2"])
        config = model_config(cfg.model)
        assert type(config) is DSV41Config and (config.fake_quant, config.index_topk) == (False, 2)
        with pytest.raises(ValueError, match="kv_source_layer_ids"):
            model_config(compose(config_name="finetune", overrides=["model=tiny",
                                                                    "model.kv_source_layer_ids=[1]"]).model)
        # fake_quant is both families' switch: off for V4 unless asked for
        assert model_config(compose(config_name="finetune", overrides=["model=tiny"]).model).fake_quant is False
        v4 = model_config(compose(config_name="finetune", overrides=["model=tiny", "model.fake_quant=true"]).model)
        assert type(v4) is DSV4Config and v4.fake_quant is True
