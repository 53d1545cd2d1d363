"""dsv4.data.hf_documents on tiny local `datasets` datasets built in a tmp dir (no network)."""

from __future__ import annotations

import json

import datasets
import pytest

from dsv4.data import ByteTokenizer, HFTokenizer, build_documents, hf_documents
from tests.unit.data.test_tokenizers import write_wordlevel

CHAT = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "good bye"}]


def test_save_to_disk_dataset_dict_with_hf_tokenizer(tmp_path):
    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": ["hello world", "good bye hello"]}),
        "test": datasets.Dataset.from_dict({"text": ["bye"]}),
    })
    dd.save_to_disk(str(tmp_path / "ds"))
    tok = HFTokenizer(write_wordlevel(tmp_path / "tok.json"))
    docs = hf_documents(tmp_path / "ds", "train", tok)
    assert [list(d.ids) for d in docs] == [[2, 3], [4, 5, 2]]
    assert docs[1].source == f"{tmp_path / 'ds'}[train] row 1"
    assert [list(d.ids) for d in hf_documents(tmp_path / "ds", "test", tok)] == [[5]]
    with pytest.raises(KeyError, match=r"has no split 'validation' \(splits: \['test', 'train'\]\)"):
        hf_documents(tmp_path / "ds", "validation", tok)


def test_jsonl_file_with_chat_rows_through_datasets(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CHAT}) + "\n", encoding="utf-8")
    (doc,) = build_documents("hf", path, "byte", split="train", max_documents=5, cache_dir=tmp_path / "cache")
    tok = ByteTokenizer()
    assert tok.decode([i for i, m in zip(doc.ids, doc.loss_mask) if m]) == "good bye<|end|>\n"


def test_missing_column_empty_dataset_and_remote_name(tmp_path):
    datasets.Dataset.from_dict({"prompt": ["x"]}).save_to_disk(str(tmp_path / "nocol"))
    with pytest.raises(KeyError, match=r"neither a `text` nor a `messages` column \(columns: \['prompt'\]\)"):
        hf_documents(tmp_path / "nocol", "train", ByteTokenizer())
    datasets.Dataset.from_dict({"text": ["a"]}).select([]).save_to_disk(str(tmp_path / "empty"), num_shards=1)
    with pytest.raises(ValueError, match=r"split 'train' has no rows \(empty dataset\)"):
        hf_documents(tmp_path / "empty", "train", ByteTokenizer())
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"empty.jsonl' is empty \(empty dataset\)"):
        hf_documents(tmp_path / "empty.jsonl", "train", ByteTokenizer())
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(ValueError, match=r"`datasets` could not load .*bad.jsonl' split 'train'"):
        hf_documents(tmp_path / "bad.jsonl", "train", ByteTokenizer(), cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError, match=r"'org/some-dataset' is not a local file or directory"):
        hf_documents("org/some-dataset", "train", ByteTokenizer())
