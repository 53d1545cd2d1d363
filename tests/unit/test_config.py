"""DSV4Config: defaults, presets, validation messages, MTP ratio rule, dict round trip."""

import pytest

from dsv4.config import DSV4Config


def test_defaults_are_flash():
    c = DSV4Config()
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.head_dim) == (4096, 43, 64, 512)
    assert (c.qk_rope_head_dim, c.q_lora_rank, c.o_lora_rank, c.o_groups) == (64, 1024, 1024, 8)
    assert (c.n_routed_experts, c.n_shared_experts, c.num_experts_per_tok) == (256, 1, 6)
    assert (c.sliding_window, c.index_topk, c.index_n_heads, c.index_head_dim) == (128, 512, 64, 128)
    assert c.rope_scaling["factor"] == 16 and c.rope_scaling["original_max_position_embeddings"] == 65536
    # 2 SWA layers, CSA at even indices 2..42, HCA at odd indices 3..41
    r = c.compress_ratios
    assert len(r) == 43 and r[:2] == [0, 0]
    assert [i for i, x in enumerate(r) if x == 4] == list(range(2, 43, 2))
    assert [i for i, x in enumerate(r) if x == 128] == list(range(3, 42, 2))
    assert DSV4Config.preset("flash") == c
    assert c.shard_multiple == 128


def test_tiny_preset_exercises_every_layer_kind():
    c = DSV4Config.preset("tiny")
    assert c.compress_ratios == [0, 4, 128, 4]
    assert c.shard_multiple == 128  # lcm(2*4, 128)
    assert c.sliding_window < 128 and c.torch_dtype == "float32"
    assert c.num_attention_heads % c.o_groups == 0


def test_pro_preset():
    c = DSV4Config.preset("pro")
    assert c.num_hidden_layers == 61 and len(c.compress_ratios) == 61
    assert c.compress_ratios[:4] == [128, 128, 4, 128]
    assert (c.n_routed_experts, c.num_experts_per_tok, c.hidden_size, c.o_groups) == (384, 6, 7168, 16)


def test_preset_overrides_and_unknown_preset():
    assert DSV4Config.preset("tiny", sliding_window=8).sliding_window == 8
    with pytest.raises(ValueError, match="unknown preset"):
        DSV4Config.preset("huge")


def test_empty_ratios_mean_all_zero():
    c = DSV4Config.preset("tiny", compress_ratios=[])
    assert c.compress_ratios == [0, 0, 0, 0]
    assert c.active_ratios == [] and c.shard_multiple == 1


def test_ratio_for_layer_mtp_reads_zero_beyond_list():
    c = DSV4Config.preset("tiny")
    assert [c.ratio_for_layer(i) for i in range(5)] == [0, 4, 128, 4, 0]
    c2 = DSV4Config.preset("tiny", compress_ratios=[0, 4, 128, 4, 128])  # a 5th entry for the MTP layer
    assert c2.ratio_for_layer(4) == 128


@pytest.mark.parametrize(
    "overrides, field, numbers",
    [
        ({"compress_ratios": [0, 4, 128]}, "compress_ratios", "3"),
        ({"compress_ratios": [0, 4, 128, 4, 4, 4]}, "compress_ratios", "6"),
        ({"compress_ratios": [0, -4, 128, 4]}, "compress_ratios", "-4"),
        ({"head_dim": 31}, "head_dim", "31"),
        ({"qk_rope_head_dim": 15}, "qk_rope_head_dim", "15"),
        ({"qk_rope_head_dim": 64}, "qk_rope_head_dim", "64"),
        ({"index_head_dim": 8}, "index_head_dim", "8"),
        ({"index_head_dim": 33}, "index_head_dim", "33"),
        ({"index_topk": 0}, "index_topk", "0"),
        ({"o_groups": 3}, "o_groups", "3"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok", "9"),
        ({"num_hash_layers": 5}, "num_hash_layers", "5"),
        ({"hc_mult": 0}, "hc_mult", "0"),
        ({"sliding_window": 0}, "sliding_window", "0"),
        ({"scoring_func": "relu"}, "scoring_func", "relu"),
        ({"num_key_value_heads": 2}, "num_key_value_heads", "2"),
        ({"tie_word_embeddings": True}, "tie_word_embeddings", "True"),
        ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling", "linear"),
        ({"attention_chunk_size": 0}, "attention_chunk_size", "0"),
    ],
)
def test_validation_names_field_and_numbers(overrides, field, numbers):
    with pytest.raises(ValueError) as err:
        DSV4Config.preset("tiny", **overrides)
    assert field in str(err.value) and numbers in str(err.value)


def test_index_dims_only_checked_with_ratio_4():
    DSV4Config.preset("tiny", compress_ratios=[0, 128, 128, 0], index_head_dim=8)  # no CSA layer: accepted


def test_dict_round_trip_and_unknown_keys():
    c = DSV4Config.preset("tiny")
    d = c.to_dict()
    assert DSV4Config.from_dict(d) == c
    d["compress_rates"] = d.pop("compress_ratios")  # transformers' built-in spelling
    assert DSV4Config.from_dict(d).compress_ratios == [0, 4, 128, 4]
    with pytest.raises(ValueError, match="unknown keys"):
        DSV4Config.from_dict({**c.to_dict(), "model_type": "deepseek_v4"})
    assert DSV4Config.from_dict({**c.to_dict(), "model_type": "x"}, ignore_unknown=True) == c
