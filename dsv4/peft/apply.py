"""Turn a ``DSV4ForCausalLM`` into a LoRA model (:func:`apply_lora`) and read the merged weights back out.

:func:`apply_lora` (in place, before expert parallelism and FSDP, after or before loading a checkpoint):

1. every ``nn.Linear`` whose released name is a target of ``lora.targets`` becomes a :class:`LoRALinear` with an
   adapter; with ``base_dtype=fp8`` every other linear the release stores in FP8 (the indexer's ``wq_b``, MTP's
   ``e_proj``/``h_proj``, V4.1's ``engram.wkv``, non-target projections) becomes a :class:`LoRALinear` without
   one, holding its kept form. The model's family, V4 or V4.1, names the released formats and the kept form is
   the family's (:class:`~dsv4.checkpoint.quant.QuantScheme`): FP8 in 128 x 128 tiles for V4, 32 x 32 for V4.1,
   so a release's bytes and scales are kept as they are;
2. every ``GroupedExperts`` becomes a :class:`LoRAGroupedExperts` (adapters when ``routed_experts`` is a target,
   kept FP4 when ``base_dtype=fp8``);
3. every parameter that is not an adapter is frozen (``requires_grad=False``): no gradient, no optimizer state,
   no gradient reduction. Buffers (the kept base, router biases) are never trained; the trainer does not update
   the router bias in LoRA mode, so the base stays bit-identical.

State-dict names of the base are unchanged (``...wq_a.weight``), so :func:`dsv4.checkpoint.load_hf_checkpoint`
fills a LoRA model like a plain one (kept targets receive the checkpoint's FP8 / FP4 bytes and scales as they are).
:func:`merged_tensors` yields the plain model's state dict with every adapter merged (``W + s B A``, fp32), what
``export.merge`` writes.

:func:`keep_base_quantized` does steps 1-3 without any adapter: every linear the release stores in FP8 and every
routed-expert group kept in the release's form, every parameter frozen (a frozen model run in inference, e.g. the
V4.1 target of DSpark drafter training).
"""

from __future__ import annotations

import math
import re
from functools import partial
from typing import Iterator

import torch
from torch import Tensor, nn

from dsv4.checkpoint import keys as K
from dsv4.checkpoint.export import ExportSource, _full, table_sources
from dsv4.checkpoint.hf_config import SCHEMES
from dsv4.checkpoint.quant import dequantize, kept_format, logical_shape, quantize
from dsv4.model.moe import GroupedExperts
from dsv4.peft.config import TARGET_MODULE_PATTERNS, LoRAConfig
from dsv4.peft.lora import LoRAGroupedExperts, LoRALinear, is_adapter_name

# the linear target groups (routed experts are modules of their own, GroupedExperts)
_TARGET_OF = [(group, re.compile(rf"(^|\.){TARGET_MODULE_PATTERNS[group]}\.weight$"))
              for group in ("attention", "shared_experts")]


def target_group(hf_weight_key: str) -> str | None:
    """The :data:`~dsv4.peft.config.TARGET_GROUPS` entry a linear's released weight name belongs to (None: never
    adapted)."""
    for group, pattern in _TARGET_OF:
        if pattern.search(hf_weight_key):
            return group
    return None


def is_lora_model(model: nn.Module) -> bool:
    return any(isinstance(m, (LoRALinear, LoRAGroupedExperts)) for m in model.modules())


def _family(model: nn.Module) -> str:
    """The checkpoint family whose released formats ``model`` keeps (V4.1 by its config's ``model_type``)."""
    return K.V41 if getattr(getattr(model, "config", None), "model_type", None) == K.V41 else K.V4


def _replace_modules(model: nn.Module, lora: LoRAConfig | None, keep_base: bool) -> dict[str, int]:
    """Steps 1 and 2 of the module docstring (``lora`` None: no adapters); the kept form is the family's scheme."""
    family = _family(model)
    scheme = SCHEMES[family]
    targets = lora.targets if lora is not None else ()
    counts = {"adapted": 0, "kept": 0, "experts": 0}
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, GroupedExperts):
                adapt = "routed_experts" in targets
                setattr(parent, child_name, LoRAGroupedExperts.from_experts(
                    child, lora if adapt else None, "fp4" if keep_base else None, scheme))
                counts["experts"] += 1
            elif isinstance(child, nn.Linear):
                hf = K.ours_to_hf(f"{full}.weight", family=family)
                if hf is None:
                    continue
                adapt = target_group(hf) in targets
                keep = "fp8" if keep_base and K.on_disk_format(hf, family) == "fp8" else None
                if adapt or keep:
                    setattr(parent, child_name, LoRALinear(child, lora if adapt else None, keep, scheme))
                    counts["adapted"] += int(adapt)
                    counts["kept"] += int(bool(keep))
    return counts


def apply_lora(model: nn.Module, lora: LoRAConfig) -> dict[str, int]:
    """Make ``model`` a LoRA model in place (see the module docstring); returns counts of what changed:
    ``adapted`` linears, ``kept`` quantized linears, ``experts`` modules, ``adapter_parameters`` elements."""
    if is_lora_model(model):
        raise ValueError("apply_lora: the model already has LoRA modules")
    counts = _replace_modules(model, lora, lora.base_dtype == "fp8")
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter_name(name))
    counts["adapter_parameters"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return counts


def keep_base_quantized(model: nn.Module) -> dict[str, int]:
    """Hold a frozen ``model``'s base in the release's FP8 / FP4 form, without adapters (in place, before loading
    its checkpoint with :func:`dsv4.checkpoint.load_hf_checkpoint`, which then copies the release's bytes and
    scales in as they are): every linear the release stores in FP8 becomes a :class:`LoRALinear` of rank 0 holding
    the kept FP8 form in the family's tiles (32 x 32 for V4.1, 128 x 128 for V4), every routed-expert group a
    :class:`LoRAGroupedExperts` of rank 0 holding kept FP4, and every parameter is frozen. The forward equals the
    same model with the base dequantised (fp32 compute: exactly). What :func:`apply_lora` with
    ``base_dtype=fp8`` does to the base, for a model that trains nothing (the frozen target of DSpark drafter
    training). Returns counts: ``kept`` linears, ``experts`` groups."""
    if is_lora_model(model):
        raise ValueError("keep_base_quantized: the model already has LoRA / kept modules")
    counts = _replace_modules(model, None, keep_base=True)
    for p in model.parameters():
        p.requires_grad_(False)
    return {"kept": counts["kept"], "experts": counts["experts"]}


def lora_summary(model: nn.Module, lora: LoRAConfig, counts: dict[str, int]) -> str:
    """One line for the log: what :func:`apply_lora` adapted and kept, trainable against all parameters (a packed
    FP4 byte holds two weights)."""
    total = sum(p.numel() for p in model.parameters()) + sum(
        math.prod(logical_shape(b)) for b in model.buffers() if kept_format(b))
    trainable = counts["adapter_parameters"]
    return (f"LoRA r={lora.rank} alpha={lora.alpha:g} on {'/'.join(lora.targets)}, base {lora.base_dtype}: "
            f"{counts['adapted']} adapted linears + {counts['experts']} expert groups, {counts['kept']} linears kept "
            f"in FP8; {trainable:,} trainable of {total:,} parameters ({100.0 * trainable / max(total, 1):.3f}%)")


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapter parameters by state-dict name (what a LoRA checkpoint and the PEFT export hold)."""
    return {name: p for name, p in model.named_parameters() if is_adapter_name(name)}


def merged_tensors(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """``(state-dict name, tensor)`` of the plain model this LoRA model stands for: adapters merged and kept
    weights dequantised (fp32), adapters and kept scales left out; every other tensor as it is."""
    owners: dict[str, nn.Module] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, (LoRALinear, LoRAGroupedExperts)):
            owners[module_name] = module
    for name, tensor in model.state_dict(keep_vars=True).items():
        module_name, _, leaf = name.rpartition(".")
        module = owners.get(module_name)
        if module is None:
            yield name, tensor
        elif isinstance(module, LoRALinear):
            if leaf == "weight":
                yield name, module.merged_weight()
        elif leaf in LoRAGroupedExperts.WEIGHTS:
            yield name, module.merged_weight(leaf)


def merged_sources(model: nn.Module) -> list[ExportSource]:
    """:func:`merged_tensors` as export sources (``dsv4.checkpoint.export_hf_checkpoint(sources=...)``): each
    merged weight is computed only when the export fetches it, one at a time, from the tensors ``model`` holds at
    that moment (:func:`merged_weight_of`)."""
    owners = {n: m for n, m in model.named_modules() if isinstance(m, (LoRALinear, LoRAGroupedExperts))}
    tables, covered = table_sources(model)  # Engram tables (never adapted): their rows, FP8 dequantised
    out: list[ExportSource] = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name in covered:
            if name in tables:
                out.append(tables[name])
            continue
        module_name, _, leaf = name.rpartition(".")
        module = owners.get(module_name)
        if module is None:
            out.append(ExportSource(name, tuple(tensor.shape), tensor.is_floating_point(),
                                    partial(merged_weight_of, model, name)))
        elif _is_merged_leaf(module, leaf):
            out.append(ExportSource(name, logical_shape(tensor), True, partial(merged_weight_of, model, name)))
    return out


def _is_merged_leaf(module: nn.Module, leaf: str) -> bool:
    return ((isinstance(module, LoRALinear) and leaf == "weight")
            or (isinstance(module, LoRAGroupedExperts) and leaf in LoRAGroupedExperts.WEIGHTS))


def merged_weight_of(model: nn.Module, name: str) -> Tensor:
    """The plain model's tensor ``name`` (a state-dict name of ``model``): an adapted weight merged with its
    adapter (fp32), any other tensor whole (an FSDP shard is gathered)."""
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    if isinstance(module, LoRALinear) and _is_merged_leaf(module, leaf):
        return module.merged_weight()
    if isinstance(module, LoRAGroupedExperts) and _is_merged_leaf(module, leaf):
        return module.merged_weight(leaf)
    return _full(getattr(module, leaf))


@torch.no_grad()
def requantization_loss(model: nn.Module) -> float | None:
    """How much of the adapters' update a re-quantised export loses: over every adapted weight the release stores
    in FP8 / FP4, ``||deq(Q(W + dW)) - W - dW|| / ||dW||`` (root of summed squares; 1.0 = all of it rounded away,
    0 = none). None when no such weight has a non-zero update. ``W`` is the base (dequantised when kept); the
    re-quantisation is the model family's (V4.1: FP8 in 32 x 32 tiles), as the export's."""
    family = _family(model)
    scheme = SCHEMES[family]
    err = delta = 0.0
    for module_name, module in model.named_modules():
        if isinstance(module, LoRALinear) and module.rank:
            fmt = K.on_disk_format(K.ours_to_hf(f"{module_name}.weight", family=family), family)
            pairs = [(module.base_weight(), module.merged_weight(), fmt)]
        elif isinstance(module, LoRAGroupedExperts) and module.rank:
            pairs = [(b, m, "fp4") for name in module.WEIGHTS
                     for b, m in zip(module.base_weight(name), module.merged_weight(name))]
        else:
            continue
        for base, merged, fmt in pairs:
            if fmt not in ("fp8", "fp4"):
                continue
            d = merged - base
            err += (dequantize(*quantize(merged, fmt, scheme), fmt, torch.float32, scheme) - merged).pow(2).sum().item()
            delta += d.pow(2).sum().item()
    return None if delta == 0 else (err / delta) ** 0.5
