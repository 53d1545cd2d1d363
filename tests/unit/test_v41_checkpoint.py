"""DeepSeek-V4.1 checkpoints against NeMo Automodel 0.7.0's V4.1 (the independent reference; imported only here).

The release-layout directory is a real client's output: a tiny NeMo ``DeepseekV41ForCausalLM`` (fp32, pure-torch
backends), its state dict renamed by NeMo's own ``DeepseekV41StateDictAdapter.to_hf``, quantised into the shapes and
dtypes of the adapter's own release placeholders (``quantization=True``) by a quantiser of this module (not dsv4's),
plus DSpark ``mtp.*``, ``vision.*``, ``aligner.*`` and ``image_*`` tensors as the release holds them, written as
safetensors shards with NeMo's nested ``config.json``. The oracle for every tensor is NeMo's own
``dequantize_checkpoint_weight``. Two such directories: ``release`` (random weights, the codec / config / key /
inspect / skip checks, loaded into dsv4's V4.1 model) and ``case`` (the well-conditioned tiny V4.1 of
tests/v41_reference.py with Engram and its tokenizer: logits against the reference, exports, conversion).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dsv4.checkpoint import keys as K
from dsv4.checkpoint import quant as Q
from dsv4.checkpoint.__main__ import main as cli_main
from dsv4.checkpoint.export import export_hf_checkpoint
from dsv4.checkpoint.hf_config import config_from_hf, config_to_hf
from dsv4.checkpoint.load import load_hf_checkpoint
from dsv4.config import DSV4Config
from dsv4.config_v41 import DSV41Config
from dsv4.model import build_causal_lm
from dsv4.model.moe import GroupedExperts
from tests.v41_release import release_fp8, release_tensors, write_release_dir

TEXT = dict(
    vocab_size=384, hidden_size=64, num_hidden_layers=12, num_attention_heads=4, head_dim=32, qk_rope_head_dim=8,
    q_lora_rank=16, o_lora_rank=8, o_groups=2, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    sliding_window=4, compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0], kv_source_layer_ids=[2, 4, 6],
    index_source_layer_ids=[2, 4, 6, 8, 10], index_n_heads=8, index_head_dim=32, index_topk=4,
    candidate_source_layer_id=6, candidate_topk_blocks=3, candidate_block_size=2, engram_layer_ids=[1, 4],
    engram_num_embeddings=[384, 552], engram_vocab_size=50, engram_n_heads=2, engram_head_dim=32,
    engram_compressed_vocab_size=329, dspark_target_layer_ids=[9, 10, 11], dspark_noise_token_id=382,
    dspark_markov_rank=16, dspark_n_routed_experts=8, dspark_num_experts_per_tok=2, rms_norm_eps=1e-6,
    max_position_embeddings=1024, dtype="float32",
    rope_scaling={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64, "beta_fast": 32.0,
                  "beta_slow": 1.0},
)
RELEASE_QUANT = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                 "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
# What the release holds beside the text backbone (a few of each group), and how many.
EXTRA = {"mtp.0.attn.wq_a.weight": (16, 64), "mtp.0.attn_norm.weight": (64,), "mtp.2.main_proj.weight": (64, 192),
         "vision.patch_embed.proj.weight": (8, 3, 2, 2), "vision.blocks.0.attn.qkv.weight": (24, 8),
         "aligner.proj.weight": (64, 72), "image_start": (64,), "image_end": (64,), "image_newline": (64,)}
# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def nemo():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from nemo_automodel.components.models.deepseek_v41.state_dict_adapter import dequantize_checkpoint_weight

    # 384 ids, 329 classes after Engram's normalisation (T0..T54 lowercase onto t0..t54)
    vocab = {f"t{i}": i for i in range(329)} | {f"T{i}": 329 + i for i in range(55)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")))
    backend = BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", rope="torch", rope_fusion=False,
                            experts="torch", dispatcher="torch")
    return SimpleNamespace(Config=DeepseekV41Config, Model=DeepseekV41ForCausalLM, backend=backend,
                           tokenizer=tokenizer, dequantize=dequantize_checkpoint_weight)


@pytest.fixture(scope="module")
def release(nemo, tmp_path_factory):
    """A release-layout directory written from NeMo's tiny V4.1 (see the module docstring)."""
    config = nemo.Config(text_config=dict(TEXT), vision_config={"num_hidden_layers": 0}, image_token_id=383,
                         dtype="float32", quantization_config=dict(RELEASE_QUANT))
    torch.manual_seed(0)
    model = nemo.Model(config, backend=nemo.backend, tokenizer=nemo.tokenizer)
    with torch.no_grad():
        for name, p in model.named_parameters():  # every tensor distinct and non-trivial
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() < 2 else 0.1) + (1.0 if name.endswith("norm.weight") else 0))
    tensors = release_tensors(model.state_dict_adapter, model.state_dict())
    gen = torch.Generator().manual_seed(1)
    for key, shape in EXTRA.items():
        tensors[key] = torch.randn(shape, generator=gen).to(torch.bfloat16)
    q, s = release_fp8(torch.randn(16, 64, generator=gen), 32, 32)  # a quantised drafter weight: its scale skips too
    tensors["mtp.0.attn.wq_a.weight"], tensors["mtp.0.attn.wq_a.scale"] = q, s
    path = str(tmp_path_factory.mktemp("v41_release"))
    write_release_dir(path, tensors, config.to_dict())
    deq = {}
    for key, value in tensors.items():
        scale = tensors.get(key[: -len("weight")] + "scale") if key.endswith(".weight") else None
        if key.endswith(".scale"):
            continue
        deq[key] = value.float() if scale is None else nemo.dequantize(
            value, scale, dtype=torch.float32, rowwise=".engram.embed." in key)
    return SimpleNamespace(path=path, tensors=tensors, deq=deq, config=config, model=model)


def _value(state: dict[str, torch.Tensor], hf_key: str) -> torch.Tensor:
    mapped = K.hf_to_ours(hf_key, K.V41)
    t = state[mapped.name]
    return t if mapped.expert is None else t[mapped.expert]


@pytest.fixture(scope="module")
def loaded(release, caplog_module):
    config = config_from_hf(release.path)
    model = build_causal_lm(config)
    with caplog_module.at_level(logging.INFO, logger="dsv4"):
        report = load_hf_checkpoint(model, release.path)
    skip_lines = [r.getMessage() for r in caplog_module.records if "outside the text backbone" in r.getMessage()]
    return SimpleNamespace(model=model, report=report, skip_lines=skip_lines, config=config)


@pytest.fixture(scope="module")
def caplog_module():
    """A log capture shared by a module-scoped fixture (pytest's caplog is function-scoped)."""
    records: list[logging.LogRecord] = []

    class _Handler(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = _Handler(level=logging.DEBUG)
    logger = logging.getLogger("dsv4")
    logger.addHandler(handler)

    class _Cap:
        def __init__(self):
            self.records = records

        def at_level(self, level, logger: str):
            import contextlib

            @contextlib.contextmanager
            def ctx():
                log = logging.getLogger(logger)
                old = log.level
                log.setLevel(level)
                try:
                    yield
                finally:
                    log.setLevel(old)
            return ctx()

    yield _Cap()
    logger.removeHandler(handler)


# ------------------------------------------------------------------------------------------ codecs
def _random_fp8(shape, gen):
    b = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32)
    b[(b & 0x7F) == 0x7F] = 0x10  # no NaN codes
    return b.to(torch.uint8).view(torch.float8_e4m3fn)


def _random_scale(shape, gen):
    b = torch.randint(100, 150, shape, generator=gen, dtype=torch.int32)
    b.view(-1)[0] = 0  # E8M0 byte 0 (2^-127 by definition, as the reference reads it)
    b.view(-1)[-1] = 254
    return b.to(torch.uint8).view(torch.float8_e8m0fnu)


@pytest.mark.parametrize("rows,cols", [(64, 96), (70, 100)])
def test_codecs_equal_reference_bit_for_bit(nemo, rows, cols):
    """FP8 32x32 tiles (ragged edges too), Engram FP8 1x32 row blocks and packed FP4 dequantise to exactly NeMo's
    fp32 values, E8M0 byte 0 included."""
    gen = torch.Generator().manual_seed(rows)
    w = _random_fp8((rows, cols), gen)
    s = _random_scale((-(-rows // 32), -(-cols // 32)), gen)
    ours = Q.dequantize(w, s, "fp8", torch.float32, Q.V41_SCHEME)
    assert torch.equal(ours, nemo.dequantize(w, s, dtype=torch.float32))
    s_rows = _random_scale((rows, -(-cols // 32)), gen)
    ours = Q.dequantize(w, s_rows, "fp8_rows", torch.float32, Q.V41_SCHEME)
    assert torch.equal(ours, nemo.dequantize(w, s_rows, dtype=torch.float32, rowwise=True))
    packed = torch.randint(-128, 128, (rows, cols // 2), generator=gen, dtype=torch.int8)
    ours = Q.dequantize(packed, s_rows, "fp4", torch.float32, Q.V41_SCHEME)
    assert torch.equal(ours, nemo.dequantize(packed, s_rows, dtype=torch.float32))


def test_requantised_release_values_are_exact(release):
    """dsv4's quantiser reproduces every released (dequantised) weight exactly in the V4.1 formats."""
    for key, value in release.deq.items():
        fmt = K.on_disk_format(key, K.V41)
        if fmt in Q.QUANT_FORMATS and key in release.tensors and key.startswith("layers."):
            q, s = Q.quantize(value, fmt, Q.V41_SCHEME)
            assert torch.equal(Q.dequantize(q, s, fmt, torch.float32, Q.V41_SCHEME), value), key


# ------------------------------------------------------------------------------------------ config.json
def test_nested_config_reads_as_reference(release):
    cfg = config_from_hf(release.path)
    assert type(cfg) is DSV41Config and cfg.image_token_id == 383 and cfg.num_hash_layers == 0
    text = release.config.text_config
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "compress_ratios", "kv_source_layer_ids",
                 "index_source_layer_ids", "candidate_source_layer_id", "candidate_topk_blocks", "engram_layer_ids",
                 "engram_num_embeddings", "engram_head_dim", "engram_compressed_vocab_size", "index_topk",
                 "dspark_target_layer_ids", "rms_norm_eps", "sliding_window", "compress_rope_theta", "rope_theta"):
        assert getattr(cfg, name) == getattr(text, name), name
    assert cfg.torch_dtype == "float32"
    assert {k: cfg.rope_scaling[k] for k in ("factor", "original_max_position_embeddings", "beta_fast",
                                             "beta_slow")} == {k: TEXT["rope_scaling"][k] for k in
                                                               ("factor", "original_max_position_embeddings",
                                                                "beta_fast", "beta_slow")}


def test_written_config_reads_in_reference(release, nemo):
    cfg = config_from_hf(release.path)
    data = config_to_hf(cfg, quantized=True)
    assert data["model_type"] == "deepseek_v41" and data["text_config"]["model_type"] == "deepseek_v41_text"
    assert data["quantization_config"] == RELEASE_QUANT and data["vision_config"]["num_hidden_layers"] == 0
    back = nemo.Config(**json.loads(json.dumps(data)))
    for name in ("compress_ratios", "kv_source_layer_ids", "engram_num_embeddings", "candidate_block_size",
                 "rms_norm_eps", "hidden_size"):
        assert getattr(back.text_config, name) == getattr(release.config.text_config, name), name
    assert back.text_config.rope_parameters["factor"] == 16.0 and back.image_token_id == 383
    assert config_from_hf(data) == dataclasses.replace(cfg, torch_dtype="bfloat16")  # a quantized export is bf16


def _with(data: dict, **changes) -> dict:
    out = json.loads(json.dumps(data))
    for path, value in changes.items():
        node = out
        *parents, leaf = path.split("__")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return out


@pytest.mark.parametrize("change,match", [
    ({"quantization_config__weight_block_size": [128, 128]}, r"weight_block_size=\[128, 128\].*\[32, 32\]"),
    ({"quantization_config__scale_fmt": "e4m3"}, r"scale_fmt='e4m3'"),
    ({"quantization_config__expert_dtype": "int4"}, r"expert_dtype='int4'"),
    ({"quantization_config__group_size": 64}, r"does not know: \['group_size'\]"),
    ({"model_type": "deepseek_v5"}, r"model_type='deepseek_v5'"),
    ({"text_config__model_type": "deepseek_v4"}, r"text_config.model_type='deepseek_v4'"),
    ({"text_config__num_hash_layers": 3}, r"num_hash_layers=3"),
])
def test_unsupported_config_values_refused(release, change, match):
    data = json.load(open(os.path.join(release.path, "config.json")))
    with pytest.raises(ValueError, match=match):
        config_from_hf(_with(data, **change))


def test_v4_block_size_still_128(release):
    from tests.unit.checkpoint.test_keys_and_config import FLASH_JSON

    with pytest.raises(ValueError, match=r"weight_block_size=\[32, 32\].*\[128, 128\]"):
        config_from_hf(_with(FLASH_JSON, quantization_config__weight_block_size=[32, 32]))
    assert type(config_from_hf(FLASH_JSON)) is DSV4Config


# ------------------------------------------------------------------------------------------ load
def test_every_tensor_equals_reference_dequantised(release, loaded):
    state = loaded.model.state_dict()
    checked = 0
    for key, value in release.deq.items():
        if K.skip_reason(key, K.V41):
            continue
        assert torch.equal(_value(state, key), value), key
        checked += 1
    targets = sum(v.shape[0] if isinstance(loaded.model.get_submodule(n.rsplit(".", 1)[0]), GroupedExperts)
                  else 1 for n, v in state.items())
    assert checked == targets  # every model tensor (each expert row) came from the checkpoint
    assert any(".engram.embed." in k for k in release.deq) and any(".attn.indexer.wk." in k for k in release.deq)


def test_skipped_groups_logged_once(release, loaded):
    assert len(loaded.skip_lines) == 1, loaded.skip_lines
    line = loaded.skip_lines[0]
    for group, n in (("mtp.* (the DSpark drafter)", 4), ("vision.* (the vision tower)", 2),
                     ("aligner.* (the vision aligner)", 1), ("image_* (the image marker embeddings)", 3)):
        assert f"{group}: {n}" in line, line
    assert "text-only training" in line
    skipped = {k for k in release.tensors if K.skip_reason(k, K.V41)} - {"mtp.0.attn.wq_a.scale"}
    assert set(loaded.report.skipped) == skipped
    assert not any(k.startswith(("mtp.", "vision.", "aligner.", "image_")) for k in loaded.report.keys_read)


def test_large_tensors_load_in_row_chunks(release, loaded, monkeypatch):
    """Above ``LOAD_CHUNK_BYTES`` a tensor is read, dequantised and copied by row chunks (each with its scale rows):
    with a 1000-byte limit (chunks of 1 to 31 rows, 32 for FP8 tiles) the Engram tables, the FP8 tiles and the plain
    tensors load to the same values, every byte read once."""
    import dsv4.checkpoint.load as L

    monkeypatch.setattr(L, "LOAD_CHUNK_BYTES", 1000)
    model = build_causal_lm(loaded.config)
    report = load_hf_checkpoint(model, release.path)
    assert report.bytes_read == loaded.report.bytes_read and sorted(report.keys_read) == sorted(loaded.report.keys_read)
    want = loaded.model.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, want[name]), name
    assert release.tensors["layers.4.engram.embed.weight"].nbytes > 1000  # chunked: 552 rows of 32 bytes
    assert release.tensors["layers.1.engram.wkv.weight"].nbytes > 1000  # FP8 tiles in chunks of 32 rows


def test_v4_checkpoint_into_v41_model_refused(release, tmp_path):
    from tests.unit.checkpoint.test_keys_and_config import FLASH_JSON

    (tmp_path / "config.json").write_text(json.dumps(FLASH_JSON))
    save_file({"embed.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"a deepseek_v4 checkpoint.*the model is deepseek_v41"):
        load_hf_checkpoint(build_causal_lm(config_from_hf(release.path)), str(tmp_path))


# ------------------------------------------------------------------------------------------ export
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "quantized"])
def test_export_reloads(release, loaded, dtype, tmp_path, nemo):
    out = str(tmp_path / dtype)
    export_hf_checkpoint(loaded.model, out, dtype=dtype)
    data = json.load(open(os.path.join(out, "config.json")))
    assert data["model_type"] == "deepseek_v41" and ("quantization_config" in data) == (dtype == "quantized")
    back = build_causal_lm(config_from_hf(out))
    load_hf_checkpoint(back, out)
    ours, got = loaded.model.state_dict(), back.state_dict()
    for name, value in ours.items():
        fmt = K.on_disk_format(K.ours_to_hf(name, 0 if name.endswith(("w1", "w2", "w3")) else None, K.V41), K.V41)
        rounded = fmt == "bf16" and dtype != "float32" or fmt in Q.QUANT_FORMATS and dtype == "bfloat16"
        want = value.to(torch.bfloat16).float() if rounded else value
        assert torch.equal(got[name], want), name  # quantized: the released values are on its grid, so exact
    files = {}
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            files.update(load_file(os.path.join(out, f)))
    if dtype == "quantized":  # the release's formats, read by the reference's own dequantiser
        for key, value in files.items():
            if key.endswith(".weight") and key[: -len("weight")] + "scale" in files:
                assert value.dtype == release.tensors[key].dtype, key
                deq = nemo.dequantize(value, files[key[: -len("weight")] + "scale"], dtype=torch.float32,
                                      rowwise=".engram.embed." in key)
                assert torch.equal(deq, release.deq[key]), key
        assert set(files) == {k for k in release.tensors if not K.skip_reason(k, K.V41)}
    if dtype == "bfloat16":
        assert files["layers.1.hc_attn_fn"].dtype == torch.float32 and files["head.weight"].dtype == torch.float32
        assert files["layers.2.attn.compressor.wkv.weight"].dtype == torch.float32
        assert files["layers.1.engram.embed.weight"].dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------ inspect
def test_inspect_reports_v41(release, capsys):
    assert cli_main(["inspect", release.path]) == 0
    out = capsys.readouterr().out
    assert "family: deepseek_v41" in out
    for line in ("layer 0: window", "layer 1: window, engram", "layer 2: full (ratio 2)", "layer 3: reuse (ratio 2)",
                 "layer 6: full (ratio 1, candidate source)", "layer 8: reindex (ratio 1)",
                 "layer 9: reuse (ratio 1)"):
        assert line in out, (line, out)
    assert "engram tables: layer 1: 384 x 32 (F8_E4M3" in out and "layer 4: 552 x 32" in out
    assert "weights: FP8 E4M3, 32x32 ue8m0 tiles; routed experts FP4" in out
    assert "would skip 10 tensors" in out and "mtp.* (the DSpark drafter): 4" in out
    assert cli_main(["inspect", release.path, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "deepseek_v41" and info["v41"]["roles"][6] == "full"
    assert info["v41"]["engram_tables"]["1"]["rows"] == 384


# ------------------------------------------------------------------------------------------ the model
SEED = 0
LOGIT_TOL = 1e-5  # of the largest |logit|
DOCS = [11, 5, 8]


def _ids(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 300, (1, length), generator=torch.Generator().manual_seed(seed))  # the tokenizer's ids


def _close(got: torch.Tensor, ref: torch.Tensor, tol: float = LOGIT_TOL) -> str | None:
    err = (got - ref).abs() / ref.abs().max()
    if err.max() <= tol:
        return None
    return f"max error {err.max().item():.3g} of the largest logit; {(err.amax(-1) > tol).float().mean():.0%} positions"


def _logits(model, ids, lens) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return model(ids).logits, model(_ids(sum(DOCS), 2), seq_lens=lens).logits


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """The well-conditioned tiny V4.1 of tests/v41_reference.py (every attention role, Engram at layers 1 and 4 on
    the reference's small BPE tokenizer) written as a release by the reference's adapter with its tokenizer, the
    reference then reading that release back (its own ``from_hf``), and dsv4's ``load_model_from_hf`` of the same
    directory (Engram's class map from the directory's tokenizer)."""
    from tests.v41_reference import build_reference, engram_tokenizer, tiny_config

    from dsv4.checkpoint import load_model_from_hf

    tokenizer = engram_tokenizer()
    config = tiny_config(tokenizer)
    ref = build_reference(config, SEED, tokenizer)
    off_grid = {k: v.clone() for k, v in ref.state_dict().items()}
    tensors = release_tensors(ref.state_dict_adapter, ref.state_dict())
    data = ref.config.to_dict()
    data["quantization_config"] = dict(RELEASE_QUANT)
    path = str(tmp_path_factory.mktemp("v41_model_release"))
    write_release_dir(path, tensors, data)
    tokenizer.save_pretrained(path)  # the release ships its tokenizer: Engram's class map comes from it
    ref.load_state_dict(ref.state_dict_adapter.from_hf(dict(tensors)), strict=True)
    lens = torch.tensor([DOCS])
    ids = _ids(23, 1)
    ref_logits = _logits(ref, ids, lens)
    model = load_model_from_hf(path).eval()
    return SimpleNamespace(path=path, ref=ref, model=model, ids=ids, lens=lens, ref_logits=ref_logits,
                           logits=_logits(model, ids, lens), off_grid=off_grid, config=config, tokenizer=tokenizer)


def test_loaded_model_logits_equal_reference(case):
    """Every tensor of the loaded model equals the reference's after it read the release (its own ``from_hf``);
    the logits of an unpacked odd-length row and of a packed row of uneven documents (seq_lens) agree within 1e-5
    of the largest logit."""
    from tests.v41_reference import dsv4_state_dict

    want, got = dsv4_state_dict(case.ref), case.model.state_dict()
    assert set(want) <= set(got) and all(torch.equal(got[k], want[k]) for k in want)
    for got, ref in zip(case.logits, case.ref_logits):
        assert got.shape == ref.shape and (problem := _close(got, ref)) is None, problem


@pytest.fixture(scope="module")
def exports(case, tmp_path_factory):
    """``export_hf_checkpoint`` of the loaded model in each dtype, and ``load_model_from_hf`` of each export."""
    from dsv4.checkpoint import load_model_from_hf

    out = {}
    for dtype in ("float32", "bfloat16", "quantized"):
        path = str(tmp_path_factory.mktemp(f"v41_export_{dtype}"))
        export_hf_checkpoint(case.model, path, dtype=dtype)
        model = load_model_from_hf(path, tokenizer=case.tokenizer).eval()
        out[dtype] = SimpleNamespace(path=path, model=model, logits=_logits(model, case.ids, case.lens))
    # (logits compared bit for bit are all computed here, under one thread setting)
    out["rounded"] = _logits(_bf16_rounded(case.model), case.ids, case.lens)
    return out


def _bf16_rounded(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every tensor a bf16 export stores as BF16 rounded to bf16."""
    import copy

    out = copy.deepcopy(model)
    with torch.no_grad():
        for name, t in out.state_dict(keep_vars=True).items():
            expert = 0 if name.endswith(("experts.w1", "experts.w2", "experts.w3")) else None
            if t.is_floating_point() and K.on_disk_format(K.ours_to_hf(name, expert, K.V41), K.V41) != "f32":
                t.copy_(t.to(torch.bfloat16).float())
    return out


def test_export_reload_gives_the_same_logits(case, exports):
    """float32: identical logits; bfloat16: identical to the model with its BF16-stored tensors rounded; quantized:
    identical to the bfloat16 export's (the loaded release's weights are on the FP8 / FP4 grid, so re-quantising
    them is exact, and the rest is stored as in bf16)."""
    for got, want in zip(exports["float32"].logits, case.logits):
        assert torch.equal(got, want)
    rounded = exports["rounded"]
    for got, want in zip(exports["bfloat16"].logits, rounded):
        assert torch.equal(got, want)
    for got, want in zip(exports["quantized"].logits, exports["bfloat16"].logits):
        assert torch.equal(got, want)
    assert not torch.equal(rounded[0], case.logits[0])  # bf16 storage is visible


def test_reference_reads_the_quantized_export(case, exports, nemo):
    """NeMo builds its model from the export's config.json and reads its tensors with its own adapter: its logits
    equal dsv4's reload of the same directory."""
    from tests.v41_reference import _eager_expert_activations

    path = exports["quantized"].path
    data = json.load(open(os.path.join(path, "config.json")))
    ref = nemo.Model(nemo.Config(**data), backend=nemo.backend, tokenizer=case.tokenizer).float().eval()
    _eager_expert_activations(ref)
    tensors = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, f)))
    ref.load_state_dict(ref.state_dict_adapter.from_hf(tensors), strict=True)
    for got, want in zip(exports["quantized"].logits, _logits(ref, case.ids, case.lens)):
        assert (problem := _close(got, want)) is None, problem


QUANT_LOGIT_ERROR = 0.03  # of the largest |logit|: docs/checkpoints.md states the measured 0.024


def test_quantized_export_error_of_an_off_grid_model(case, tmp_path):
    """A model whose weights are not on the release grid (the reference's conditioned fp32 weights) exported
    quantized reloads within the quantisation error docs/checkpoints.md states."""
    from tests.v41_reference import dsv4_names

    from dsv4.checkpoint import load_model_from_hf

    model = build_causal_lm(case.config, tokenizer=case.tokenizer).eval()
    model.load_state_dict(dsv4_names(case.off_grid), strict=False)
    want = _logits(model, case.ids, case.lens)
    export_hf_checkpoint(model, str(tmp_path / "q"), dtype="quantized")
    got = _logits(load_model_from_hf(str(tmp_path / "q"), tokenizer=case.tokenizer).eval(), case.ids, case.lens)
    errors = [((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want)]
    assert max(errors) <= QUANT_LOGIT_ERROR, errors
    assert min(errors) > 1e-4, errors  # the weights did move


def test_converted_run_checkpoint_equals_the_export(case, exports, tmp_path):
    """``python -m dsv4.checkpoint export`` of a V4.1 run's DCP checkpoint (its ``meta.pt`` names the family) writes
    the files ``export_hf_checkpoint`` wrote for the same weights, byte for byte."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    from dsv4.checkpoint.convert import MODEL_PREFIX

    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    ckpt.mkdir(parents=True)
    save({MODEL_PREFIX + k: v for k, v in case.model.state_dict().items()}, storage_writer=FileSystemWriter(str(ckpt)),
         no_dist=True)
    torch.save({"dsv4": {"config": case.model.config.to_dict(), "model_type": "deepseek_v41"}}, ckpt / "meta.pt")
    out = tmp_path / "out"
    assert cli_main(["export", str(tmp_path / "run"), "--out", str(out), "--dtype", "quantized", "--no-progress"]) == 0
    want = exports["quantized"].path
    assert sorted(os.listdir(out)) == sorted(os.listdir(want))
    for name in os.listdir(want):
        assert (out / name).read_bytes() == open(os.path.join(want, name), "rb").read(), name


def test_expert_parallel_rank_reads_only_its_experts(case):
    """``ep_rank=1, ep_size=2``: of the routed experts only 4..7 are read (and their scales), into their rows."""
    import re

    model = build_causal_lm(case.config)
    report = load_hf_checkpoint(model, case.path, ep_rank=1, ep_size=2)
    experts = {int(m.group(1)) for k in report.keys_read if (m := re.search(r"\.experts\.(\d+)\.", k))}
    assert experts == {4, 5, 6, 7}
    assert sum(".experts." in k for k in report.keys_read) == 12 * 4 * 3 * 2  # layers x experts x w1-3 x weight+scale
    got, want = model.state_dict(), case.model.state_dict()
    for name in want:
        if name.endswith(("experts.w1", "experts.w2", "experts.w3")):
            assert torch.equal(got[name][4:], want[name][4:]) and not torch.equal(got[name][:4], want[name][:4])
        else:
            assert torch.equal(got[name], want[name]), name


def test_start_up_mtp_check_expects_no_depths_of_a_v41_model(case, exports):
    """The recipe's start-up check (``check_mtp_weights`` with ``built_mtp_depths``) accepts a V4.1 directory without
    ``mtp.*`` keys (a dsv4 export): the V4.1 model builds no MTP depth; its DSpark layers are another model."""
    from dsv4.checkpoint.load import built_mtp_depths, check_mtp_weights

    assert case.config.num_nextn_predict_layers == 3 and built_mtp_depths(case.config) == 0
    assert check_mtp_weights(exports["float32"].path, built_mtp_depths(case.config)) == []
    assert built_mtp_depths(DSV4Config.preset("tiny")) == 1


def test_flash_config_reads_as_the_v41_flash_preset(nemo):
    """NeMo's default (V4.1-Flash) nested config with the release's quantization_config reads as ``v41_flash`` in
    every field the release carries, and the preset written back reads the same in NeMo."""
    data = nemo.Config(quantization_config=dict(RELEASE_QUANT)).to_dict()
    cfg = config_from_hf(data)
    preset = DSV4Config.preset("v41_flash")
    dsv4_only = {"fake_quant", "engram_trainable", "mtp_loss_weight", "indexer_loss_coeff", "attention_chunk_size",
                 "loss_chunk_size", "activation_checkpointing", "moe_chunk_tokens", "attention_backend"}
    diffs = {f.name: (getattr(cfg, f.name), getattr(preset, f.name)) for f in dataclasses.fields(preset)
             if f.name not in dsv4_only and getattr(cfg, f.name) != getattr(preset, f.name)}
    assert not diffs, diffs
    back = nemo.Config(**json.loads(json.dumps(config_to_hf(preset, quantized=True))))
    assert back.text_config.to_dict() == {**nemo.Config().text_config.to_dict(), "dtype": "bfloat16"}
    assert back.quantization_config == RELEASE_QUANT and len(cfg.compress_ratios) == 43
