"""dsv4.data.prepared: the on-disk dataset equals the in-memory packing token for token (also across tokenizing
chunks and row blocks, and for both parts of a ``data.val_fraction`` split), is built once (atomic, locked: a
waiting process reuses it) and reused by a second start without tokenizing."""

from __future__ import annotations

import fcntl
import json
import logging
import multiprocessing
import time

import pytest
import torch
from filelock import FileLock

from dsv4.data import build_documents, build_packed_dataset, prepared
from dsv4.data.datamodule import DSV4DataModule
from dsv4.data.defaults import resolve_data_source
from dsv4.data.prepared import PreparedRows, prepare_dataset, prepare_split_dataset
from dsv4.data.prepared_key import prepared_fingerprint, prepared_path
from dsv4.data.validation import split_documents
from tests.unit.data.model_tokenizer import write_tokenizer_dir

CHATS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4", "reasoning_content": "add"},
                  {"role": "user", "content": "and 3+3?"},
                  {"role": "assistant", "content": "6", "reasoning_content": "add again"}]},
    {"text": ""},  # an empty document: counted, in no row
    {"text": "hello world the quick brown fox " * 9},
    {"messages": [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": "Sunny."}]},
    {"messages": [{"role": "user", "content": "hello"}]},  # nothing supervised: left out
] * 7


def _assert_same_rows(memory, prepared) -> None:
    assert len(memory) == len(prepared) and memory.stats == prepared.stats
    for i in range(len(memory)):
        a, b = memory[i], prepared[i]
        for name in ("input_ids", "labels", "seq_ids", "positions"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (i, name)
        assert memory.pieces[i] == prepared.row_pieces(i), i


@pytest.fixture
def chat_source(tmp_path):
    ckpt = write_tokenizer_dir(tmp_path / "ckpt")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in CHATS), encoding="utf-8")
    return resolve_data_source({"kind": "jsonl", "path": str(data), "tokenizer": "auto"}, str(ckpt), 256)


@pytest.mark.parametrize("overlong, num_proc", [("truncate_left", 2), ("split", 1), ("drop", 1)])
def test_prepared_rows_equal_the_in_memory_packing(tmp_path, chat_source, overlong, num_proc):
    assert chat_source["chat_template"] == "deepseek_v4"
    memory = build_packed_dataset(build_documents(**chat_source), 32, 8, cp_size=2, overlong=overlong)
    prepared = prepare_dataset(chat_source, 32, 8, tmp_path / "cache", cp_size=2, overlong=overlong,
                               num_proc=num_proc)
    _assert_same_rows(memory, prepared)
    assert memory.stats.num_empty_documents == 7 and memory.stats.num_unsupervised_pieces >= 7
    arrays = prepared.arrays
    assert isinstance(arrays["input_ids"], __import__("numpy").memmap) and not arrays["input_ids"].flags.writeable


_TOKENIZE_CHUNK = prepared._tokenize_chunk


def _first_chunk_last(chunk):
    """A tokenizing process's task, the first chunk finishing after the others: results taken as they finish (not
    in order) would put it last."""
    if chunk[0][0].endswith(":1"):
        time.sleep(0.3)
    return _TOKENIZE_CHUNK(chunk)


@pytest.mark.parametrize("val_fraction", [None, 0.2])
def test_rows_across_chunks_and_row_blocks_equal_the_in_memory_packing(tmp_path, chat_source, monkeypatch,
                                                                       val_fraction):
    """35 records in 12 chunks of 3 over two tokenizing processes (the first chunk finishing last); 25 rows (a
    split: 19 training and 6 held-out rows) written in blocks of 4, the last one partial."""
    monkeypatch.setattr(prepared, "CHUNK", 3)
    monkeypatch.setattr(prepared, "ROW_BLOCK", 4)
    monkeypatch.setattr(prepared, "_tokenize_chunk", _first_chunk_last)
    documents = build_documents(**chat_source)
    kwargs = dict(cp_size=2, overlong="split", num_proc=2)
    if val_fraction is None:
        parts, rows = [documents], [prepare_dataset(chat_source, 32, 8, tmp_path, **kwargs)]
    else:
        parts = split_documents(documents, val_fraction, seed=3)
        rows = prepare_split_dataset(chat_source, 32, 8, tmp_path, val_fraction=val_fraction, seed=3, **kwargs)
    assert len(documents) == 35
    for part, got in zip(parts, rows, strict=True):
        memory = build_packed_dataset(part, 32, 8, cp_size=2, overlong="split")
        assert len(memory) > 4 and len(memory) % 4, len(memory)
        _assert_same_rows(memory, got)


def test_prepared_bundled_corpus_equals_in_memory(tmp_path):
    source = {"kind": "stdlib", "tokenizer": "byte", "max_bytes": 60_000}
    memory = build_packed_dataset(build_documents(**source), 256, 128, overlong="split")
    _assert_same_rows(memory, prepare_dataset(source, 256, 128, tmp_path, overlong="split", num_proc=2))


def test_second_start_reuses_without_tokenizing(tmp_path, chat_source, caplog, monkeypatch):
    first = prepare_dataset(chat_source, 64, 8, tmp_path / "cache", overlong="truncate_left")
    monkeypatch.setattr("dsv4.data.prepared._tokenized", lambda *a, **k: pytest.fail("tokenized again"))
    with caplog.at_level(logging.INFO, logger="dsv4"):
        second = prepare_dataset(chat_source, 64, 8, tmp_path / "cache", overlong="truncate_left")
    lines = [r.getMessage() for r in caplog.records if "reusing" in r.getMessage()]
    assert lines == [f"data: reusing prepared dataset {first.path} ({len(first)} rows, "
                     f"{json.loads((first.path / 'meta.json').read_text())['tokens']} tokens)"]
    assert second.path == first.path and len(second) == len(first)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [first.path.name, first.path.name + ".lock"]


def test_a_held_lock_times_out_naming_the_path(tmp_path, chat_source):
    target = prepared_path(tmp_path, prepared_fingerprint(chat_source, 64, 8, "truncate_left"))
    tmp_path.mkdir(exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(TimeoutError, match=f"for another process to prepare {target} "):
            prepare_dataset(chat_source, 64, 8, tmp_path, overlong="truncate_left", wait_timeout_s=0.3)
    assert not target.exists()


def _prepare_in_child(source, cache, queue) -> None:
    """A second process: report when it waits for the lock, then what it logged and found."""
    lines = []

    class Report(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())
            if record.getMessage().startswith("data: waiting"):
                queue.put("waiting")

    logger = logging.getLogger("dsv4")
    logger.setLevel(logging.INFO)
    logger.addHandler(Report())
    rows = prepare_dataset(source, 64, 8, cache, overlong="truncate_left", wait_timeout_s=120)
    queue.put((lines, str(rows.path), len(rows)))


def test_processes_waiting_on_the_lock_build_once_and_reuse(tmp_path, chat_source):
    target = prepared_path(tmp_path, prepared_fingerprint(chat_source, 64, 8, "truncate_left"))
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    with FileLock(target.with_name(target.name + ".lock")):
        children = [context.Process(target=_prepare_in_child, args=(chat_source, tmp_path, queue))
                    for _ in range(2)]
        for child in children:
            child.start()
        assert [queue.get(timeout=120) for _ in children] == ["waiting", "waiting"]
        assert not target.exists()
    reports = sorted((queue.get(timeout=120) for _ in children), key=lambda r: r[0][-1])  # prepared < reusing
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    (builder, *_), (reuser, *_) = reports
    rows = PreparedRows(target)
    assert {r[1:] for r in reports} == {(str(target), len(rows))}
    wait = f"data: waiting for another process to prepare {target} (lock {target}.lock)"
    assert builder[0] == wait and builder[-1].startswith(f"data: prepared dataset {target} ({len(rows)} rows")
    assert reuser == [wait, f"data: reusing prepared dataset {target} ({len(rows)} rows, "
                            f"{json.loads((target / 'meta.json').read_text())['tokens']} tokens)"]


def test_bad_data_leaves_nothing_behind(tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match=rf"{data}:2: not valid JSON"):
        prepare_dataset({"kind": "jsonl", "path": str(data), "tokenizer": "byte"}, 64, 8, tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_datamodule_maps_the_prepared_rows(tmp_path, chat_source):
    kwargs = dict(source=chat_source, seq_len=64, shard_multiple=8, overlong="truncate_left")
    prepared = DSV4DataModule(**kwargs, cache_dir=str(tmp_path), num_proc=1)
    prepared.setup()
    assert isinstance(prepared.dataset, PreparedRows)
    memory = DSV4DataModule(**kwargs)
    memory.setup()
    _assert_same_rows(memory.dataset, prepared.dataset)
    batch = next(iter(prepared.train_dataloader()))
    assert batch.input_ids.shape == (1, 64) and batch.input_ids.dtype == torch.long


def test_a_val_fraction_split_is_prepared_once_then_mapped(tmp_path, chat_source, caplog, monkeypatch):
    kwargs = dict(source=chat_source, seq_len=64, shard_multiple=8, overlong="truncate_left", val_fraction=0.2,
                  seed=3)
    memory = DSV4DataModule(**kwargs)
    memory.setup()
    with caplog.at_level(logging.INFO, logger="dsv4"):
        first = DSV4DataModule(**kwargs, cache_dir=str(tmp_path))
        first.setup()
    directory = first.dataset.path.parent
    tokens = json.loads((directory / "meta.json").read_text())["tokens"]
    counts = f"{len(memory.dataset)} training rows, {len(memory.val_dataset)} held-out rows, {tokens} tokens"
    lines = [r.getMessage() for r in caplog.records if not r.getMessage().startswith("data: tokenized")]
    assert len(lines) == 1 and lines[0].startswith(f"data: prepared dataset {directory} ({counts}) in "), lines
    caplog.clear()
    monkeypatch.setattr("dsv4.data.prepared._tokenized", lambda *a, **k: pytest.fail("tokenized again"))
    monkeypatch.setattr("dsv4.data.datamodule.build_documents", lambda *a, **k: pytest.fail("tokenized in memory"))
    with caplog.at_level(logging.INFO, logger="dsv4"):
        second = DSV4DataModule(**kwargs, cache_dir=str(tmp_path))
        second.setup()
    assert [r.getMessage() for r in caplog.records] == [f"data: reusing prepared dataset {directory} ({counts})"]
    for module in (first, second):
        assert isinstance(module.dataset, PreparedRows) and isinstance(module.val_dataset, PreparedRows)
        _assert_same_rows(memory.dataset, module.dataset)
        _assert_same_rows(memory.val_dataset, module.val_dataset)
    batch = next(iter(second.validation_dataloader()))
    assert torch.equal(batch.input_ids, memory.val_dataset[0].input_ids)


def test_a_second_validation_source_is_prepared_too(tmp_path, chat_source):
    held_out = tmp_path / "val.jsonl"
    held_out.write_text("".join(json.dumps(r) + "\n" for r in CHATS[:5]), encoding="utf-8")
    kwargs = dict(source=chat_source, seq_len=64, shard_multiple=8, overlong="truncate_left",
                  val_source={**chat_source, "path": str(held_out)})
    memory, mapped = DSV4DataModule(**kwargs), DSV4DataModule(**kwargs, cache_dir=str(tmp_path))
    memory.setup()
    mapped.setup()
    assert isinstance(mapped.val_dataset, PreparedRows) and mapped.val_dataset.path.parent == tmp_path
    _assert_same_rows(memory.val_dataset, mapped.val_dataset)
    _assert_same_rows(memory.dataset, mapped.dataset)


def test_prepare_command_composes_the_recipe_config(tmp_path, capsys):
    from dsv4.data.__main__ import main

    assert main([]) == 2
    assert main(["prepare", "seq_len=256", "data.max_bytes=50000", f"data.cache_dir={tmp_path}",
                 "data.num_proc=1", "data.val_fraction=0.1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("packing: ") and out[2].startswith("validation packing: ")
    assert out[1].startswith(str(tmp_path / "stdlib-")) and out[1].endswith("/train")
    assert out[3] == out[1][:-len("train")] + "val"
