"""End-to-end: ``model.checkpoint=<dir with tokenizer.json>`` and ``data=jsonl`` train two CP ranks on the
checkpoint's tokenizer and chat format with no data overrides; the first start prepares the data once, a second
start maps it and tokenizes nothing."""

from __future__ import annotations

import json
import re

import pytest
import torch

from dsv4.checkpoint import export_hf_checkpoint
from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM
from tests.e2e.helpers import run_recipe
from tests.unit.data.model_tokenizer import write_tokenizer_dir

pytestmark = pytest.mark.e2e

CHAT = {"messages": [{"role": "user", "content": "2+2?"},
                     {"role": "assistant", "content": "4", "reasoning_content": "add"}]}


def test_checkpoint_tokenizer_prepared_once_then_reused(tmp_path):
    torch.manual_seed(0)
    ckpt = tmp_path / "ckpt"
    export_hf_checkpoint(DSV4ForCausalLM(DSV4Config.preset("tiny")), ckpt, dtype="float32")
    write_tokenizer_dir(ckpt)
    data = tmp_path / "train.jsonl"
    # four chats (two per row) and a text: every CP rank's half of every row holds a document
    data.write_text("".join(json.dumps(CHAT) + "\n" for _ in range(4))
                    + json.dumps({"text": "hello world the quick brown fox " * 30}) + "\n")
    args = ["seq_len=256", "logger=csv", "scheduler.warmup_steps=1", "cp=2", "trainer.max_steps=1",
            "checkpoint.every_n_steps=0", f"model.checkpoint={ckpt}", "data=jsonl", f"data.path={data}",
            f"data.cache_dir={tmp_path / 'cache'}", "data.num_proc=1"]
    first = run_recipe(args, tmp_path / "run1")
    log = first.stdout + first.stderr
    prepared = re.findall(r"data: prepared dataset (\S+) \((\d+) rows", log)
    assert len(prepared) == 1 and "data: tokenized" in log
    directory = prepared[0][0]
    assert json.loads(open(f"{directory}/meta.json").read())["fingerprint"]["tokenizer"].startswith("sha256:")
    # Lightning's second rank re-runs the start-up and maps what the launching process prepared
    assert f"data: reusing prepared dataset {directory}" in log
    second = run_recipe(args, tmp_path / "run2")
    log = second.stdout + second.stderr
    assert "data: tokenized" not in log and "data: prepared dataset" not in log
    assert f"data: reusing prepared dataset {directory} ({prepared[0][1]} rows" in log
