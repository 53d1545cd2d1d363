"""An export into a directory that already holds files: refused, or with ``overwrite`` every file the new export
does not write is removed (the HF export and the PEFT adapter); only the directory's own files and links go."""

import json
import os

import pytest
import torch

from dsv4.checkpoint import export_hf_checkpoint, load_hf_checkpoint
from dsv4.checkpoint.hf_config import INDEX_FILE
from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM

STALE = "model-00001-of-00009.safetensors"


def _model(seed):
    torch.manual_seed(seed)
    return DSV4ForCausalLM(DSV4Config.preset("tiny"))


def _stale_export(path):
    """What a 9-shard export leaves: one of its shards and its index."""
    path.mkdir()
    (path / STALE).write_bytes(b"\0" * 64)
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": {"embed.weight": STALE}}))


def test_a_directory_with_a_stale_shard_is_refused_before_anything_is_written(tmp_path):
    out = tmp_path / "hf"
    _stale_export(out)
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    with pytest.raises(ValueError) as err:
        export_hf_checkpoint(_model(0), str(out), dtype="float32")
    assert (f"`path`={str(out)!r} is not empty (2 file(s), e.g. ['{STALE}', '{INDEX_FILE}']); the export would "
            "leave them beside its own files: choose an empty directory, or set overwrite=True") in str(err.value)
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before


def test_overwrite_leaves_only_the_files_the_new_index_names(tmp_path):
    out, outside = tmp_path / "hf", tmp_path / "outside.txt"
    _stale_export(out)
    outside.write_text("not the export's")
    os.symlink(outside, out / "link.safetensors")
    source = _model(0)
    report = export_hf_checkpoint(source, str(out), dtype="float32", max_shard_bytes=300_000, overwrite=True)
    index = json.loads((out / INDEX_FILE).read_text())
    assert len(report.files) > 2 and STALE not in report.files
    assert sorted(os.listdir(out)) == sorted({*index["weight_map"].values(), INDEX_FILE, "config.json"})
    assert outside.read_text() == "not the export's"  # the link went, not what it pointed to
    loaded = _model(1)
    load_hf_checkpoint(loaded, str(out))
    want = source.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in loaded.state_dict().items())


def test_a_subdirectory_or_a_file_is_refused_even_with_overwrite(tmp_path):
    out = tmp_path / "hf"
    (out / "keep").mkdir(parents=True)
    (out / "keep" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"holds the directory 'keep'; an export replaces files only \(with "
                                         r"overwrite=True\): remove it or choose another directory"):
        export_hf_checkpoint(_model(0), str(out), overwrite=True)
    assert os.listdir(out) == ["keep"] and (out / "keep" / "notes.txt").read_text() == "x"
    with pytest.raises(ValueError, match=r"notes.txt' is not a directory"):
        export_hf_checkpoint(_model(0), str(out / "keep" / "notes.txt"), overwrite=True)


def test_the_adapter_directory_is_refused_or_replaced(tmp_path):
    from dsv4.peft import LoRAConfig, apply_lora
    from dsv4.peft.peft_format import ADAPTER_CONFIG, ADAPTER_WEIGHTS, export_peft_adapter

    lora = LoRAConfig(rank=2, alpha=4)
    model = _model(0)
    apply_lora(model, lora)
    out = tmp_path / "adapter"
    out.mkdir()
    (out / "adapter_model.bin").write_bytes(b"old")
    with pytest.raises(ValueError, match=r"is not empty \(1 file\(s\), e.g. \['adapter_model.bin'\]\)"):
        export_peft_adapter(model, str(out), lora)
    assert os.listdir(out) == ["adapter_model.bin"]
    export_peft_adapter(model, str(out), lora, overwrite=True)
    assert sorted(os.listdir(out)) == sorted([ADAPTER_CONFIG, ADAPTER_WEIGHTS])
