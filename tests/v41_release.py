"""A V4.1 release directory written the way the release is, for tests: NeMo Automodel's release names and
quantisation placeholders (its adapters' ``convert_single_tensor_to_hf(..., quantization=True)``) filled by a
quantiser of this module (not dsv4's): FP8 e4m3 with power-of-two e8m0 scales per 32 x 32 tile (per row and 32
columns for Engram tables), routed experts packed FP4 (low nibble the even column) with e8m0 scales per 32 columns,
each scale ``2^ceil(log2(amax / max))``; written as safetensors shards with an index and the nested ``config.json``.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from dsv4.checkpoint.hf_config import INDEX_FILE

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ------------------------------------------------------------------------------------------ the release quantiser
def _pow2_at_least(x: torch.Tensor) -> torch.Tensor:
    """The release's ue8m0 choice: 2^ceil(log2 x) (x > 0)."""
    return torch.exp2(torch.ceil(torch.log2(x)))


def _byte(s: torch.Tensor) -> torch.Tensor:
    return (torch.log2(s).round().to(torch.int32) + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def release_fp8(w: torch.Tensor, rb: int, cb: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    nr, nc = -(-rows // rb), -(-cols // cb)
    padded = torch.zeros(nr * rb, nc * cb)
    padded[:rows, :cols] = w
    amax = padded.abs().reshape(nr, rb, nc, cb).amax(dim=(1, 3)).clamp_min(2.0**-60)
    s = _pow2_at_least(amax / 448)
    full = s.repeat_interleave(rb, 0)[:rows].repeat_interleave(cb, 1)[:, :cols]
    return (w / full).to(torch.float8_e4m3fn), _byte(s)


def release_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    s = _pow2_at_least(w.abs().reshape(rows, cols // 32, 32).amax(-1).clamp_min(2.0**-60) / 6)
    x = w / s.repeat_interleave(32, 1)
    mag = (x.abs()[..., None] - E2M1).abs().argmin(-1)  # nearest magnitude
    codes = mag + 8 * ((x < 0) & (mag > 0))
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8), _byte(s)


def release_tensors(adapter, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """NeMo's release names and placeholders (``to_hf(quantization=True)``), filled by the quantiser above."""
    out: dict[str, torch.Tensor] = {}
    for fqn, value in state.items():
        floats = dict(adapter.convert_single_tensor_to_hf(fqn, value))
        placeholders = adapter.convert_single_tensor_to_hf(fqn, value, quantization=True, for_checkpoint_load=True)
        for key, ph in placeholders:
            if key.endswith(".scale"):
                continue
            w = floats[key].detach().float()
            if ph.dtype == torch.int8:
                q, s = release_fp4(w)
            elif ph.dtype == torch.float8_e4m3fn:
                scale = dict(placeholders)[key[: -len("weight")] + "scale"]
                q, s = release_fp8(w, *((1, 32) if scale.shape[0] == w.shape[0] else (32, 32)))
            else:
                out[key] = w.clone()
                continue
            scale = dict(placeholders)[key[: -len("weight")] + "scale"]
            assert (q.dtype, q.shape, s.dtype, s.shape) == (ph.dtype, ph.shape, scale.dtype, scale.shape), key
            out[key], out[key[: -len("weight")] + "scale"] = q, s
    return out


def write_release_dir(path: str, tensors: dict[str, torch.Tensor], config: dict, shards: int = 2) -> None:
    os.makedirs(path, exist_ok=True)
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in names[i * per:(i + 1) * per]}, os.path.join(path, file))
        weight_map.update({k: file for k in names[i * per:(i + 1) * per]})
    with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
