"""Export a ``DSV4ForCausalLM`` to an HF-format directory: safetensors shards, ``model.safetensors.index.json``
(``metadata.total_size`` + ``weight_map``) and ``config.json``.

``dtype``:

* ``"bfloat16"`` (default): every tensor that is FP8/FP4/BF16 in the release is written as BF16; tensors the
  release keeps in F32 (``hc_*``, ``attn_sink``, ``ape``, ``gate.bias``) stay F32; ``tid2eid`` is I64. No scales.
* ``"float32"``: every float tensor as F32 (lossless for an fp32 model).
* ``"quantized"``: the release formats: FP8 e4m3 + 128x128 e8m0 ``.scale`` for the dense/shared-expert linears,
  indexer ``wq_b`` and MTP ``e_proj``/``h_proj``; packed FP4 + e8m0 per 32 columns for routed experts; BF16/F32
  /I64 as in the release; ``config.json`` gets a ``quantization_config`` and ``"expert_dtype": "fp4"``.

``config.json`` (:func:`~dsv4.checkpoint.hf_config.config_to_hf`) has the release's fields, ``compress_ratios`` with
one entry per MTP block after the backbone's.

Tensors are converted one at a time and a shard is written as soon as it reaches ``max_shard_bytes``, so at
most one shard of converted tensors is held. Routed experts are split back into ``ffn.experts.{e}.w{1,2,3}``.
The model must hold every expert (call ``dsv4.parallel.expert_shard.unshard_experts`` first under EP) and full
tensors (``DTensor`` parameters are gathered with ``full_tensor()``, a collective: call this on every rank and
pass ``write=False`` on all but one).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
from safetensors.torch import save_file
from torch import nn

from dsv4.checkpoint import keys as K
from dsv4.checkpoint.hf_config import INDEX_FILE, write_hf_config
from dsv4.checkpoint.quant import quantize_fp4_packed, quantize_fp8_block
from dsv4.distributed import full_tensor

EXPORT_DTYPES = ("bfloat16", "float32", "quantized")
DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3


@dataclass
class ExportReport:
    path: str
    files: list[str] = field(default_factory=list)
    total_size: int = 0
    num_tensors: int = 0
    weight_map: dict[str, str] = field(default_factory=dict)


def _full(t: torch.Tensor) -> torch.Tensor:
    return full_tensor(t).detach().cpu()


def iter_hf_tensors(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(on-disk key, full tensor)`` for every persistent tensor of ``model`` (or for the ``(state-dict name,
    tensor)`` pairs of ``tensors``, e.g. a LoRA model's merged weights), experts split per expert."""
    for name, t in (model.state_dict().items() if tensors is None else tensors):
        if K.is_stacked_expert(name):
            module = model.get_submodule(name.rsplit(".", 1)[0])
            if module.num_local_experts != module.num_experts:
                raise ValueError(
                    f"export: {name} holds experts [{module.expert_offset}, {module.expert_offset + module.num_local_experts}) "
                    f"of {module.num_experts}; call unshard_experts(model, ep_group) before exporting"
                )
            full = _full(t)
            for row in range(full.shape[0]):
                yield K.ours_to_hf(name, module.expert_offset + row), full[row].clone()
            continue
        hf = K.ours_to_hf(name)
        if hf is None:
            raise KeyError(f"export: no on-disk name for state-dict key {name!r}")
        yield hf, _full(t)


def convert_for_export(hf_key: str, tensor: torch.Tensor, dtype: str) -> list[tuple[str, torch.Tensor]]:
    """One model tensor -> the on-disk tensor(s) (weight, and ``.scale`` when quantised)."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype must be one of {EXPORT_DTYPES}, got {dtype!r}")
    fmt = K.on_disk_format(hf_key)
    if not tensor.dtype.is_floating_point:
        return [(hf_key, tensor.to(torch.int64).contiguous())]
    if dtype == "float32":
        return [(hf_key, tensor.float().contiguous())]
    if fmt == "f32":
        return [(hf_key, tensor.float().contiguous())]
    if dtype == "quantized" and fmt in ("fp8", "fp4"):
        q, s = quantize_fp8_block(tensor) if fmt == "fp8" else quantize_fp4_packed(tensor)
        return [(hf_key, q.contiguous()), (K.scale_key_of_weight(hf_key), s.contiguous())]
    return [(hf_key, tensor.to(torch.bfloat16).contiguous())]


def export_hf_checkpoint(
    model: nn.Module,
    path: str,
    *,
    dtype: str = "bfloat16",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    config=None,
    write: bool = True,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
) -> ExportReport:
    """Write ``model`` to ``path`` (see the module docstring). ``config`` defaults to ``model.config``;
    ``tensors`` replaces ``model.state_dict()`` as the source (``dsv4.peft.merged_tensors`` for a merged LoRA
    model)."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype must be one of {EXPORT_DTYPES}, got {dtype!r}")
    config = config if config is not None else getattr(model, "config", None)
    report = ExportReport(path=path)
    if write:
        os.makedirs(path, exist_ok=True)
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    temp_files: list[tuple[str, list[str]]] = []

    def flush() -> None:
        nonlocal pending, pending_bytes
        if not pending:
            return
        name = f"shard-{len(temp_files):05d}.tmp"
        if write:
            save_file(pending, os.path.join(path, name), metadata={"format": "pt"})
        temp_files.append((name, list(pending)))
        pending, pending_bytes = {}, 0

    for hf_key, tensor in iter_hf_tensors(model, tensors):
        for key, t in convert_for_export(hf_key, tensor, dtype):
            size = t.numel() * t.element_size()
            if pending and pending_bytes + size > max_shard_bytes:
                flush()
            pending[key] = t
            pending_bytes += size
            report.total_size += size
            report.num_tensors += 1
    flush()

    n = len(temp_files)
    for i, (tmp, keys) in enumerate(temp_files):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        if write:
            os.replace(os.path.join(path, tmp), os.path.join(path, final))
        report.files.append(final)
        report.weight_map.update({k: final for k in keys})
    if write:
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": report.total_size}, "weight_map": report.weight_map}, f, indent=2)
        if config is not None:
            torch_dtype = {"bfloat16": "bfloat16", "float32": "float32", "quantized": "bfloat16"}[dtype]
            write_hf_config(config, path, quantized=dtype == "quantized", torch_dtype=torch_dtype)
    return report
