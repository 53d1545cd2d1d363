"""Hostile checkpoint files: every one is refused with a ValueError (KeyError for keys the model does not hold)
that names the file (and the key), before anything sized by the file's claims is allocated; ``inspect`` answers
each with one line, not a traceback."""

import json
import os
import re
import struct
import subprocess
import sys
import tracemalloc

import pytest
import torch
from safetensors.torch import save_file

from dsv4.checkpoint import CheckpointDir, export_hf_checkpoint, load_hf_checkpoint
from dsv4.checkpoint.__main__ import main as cli_main
from dsv4.checkpoint.hf_config import INDEX_FILE
from dsv4.checkpoint.safetensors_io import MAX_HEADER_BYTES, TensorInfo, TensorReader
from dsv4.config import DSV4Config
from dsv4.model import DSV4ForCausalLM
from tests.unit.checkpoint.helpers import write_raw_safetensors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
GOOD = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


def _write(file, header: bytes, length: int | None = None, data: bytes = b"") -> str:
    """A safetensors file from raw header bytes; ``length`` overrides the 8-byte header length field."""
    os.makedirs(os.path.dirname(file), exist_ok=True)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return file


def _header(entries: dict) -> bytes:
    return json.dumps(entries).encode()


def _bad_dir(tmp_path, case: str) -> tuple[str, str]:
    """``(checkpoint dir, the file its error must name)`` for one hostile case."""
    d = tmp_path / case
    shard = str(d / "model.safetensors")
    if case == "length_2**60":
        _write(shard, _header(GOOD), length=2**60, data=b"\0" * 8)
    elif case == "length_2**30":
        _write(shard, _header(GOOD), length=2**30, data=b"\0" * 8)
    elif case == "truncated_file":  # the file ends inside the header
        _write(shard, _header(GOOD)[:20], length=len(_header(GOOD)))
    elif case == "truncated_header":  # the length field cuts the JSON short
        _write(shard, _header(GOOD), length=20, data=b"\0" * 8)
    elif case == "non_utf8":
        _write(shard, b'{"\xff\xfe": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}', data=b"\0" * 8)
    elif case == "offsets_vs_shape":
        _write(shard, _header({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}), data=b"\0" * 8)
    elif case in ("index_parent", "index_absolute"):
        outside = _write(str(tmp_path / "x.safetensors"), _header(GOOD), data=b"\0" * 8)  # readable, outside
        d.mkdir(parents=True)
        name = "../x.safetensors" if case == "index_parent" else outside
        (d / INDEX_FILE).write_text(json.dumps({"weight_map": {"a": name}}))
        shard = str(d / INDEX_FILE)
    else:
        raise AssertionError(case)
    return str(d), shard


def _hwm_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


@pytest.mark.parametrize("length", [2**60, 2**30, MAX_HEADER_BYTES + 8])
def test_header_length_beyond_the_file_is_refused_before_allocating(tmp_path, length):
    file = _write(str(tmp_path / "c" / "model.safetensors"), _header(GOOD), length=length, data=b"\0" * 8)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := current RSS
    except OSError:
        pytest.skip("needs Linux /proc/self/clear_refs")
    before = _hwm_kib()
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=re.escape(file) + r": header length \d+ exceeds the file \(\d+ bytes\)"):
            CheckpointDir.open(str(tmp_path / "c"))
        python_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert _hwm_kib() - before < 4 * 1024  # the process's peak RSS grew by less than 4 MiB
    assert python_peak < 4 * 2**20  # and no large buffer was allocated (untouched pages would not show in RSS)


def test_header_over_100mb_is_refused_even_when_the_file_is_larger(tmp_path):
    file = _write(str(tmp_path / "model.safetensors"), b"{", length=MAX_HEADER_BYTES + 1)
    os.truncate(file, MAX_HEADER_BYTES + 4096)  # sparse: costs no disk
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=re.escape(file) + rf": header length {MAX_HEADER_BYTES + 1} exceeds the "
                           rf"{MAX_HEADER_BYTES}-byte limit"):
            CheckpointDir.open(str(tmp_path))
        assert tracemalloc.get_traced_memory()[1] < 4 * 2**20
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("case,message", [
    ("truncated_file", r"header length \d+ exceeds the file \(\d+ bytes\): truncated"),
    ("truncated_header", r"header is not valid JSON \(truncated or corrupt\?\)"),
    ("non_utf8", r"header is not valid UTF-8 \(byte 2 of \d+\)"),
])
def test_truncated_or_non_utf8_header_names_the_file(tmp_path, case, message):
    path, file = _bad_dir(tmp_path, case)
    with pytest.raises(ValueError, match=re.escape(file) + ": " + message):
        CheckpointDir.open(path)


@pytest.mark.parametrize("case", ["index_parent", "index_absolute"])
def test_index_pointing_outside_the_directory_is_refused(tmp_path, case):
    path, index = _bad_dir(tmp_path, case)
    with pytest.raises(ValueError, match=re.escape(index) + r": shard '.*x\.safetensors' points outside the checkpoint"):
        CheckpointDir.open(path)


def test_index_into_a_subdirectory_and_symlinked_shards_still_load(tmp_path):
    """Lexical containment: a shard in a subfolder is fine, and so is a symlinked shard (the HF cache layout)."""
    blobs = tmp_path / "blobs"
    _write(str(blobs / "blob1"), _header(GOOD), data=struct.pack("<2f", 1.0, 2.0))
    d = tmp_path / "snap"
    (d / "sub").mkdir(parents=True)
    os.symlink(blobs / "blob1", d / "sub" / "s.safetensors")
    (d / INDEX_FILE).write_text(json.dumps({"weight_map": {"a": "sub/s.safetensors"}}))
    ckpt = CheckpointDir.open(str(d))
    assert torch.equal(TensorReader(ckpt).read("a"), torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("entry,message", [
    ({"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}, r"hold 8 bytes, but shape \[4\] x F32 needs 16"),
    ({"dtype": "BF16", "shape": [2**40, 2**40], "data_offsets": [0, 8]}, r"hold 8 bytes, but shape .* needs 2417851639229258349412352"),
    ({"dtype": "F32", "shape": [1] * 65, "data_offsets": [0, 4]}, r"is not a list of at most 64 non-negative integers"),
    ({"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}, r"run to byte \d+, past the end of the file"),
    ({"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}, r"shape \[-2\] is not a list of at most 64 non-negative"),
    ({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}, r"data_offsets \[8, 0\] are not \[begin, end\]"),
])
def test_offsets_that_disagree_with_shape_and_dtype_name_the_key(tmp_path, entry, message):
    file = _write(str(tmp_path / "model.safetensors"), _header({"layers.0.attn_norm.weight": entry}), data=b"\0" * 8)
    with pytest.raises(ValueError, match=re.escape(file) + r": tensor 'layers\.0\.attn_norm\.weight': .*" + message):
        CheckpointDir.open(str(tmp_path))


def test_overlapping_data_and_duplicate_keys_are_refused(tmp_path):
    a = _write(str(tmp_path / "a" / "m.safetensors"), _header(
        {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "y": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}
    ), data=b"\0" * 8)
    with pytest.raises(ValueError, match=re.escape(a) + r": tensor 'y': data overlaps that of 'x'"):
        CheckpointDir.open(str(tmp_path / "a"))
    entry = '{"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}'
    b = _write(str(tmp_path / "b" / "m.safetensors"), f'{{"x": {entry}, "x": {entry}}}'.encode(), data=b"\0" * 8)
    with pytest.raises(ValueError, match=re.escape(b) + r": header: duplicate key 'x'"):
        CheckpointDir.open(str(tmp_path / "b"))


def test_reader_names_the_key_when_sizes_disagree(tmp_path):
    """A hand-built TensorInfo (the header checks bypassed) still fails naming the key, not with a reshape error."""
    _write(str(tmp_path / "m.safetensors"), _header(GOOD), data=b"\0" * 8)
    ckpt = CheckpointDir.open(str(tmp_path))
    ckpt.tensors["a"] = TensorInfo("a", "F32", (4,), "m.safetensors", ckpt.tensors["a"].begin, ckpt.tensors["a"].end)
    with pytest.raises(ValueError, match=r"m\.safetensors: tensor 'a': 8 bytes, but shape \[4\] x F32 needs 16"):
        TensorReader(ckpt).read("a")


@pytest.fixture(scope="module")
def f32_ckpt(tmp_path_factory):
    torch.manual_seed(0)
    model = DSV4ForCausalLM(DSV4Config.preset("tiny", num_nextn_predict_layers=0))
    path = tmp_path_factory.mktemp("f32")
    export_hf_checkpoint(model, str(path), dtype="float32")
    return model, path


def _with_extra_key(src, dst, key: str, tensor: torch.Tensor) -> str:
    os.makedirs(dst)
    for name in os.listdir(src):
        os.symlink(os.path.join(src, name), os.path.join(dst, name))
    os.unlink(os.path.join(dst, INDEX_FILE))
    index = json.loads((src / INDEX_FILE).read_text())
    save_file({key: tensor}, os.path.join(dst, "extra.safetensors"))
    index["weight_map"][key] = "extra.safetensors"
    with open(os.path.join(dst, INDEX_FILE), "w") as f:
        json.dump(index, f)
    return str(dst)


@pytest.mark.parametrize("ep", [None, (1, 2)])
@pytest.mark.parametrize("expert", ["8", "1000", "07"])
def test_expert_index_beyond_n_routed_experts_is_an_unexpected_key(f32_ckpt, tmp_path, ep, expert):
    model, path = f32_ckpt
    assert model.config.n_routed_experts == 8
    key = f"layers.1.ffn.experts.{expert}.w1.weight"
    w1 = model.state_dict()["model.layers.1.mlp.experts.w1"][0]
    bad = _with_extra_key(path, str(tmp_path / "bad"), key, w1.clone())
    kwargs = {} if ep is None else {"ep_rank": ep[0], "ep_size": ep[1]}
    with pytest.raises(KeyError, match=r"unexpected key.*" + re.escape(key)) as err:
        load_hf_checkpoint(model, bad, **kwargs)
    if expert != "07":  # "07" is no expert index at all (one number, one key)
        assert f"{key}: expert index >= n_routed_experts (8)" in str(err.value)


def test_two_keys_for_one_model_tensor_are_refused(f32_ckpt, tmp_path):
    model, path = f32_ckpt
    sink = model.state_dict()["model.layers.0.self_attn.sink.logits"]
    bad = _with_extra_key(path, str(tmp_path / "bad"), "layers.0.attn.sink.logits", sink.clone())
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.(sink\.logits|attn_sink): fills model\.layers\.0\.self_attn"
                                         r"\.sink\.logits like layers\.0\.attn\.(attn_sink|sink\.logits)"):
        load_hf_checkpoint(model, bad)


def test_unknown_dtype_is_listed_but_not_read(tmp_path):
    write_raw_safetensors(str(tmp_path / "m.safetensors"), {"a": ("F4_WEIRD", [64], b"\0" * 32)})
    ckpt = CheckpointDir.open(str(tmp_path))
    assert ckpt.tensors["a"].dtype == "F4_WEIRD"  # inspect can still count it
    with pytest.raises(ValueError, match=r"a \(in m\.safetensors\): unknown safetensors dtype 'F4_WEIRD'"):
        TensorReader(ckpt).read("a")


_CASES = ["length_2**60", "length_2**30", "truncated_file", "truncated_header", "non_utf8", "offsets_vs_shape",
          "index_parent", "index_absolute"]


@pytest.mark.parametrize("case", _CASES)
def test_inspect_answers_a_bad_file_with_one_line(tmp_path, capsys, case):
    path, file = _bad_dir(tmp_path, case)
    assert cli_main(["inspect", path]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and file in err


def test_inspect_subprocess_prints_no_traceback(tmp_path):
    for case in ("length_2**60", "index_parent"):
        path, file = _bad_dir(tmp_path, case)
        proc = subprocess.run([sys.executable, "-m", "dsv4.checkpoint", "inspect", path], capture_output=True,
                              text=True, cwd=ROOT, timeout=1800)
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        assert proc.returncode != 0, case
        assert len(lines) == 1 and "Traceback" not in lines[0] and file in lines[0], (case, proc.stdout, proc.stderr)


def test_inspect_names_a_bad_config_json(tmp_path, capsys):
    _write(str(tmp_path / "model.safetensors"), _header(GOOD), data=b"\0" * 8)
    (tmp_path / "config.json").write_text('{"hidden_size": 64,')
    assert cli_main(["inspect", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(tmp_path / "config.json") in err
