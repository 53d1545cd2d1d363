"""DeepSeek-V4.1 Engram against the independent reference, NeMo Automodel 0.7.0's ``deepseek_v41/engram.py``:
the tokenizer's class map, the n-gram hash ids (unpacked, padded, packed and image rows; a row split with a
history) and the module's forward and gradients, bit for bit or within 1e-6 / 1e-5."""

from __future__ import annotations

import copy
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from dsv4.config import DSV4Config
from dsv4.data.tokenizers import ByteTokenizer, HFTokenizer
from dsv4.model.v41.engram import Engram
from dsv4.model.v41.engram_hash import (
    EngramHashing, EngramHistory, engram_hash_specs, engram_hash_specs_for, engram_history_from_tail,
    engram_history_tail, engram_ngram_ids,
)
from dsv4.model.v41.engram_vocab import engram_class_map, engram_class_map_for

LAYERS = [1, 4]  # Engram layers of v41_tiny (the public tiny V4.1 fixture): rows 384 and 552, engram_vocab_size 50
TEXTS = ["Hello World", "hello world", "HELLO  world", "Café café CAFÉ cafe", "naïve Naive  NAÏVE",
         "résumé Resume", "ﬁne fine", "tab\tnew\nline  ", "Straße strasse", "Ωmega ωmega", "   spaced   out  "]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A byte-level BPE trained on accented / upper-case / whitespace variants (so normalisation merges classes),
    as a tokenizers.Tokenizer, a transformers fast tokenizer and a dsv4 HFTokenizer over its saved file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(TEXTS * 3, trainers.BpeTrainer(
        vocab_size=300, min_frequency=1, special_tokens=["<s>", "</s>", "<pad>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    raw.save(str(path))
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    directory = tmp_path_factory.mktemp("tokdir")
    fast.save_pretrained(str(directory))
    return SimpleNamespace(raw=raw, fast=fast, hf=HFTokenizer(path), hf_dir=HFTokenizer(directory))


@pytest.fixture(scope="module")
def nemo():
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41 import engram, packing
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig

    return SimpleNamespace(engram=engram, packing=packing, Config=DeepseekV41TextConfig,
                           backend=BackendConfig(linear="torch", rms_norm="torch_fp32"))


@pytest.fixture(scope="module")
def setup(tok, nemo):
    """dsv4's v41_tiny config (Engram layers 1 and 4, rows 384 and 552) on the test tokenizer, and the reference's
    text config with the same Engram dims and hash."""
    cmap = engram_class_map(tok.fast)
    config = replace(DSV4Config.preset("v41_tiny"), vocab_size=len(tok.fast), engram_compressed_vocab_size=cmap.count)
    dims = {name: getattr(config, name) for name in (
        "engram_layer_ids", "engram_num_embeddings", "engram_max_ngram_size", "engram_vocab_size", "engram_n_heads",
        "engram_head_dim", "engram_pad_token_id", "engram_compressed_vocab_size", "hidden_size", "hc_mult",
        "rms_norm_eps", "initializer_range")}
    ref_config = nemo.Config(
        vocab_size=len(tok.fast), moe_intermediate_size=8, num_hidden_layers=6, num_attention_heads=2, head_dim=16,
        qk_rope_head_dim=8, q_lora_rank=8, o_lora_rank=8, o_groups=2, n_routed_experts=4, num_experts_per_tok=2,
        sliding_window=4, compress_ratios=[0, 0, 2, 2, 1, 1], kv_source_layer_ids=[2, 4],
        index_source_layer_ids=[2, 4], index_n_heads=2, index_head_dim=16, index_topk=2, candidate_source_layer_id=-1,
        num_nextn_predict_layers=0, dspark_target_layer_ids=[], dtype="float32", **dims)
    return SimpleNamespace(cmap=cmap, config=config, ref_config=ref_config,
                           hashing=EngramHashing.build(config, tok.fast), specs=engram_hash_specs_for(config, cmap),
                           ref_hash=nemo.engram.DeepseekV41NgramHash(ref_config, tok.fast))


def _byte_fallback_fast():
    """A fast tokenizer whose ids are the 256 bytes spelled <0xHH>, decoded by byte fallback: the same tokens as
    dsv4's ByteTokenizer, in a form the reference reads."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({f"<0x{i:02X}>": i for i in range(256)}, unk_token="<0x00>"))
    raw.decoder = decoders.ByteFallback()
    return PreTrainedTokenizerFast(tokenizer_object=raw)


# ---- class map -------------------------------------------------------------------------------------------------

def test_class_map_equals_reference(tok, nemo, setup):
    """Every tokenizer form gives the reference's class of every token id and its class count; normalisation
    merges classes (count < vocab)."""
    ref_map, ref_count = nemo.engram._compressed_token_map(tok.fast)
    assert setup.cmap.count == ref_count < len(tok.fast)
    assert setup.cmap.classes.tolist() == list(ref_map)
    for other in (tok.raw, tok.hf, tok.hf_dir):
        found = engram_class_map(other)
        assert found.count == ref_count and found.classes.tolist() == list(ref_map)
    cls = {t: int(setup.cmap.classes[tok.raw.token_to_id(t)]) for t in ("world", "World", "caf", "CAF", "Caf", "el")}
    assert cls["world"] == cls["World"] and cls["caf"] == cls["CAF"] == cls["Caf"] != cls["el"]


def test_byte_tokenizer_class_map(nemo):
    """dsv4's byte tokenizer: 227 classes, the reference's map of the same 256 byte tokens under byte fallback."""
    ref_map, ref_count = nemo.engram._compressed_token_map(_byte_fallback_fast())
    found = engram_class_map(ByteTokenizer())
    assert found.count == ref_count == 227
    assert found.classes.tolist() == list(ref_map)


def test_count_and_rows_mismatch_refused(tok, setup):
    wrong = setup.cmap.count + 1
    with pytest.raises(ValueError, match=rf"{setup.cmap.count} classes but engram_compressed_vocab_size is {wrong}"):
        engram_class_map_for(tok.fast, wrong)
    with pytest.raises(ValueError, match=rf"{setup.cmap.count} classes but engram_compressed_vocab_size is {wrong}"):
        engram_hash_specs_for(replace(setup.config, engram_compressed_vocab_size=wrong), setup.cmap)
    with pytest.raises(ValueError, match=r"layer 4: .* need 552 table rows but engram_num_embeddings gives 553"):
        engram_hash_specs(layer_ids=LAYERS, num_embeddings=[384, 553], max_ngram_size=4, n_heads=2, vocab_size=50,
                          class_count=setup.cmap.count, pad_class=0)
    assert engram_class_map_for(tok.fast, setup.config).count == setup.cmap.count


def test_flash_table_rows():
    """V4.1-Flash's Engram dims give exactly the released table sizes (24 buckets of primes > 16M per layer)."""
    flash = DSV4Config.preset("v41_flash")
    specs = engram_hash_specs(layer_ids=flash.engram_layer_ids, num_embeddings=flash.engram_num_embeddings,
                              max_ngram_size=flash.engram_max_ngram_size, n_heads=flash.engram_n_heads,
                              vocab_size=flash.engram_vocab_size, class_count=flash.engram_compressed_vocab_size,
                              pad_class=0)
    assert [s.rows for s in specs] == [384006168, 384016682] and specs[0].n_buckets == 24
    assert specs[1].primes[0] > specs[0].primes[-1] > specs[0].primes[0] >= 16_000_000


# ---- hash ------------------------------------------------------------------------------------------------------

def _rows(tok, length: int, rows: int, seed: int) -> torch.Tensor:
    """Token rows mixing merged classes (the training texts) with random ids."""
    ids = torch.tensor(tok.fast.encode(" ".join(TEXTS)), dtype=torch.int64)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        start = int(torch.randint(0, ids.numel() - length, (1,), generator=g))
        row = ids[start:start + length].clone()
        noise = torch.rand(length, generator=g) < 0.2
        row[noise] = torch.randint(0, len(tok.fast), (int(noise.sum()),), generator=g)
        out.append(row)
    return torch.stack(out)


def _ours(setup, ids, **blocking):
    return [engram_ngram_ids(ids, setup.cmap, spec, **blocking) for spec in setup.specs]


def test_hash_parameters_equal_reference(setup):
    """Primes, offsets and multipliers of every layer equal the reference's buffers."""
    ref = setup.ref_hash
    for k, spec in enumerate(setup.specs):
        assert list(spec.primes) == ref.primes[k].tolist()
        assert list(spec.offsets) == ref.offsets[k].tolist()
        assert list(spec.multipliers) == ref.multipliers[k].tolist()
        assert spec.pad_class == ref.pad_id


@pytest.mark.parametrize("case", ["unpacked", "padded", "packed", "seq_lens"])
def test_hash_ids_equal_reference(tok, nemo, setup, case):
    """Hash ids of every layer equal the reference's bit for bit; ``active`` is the reference's gate mask."""
    batch, length = 3, 17
    ids = _rows(tok, length, batch, seed=1)
    ref_kwargs, ours_kwargs = {}, {}
    if case == "padded":
        lengths = torch.tensor([17, 11, 3])
        valid = torch.arange(length) < lengths[:, None]
        ids = ids.masked_fill(~valid, tok.fast.pad_token_id)
        ref_kwargs, ours_kwargs = dict(token_mask=valid), dict(padding_mask=~valid)
    elif case == "packed":
        docs = torch.tensor([[1] * 5 + [2] * 6 + [3] * 4 + [0] * 2,
                             [1] * 2 + [0] * 2 + [2] * 9 + [0] * 4,
                             [4] * 1 + [5] * 16])
        image = torch.zeros(batch, length, dtype=torch.bool)
        image[0, 7:9] = True
        image[2, 10] = True
        ref_kwargs = dict(sequence_ids=docs, token_mask=~image)
        ours_kwargs = dict(packed_seq_ids=docs, image_mask=image)
    elif case == "seq_lens":
        seq_lens = torch.tensor([[5, 6, 4], [2, 9, -1000], [1, 0, 16]])
        layout = nemo.packing.packed_layout(seq_lens, seq_lens_padded=None, input_shape=(batch, length),
                                            alignment=1, minimum_length=length)
        ref_kwargs = dict(sequence_ids=layout.sequence_ids)
        ours_kwargs = dict(seq_lens=seq_lens)
    expected = setup.ref_hash(ids, **ref_kwargs)
    mask = torch.ones(batch, length, dtype=torch.bool)
    if "token_mask" in ref_kwargs:
        mask &= ref_kwargs["token_mask"]
    if "sequence_ids" in ref_kwargs:
        mask &= ref_kwargs["sequence_ids"] > 0
    for k, (ngram_ids, active) in enumerate(_ours(setup, ids, **ours_kwargs)):
        assert ngram_ids.dtype == torch.int64 and ngram_ids.shape == (batch, length, 6)
        assert torch.equal(ngram_ids, expected[:, :, k])
        assert torch.equal(active, mask)
    per_layer, active = setup.hashing.to(ids.device)(ids, **ours_kwargs)  # all layers from one set of windows
    assert list(per_layer) == LAYERS and torch.equal(active, mask)
    assert torch.equal(torch.stack([per_layer[i] for i in LAYERS], 2), expected)


def test_history_split_equals_whole_row(tok, setup):
    """A packed row (documents, padding, image tokens) cut anywhere, its right part hashed with the left part's
    last tokens as history, gives the whole row's ids; so does the CP halo form of the history (the left part's
    :func:`engram_history_tail`, received only where the right part's first token continues the left part's last
    document, read back by :func:`engram_history_from_tail`), with masked tokens inside a document and a document
    that starts within the last three tokens."""
    ids = _rows(tok, 20, 2, seed=2)
    docs = torch.tensor([[1] * 6 + [2] * 7 + [0] + [3] * 6, [1] * 4 + [0] * 2 + [2] * 14])
    image = torch.zeros(2, 20, dtype=torch.bool)
    image[1, 9] = True
    whole = _ours(setup, ids, packed_seq_ids=docs, image_mask=image)
    visible = docs.masked_fill(image, 0)
    for cut in (1, 2, 6, 7, 8, 10, 11, 13, 15):
        left = _ours(setup, ids[:, :cut], packed_seq_ids=docs[:, :cut], image_mask=image[:, :cut])
        history = EngramHistory(ids[:, max(0, cut - 3):cut], visible[:, max(0, cut - 3):cut])
        right = _ours(setup, ids[:, cut:], packed_seq_ids=docs[:, cut:], image_mask=image[:, cut:], history=history)
        for (w, wa), (lft, la), (r, ra) in zip(whole, left, right):
            assert torch.equal(torch.cat([lft, r], 1), w), cut
            assert torch.equal(torch.cat([la, ra], 1), wa)
        if cut < 3:
            continue
        tail = engram_history_tail(ids[:, :cut], docs[:, :cut], image[:, :cut], 3)
        assert tail.dtype == torch.int32 and tail.shape == (2, 3)
        continues = (docs[:, cut] == docs[:, cut - 1]) & (docs[:, cut] > 0)  # the CP halo route's rows
        received = torch.where(continues[:, None], tail, torch.zeros_like(tail))
        history = engram_history_from_tail(received, docs[:, cut:])
        right = _ours(setup, ids[:, cut:], packed_seq_ids=docs[:, cut:], padding_mask=image[:, cut:],
                      history=history)
        for (w, wa), (r, ra) in zip(whole, right):
            assert torch.equal(r, w[:, cut:]), cut
            assert torch.equal(ra, wa[:, cut:])
    # an unpacked row: history doc ids 1
    row = _ours(setup, ids)
    right = _ours(setup, ids[:, 9:], history=EngramHistory(ids[:, 6:9], torch.ones(2, 3, dtype=torch.int64)))
    assert torch.equal(right[0][0], row[0][0][:, 9:])


# ---- module ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def modules(tok, nemo, setup):
    """The reference Engram of layer 4 and ours with its weights (q/k weights moved off ones), on padded rows."""
    torch.manual_seed(0)
    ref = nemo.engram.DeepseekV41Engram(setup.ref_config, 4, nemo.backend)
    with torch.no_grad():
        ref.embed.weight.normal_(0, 0.5)
        ref.wkv.weight.normal_(0, 0.15)
        ref.q_weight.add_(0.3 * torch.randn_like(ref.q_weight))
        ref.k_weight.add_(0.3 * torch.randn_like(ref.k_weight))
    ours = Engram(replace(setup.config, engram_trainable=True), 4)
    with torch.no_grad():
        for name in ("embed.weight", "wkv.weight", "q_weight", "k_weight"):
            ours.get_parameter(name).copy_(ref.get_parameter(name))
    ids = _rows(tok, 9, 2, seed=3)
    valid = torch.arange(9) < torch.tensor([[9], [6]])
    ngram_ids, active = engram_ngram_ids(ids, setup.cmap, setup.specs[1], padding_mask=~valid)
    streams = torch.randn(2, 9, setup.config.hc_mult, setup.config.hidden_size)
    probe = torch.randn_like(streams)

    def run(module, dtype=torch.float32, **kw):
        x = streams.to(dtype).clone().requires_grad_(True)
        out = module(x, ngram_ids, **kw)
        (out * probe.to(dtype)).sum().backward()
        grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        module.zero_grad(set_to_none=True)
        return out.detach(), x.grad, grads

    fp32 = SimpleNamespace(ours=run(ours, active=active), ref=run(ref, token_mask=valid))
    bf16 = SimpleNamespace(ours=run(copy.deepcopy(ours).to(torch.bfloat16), torch.bfloat16, active=active),
                           ref=run(copy.deepcopy(ref).to(torch.bfloat16), torch.bfloat16, token_mask=valid))
    return SimpleNamespace(streams=streams, active=active, ours=fp32.ours, ref=fp32.ref, bf16=bf16)


def _close(a: torch.Tensor, b: torch.Tensor, rel: float) -> None:
    err = float((a - b).abs().max() / b.abs().max())
    assert err <= rel, err


def test_forward_and_gradients_equal_reference(modules):
    out, grad_x, grads = modules.ours
    ref_out, ref_grad_x, ref_grads = modules.ref
    assert not torch.equal(out, modules.streams)  # the memory does change the streams
    _close(out, ref_out, 1e-6)
    _close(grad_x, ref_grad_x, 1e-5)
    for name in ("wkv.weight", "q_weight", "k_weight", "embed.weight"):
        _close(grads[name], ref_grads[name], 1e-5)


def test_bf16_equals_reference(modules):
    """bf16 weights and streams: the lookup and wkv run in bf16, the gate in fp32, as the reference's."""
    out, grad_x, grads = modules.bf16.ours
    ref_out, ref_grad_x, ref_grads = modules.bf16.ref
    assert out.dtype == torch.bfloat16
    _close(out.float(), ref_out.float(), 1e-6)
    _close(grad_x.float(), ref_grad_x.float(), 1e-5)
    _close(grads["wkv.weight"].float(), ref_grads["wkv.weight"].float(), 1e-5)


def test_gate_zero_on_padding(modules, setup):
    """Inactive (padding) positions come back bit for bit; the table is frozen unless engram_trainable."""
    out = modules.ours[0]
    inactive = ~modules.active
    assert inactive.any()
    assert torch.equal(out[inactive], modules.streams[inactive])
    assert not Engram(setup.config, 1).embed.weight.requires_grad
