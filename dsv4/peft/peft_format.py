"""PEFT-format LoRA adapters: ``adapter_config.json`` + ``adapter_model.safetensors``.

Module names are the released checkpoint's (:mod:`dsv4.checkpoint.keys`), under PEFT's ``base_model.model.``
prefix, one ``lora_A`` / ``lora_B`` pair per adapted linear and per routed expert::

    base_model.model.layers.3.attn.wq_a.lora_A.weight              [r, in]
    base_model.model.layers.3.attn.wq_a.lora_B.weight              [out, r]
    base_model.model.layers.3.ffn.experts.17.w1.lora_A.weight      [r, hidden]     (expert 17's own pair)
    base_model.model.mtp.0.ffn.shared_experts.w2.lora_B.weight     [hidden, r]

``adapter_config.json`` is a PEFT ``LoraConfig`` (``peft_type`` LORA, ``r``, ``lora_alpha``, ``lora_dropout``,
``target_modules`` as a regular expression over those module names, ``bias`` none, no rsLoRA, no fan-in-fan-out),
readable by ``peft.PeftConfig.from_pretrained``. ``wo_a`` is block-diagonal in the model: its adapter is a plain
``[r, in_g]`` / ``[G * out_g, r]`` pair applied per group, and ``W + (alpha / r) B A`` is the merged weight there too.

:func:`export_peft_adapter` gathers full tensors (a collective under FSDP: call it on every rank, ``write`` on
one). :func:`load_peft_adapter` fills a LoRA model built with the same rank and alpha, before FSDP wrapping; under
EP each rank reads its own experts. Every check (config, missing / unexpected keys, shapes) runs before any
tensor is read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Iterator

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from dsv4.checkpoint import keys as K
from dsv4.checkpoint.safetensors_io import CheckpointDir, TensorReader
from dsv4.distributed import full_tensor
from dsv4.peft.config import TARGET_MODULE_PATTERNS, LoRAConfig
from dsv4.peft.lora import LoRAGroupedExperts, LoRALinear

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def target_modules_regex(lora: LoRAConfig) -> str:
    """PEFT's ``target_modules`` (matched with ``re.fullmatch`` against module names) for ``lora.targets``."""
    return r"^(layers|mtp)\.\d+\.(" + "|".join(TARGET_MODULE_PATTERNS[t] for t in lora.targets) + r")$"


def _adapter_slots(model: nn.Module) -> Iterator[tuple[str, nn.Parameter, int | None]]:
    """``(PEFT key, parameter, expert row or None)`` for every adapter tensor this rank holds."""
    for module_name, module in model.named_modules():
        if isinstance(module, LoRALinear) and module.rank:
            hf_module = K.ours_to_hf(f"{module_name}.weight")[: -len(".weight")]
            yield f"{PREFIX}{hf_module}.lora_A.weight", module.lora_A, None
            yield f"{PREFIX}{hf_module}.lora_B.weight", module.lora_B, None
        elif isinstance(module, LoRAGroupedExperts) and module.rank:
            for name in module.WEIGHTS:
                for row in range(module.num_local_experts):
                    hf = K.ours_to_hf(f"{module_name}.{name}", module.expert_offset + row)[: -len(".weight")]
                    for ab in "AB":
                        yield f"{PREFIX}{hf}.lora_{ab}.weight", getattr(module, f"{name}_lora_{ab}"), row


def peft_config_dict(lora: LoRAConfig, base_model: str | None = None) -> dict:
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "revision": None,
        "inference_mode": True, "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
        "target_modules": target_modules_regex(lora), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
    }


def export_peft_adapter(model: nn.Module, path: str, lora: LoRAConfig, *, base_model: str | None = None,
                        write: bool = True) -> list[str]:
    """Write the adapters of ``model`` to ``path`` in the PEFT format; returns the keys written. The model must
    hold every expert (``unshard_experts`` first under EP)."""
    tensors: dict[str, Tensor] = {}
    for key, param, row in _adapter_slots(model):
        value = full_tensor(param).detach()
        tensors[key] = (value if row is None else value[row]).float().cpu().contiguous()
    for module in model.modules():
        if isinstance(module, LoRAGroupedExperts) and module.rank and module.num_local_experts != module.num_experts:
            raise ValueError("export_peft_adapter: the model holds a slice of the routed experts; call "
                             "unshard_experts(model, ep_group) before exporting")
    if not tensors:
        raise ValueError("export_peft_adapter: the model has no LoRA adapters (apply_lora first)")
    if write:
        os.makedirs(path, exist_ok=True)
        save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
            json.dump(peft_config_dict(lora, base_model), f, indent=2)
    return list(tensors)


@dataclass
class AdapterLoadReport:
    loaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # other EP ranks' experts


def read_peft_config(path: str) -> dict:
    """``adapter_config.json`` of ``path``, checked for what this loader supports (ValueError naming the field)."""
    file = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{path}: no {ADAPTER_CONFIG} (a PEFT adapter directory has one)")
    try:
        with open(file) as f:
            config = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{file}: not valid JSON ({err})") from None
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{file}: peft_type={config.get('peft_type')!r}, only LORA adapters are supported")
    for key, supported in (("use_rslora", False), ("fan_in_fan_out", False), ("bias", "none"), ("use_dora", False)):
        if config.get(key, supported) != supported:
            raise ValueError(f"{file}: {key}={config[key]!r} is not supported (expected {supported!r})")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{file}: per-module rank_pattern / alpha_pattern are not supported")
    return config


@torch.no_grad()
def load_peft_adapter(model: nn.Module, path: str) -> AdapterLoadReport:
    """Fill the adapters of a LoRA ``model`` from the PEFT adapter directory ``path`` (see the module docstring)."""
    config = read_peft_config(path)
    ranks = {m.rank for m in model.modules() if isinstance(m, (LoRALinear, LoRAGroupedExperts)) and m.rank}
    scalings = {m.scaling for m in model.modules() if isinstance(m, (LoRALinear, LoRAGroupedExperts)) and m.rank}
    if not ranks:
        raise ValueError("load_peft_adapter: the model has no LoRA adapters (apply_lora with the adapter's targets)")
    if ranks != {config.get("r")} or scalings != {config.get("lora_alpha", 0) / config.get("r", 1)}:
        raise ValueError(f"{path}: r={config.get('r')}, lora_alpha={config.get('lora_alpha')} differ from the model's "
                         f"adapters (rank {sorted(ranks)}, alpha / rank {sorted(scalings)}); set peft.rank / peft.alpha")
    ckpt = CheckpointDir.open(path)
    slots = {key: (param, row) for key, param, row in _adapter_slots(model)}
    missing = sorted(k for k in slots if k not in ckpt.tensors)
    report = AdapterLoadReport()
    unexpected = []
    for key in ckpt.tensors:
        if key in slots:
            continue
        expert = K.hf_to_ours(key[len(PREFIX):].rsplit(".lora_", 1)[0] + ".weight") if key.startswith(PREFIX) else None
        if expert is not None and expert.expert is not None and _holds_expert_module(model, expert.name, expert.expert):
            report.skipped.append(key)
        else:
            unexpected.append(key)
    if missing or unexpected:
        raise KeyError(f"{path}: {len(missing)} adapter keys missing from the file: {missing[:5]}; {len(unexpected)} "
                       f"unexpected (the model has no such adapter: check peft.targets): {sorted(unexpected)[:5]}")
    for key, (param, row) in slots.items():
        want = tuple(param.shape[1:] if row is not None else param.shape)
        if tuple(ckpt.tensors[key].shape) != want:
            raise ValueError(f"{path}: {key} has shape {list(ckpt.tensors[key].shape)}, the model's adapter {list(want)}")
    reader = TensorReader(ckpt)
    try:
        for key, (param, row) in slots.items():
            dest = param if row is None else param[row]
            dest.copy_(reader.read(key).to(dtype=dest.dtype, device=dest.device))
            report.loaded.append(key)
    finally:
        reader.close()
    return report


def _holds_expert_module(model: nn.Module, name: str, expert: int) -> bool:
    """Whether ``name`` (a stacked expert tensor) exists in ``model`` and ``expert`` is a valid global index that
    another EP rank holds."""
    try:
        module = model.get_submodule(name.rsplit(".", 1)[0])
    except AttributeError:
        return False
    return isinstance(module, LoRAGroupedExperts) and module.rank > 0 and 0 <= expert < module.num_experts
