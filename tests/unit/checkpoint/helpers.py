"""Synthetic checkpoints for the checkpoint tests: hand-made FP8 / FP4 tensors with known dequantised values."""

from __future__ import annotations

import json
import os
import struct

import torch
from safetensors.torch import save_file

from dsv4.checkpoint import keys as K
from dsv4.checkpoint.export import iter_hf_tensors
from dsv4.checkpoint.hf_config import INDEX_FILE, write_hf_config

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def fp8_case(out: int, inp: int, gen: torch.Generator):
    """(e4m3 weight, e8m0 scale bytes [ceil(out/128), ceil(in/128)], expected fp32) from known values."""
    q = (torch.randn(out, inp, generator=gen) * 8).to(torch.float8_e4m3fn)
    rows, cols = -(-out // 128), -(-inp // 128)
    sbytes = torch.randint(120, 134, (rows, cols), generator=gen, dtype=torch.int32)
    expected = q.float().clone()
    for i in range(rows):  # the oracle: a loop over tiles, 2 ** (byte - 127)
        for j in range(cols):
            expected[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] *= 2.0 ** (int(sbytes[i, j]) - 127)
    return q, sbytes.to(torch.uint8).view(torch.float8_e8m0fnu), expected


def fp4_case(out: int, inp: int, gen: torch.Generator):
    """(int8 packed [out, in/2], e8m0 [out, ceil(in/32)], expected fp32) from random codes."""
    codes = torch.randint(0, 16, (out, inp), generator=gen)
    packed = (codes[:, 0::2] + 16 * codes[:, 1::2]).to(torch.uint8).view(torch.int8)  # low nibble = column 2j
    groups = -(-inp // 32)
    sbytes = torch.randint(120, 134, (out, groups), generator=gen, dtype=torch.int32)
    table = torch.tensor(E2M1)
    expected = table[codes].clone()
    for g in range(groups):
        expected[:, g * 32 : (g + 1) * 32] *= torch.pow(2.0, (sbytes[:, g : g + 1] - 127).float())
    return packed, sbytes.to(torch.uint8).view(torch.float8_e8m0fnu), expected


def write_shards(path: str, tensors: dict[str, torch.Tensor], num_shards: int, config=None) -> dict[str, str]:
    """Write ``tensors`` round-robin-by-block into ``num_shards`` files with an index; returns the weight map."""
    os.makedirs(path, exist_ok=True)
    names = list(tensors)
    per = -(-len(names) // num_shards)
    weight_map = {}
    total = 0
    for s in range(num_shards):
        chunk = names[s * per : (s + 1) * per]
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in chunk}, os.path.join(path, fname))
        for k in chunk:
            weight_map[k] = fname
            total += tensors[k].numel() * tensors[k].element_size()
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    if config is not None:
        write_hf_config(config, path, quantized=True)
    return weight_map


def synthetic_release_checkpoint(model, path: str, num_shards: int = 3, seed: int = 0):
    """A release-format checkpoint for ``model``'s config: FP8 / FP4 tensors from known values, everything else
    random in its release dtype. Returns ``{hf_key: expected fp32 value}`` (every non-scale key)."""
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    for key, t in iter_hf_tensors(model):
        fmt = K.on_disk_format(key)
        if fmt == "fp8":
            q, s, exp = fp8_case(*t.shape, gen)
            tensors[key], tensors[K.scale_key_of_weight(key)], expected[key] = q, s, exp
        elif fmt == "fp4":
            p, s, exp = fp4_case(*t.shape, gen)
            tensors[key], tensors[K.scale_key_of_weight(key)], expected[key] = p, s, exp
        elif fmt == "int":
            tensors[key] = torch.randint(0, t.max().item() + 1, t.shape, generator=gen, dtype=torch.int64)
            expected[key] = tensors[key]
        else:
            v = torch.randn(t.shape, generator=gen)
            tensors[key] = v.to(torch.bfloat16) if fmt == "bf16" else v
            expected[key] = tensors[key].float()
    write_shards(path, tensors, num_shards, config=model.config)
    return expected


def write_raw_safetensors(file: str, entries: dict[str, tuple[str, list[int], bytes]]) -> None:
    """A safetensors file written by hand (to test dtype tags safetensors itself refuses to write)."""
    header, data, off = {}, b"", 0
    for key, (dtype, shape, raw) in entries.items():
        header[key] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
        data += raw
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)
