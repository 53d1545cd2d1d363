"""dsv4.data.sources: the stdlib corpus, JSONL text/chat files and their start-up errors, and the factory."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

from dsv4.data import ByteTokenizer, Document, build_documents, jsonl_documents, stdlib_corpus


class CountingTokenizer(ByteTokenizer):
    def __init__(self):
        self.calls = 0

    def encode(self, text):
        self.calls += 1
        return super().encode(text)


def _write_jsonl(path: Path, records) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------- stdlib


def test_stdlib_corpus_is_deterministic_and_non_empty():
    first = stdlib_corpus(max_documents=4)
    second = stdlib_corpus(max_documents=4)
    assert len(first) == 4
    assert [d.source for d in first] == [d.source for d in second]
    assert [list(d.ids) for d in first] == [list(d.ids) for d in second]
    assert all(d.source.startswith("stdlib:") and d.source.endswith(".py") for d in first)
    assert all(len(d) >= 64 and d.loss_mask is None for d in first)
    # the text of a document is the file itself (byte tokenizer)
    root = Path(sysconfig.get_paths()["stdlib"])
    path = root / first[0].source.removeprefix("stdlib:")
    assert ByteTokenizer().decode(first[0].ids) == path.read_text(encoding="utf-8")
    assert [d.source for d in stdlib_corpus(max_documents=4, seed=1)] != [d.source for d in first]


def test_stdlib_corpus_limits_on_a_small_tree(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "a.py").write_text("x = 'é'\n" * 10, encoding="utf-8")  # 90 bytes
    (tmp_path / "pkg" / "b.py").write_text("y = 1\n" * 20, encoding="utf-8")  # 120 bytes
    (tmp_path / "pkg" / "tiny.py").write_text("z\n", encoding="utf-8")  # below min_bytes
    (tmp_path / "pkg" / "latin1.py").write_bytes(b"# \xe9\xe9\n" * 30)  # not UTF-8: skipped
    (tmp_path / "site-packages" / "c.py").write_text("w = 2\n" * 30, encoding="utf-8")
    (tmp_path / "notes.txt").write_text("not python\n" * 30, encoding="utf-8")
    docs = stdlib_corpus(root=tmp_path, seed=None, min_bytes=16)
    assert [d.source for d in docs] == ["stdlib:a.py", "stdlib:pkg/b.py"]
    assert ByteTokenizer().decode(docs[0].ids) == "x = 'é'\n" * 10
    assert [d.source for d in stdlib_corpus(root=tmp_path, seed=None, min_bytes=16, max_bytes=100)] == ["stdlib:a.py"]
    with pytest.raises(ValueError, match=r"yielded no documents .*min_bytes=1000"):
        stdlib_corpus(root=tmp_path, min_bytes=1000)


# -------------------------------------------------------------------------------------------------- jsonl


def test_jsonl_text_and_chat_rows(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [
        {"text": "héllo"},
        "",
        {"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}], "id": 3},
    ])
    docs = jsonl_documents(path, ByteTokenizer())
    assert [d.source for d in docs] == [f"{path}:1", f"{path}:3"]
    assert docs[0].ids == list("héllo".encode()) and docs[0].loss_mask is None
    supervised = ByteTokenizer().decode([i for i, m in zip(docs[1].ids, docs[1].loss_mask) if m])
    assert supervised == "A<|end|>\n"


@pytest.mark.parametrize(
    "records, error, pattern",
    [
        ([{"text": "ok"}, "{not json"], ValueError, r"d.jsonl:2: not valid JSON \(Expecting property name"),
        ([{"text": "ok"}, {"text": "ok"}, {"prompt": "x"}], KeyError,
         r"d.jsonl:3: record has neither a `text` nor a `messages` field \(keys: \['prompt'\]\)"),
        ([{"text": 5}], ValueError, r"d.jsonl:1: field `text` must be a string, got int"),
        (["[1, 2]"], ValueError, r"d.jsonl:1: expected a JSON object, got list"),
        ([{"messages": [{"role": "user"}]}], KeyError, r"d.jsonl:1: messages\[0\] has no `content` field"),
        ([{"text": "ok"}, {"messages": [{"role": "user", "content": "Q"}, {"role": "asistant", "content": "A"}]}],
         ValueError, r"d.jsonl:2: messages\[1\].role='asistant' is not a chat role .* did you mean 'assistant'\?"),
        (["", "  "], ValueError, r"d.jsonl' holds no records \(empty dataset\)"),
    ],
)
def test_jsonl_bad_data_fails_before_tokenizing(tmp_path, records, error, pattern):
    path = _write_jsonl(tmp_path / "d.jsonl", records)
    tok = CountingTokenizer()
    with pytest.raises(error, match=pattern):
        jsonl_documents(path, tok)
    assert tok.calls == 0


def test_jsonl_not_utf8_and_missing_file(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"text": "a"}\n{"text": "\xff"}\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: line is not valid UTF-8"):
        jsonl_documents(path, ByteTokenizer())
    with pytest.raises(ValueError, match=r"nope.jsonl' is not a file"):
        jsonl_documents(tmp_path / "nope.jsonl", ByteTokenizer())


def test_jsonl_custom_keys_and_limit(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", [{"body": "a"}, {"body": "bb"}, {"body": "ccc"}])
    docs = jsonl_documents(path, ByteTokenizer(), text_key="body", max_documents=2)
    assert [list(d.ids) for d in docs] == [[97], [98, 98]]


# ------------------------------------------------------------------------------------------------ factory


def test_build_documents_kinds(tmp_path):
    stdlib = build_documents("stdlib", max_documents=2)
    assert len(stdlib) == 2 and all(isinstance(d, Document) for d in stdlib)
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", encoding="utf-8")
    path = _write_jsonl(tmp_path / "c.jsonl", [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    ])
    (doc,) = build_documents("jsonl", path, "byte", chat_template_file=template)
    assert ByteTokenizer().decode(doc.ids) == "user: hi\nassistant: yo\n"
    assert ByteTokenizer().decode([i for i, m in zip(doc.ids, doc.loss_mask) if m]) == "assistant: yo\n"


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"kind": "csv"}, r"data kind 'csv' is not one of \('stdlib', 'jsonl', 'hf'\)"),
        ({"kind": "jsonl"}, r"data kind 'jsonl' needs a `path`"),
        ({"kind": "jsonl", "path": "x.jsonl", "chat_template": "a", "chat_template_file": "b"}, "not both"),
    ],
)
def test_build_documents_errors(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        build_documents(**kwargs)
