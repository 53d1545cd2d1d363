"""dsv4.data.prepared_key: the prepared-data key follows every input the rows depend on (the data keys and file,
every file a tokenizer is built from, the chat template text) and nothing else (a README or a weight file beside the
tokenizer)."""

from __future__ import annotations

import json
import os

import pytest

from dsv4.data.prepared_key import prepared_fingerprint, prepared_path, tokenizer_files

# every file a tokenizer may be built from (any tokenizer class), and files of a checkpoint directory that are not
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt",
                   "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json", "additional_chat_templates/tool_use.jinja", "config.json",
                   "tokenization_custom.py", "spiece.model")
UNRELATED = ("README.md", "model.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
             "pytorch_model.bin", ".gitattributes")


@pytest.fixture
def source(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"text": "hello"}) + "\n")
    tok = tmp_path / "tok"
    (tok / "additional_chat_templates").mkdir(parents=True)
    for name in TOKENIZER_FILES + UNRELATED:
        (tok / name).write_text("{}")
    return {"kind": "jsonl", "path": str(data), "tokenizer": str(tok), "chat_template": None}


def _key(tmp_path, source, seq_len=64, overlong="truncate_left", **kwargs):
    return prepared_path(tmp_path / "cache", prepared_fingerprint(source, seq_len, 8, overlong, **kwargs)).name


def test_every_tokenizer_file_is_in_the_key_and_nothing_else(tmp_path, source):
    tok = tmp_path / "tok"
    base = _key(tmp_path, source)
    assert sorted(p.relative_to(tok).as_posix() for p in tokenizer_files(tok)) == sorted(TOKENIZER_FILES)
    for name in TOKENIZER_FILES:
        (tok / name).write_text("[]")  # same size, other content
        assert _key(tmp_path, source) != base, name
        (tok / name).write_text("{}")
        assert _key(tmp_path, source) == base, name
    for name in UNRELATED:
        (tok / name).write_text("changed")
        assert _key(tmp_path, source) == base, name
    (tok / "model-00003-of-00003.safetensors").write_text("a new shard")
    assert _key(tmp_path, source) == base
    (tok / "merges.txt").unlink()  # a file that is gone
    assert _key(tmp_path, source) != base
    (tok / "sentencepiece.bpe.model").write_text("{}")  # a new one, whatever its name
    missing = _key(tmp_path, source)
    (tok / "merges.txt").write_text("{}")
    assert missing != _key(tmp_path, source) != base


def test_a_tokenizer_file_is_keyed_with_the_files_read_beside_it(tmp_path, source):
    tok = tmp_path / "tok"
    source = {**source, "tokenizer": str(tok / "tokenizer.json")}
    base = _key(tmp_path, source)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (tok / name).write_text("[]")
        assert _key(tmp_path, source) != base, name
        (tok / name).write_text("{}")
    (tok / "README.md").write_text("changed")
    assert _key(tmp_path, source) == base
    with pytest.raises(ValueError, match=r"`data.tokenizer`='.*missing' does not exist"):
        _key(tmp_path, {**source, "tokenizer": str(tmp_path / "missing")})


def test_the_chat_template_text_is_in_the_key(tmp_path, source):
    tok = tmp_path / "tok"
    base = _key(tmp_path, source)
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages }}")
    from_file = _key(tmp_path, {**source, "chat_template_file": str(template)})
    assert from_file != base
    assert _key(tmp_path, {**source, "chat_template": "{{ messages }}"}) == from_file  # the text, not where it is
    template.write_text("{{ messages }}!")  # the same file, edited
    assert _key(tmp_path, {**source, "chat_template_file": str(template)}) != from_file
    assert _key(tmp_path, {**source, "chat_template": "deepseek_v4"}) not in (base, from_file)
    # the tokenizer's own template (in its config) is keyed as a template, not only as a file
    (tok / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ a }}"}))
    own = prepared_fingerprint(source, 64, 8, "split")["chat_template"]
    (tok / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ b }}"}))
    assert prepared_fingerprint(source, 64, 8, "split")["chat_template"] != own
    with pytest.raises(ValueError, match=r"`data.chat_template_file`='.*nope.jinja' is not a file"):
        _key(tmp_path, {**source, "chat_template_file": str(tmp_path / "nope.jinja")})


def test_the_key_follows_the_data_keys_and_file(tmp_path, source):
    base = _key(tmp_path, source)
    assert _key(tmp_path, source) == base and base.startswith("jsonl-")
    assert _key(tmp_path, source, seq_len=128) != base and _key(tmp_path, source, overlong="split") != base
    assert _key(tmp_path, {**source, "max_documents": 3}) != base
    assert _key(tmp_path, source, pad_id=1) != base
    split = _key(tmp_path, source, val_split=(0.1, 0))
    assert split not in (base, _key(tmp_path, source, val_split=(0.1, 1)), _key(tmp_path, source, val_split=(0.2, 0)))
    assert _key(tmp_path, {**source, "tokenizer": "byte"}) != base
    os.utime(source["path"], ns=(1, 1))  # the data file changed (modification time)
    assert _key(tmp_path, source) != base
