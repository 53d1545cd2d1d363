"""End-to-end: `model.checkpoint=<HF dir>` loads before training on CP ranks; `export.hf_dir` writes at the end."""

from __future__ import annotations

import pytest
import torch

from dsv4.checkpoint import export_hf_checkpoint, load_model_from_hf
from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM
from tests.e2e.helpers import FAST, assert_export_holds_the_loaded_weights, run_recipe

pytestmark = pytest.mark.e2e


def test_load_then_train_then_export(tmp_path):
    torch.manual_seed(7)
    source = DSV4ForCausalLM(DSV4Config.preset("tiny"))
    export_hf_checkpoint(source, tmp_path / "in", dtype="float32")
    run_recipe([*FAST, "cp=2", "trainer.max_steps=1", "checkpoint.every_n_steps=0", "optim.lr=0",
                f"model.checkpoint={tmp_path / 'in'}", "data.tokenizer=byte", f"export.hf_dir={tmp_path / 'out'}",
                "export.dtype=float32"], tmp_path / "run")
    assert_export_holds_the_loaded_weights(source.state_dict(), load_model_from_hf(tmp_path / "out").state_dict())


def test_model_checkpoint_reads_a_transformers_directory(tmp_path):
    """`model.checkpoint=` a directory transformers' save_pretrained wrote for the same tiny model: it loads (names
    mapped; it holds no MTP weights, so `model.init_missing_mtp=true` keeps the MTP depth's initialisation, logged),
    so with lr = 0 the export holds exactly its weights."""
    from tests.unit.checkpoint.hf_reference import C, H, random_hf_model, tiny_hf_config

    hf = random_hf_model(tiny_hf_config(compress_rates={C: 4, H: 128}, index_n_heads=2))
    hf.save_pretrained(str(tmp_path / "in"))
    proc = run_recipe([*FAST, "cp=2", "trainer.max_steps=1", "checkpoint.every_n_steps=0", "optim.lr=0",
                       f"model.checkpoint={tmp_path / 'in'}", "model.init_missing_mtp=true",
                       "data.tokenizer=byte",
                       f"export.hf_dir={tmp_path / 'out'}", "export.dtype=float32"], tmp_path / "run")
    assert ("(transformers layout) holds no weights for MTP depth(s) [0]: they keep their initialisation"
            in proc.stdout + proc.stderr)
    want = load_model_from_hf(tmp_path / "in", attention_chunk_size=64, init_missing_mtp=True).state_dict()
    got = load_model_from_hf(tmp_path / "out").state_dict()
    for name, theirs in want.items():
        if name.startswith("mtp."):
            continue
        if name.endswith("e_score_correction_bias"):  # one load-balancing update, not an optimizer step
            torch.testing.assert_close((got[name] - theirs).abs(), torch.full_like(theirs, 1e-3))
        else:
            assert torch.equal(got[name], theirs), name
