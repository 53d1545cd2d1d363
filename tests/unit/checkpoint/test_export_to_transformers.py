"""An export (fp32, bf16, quantized) loads in transformers' ``AutoModelForCausalLM`` with no missing or unexpected
keys and the logits of the model that wrote it; its ``config.json`` carries the release's fields."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from dsv4.checkpoint import config_to_hf, export_hf_checkpoint, load_model_from_hf
from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM
from tests.unit.checkpoint.hf_reference import indexer_ties, relative_error

L = 256  # the ratio-128 layer compresses twice


@pytest.fixture(scope="module")
def source():
    torch.manual_seed(0)
    model = DSV4ForCausalLM(DSV4Config.preset("tiny", index_n_heads=8)).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the tensors a fresh model holds at zero or one, random too
        for name, p in model.named_parameters():
            if name.endswith(("sink.logits", "ape", ".base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "quantized"])
def test_export_loads_in_transformers_with_the_same_logits(source, tmp_path, dtype):
    export_hf_checkpoint(source, str(tmp_path), dtype=dtype)
    hf, info = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32, output_loading_info=True)
    hf.eval()
    # mtp.* keys are transformers' to ignore (it builds no MTP block); nothing else is missing or unexpected
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    assert all(k.startswith("mtp.") for k in info["unexpected_keys"]), info["unexpected_keys"]
    # the reference: the exported weights as dsv4 reads them back (fp32 = the source itself)
    ours = source if dtype == "float32" else load_model_from_hf(str(tmp_path), torch_dtype="float32",
                                                                 attention_chunk_size=64).eval()
    ids = torch.randint(0, 256, (2, L), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), indexer_ties(hf) as ties:
        want = hf(ids).logits
        got = ours(ids).logits
    assert ties and not any(ties), ties
    err = relative_error(got, want)
    assert err < 1e-5, err


def test_exported_config_has_the_release_fields(source, tmp_path):
    export_hf_checkpoint(source, str(tmp_path / "q"), dtype="quantized")
    export_hf_checkpoint(source, str(tmp_path / "b"), dtype="bfloat16")
    q = json.loads((tmp_path / "q" / "config.json").read_text())
    b = json.loads((tmp_path / "b" / "config.json").read_text())
    # num_hidden_layers + num_nextn_predict_layers entries, the MTP block's last (sliding window only: 0)
    assert q["compress_ratios"] == b["compress_ratios"] == [0, 4, 128, 4, 0]
    assert q["expert_dtype"] == "fp4" and "expert_dtype" not in b
    assert q["quantization_config"]["weight_block_size"] == [128, 128] and "quantization_config" not in b
    for field in ("architectures", "model_type", "norm_topk_prob", "topk_method", "scoring_func", "rope_scaling",
                  "num_nextn_predict_layers", "num_hash_layers", "qk_rope_head_dim", "rms_norm_eps",
                  "max_position_embeddings", "hidden_act", "torch_dtype"):
        assert field in q, field
    flash = config_to_hf(DSV4Config.preset("flash"), quantized=True)  # 43 layers + 1 MTP block, as released
    assert len(flash["compress_ratios"]) == 44 and flash["compress_ratios"][-2:] == [4, 0]
