"""Packed DSpark capture equals per-document capture; only the last position reaches the output head."""

import pytest
import torch

from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM
from dsv4.speculative import (
    FeatureCapture,
    capture_dspark_features,
    dspark_packed_forward,
    model_needs_uniform_tokens,
    split_documents,
)


def _model(name):
    torch.manual_seed(0)
    return DSV4ForCausalLM(DSV4Config.preset(name)).eval()


def _alone(model, ids, layer_ids):
    """Reference: one document run alone (no packing metadata at all)."""
    with FeatureCapture(model, layer_ids) as cap, torch.no_grad():
        model(ids.unsqueeze(0))
    return cap.hidden_states()[0], cap.last_hidden_state()[0]


@pytest.mark.parametrize("name, alignment", [("tiny", 128), ("v4_ratio2_tiny", 2)])
def test_packed_capture_equals_per_document(name, alignment):
    model = _model(name)
    cfg = model.config
    assert cfg.shard_multiple == alignment
    layer_ids = [0, 2, 3]
    # lengths 1, exactly the alignment, alignment + 1 (and a 3 for the small alignment); two rows, caller padding
    lens = torch.tensor([[1, alignment, alignment + 1, -1000], [3, 0, 1, alignment + 1]])
    width = int(lens.clamp_min(0).sum(1).max()) + 2
    ids = torch.randint(1, cfg.vocab_size, (2, width), generator=torch.Generator().manual_seed(1))
    feats = capture_dspark_features(model, ids, lens, layer_ids)
    d = cfg.hidden_size
    assert feats.hidden_states.shape == (2, width, len(layer_ids) * d)
    assert feats.last_hidden_state.shape == (2, width, d)
    assert feats.layout.aligned_length % alignment == 0
    docs = feats.documents(lens)
    assert [(x["row"], x["column"]) for x in docs] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 2), (1, 3)]
    for doc, (b, start, n) in zip(docs, [(0, 0, 1), (0, 1, alignment), (0, 1 + alignment, alignment + 1),
                                          (1, 0, 3), (1, 3, 1), (1, 4, alignment + 1)]):
        ref_hidden, ref_last = _alone(model, ids[b, start:start + n], layer_ids)
        torch.testing.assert_close(doc["hidden_states"], ref_hidden, atol=1e-5, rtol=0)
        torch.testing.assert_close(doc["last_hidden_state"], ref_last, atol=1e-5, rtol=0)
    # caller padding columns come back as zeros
    assert feats.hidden_states[0, 2 + 2 * alignment:].abs().max() == 0


def test_frozen_forward_projects_only_the_last_position():
    model = _model("v4_ratio2_tiny").train()
    rows = []
    original = model.logits_from_hidden

    def counting(hidden):
        rows.append(hidden.shape[0] * hidden.shape[1])
        return original(hidden)

    model.logits_from_hidden = counting
    ids = torch.randint(1, 256, (3, 20))
    lens = torch.tensor([[5, 7, 8], [20, 0, 0], [1, 2, 3]])
    layout = dspark_packed_forward(model, ids, lens)
    # main head + one MTP depth, each [B, 1] rows: 3 rows per head instead of 3 * 20
    assert rows == [3] * (1 + model.config.num_nextn_predict_layers)
    assert model.training  # mode restored
    assert all(p.grad is None for p in model.parameters())
    assert layout.restore(layout.pack(ids)).equal(torch.where(layout.input_positions >= 0, ids, 0))


def test_model_seq_lens_path_and_logits_to_keep():
    model = _model("tiny")
    ids = torch.randint(1, 256, (1, 12))
    lens = torch.tensor([[4, 8]])
    with torch.no_grad():
        full = model(ids, seq_lens=lens)
        last2 = model(ids, seq_lens=lens, logits_to_keep=2)
        picked = model(ids, seq_lens=lens, logits_to_keep=torch.tensor([0, 5]))
        alone = model(ids[:, 4:])
        # a CP-sharded batch carries global seq_lens with packed_seq_ids: ignored as before
        plain = model(ids, packed_seq_ids=torch.ones_like(ids), seq_lens=lens)
    assert full.logits.shape == (1, 12, 256)
    torch.testing.assert_close(full.logits[:, 4:], alone.logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(last2.logits, full.logits[:, -2:])
    torch.testing.assert_close(picked.logits, full.logits[:, [0, 5]])
    torch.testing.assert_close(plain.logits, model(ids).logits)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids, seq_lens=lens, labels=ids, logits_to_keep=1)
    with pytest.raises(ValueError, match="logits_to_keep"):
        model(ids, logits_to_keep=-1)


def test_packed_loss_equals_sum_of_documents():
    model = _model("v4_ratio2_tiny")
    ids = torch.randint(1, 256, (1, 9))
    labels = torch.roll(ids, -1, 1)
    labels[0, [2, 8]] = -100  # last token of each document
    with torch.no_grad():
        packed = model(ids, seq_lens=torch.tensor([[3, 6]]), labels=labels)
        a = model(ids[:, :3], labels=labels[:, :3])
        b = model(ids[:, 3:], labels=labels[:, 3:])
    torch.testing.assert_close(packed.ce_loss_sum, a.ce_loss_sum + b.ce_loss_sum, atol=1e-4, rtol=1e-5)
    assert packed.label_count == a.label_count + b.label_count


def test_capture_validation_and_helpers():
    model = _model("v4_ratio2_tiny")
    for bad in ([], [1, 1], [2, 1], [-1], [4]):
        with pytest.raises(ValueError, match="layer ids"):
            FeatureCapture(model, bad)
    with pytest.raises(RuntimeError, match="nothing recorded"):
        with FeatureCapture(model, [1]) as cap:
            pass
        cap.hidden_states()
    assert not model_needs_uniform_tokens(model)
    vals = torch.arange(10).reshape(1, 10)
    parts = split_documents(vals, torch.tensor([[2, 0, 3]]), torch.tensor([[4, 0, 3]]))
    assert [(b, d, t.tolist()) for b, d, t in parts] == [(0, 0, [0, 1]), (0, 2, [4, 5, 6])]
    with FeatureCapture(model, [1]):
        pass
    assert not model.model.layers[1]._forward_pre_hooks  # hooks removed


def test_v41_packed_capture_equals_per_document_after_engram():
    """The seed API on a DeepSeek-V4.1 target (v41_tiny hashing through the byte tokenizer): packed alignment
    lcm(ratios 2, 1) = 2; every document's features (its DSpark targets 9-11 and Engram layer 4) equal those of the
    document run alone; a feature is the streams entering the layer's attention hyper-connection after its Engram
    update (at layer 4: Engram's output, not the block's input)."""
    from dsv4.data.tokenizers import ByteTokenizer
    from dsv4.model import build_causal_lm

    torch.manual_seed(0)
    cfg = DSV4Config.preset("v41_tiny")
    model = build_causal_lm(cfg, tokenizer=ByteTokenizer()).eval()
    assert cfg.shard_multiple == 2
    layer_ids = [4, *cfg.dspark_target_layer_ids]
    lens = torch.tensor([[1, 2, 5, -1000], [3, 0, 6, 7]])  # odd lengths: each padded to the alignment of 2
    width = int(lens.clamp_min(0).sum(1).max()) + 1
    ids = torch.randint(1, 256, (2, width), generator=torch.Generator().manual_seed(1))
    feats = capture_dspark_features(model, ids, lens, layer_ids)
    assert feats.layout.aligned_length % 2 == 0 and feats.hidden_states.shape == (2, width, 4 * cfg.hidden_size)
    docs = feats.documents(lens)
    for doc, (b, start, n) in zip(docs, [(0, 0, 1), (0, 1, 2), (0, 3, 5), (1, 0, 3), (1, 3, 6), (1, 9, 7)], strict=True):
        ref_hidden, ref_last = _alone(model, ids[b, start:start + n], layer_ids)
        torch.testing.assert_close(doc["hidden_states"], ref_hidden, atol=1e-5, rtol=0)
        torch.testing.assert_close(doc["last_hidden_state"], ref_last, atol=1e-5, rtol=0)
    seen = {}
    layer = model.model.layers[4]
    hooks = [layer.engram.register_forward_hook(lambda m, a, out: seen.__setitem__("engram", out.mean(2))),
             layer.register_forward_pre_hook(lambda m, a: seen.__setitem__("block", a[0].mean(2)))]
    try:
        hidden, _ = _alone(model, ids[1, 9:16], [4])
    finally:
        for h in hooks:
            h.remove()
    torch.testing.assert_close(hidden, seen["engram"][0], atol=0, rtol=0)
    assert (hidden - seen["block"][0]).abs().max() > 1e-3  # the Engram update is in the feature


def test_v41_capture_job_defaults_to_the_dspark_targets(tmp_path):
    """``recipes/capture_dspark.py model=v41_tiny`` (its job in-process, one rank): ``layer_ids`` default to the
    config's ``dspark_target_layer_ids``; the stored features equal a direct per-document capture of the same seeded
    model on the byte tokenizer (cp=2: tests/distributed/test_cp_v41.py)."""
    import json

    from safetensors.torch import load_file

    from dsv4.config import config_class
    from dsv4.data import build_documents
    from dsv4.data.tokenizers import ByteTokenizer
    from dsv4.model import build_causal_lm
    from dsv4.speculative.capture_job import run_capture
    from tests.unit.test_conf import _compose

    args = ["model=v41_tiny", "max_documents=2", "docs_per_shard=2", "max_document_tokens=9", "seq_len=32",
            "progress=false", f"output_dir={tmp_path / 'features'}"]
    run_capture(_compose(args, name="capture_dspark"), tmp_path)
    index = json.loads((tmp_path / "features" / "index.json").read_text())
    assert index["layer_ids"] == [9, 10, 11] == DSV4Config.preset("v41_tiny").dspark_target_layer_ids
    torch.manual_seed(index["seed"])
    assert index["model_type"] == "deepseek_v41"
    model = build_causal_lm(config_class(index["model_type"]).from_dict(index["model"]), tokenizer=ByteTokenizer()).eval()
    docs = build_documents("stdlib", tokenizer="byte", max_bytes=400000, min_bytes=64)
    for entry in index["documents"]:
        d = entry["document_id"]
        hidden, last = _alone(model, torch.tensor(list(docs[d].ids[: entry["length"]])), [9, 10, 11])
        stored = load_file(str(tmp_path / "features" / entry["shard"]))
        torch.testing.assert_close(stored[f"{d}.hidden_states"], hidden, atol=1e-5, rtol=0)
        torch.testing.assert_close(stored[f"{d}.last_hidden_state"], last, atol=1e-5, rtol=0)


def test_a_bf16_target_computes_what_fsdp_mixed_precision_computes(one_rank_group):
    """``build_frozen_target(compute_dtype=bf16)``: the float weights stored in bf16 except the modules the release
    keeps in fp32 and the Engram tables, buffers as built; its features equal, bit for bit, those of the same model
    sharded by ``apply_fsdp`` in bf16 (what a fine-tuning run computes; FSDP2 casts at each all-gather)."""
    from dsv4.batch import TokenBatch
    from dsv4.model.v41.engram_table import LocalEngramTable
    from dsv4.parallel.mesh import ParallelDims, build_meshes
    from dsv4.parallel.wrap import FP32_MODULES, apply_fsdp
    from dsv4.speculative.dspark_step import target_features
    from dsv4.speculative.target import build_frozen_target

    config = DSV4Config.preset("v41_tiny")
    half = build_frozen_target(config, seed=0, compute_dtype=torch.bfloat16)
    sharded = build_frozen_target(config, seed=0)
    fp32 = {f"{n}.{p}" if n else p for n, m in half.named_modules() if isinstance(m, (*FP32_MODULES, LocalEngramTable))
            for p, _ in m.named_parameters()}
    assert fp32 and any(".engram." in n for n in fp32)
    for name, p in half.named_parameters():
        assert p.dtype == (torch.float32 if name in fp32 else torch.bfloat16), name
        assert not p.requires_grad
    assert all(a.dtype == b.dtype for a, b in zip(half.buffers(), sharded.buffers()))
    apply_fsdp(sharded, build_meshes(ParallelDims(world_size=1), "cpu"), compute_dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(0))  # byte tokens
    batch = TokenBatch(ids, ids, torch.ones_like(ids), torch.arange(64).unsqueeze(0))
    got, got_last = target_features(half, batch, config.dspark_target_layer_ids)
    want, want_last = target_features(sharded, batch, config.dspark_target_layer_ids)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want) and torch.equal(got_last, want_last)
