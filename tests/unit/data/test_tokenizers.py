"""dsv4.data.tokenizers: byte round trips, a local `tokenizers` WordLevel tokenizer (no network), token offsets, the
logged tokenizer.json fallback, and data.tokenizer=auto against model.checkpoint."""

from __future__ import annotations

import json
import logging

import pytest

from dsv4.data import ByteTokenizer, HFTokenizer, Tokenizer, build_tokenizer
from dsv4.data.defaults import resolve_tokenizer_spec

VOCAB = {"[PAD]": 0, "[UNK]": 1, "hello": 2, "world": 3, "good": 4, "bye": 5, "<|end|>": 6}


def write_wordlevel(path):
    """A tiny WordLevel tokenizer.json (whitespace split) at ``path``; returns the path."""
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import models, pre_tokenizers

    tok = FastTokenizer(models.WordLevel(VOCAB, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return path


def test_byte_tokenizer_round_trip_non_ascii():
    tok = ByteTokenizer()
    text = "naïve café — 東京 🚀\n\ttab"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert len(ids) > len(text)  # multi-byte characters
    assert tok.decode(ids) == text
    assert (tok.vocab_size, tok.pad_id) == (256, 0)
    assert isinstance(tok, Tokenizer)
    assert tok.encode("") == [] and tok.decode([]) == ""
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 256\), got \[300\]"):
        tok.decode([65, 300])


def test_hf_tokenizer_from_json_file(tmp_path):
    path = write_wordlevel(tmp_path / "tok.json")
    tok = HFTokenizer(path)
    assert tok.encode("hello world bye") == [2, 3, 5]
    assert tok.encode("hello mars") == [2, 1]
    assert tok.decode([2, 3]) == "hello world"
    assert tok.vocab_size == len(VOCAB) and tok.pad_id == 0
    assert HFTokenizer(path, pad_token="bye").pad_id == 5
    with pytest.raises(ValueError, match=r"pad_token 'zzz' is not in the vocabulary"):
        HFTokenizer(path, pad_token="zzz")


def test_hf_tokenizer_from_directory_reads_pad_token(tmp_path):
    write_wordlevel(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "bye", "unk_token": "[UNK]",
    }))
    tok = build_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert tok.pad_id == 5 and tok.encode("good bye") == [4, 5]


def test_hf_tokenizer_is_local_only(tmp_path):
    with pytest.raises(ValueError, match=r"'org/model' does not exist; the tokenizer must be a local file"):
        HFTokenizer("org/model")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match=r"cannot read tokenizer file"):
        HFTokenizer(bad)


def test_build_tokenizer_specs():
    assert isinstance(build_tokenizer("byte"), ByteTokenizer)
    assert isinstance(build_tokenizer(None), ByteTokenizer)
    tok = ByteTokenizer()
    assert build_tokenizer(tok) is tok
    with pytest.raises(ValueError, match=r"lacks \['encode', 'decode', 'vocab_size', 'pad_id'\]"):
        build_tokenizer(object())


def test_offsets_are_character_offsets(tmp_path):
    ids, offsets = ByteTokenizer().encode_with_offsets("aé🚀")
    assert ids == list("aé🚀".encode()) and offsets == [(0, 1), (1, 2), (1, 2), (2, 3), (2, 3), (2, 3), (2, 3)]
    write_wordlevel(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    for tok in (HFTokenizer(tmp_path / "tokenizer.json"), HFTokenizer(tmp_path)):  # tokenizers / transformers
        assert tok.encode_with_offsets("hello  wörld bye") == ([2, 1, 5], [(0, 5), (7, 12), (13, 16)])


def test_autotokenizer_failure_reads_tokenizer_json_and_says_why(tmp_path, caplog):
    write_wordlevel(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"5": 3}}))
    with caplog.at_level(logging.INFO, logger="dsv4"):
        tok = HFTokenizer(tmp_path)
    assert tok._hf is None and tok.encode("hello world") == [2, 3]
    lines = [r.getMessage() for r in caplog.records if r.name == "dsv4"]
    assert len(lines) == 1 and all(r.levelno == logging.INFO for r in caplog.records if r.name == "dsv4")
    assert lines[0].startswith(f"tokenizer: reading {tmp_path / 'tokenizer.json'} with the tokenizers library: "
                               f"transformers.AutoTokenizer cannot load {tmp_path} (TypeError: Found a <class 'int'>")


def test_auto_tokenizer_is_the_checkpoints_or_refused(tmp_path):
    assert resolve_tokenizer_spec("auto", None) == "byte"
    assert resolve_tokenizer_spec("byte", str(tmp_path)) == "byte"
    with pytest.raises(ValueError, match=rf"`data.tokenizer`=auto: `model.checkpoint`='{tmp_path}' holds no tokenizer "
                                         r"\(no tokenizer.json in that directory\); choose one: data.tokenizer=byte "
                                         r"\(UTF-8 bytes, 256 ids\) or data.tokenizer=<path to a tokenizer.json"):
        resolve_tokenizer_spec("auto", str(tmp_path))
    write_wordlevel(tmp_path / "tokenizer.json")
    assert resolve_tokenizer_spec("auto", str(tmp_path)) == str(tmp_path)
