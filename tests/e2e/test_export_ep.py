"""End-to-end: `export.hf_dir` / `export.adapter_dir` from expert-parallel runs of `recipes/finetune.py` (2 gloo ranks).

* `dp=2 ep=2`, lr = 0, from a float32 checkpoint: the float32 export holds exactly the loaded weights (the routers'
  load-balancing biases moved by one update, +-1e-3).
* `cp=2 ep=2 peft=lora` (FP8 / FP4 base) with training: the merged export is byte-identical to the one-process
  merged export of the same weights (the base checkpoint + the run's exported adapter, loaded in this process), and
  the converter turns the run's checkpoint into the same adapter and merged files.
* `cp=2 ep=2` full fine-tune: the converter writes the run's own export from its checkpoint, and a resume follows
  the uninterrupted trajectory.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.e2e.helpers import FAST, assert_export_holds_the_loaded_weights, run_recipe

pytestmark = pytest.mark.e2e


def _source(seed):
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM

    torch.manual_seed(seed)
    return DSV4ForCausalLM(DSV4Config.preset("tiny"))


def test_dp2_ep2_export_holds_the_loaded_weights(tmp_path):
    from dsv4.checkpoint import export_hf_checkpoint, load_model_from_hf

    source = _source(7)
    export_hf_checkpoint(source, tmp_path / "in", dtype="float32")
    run_recipe([*FAST, "dp=2", "ep=2", "trainer.max_steps=1", "checkpoint.every_n_steps=0", "optim.lr=0",
                f"model.checkpoint={tmp_path / 'in'}", "data.tokenizer=byte", f"export.hf_dir={tmp_path / 'out'}",
                "export.dtype=float32"],
               tmp_path / "run")
    assert_export_holds_the_loaded_weights(source.state_dict(), load_model_from_hf(tmp_path / "out").state_dict())


def test_cp2_ep2_lora_merged_export_equals_the_one_process_export(tmp_path):
    from dsv4.checkpoint import export_hf_checkpoint, load_hf_checkpoint
    from dsv4.peft import LoRAConfig, apply_lora
    from dsv4.peft.apply import merged_sources
    from dsv4.peft.peft_format import load_peft_adapter

    export_hf_checkpoint(_source(11), tmp_path / "base", dtype="quantized")
    run_recipe([*FAST, "cp=2", "ep=2", "peft=lora", "peft.base_dtype=fp8", "peft.rank=4", "peft.alpha=8",
                f"model.checkpoint={tmp_path / 'base'}", "data.tokenizer=byte", "optim.lr=1e-2", "trainer.max_steps=2",
                "checkpoint.every_n_steps=0", f"export.adapter_dir={tmp_path / 'adapter'}", "export.merge=true",
                f"export.hf_dir={tmp_path / 'merged'}", "export.dtype=float32"], tmp_path / "run")
    model = _source(0)
    apply_lora(model, LoRAConfig(rank=4, alpha=8.0, base_dtype="fp8"))
    load_hf_checkpoint(model, str(tmp_path / "base"))
    load_peft_adapter(model, str(tmp_path / "adapter"))
    assert any(p.abs().max() > 0 for n, p in model.named_parameters() if n.endswith("lora_B"))  # it trained
    export_hf_checkpoint(model, str(tmp_path / "one"), dtype="float32", sources=merged_sources(model))
    names = sorted(os.listdir(tmp_path / "one"))
    assert sorted(os.listdir(tmp_path / "merged")) == names
    for name in names:
        assert (tmp_path / "merged" / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), name
    # the converter, from the run's ep=2 checkpoint (every expert's adapters at their global place): the same files
    from dsv4.checkpoint.__main__ import main

    for flag, want in (("--adapter", "adapter"), ("--merge", "merged")):
        out = tmp_path / f"converted-{want}"
        assert main(["export", str(tmp_path / "run"), flag, "--dtype", "float32", "--no-progress", "--out", str(out)]) == 0
        assert sorted(os.listdir(out)) == sorted(os.listdir(tmp_path / want))
        for name in os.listdir(out):
            assert (out / name).read_bytes() == (tmp_path / want / name).read_bytes(), (flag, name)


def test_cp2_ep2_checkpoint_resumes_on_the_same_trajectory_and_converts(tmp_path):
    """A `cp=2 ep=2` full fine-tune checkpointed at step 2 (each EP rank's experts at their global place):
    `python -m dsv4.checkpoint export` of it writes the run's own `export.hf_dir` byte for byte, and the run resumed
    to step 3 follows an uninterrupted 3-step run: the same losses (step 3's loss is computed from the loaded
    weights: a checkpoint missing one EP rank's experts changes it) and the same float32 export after step 3's
    update, byte for byte (that update uses the loaded AdamW moments and step: a resume without them moves every
    weight differently)."""
    from dsv4.checkpoint.__main__ import main
    from tests.e2e.helpers import losses

    common = [*(a for a in FAST if not a.startswith("scheduler.")), "cp=2", "ep=2", "scheduler=constant", "optim.lr=1e-2", "checkpoint.every_n_steps=0",
              "export.dtype=float32"]
    cut, whole = tmp_path / "cut", tmp_path / "whole"
    run_recipe([*common, "trainer.max_steps=2", f"export.hf_dir={tmp_path / 'hf'}"], cut)
    assert main(["export", str(cut), "--dtype", "float32", "--no-progress", "--out", str(tmp_path / "out")]) == 0
    names = sorted(os.listdir(tmp_path / "hf"))
    assert sorted(os.listdir(tmp_path / "out")) == names and len(names) >= 3
    for name in names:
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "hf" / name).read_bytes(), name
    # resumes from cut/checkpoints/last.ckpt (step 2)
    proc = run_recipe([*common, "trainer.max_steps=3", f"export.hf_dir={tmp_path / 'resumed'}"], cut)
    assert "resuming from" in proc.stdout + proc.stderr
    run_recipe([*common, "trainer.max_steps=3", f"export.hf_dir={tmp_path / 'whole-hf'}"], whole)
    resumed, uninterrupted = losses(cut), losses(whole)
    assert sorted(uninterrupted) == [0, 1, 2] or sorted(uninterrupted) == [1, 2, 3]
    assert resumed == uninterrupted
    names = sorted(os.listdir(tmp_path / "whole-hf"))
    assert sorted(os.listdir(tmp_path / "resumed")) == names
    for name in names:  # the weights after step 3's update
        assert (tmp_path / "resumed" / name).read_bytes() == (tmp_path / "whole-hf" / name).read_bytes(), name
    # and that update moved the weights the checkpoint held (else equal exports would say nothing about moments)
    assert any((tmp_path / "resumed" / n).read_bytes() != (tmp_path / "hf" / n).read_bytes() for n in names
               if n.endswith(".safetensors"))
