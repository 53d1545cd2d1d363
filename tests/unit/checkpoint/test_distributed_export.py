"""The export's file writer: files laid out from metadata and filled tensor by tensor are exactly what
``safetensors.torch.save_file`` writes for the same tensors (so an export written by several ranks, each at its
own offsets, is a plain safetensors file); the planned shapes and dtypes of every export dtype are the converted
tensors'. The 2-rank EP / FSDP export against the one-process export: ``tests/distributed/test_checkpoint_ep.py``."""

import os

import pytest
import torch
from safetensors.torch import load_file, save

from dsv4.checkpoint import export_hf_checkpoint
from dsv4.checkpoint.safetensors_write import TensorMeta, create_file, file_layout, write_tensor
from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM


def _fill(path, tensors, order):
    layout = file_layout([TensorMeta(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()], {"format": "pt"})
    create_file(path, layout)
    fd = os.open(path, os.O_WRONLY)
    try:
        for key in order:  # any order: every tensor has its place
            write_tensor(fd, layout, key, tensors[key], path)
    finally:
        os.close(fd)


def test_filled_file_is_byte_identical_to_save_file(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "b.weight": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "a.weight": torch.randn(7, generator=g),
        "aa": torch.zeros(0),
        "q.weight": (torch.randn(4, 4, generator=g) * 8).to(torch.float8_e4m3fn),
        "q.scale": torch.randint(120, 130, (1, 1), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu),
        "e.weight": torch.randint(-128, 127, (2, 3), generator=g, dtype=torch.int8),
        "tid2eid": torch.randint(0, 8, (5, 2), generator=g, dtype=torch.int64),
        "h": torch.randn(2, 2, generator=g).half(),
        "x": torch.randn(1, generator=g).double(),
        "i": torch.arange(3, dtype=torch.int32),
        "j": torch.arange(3, dtype=torch.int16),
        "u": torch.arange(3, dtype=torch.uint8),
        "m": torch.tensor([True, False]),
        "f5": torch.randn(3, generator=g).to(torch.float8_e5m2),
    }
    path = str(tmp_path / "f.safetensors")
    _fill(path, tensors, reversed(list(tensors)))
    with open(path, "rb") as f:
        assert f.read() == save(tensors, metadata={"format": "pt"})


def test_write_refuses_a_tensor_of_another_size(tmp_path):
    path = str(tmp_path / "f.safetensors")
    layout = file_layout([TensorMeta("w", torch.float32, (2, 3))])
    create_file(path, layout)
    fd = os.open(path, os.O_WRONLY)
    try:
        with pytest.raises(ValueError, match=r"tensor 'w' has 20 bytes, its place 24"):
            write_tensor(fd, layout, "w", torch.zeros(5), path)
    finally:
        os.close(fd)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "quantized"])
def test_export_shards_are_what_save_file_writes(tmp_path, dtype):
    torch.manual_seed(0)
    model = DSV4ForCausalLM(DSV4Config.preset("tiny"))
    report = export_hf_checkpoint(model, str(tmp_path), dtype=dtype, max_shard_bytes=300_000)
    assert len(report.files) > 2 and sorted(os.listdir(tmp_path)) == sorted(
        [*report.files, "config.json", "model.safetensors.index.json"])
    assert len(report.keys_written) == report.num_tensors == len(report.weight_map)
    for name in report.files:
        file = os.path.join(tmp_path, name)
        with open(file, "rb") as f:
            assert f.read() == save(load_file(file), metadata={"format": "pt"}), name


def test_the_shard_plan_is_huggingface_hubs_but_for_a_lone_or_oversized_shard():
    """What export.py's docstring says of huggingface_hub's planner: the same file names and grouping whenever
    there are several shards and no tensor passes the limit; a lone shard and an oversized tensor differ."""
    from huggingface_hub import split_state_dict_into_shards_factory

    from dsv4.checkpoint.export import _plan, _shards, model_sources

    torch.manual_seed(0)
    model = DSV4ForCausalLM(DSV4Config.preset("tiny"))

    def plans(limit):
        planned = _plan(model, model_sources(model), "bfloat16", 1, None)
        metas = {m.key: m for p in planned for m in p.parts}
        shards = _shards(planned, limit)
        ours = {f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors": [m.key for m in s] for i, s in enumerate(shards)}
        hub = split_state_dict_into_shards_factory(metas, get_storage_size=lambda m: m.nbytes, max_shard_size=limit,
                                                   filename_pattern="model{suffix}.safetensors").filename_to_tensors
        return ours, hub, max(m.nbytes for m in metas.values())

    ours, hub, largest = plans(300_000)
    assert len(ours) > 2 and ours == hub
    ours, hub, _ = plans(largest)  # the largest tensor fills a shard exactly
    assert ours == hub
    ours, hub, _ = plans(10**9)
    assert list(ours) == ["model-00001-of-00001.safetensors"] and list(hub) == ["model.safetensors"]
    ours, hub, _ = plans(largest // 2)  # the hub keeps filling the open shard around an oversized tensor
    assert ours != hub and len(ours) > len(hub)
