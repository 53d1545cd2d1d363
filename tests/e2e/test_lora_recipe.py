"""End-to-end LoRA: `recipes/finetune.py peft=lora peft.base_dtype=fp8` from a released-format checkpoint on 2
gloo CP ranks; adapter-only DCP checkpoints that resume, the PEFT export and the merged export.

The base is the tiny model exported in the release formats (FP8 linears, FP4 experts). Oracles: the same run
uninterrupted (resume), and in this process the base checkpoint + a LoRA model + the exported adapter (the
merged export must give its logits).
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.e2e.helpers import FAST, losses, run_recipe

pytestmark = pytest.mark.e2e


def _base_checkpoint(path):
    from dsv4.checkpoint import export_hf_checkpoint
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM

    torch.manual_seed(11)
    export_hf_checkpoint(DSV4ForCausalLM(DSV4Config.preset("tiny", **MODEL)), str(path), dtype="quantized")
    return path


# 8 indexer heads: the comparisons with transformers stay free of exact indexer ties (tests/unit/checkpoint/
# hf_reference.py)
MODEL = {"index_n_heads": 8}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = _base_checkpoint(root / "base")
    args = [*FAST, "cp=2", "peft=lora", "peft.base_dtype=fp8", "peft.rank=4", "peft.alpha=8", f"model.checkpoint={base}",
            "data.tokenizer=byte", "optim.lr=1e-2", *(f"model.{k}={v}" for k, v in MODEL.items())]
    run = root / "run"
    run_recipe([*args, "trainer.max_steps=4", "checkpoint.every_n_steps=2", f"export.adapter_dir={root / 'adapter'}",
                "export.merge=true", f"export.hf_dir={root / 'merged'}", "export.dtype=float32"], run)
    return {"root": root, "base": base, "run": run, "args": args}


def test_lora_run_checkpoints_only_adapters_and_optimizer(lora_run):
    from torch.distributed.checkpoint import FileSystemReader

    trajectory = losses(lora_run["run"])
    assert sorted(trajectory) == [0, 1, 2, 3] and all(math.isfinite(v) for v in trajectory.values())
    metadata = FileSystemReader(str(lora_run["run"] / "checkpoints" / "step2.ckpt")).read_metadata()
    model_keys = [k for k in metadata.state_dict_metadata if k.startswith("state_dict.")]
    assert model_keys and all(k.endswith(("lora_A", "lora_B")) for k in model_keys), model_keys[:5]
    # 5 blocks x (5 attention + 3 shared + 3 stacked routed) projections x (A, B)
    assert len(model_keys) == 110


def test_lora_resume_continues_the_same_trajectory(lora_run, tmp_path):
    """Resume from the step-2 checkpoint; this run also exports a re-quantised merge, which must say how much of
    the update the FP8 / FP4 rounding loses, into a directory holding a stale 9-shard export's first shard and index
    (`export.overwrite=true`): afterwards it holds the files the new index names, the index and config.json only."""
    import json
    import os

    resumed_dir, merged = tmp_path / "resumed", tmp_path / "merged_q"
    merged.mkdir()
    (merged / "model-00001-of-00009.safetensors").write_bytes(b"\0" * 8)
    (merged / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    proc = run_recipe([*lora_run["args"], "trainer.max_steps=4", "checkpoint.every_n_steps=2",
                       f"checkpoint.resume={lora_run['run'] / 'checkpoints' / 'step2.ckpt'}", "export.merge=true",
                       f"export.hf_dir={merged}", "export.dtype=quantized", "export.overwrite=true"], resumed_dir)
    resumed, reference = losses(resumed_dir), losses(lora_run["run"])
    assert sorted(resumed) == [2, 3]
    for step in (2, 3):
        assert abs(resumed[step] - reference[step]) <= 1e-5, (step, resumed[step], reference[step])
    log = proc.stdout + proc.stderr
    assert "re-quantising the merged FP8 / FP4 weights rounds away" in log or "re-quantised merge keeps" in log
    index = json.loads((merged / "model.safetensors.index.json").read_text())
    assert sorted(os.listdir(merged)) == sorted({*index["weight_map"].values(), "model.safetensors.index.json",
                                                 "config.json"})
    assert "model-00001-of-00009.safetensors" not in index["weight_map"].values()


def test_lora_exports_the_adapter_and_the_merged_model(lora_run):
    peft = pytest.importorskip("peft")
    from dsv4.checkpoint import load_hf_checkpoint, load_model_from_hf
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM
    from dsv4.peft import LoRAConfig, apply_lora
    from dsv4.peft.peft_format import load_peft_adapter

    root = lora_run["root"]
    config = peft.PeftConfig.from_pretrained(str(root / "adapter"))
    assert config.r == 4 and config.lora_alpha == 8
    adapted = DSV4ForCausalLM(DSV4Config.preset("tiny", **MODEL))
    apply_lora(adapted, LoRAConfig(rank=4, alpha=8, base_dtype="fp8"))
    load_hf_checkpoint(adapted, str(lora_run["base"]))
    load_peft_adapter(adapted, str(root / "adapter"))
    merged = load_model_from_hf(str(root / "merged"))
    ids = torch.randint(1, 256, (1, 256), generator=torch.Generator().manual_seed(2))
    expected = adapted(ids).logits
    plain = load_model_from_hf(str(lora_run["base"]))
    assert (plain(ids).logits - expected).abs().max() > 1e-3  # the adapters learned something
    torch.testing.assert_close(merged(ids).logits, expected, rtol=0, atol=1e-5)


def test_lora_exports_apply_in_transformers_and_peft(lora_run):
    """The recipe's adapter through peft on transformers' DeepseekV4ForCausalLM (the base checkpoint, FP8 / FP4
    dequantised by transformers) and its merged export in transformers give the dsv4 LoRA model's logits."""
    import warnings

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from dsv4.checkpoint import load_hf_checkpoint
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM
    from dsv4.peft import LoRAConfig, apply_lora
    from dsv4.peft.peft_format import load_peft_adapter
    from tests.unit.checkpoint.hf_reference import indexer_ties, relative_error

    root = lora_run["root"]
    adapted = DSV4ForCausalLM(DSV4Config.preset("tiny", **MODEL))
    apply_lora(adapted, LoRAConfig(rank=4, alpha=8, base_dtype="fp8"))
    load_hf_checkpoint(adapted, str(lora_run["base"]))
    load_peft_adapter(adapted, str(root / "adapter"))
    ids = torch.randint(1, 256, (1, 256), generator=torch.Generator().manual_seed(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with_adapter = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(str(lora_run["base"]), dtype=torch.float32), str(root / "adapter"))
        merged = AutoModelForCausalLM.from_pretrained(str(root / "merged"), dtype=torch.float32)
    with torch.no_grad(), indexer_ties(with_adapter) as ties, indexer_ties(merged) as merged_ties:
        expected = adapted(ids).logits
        got = with_adapter.eval()(ids).logits
        got_merged = merged.eval()(ids).logits
    assert ties and not any(ties) and not any(merged_ties), (ties, merged_ties)
    assert relative_error(got, expected) < 1e-5
    assert relative_error(got_merged, expected) < 1e-5
