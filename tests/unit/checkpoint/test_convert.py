"""``python -m dsv4.checkpoint export``: a run's DCP checkpoint -> the files the run's own ``export.hf_dir`` wrote.

One in-process run (one rank, 1 step, checkpointed) exports bfloat16 at its end (``export.hf_dir``), and the same
end-of-training call exports the same weights quantized as well (FP8 / FP4 with e8m0 scales: the fixture calls
:func:`~dsv4.checkpoint.export_hf_checkpoint` a second time with ``dtype="quantized"``); the converter, in this process
from ``last.ckpt``, must write the same bytes for each. Damaged checkpoints are refused naming the file."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from dsv4.checkpoint.__main__ import main
from dsv4.checkpoint.convert import export_run
from dsv4.checkpoint.safetensors_io import CheckpointFormatError
from dsv4.training.run import run_finetune
from dsv4.training.schema import register_schema

CONF = Path(__file__).resolve().parents[3] / "conf"
FAST = ["seq_len=256", "logger=csv", "data.max_bytes=200000", "scheduler.warmup_steps=1", "callbacks=none"]


def _run(root, overrides):
    import torch.distributed as dist

    env = dict(os.environ)
    dist.init_process_group("gloo", init_method=f"file://{root / 'store'}", rank=0, world_size=1)
    try:
        register_schema()
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(config_name="finetune", overrides=[
                *FAST, "trainer.max_steps=1", "checkpoint.every_n_steps=0", *overrides])
        (root / "run").mkdir()
        run_finetune(cfg, root / "run")
    finally:
        dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(env)
    return root


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """The run; ``hf/`` is its bfloat16 export (``export.hf_dir``), ``hf_quantized/`` the quantized export of the
    same model made by the same end-of-training call (the run's arguments, ``dtype="quantized"``)."""
    import dsv4.checkpoint as checkpoint

    root = tmp_path_factory.mktemp("convert")
    export = checkpoint.export_hf_checkpoint

    def export_also_quantized(model, path, **kwargs):
        report = export(model, path, **kwargs)
        export(model, str(root / "hf_quantized"), **{**kwargs, "dtype": "quantized"})
        return report

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(checkpoint, "export_hf_checkpoint", export_also_quantized)
        _run(root, [f"export.hf_dir={root / 'hf'}"])
    return root


def _files(directory):
    return {name: (directory / name).read_bytes() for name in sorted(os.listdir(directory))}


def _assert_same_export(want_dir: Path, got_dir: Path) -> dict:
    """``got_dir`` holds exactly the files of ``want_dir``: the same index, and in each shard the same tensors
    (keys, dtypes, shapes, bytes), then the same bytes for every file (headers included). Returns the tensors."""
    import torch
    from safetensors import safe_open

    want, got = _files(want_dir), _files(got_dir)
    assert list(got) == list(want) and len(want) >= 3
    index = json.loads(want["model.safetensors.index.json"])
    assert json.loads(got["model.safetensors.index.json"]) == index
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(want_dir / shard, "pt") as w, safe_open(got_dir / shard, "pt") as g:
            assert sorted(g.keys()) == sorted(w.keys()) == sorted(k for k, f in index["weight_map"].items()
                                                                   if f == shard), shard
            for key in w.keys():
                a, b = w.get_tensor(key), g.get_tensor(key)
                assert (b.dtype, b.shape) == (a.dtype, a.shape), key
                a_bytes, b_bytes = (t.contiguous().view(-1).view(torch.uint8) for t in (a, b))
                same = torch.equal(b_bytes, a_bytes)
                assert same, f"{key} ({a.dtype}): {int((a_bytes != b_bytes).sum())} of {a_bytes.numel()} bytes differ"
                tensors[key] = a
    for name in want:
        assert got[name] == want[name], name
    return tensors


def test_converter_writes_the_runs_own_export(finished_run, tmp_path, capsys):
    """Into a directory holding a stale shard: refused (nothing read), then with --overwrite the run's own files and
    nothing else."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "model-00001-of-00009.safetensors").write_bytes(b"\0")
    assert main(["export", str(finished_run / "run"), "--out", str(out)]) == 2
    assert f"error: `--out`={str(out)!r} is not empty" in capsys.readouterr().err
    assert main(["export", str(finished_run / "run"), "--out", str(out), "--overwrite"]) == 0
    _assert_same_export(finished_run / "hf", out)
    assert "wrote" in capsys.readouterr().out


def test_converter_quantized_is_the_runs_quantized_export(finished_run, tmp_path):
    """``--step 1 --dtype quantized``: every tensor (FP8 weights with their 128x128 e8m0 scales, packed FP4 experts
    with their per-32-column scales, BF16 / F32 / I64 ones), the index and config.json are the run's own quantized
    export of the same weights, byte for byte."""
    import torch

    report = export_run(finished_run / "run", str(tmp_path / "out"), step=1, dtype="quantized")
    tensors = _assert_same_export(finished_run / "hf_quantized", tmp_path / "out")
    assert report.weight_map == json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())[
        "weight_map"]
    # quantized, not a plain copy: FP8 and packed FP4 weights, each with its e8m0 scale
    by_dtype = {dt: [k for k, t in tensors.items() if t.dtype == dt] for dt in (torch.float8_e4m3fn, torch.int8)}
    assert by_dtype[torch.float8_e4m3fn] and by_dtype[torch.int8], {k: t.dtype for k, t in tensors.items()}
    for key in by_dtype[torch.float8_e4m3fn] + by_dtype[torch.int8]:
        assert tensors[key.removesuffix(".weight") + ".scale"].dtype == torch.float8_e8m0fnu, key


def test_converter_refuses_a_missing_step(finished_run, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"step7\.ckpt: no such checkpoint directory .*step1\.ckpt"):
        export_run(finished_run / "run", str(tmp_path / "x"), step=7)


def test_damaged_checkpoint_names_the_file(finished_run, tmp_path, capsys):
    ckpt = tmp_path / "last.ckpt"
    shutil.copytree(finished_run / "run" / "checkpoints" / "last.ckpt", ckpt)
    shard = next(p for p in sorted(ckpt.iterdir()) if p.suffix == ".distcp")
    with open(shard, "r+b") as f:
        f.truncate(1000)
    with pytest.raises(CheckpointFormatError, match=rf"{shard}: \d+ bytes, but .* lies at bytes .*: truncated"):
        export_run(ckpt, str(tmp_path / "out"))
    shard.unlink()
    assert main(["export", str(ckpt), "--out", str(tmp_path / "out")]) == 2
    assert f"error: {shard}: missing" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing written before the checks


def test_converter_writes_a_lora_runs_adapter_and_merged_model(tmp_path_factory, tmp_path):
    """A LoRA run from a base checkpoint kept in FP8 / FP4 (every target, lr high enough that B moves): --adapter
    writes the run's export.adapter_dir and --merge its export.hf_dir with export.merge, byte for byte (the base
    streamed from the run's model.checkpoint one block at a time)."""
    import torch

    from dsv4.checkpoint import export_hf_checkpoint
    from dsv4.config import DSV4Config
    from dsv4.model import DSV4ForCausalLM

    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(11)
    export_hf_checkpoint(DSV4ForCausalLM(DSV4Config.preset("tiny")), str(root / "base"), dtype="quantized")
    _run(root, ["peft=lora", "peft.rank=4", "peft.alpha=8", "peft.base_dtype=fp8", "optim.lr=1e-2",
                f"model.checkpoint={root / 'base'}", "data.tokenizer=byte", f"export.adapter_dir={root / 'adapter'}",
                "export.merge=true",
                f"export.hf_dir={root / 'merged'}", "export.dtype=float32"])
    with pytest.raises(ValueError, match="a LoRA run's checkpoint .*pass --adapter .* or --merge"):
        export_run(root / "run", str(tmp_path / "x"))
    with pytest.raises(ValueError, match="choose one"):
        export_run(root / "run", str(tmp_path / "x"), adapter=True, merge=True)
    assert main(["export", str(root / "run"), "--adapter", "--out", str(tmp_path / "out")]) == 0
    want, got = _files(root / "adapter"), _files(tmp_path / "out")
    assert list(got) == list(want) == ["adapter_config.json", "adapter_model.safetensors"]
    for name in want:
        assert got[name] == want[name], name
    from safetensors.torch import load_file

    trained = load_file(tmp_path / "out" / "adapter_model.safetensors")
    assert any(t.abs().max() > 0 for k, t in trained.items() if "lora_B" in k)  # B moved off its zero start

    assert main(["export", str(root / "run"), "--merge", "--dtype", "float32", "--out", str(tmp_path / "merged")]) == 0
    want, got = _files(root / "merged"), _files(tmp_path / "merged")
    assert list(got) == list(want) and len(want) >= 3
    for name in want:
        assert got[name] == want[name], name


def test_merge_needs_the_runs_base_checkpoint(finished_run, tmp_path, capsys):
    assert main(["export", str(finished_run / "run"), "--merge", "--out", str(tmp_path / "out")]) == 2
    assert "--merge needs a LoRA run's checkpoint; this one holds the full model" in capsys.readouterr().err
