"""End-to-end: `recipes/finetune.py model.indexer_loss_coeff=... indexer_warmup_steps=...` on 2 gloo CP ranks.

During the warm-up only the indexer trains: exported after it, every other tensor (router biases included) is
bit-identical to the checkpoint the run started from, and the indexer's tensors moved; ``train/indexer_loss`` is
logged every step.
"""

from __future__ import annotations

import csv
import math

import pytest
import torch

from tests.e2e.helpers import FAST, run_recipe

pytestmark = pytest.mark.e2e


def test_indexer_warmup_trains_only_the_indexer(tmp_path):
    from dsv4.checkpoint import CheckpointDir, export_hf_checkpoint
    from dsv4.checkpoint.safetensors_io import TensorReader
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM

    torch.manual_seed(5)
    base = tmp_path / "base"
    export_hf_checkpoint(DSV4ForCausalLM(DSV4Config.preset("tiny")), str(base), dtype="float32")
    run_recipe([*FAST, "cp=2", f"model.checkpoint={base}", "data.tokenizer=byte", "model.indexer_loss_coeff=0.01",
                "model.index_topk=8",
                "model.attention_backend=torch", "indexer_warmup_steps=3", "trainer.max_steps=3",
                "checkpoint.every_n_steps=0", "optim.lr=1e-2", f"export.hf_dir={tmp_path / 'out'}",
                "export.dtype=float32"], tmp_path / "run")
    with open(tmp_path / "run" / "csv" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/indexer_loss")]
    values = [float(r["train/indexer_loss"]) for r in rows]
    assert len(values) == 3 and all(math.isfinite(v) and v > 0 for v in values)
    before, after = CheckpointDir.open(str(base)), CheckpointDir.open(str(tmp_path / "out"))
    assert before.tensors.keys() == after.tensors.keys()
    read_before, read_after = TensorReader(before), TensorReader(after)
    unchanged_indexer = []
    for key in sorted(before.tensors):
        same = torch.equal(read_before.read(key), read_after.read(key))
        if ".indexer." not in key:
            assert same, f"{key} changed during the indexer warm-up"
        elif same:
            unchanged_indexer.append(key)
    read_before.close()
    read_after.close()
    assert not unchanged_indexer, unchanged_indexer  # every indexer tensor learned
