"""PEFT-format LoRA adapters: ``adapter_config.json`` + ``adapter_model.safetensors``, in two layouts.

``layout="transformers"`` (the default of :func:`export_peft_adapter`, what ``export.adapter_dir`` writes): the
module names of transformers' ``DeepseekV4ForCausalLM``, so that ``peft.PeftModel.from_pretrained(
AutoModelForCausalLM.from_pretrained(base), DIR)`` applies it (``tests/unit/peft/test_peft_transformers.py`` checks the
logits against the dsv4 LoRA model)::

    base_model.model.model.layers.3.self_attn.q_a_proj.lora_A.weight     [r, in]    (wq_a; q_b_proj, kv_proj,
    base_model.model.model.layers.3.self_attn.q_a_proj.lora_B.weight     [out, r]    o_b_proj likewise)
    base_model.model.model.layers.3.mlp.shared_experts.gate_proj.lora_A.weight   (w1; up_proj = w3, down_proj = w2)
    base_model.model.model.layers.3.self_attn.o_a_proj.lora_A.weight     [r, in_g]  (wo_a, a target *parameter*)
    base_model.model.model.layers.3.mlp.experts.base_layer.lora_A.weight [E * 2r, hidden]   (gate_up_proj)
    base_model.model.model.layers.3.mlp.experts.base_layer.lora_B.weight [2 * inter, 2r * E]
    base_model.model.model.layers.3.mlp.experts.lora_A.weight            [E * r, inter]     (down_proj)
    base_model.model.model.layers.3.mlp.experts.lora_B.weight            [hidden, r * E]

``target_modules`` is a regular expression over the plain linears; ``wo_a`` and the routed experts are PEFT
``target_parameters`` (transformers' ``o_a_proj`` is block-diagonal over the output groups and its experts are fused
3-D parameters, which PEFT's ``nn.Linear`` adapter cannot wrap; a target parameter adds ``s B A`` to the weight, which
for ``wo_a`` is exactly the dsv4 block-diagonal adapter). PEFT wraps the experts' parameters one inside the other:
``gate_up_proj`` (``experts.base_layer``) inside ``down_proj`` (``experts``). PEFT's per-expert layout: ``lora_A``
rows ``[e r', (e + 1) r')`` are expert ``e``'s ``A``; ``lora_B`` column ``j E + e`` is column ``j`` of expert ``e``'s
``B``. transformers fuses ``w1`` and ``w3`` into ``gate_up_proj [E, 2 inter, hidden]`` (``w1`` rows first), so its
adapter is the exact rank-``2r`` pair ``A = [A1; A3]``, ``B = [[B1, 0], [0, B3]]`` (``B A = [B1 A1; B3 A3]``), with
``rank_pattern`` ``2r`` and ``alpha_pattern`` ``2 alpha`` so the scale stays ``alpha / r``. PEFT cannot apply dropout
to a target parameter, so the file says ``lora_dropout`` 0 when it has any (inference is unaffected).
transformers builds no MTP block: MTP adapters are kept under their release names (below), which PEFT leaves unused
and :func:`load_peft_adapter` reads back.

``layout="release"`` (the format of earlier dsv4 exports): the released checkpoint's module names
(:mod:`dsv4.checkpoint.keys`), one pair per adapted linear and per routed expert, e.g.
``base_model.model.layers.3.attn.wq_a.lora_A.weight`` or ``base_model.model.layers.3.ffn.experts.17.w1.lora_B.weight``,
``target_modules`` a regular expression over them; it applies only to dsv4.

Both: ``peft_type`` LORA, ``r``, ``lora_alpha``, ``bias`` none, no rsLoRA, no fan-in-fan-out, readable by
``peft.PeftConfig.from_pretrained``. :func:`export_peft_adapter` gathers full tensors (a collective under FSDP and EP:
call it on every rank, ``write`` on one; each routed expert's adapters come from an EP rank that holds it). :func:`load_peft_adapter` reads either layout (told apart by the keys) into a LoRA
model built with the same rank and alpha, before FSDP wrapping; under EP each rank keeps its own experts. Every
check (config, missing / unexpected keys, shapes, and for a transformers file that each ``gate_up_proj`` ``B`` is
block-diagonal, i.e. a dsv4 adapter) runs before any adapter is written.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor, nn

from dsv4.checkpoint import keys as K
from dsv4.checkpoint.export_dir import check_export_dir, remove_stale_files
from dsv4.checkpoint.safetensors_io import CheckpointDir, TensorReader
from dsv4.distributed import full_tensor, group_size, is_initialized, resolve_group
from dsv4.peft.config import TARGET_MODULE_PATTERNS, LoRAConfig
from dsv4.peft.lora import LoRAGroupedExperts, LoRALinear

log = logging.getLogger("dsv4")

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


ADAPTER_LAYOUTS = ("transformers", "release")
TF_PREFIX = PREFIX + "model."  # transformers' DeepseekV4ForCausalLM keeps its decoder under `model.`
# release module (after ``layers.{i}.``) -> transformers' module (after ``model.layers.{i}.``), by target group
_TF_LINEARS = {
    "attn.wq_a": "self_attn.q_a_proj", "attn.wq_b": "self_attn.q_b_proj", "attn.wkv": "self_attn.kv_proj",
    "attn.wo_b": "self_attn.o_b_proj", "attn.wo_a": "self_attn.o_a_proj",
    "ffn.shared_experts.w1": "mlp.shared_experts.gate_proj", "ffn.shared_experts.w3": "mlp.shared_experts.up_proj",
    "ffn.shared_experts.w2": "mlp.shared_experts.down_proj",
}
_RELEASE_OF = {v: k for k, v in _TF_LINEARS.items()}
_TF_MODULE_TARGETS = {"attention": r"self_attn\.(q_a_proj|q_b_proj|kv_proj|o_b_proj)",
                      "shared_experts": r"mlp\.shared_experts\.(gate_proj|up_proj|down_proj)"}
O_A_PARAMETER = "self_attn.o_a_proj.weight"
GATE_UP_PARAMETER = "mlp.experts.gate_up_proj"
DOWN_PARAMETER = "mlp.experts.down_proj"
_GATE_UP_MODULE = "mlp.experts.base_layer"  # PEFT nests the gate_up_proj wrapper inside the down_proj one
_DOWN_MODULE = "mlp.experts"
_RELEASE_KEY = re.compile(r"^base_model\.model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")
_RELEASE_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w1|w2|w3)$")
_TF_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")


def adapter_layout(keys) -> str:
    """``"transformers"`` when any key lives under transformers' ``model.`` decoder prefix, else ``"release"``."""
    return "transformers" if any(k.startswith(TF_PREFIX) for k in keys) else "release"


def transformers_target_modules(lora: LoRAConfig) -> str | None:
    """PEFT's ``target_modules`` over transformers' module names (None when only target parameters are adapted)."""
    groups = [_TF_MODULE_TARGETS[t] for t in lora.targets if t in _TF_MODULE_TARGETS]
    return r"^model\.layers\.\d+\.(" + "|".join(groups) + r")$" if groups else None


def transformers_target_parameters(lora: LoRAConfig) -> list[str]:
    return ([O_A_PARAMETER] if "attention" in lora.targets else []) + (
        [GATE_UP_PARAMETER, DOWN_PARAMETER] if "routed_experts" in lora.targets else [])


def peft_config_dict(lora: LoRAConfig, base_model: str | None = None, layout: str = "transformers") -> dict:
    if layout not in ADAPTER_LAYOUTS:
        raise ValueError(f"adapter layout must be one of {ADAPTER_LAYOUTS}, got {layout!r}")
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "revision": None,
        "inference_mode": True, "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
        "target_modules": target_modules_regex(lora), "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
    }
    if layout == "release":
        return config
    parameters = transformers_target_parameters(lora)
    config.update(target_modules=transformers_target_modules(lora), target_parameters=parameters)
    if parameters and lora.dropout:
        log.warning("adapter export: lora_dropout=%s written as 0 (PEFT applies no dropout to the target parameters "
                    "%s; inference is unaffected)", lora.dropout, parameters)
        config["lora_dropout"] = 0.0
    if "routed_experts" in lora.targets:  # the fused gate_up_proj carries the rank-2r pair, same alpha / r
        config["rank_pattern"] = {GATE_UP_PARAMETER: 2 * lora.rank}
        config["alpha_pattern"] = {GATE_UP_PARAMETER: 2 * lora.alpha}
    return config


def release_to_transformers(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Release-layout adapter tensors -> transformers' layout (see the module docstring); MTP keys unchanged."""
    out: dict[str, Tensor] = {}
    experts: dict[int, dict[tuple[int, str, str], Tensor]] = {}
    for key, t in tensors.items():
        m = _RELEASE_KEY.match(key)
        if m is None:  # MTP blocks: transformers has none, the release name is kept
            out[key] = t
            continue
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        em = _RELEASE_EXPERT.match(module)
        if em is not None:
            experts.setdefault(layer, {})[(int(em.group(1)), em.group(2), ab)] = t
        elif module in _TF_LINEARS:
            out[f"{TF_PREFIX}layers.{layer}.{_TF_LINEARS[module]}.lora_{ab}.weight"] = t
        else:
            raise KeyError(f"adapter export: {key} has no module in transformers' DeepseekV4ForCausalLM")
    for layer, pairs in experts.items():
        n = 1 + max(e for e, _, _ in pairs)
        missing = [(e, w, ab) for e in range(n) for w in ("w1", "w2", "w3") for ab in "AB" if (e, w, ab) not in pairs]
        if missing:
            raise KeyError(f"adapter export: layer {layer} lacks routed-expert adapters {missing[:5]} (every expert "
                           "is needed for the fused transformers layout; unshard the experts first)")
        stack = {(w, ab): torch.stack([pairs[(e, w, ab)] for e in range(n)]) for w in ("w1", "w2", "w3") for ab in "AB"}
        a1, a3, b1, b3 = stack["w1", "A"], stack["w3", "A"], stack["w1", "B"], stack["w3", "B"]  # [E, r, H], [E, I, r]
        r, inter = a1.shape[1], b1.shape[1]
        b = a1.new_zeros(n, 2 * inter, 2 * r)
        b[:, :inter, :r], b[:, inter:, r:] = b1, b3
        prefix = f"{TF_PREFIX}layers.{layer}."
        out[f"{prefix}{_GATE_UP_MODULE}.lora_A.weight"] = torch.cat([a1, a3], dim=1).reshape(n * 2 * r, -1)
        out[f"{prefix}{_GATE_UP_MODULE}.lora_B.weight"] = b.permute(1, 2, 0).reshape(2 * inter, 2 * r * n)
        a2, b2 = stack["w2", "A"], stack["w2", "B"]  # [E, r, I], [E, H, r]
        out[f"{prefix}{_DOWN_MODULE}.lora_A.weight"] = a2.reshape(n * r, -1)
        out[f"{prefix}{_DOWN_MODULE}.lora_B.weight"] = b2.permute(1, 2, 0).reshape(b2.shape[1], r * n)
    return {k: v.contiguous() for k, v in out.items()}


def transformers_to_release(tensors: dict[str, Tensor], rank: int, where: str = "adapter") -> dict[str, Tensor]:
    """Inverse of :func:`release_to_transformers` for adapters of rank ``rank`` (``gate_up_proj``: ``2 rank``). A
    ``gate_up_proj`` ``B`` that is not block-diagonal (an adapter trained elsewhere, coupling ``w1`` and ``w3``) has
    no dsv4 form: ``ValueError`` naming the key and the largest off-diagonal entry."""
    out: dict[str, Tensor] = {}
    fused: dict[tuple[int, str, str], tuple[str, Tensor]] = {}
    for key, t in tensors.items():
        m = _TF_KEY.match(key)
        if m is None:
            out[key] = t
            continue
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module in _RELEASE_OF:
            out[f"{PREFIX}layers.{layer}.{_RELEASE_OF[module]}.lora_{ab}.weight"] = t
        elif module in (_GATE_UP_MODULE, _DOWN_MODULE):
            fused[(layer, module, ab)] = (key, t)
        else:
            out[key] = t  # reported as unexpected by the loader
    for (layer, module, ab) in sorted(fused):
        if ab == "B":
            continue
        key_a, a = fused[(layer, module, "A")]
        if (layer, module, "B") not in fused:
            raise KeyError(f"{where}: {key_a} has no lora_B beside it")
        key_b, b = fused[(layer, module, "B")]
        r = 2 * rank if module == _GATE_UP_MODULE else rank
        if a.shape[0] % r or b.shape[1] != a.shape[0]:
            raise ValueError(f"{where}: {key_a} {list(a.shape)} / {key_b} {list(b.shape)} are not rank-{r} pairs per "
                             "expert (lora_A [E * r, in], lora_B [out, r * E])")
        n = a.shape[0] // r
        a = a.reshape(n, r, -1)
        b = b.reshape(b.shape[0], r, n).permute(2, 0, 1)  # [E, out, r]
        prefix = f"{PREFIX}layers.{layer}.ffn.experts."
        if module == _DOWN_MODULE:
            for e in range(n):
                out[f"{prefix}{e}.w2.lora_A.weight"], out[f"{prefix}{e}.w2.lora_B.weight"] = a[e], b[e]
            continue
        inter = b.shape[1] // 2
        off = torch.cat([b[:, :inter, rank:].flatten(), b[:, inter:, :rank].flatten()]).abs()
        if off.numel() and off.max() > 0:
            raise ValueError(f"{where}: {key_b} couples gate and up (largest off-diagonal entry {off.max().item():.3g});"
                             f" a dsv4 adapter holds separate w1 / w3 pairs, so only a block-diagonal B loads")
        for e in range(n):
            out[f"{prefix}{e}.w1.lora_A.weight"], out[f"{prefix}{e}.w3.lora_A.weight"] = a[e, :rank], a[e, rank:]
            out[f"{prefix}{e}.w1.lora_B.weight"] = b[e, :inter, :rank]
            out[f"{prefix}{e}.w3.lora_B.weight"] = b[e, inter:, rank:]
    return {k: v.contiguous() for k, v in out.items()}


def export_peft_adapter(model: nn.Module, path: str, lora: LoRAConfig, *, base_model: str | None = None,
                        write: bool = True, layout: str = "transformers", overwrite: bool = False) -> list[str]:
    """Write the adapters of ``model`` to ``path`` in the PEFT format, in ``layout`` (see the module docstring);
    returns the keys written. A collective under FSDP or EP (every rank calls it; ``write`` on one): each routed
    expert's adapters come from a rank that holds it. ``path`` as in :func:`write_peft_adapter`."""
    if layout not in ADAPTER_LAYOUTS:
        raise ValueError(f"adapter layout must be one of {ADAPTER_LAYOUTS}, got {layout!r}")
    tensors = _full_adapters(model)
    if not tensors:
        raise ValueError("export_peft_adapter: the model has no LoRA adapters (apply_lora first)")
    if layout == "transformers":
        tensors = release_to_transformers(tensors)
    if write:
        write_peft_adapter(tensors, path, lora, base_model, layout, overwrite=overwrite)
    return list(tensors)


def write_peft_adapter(tensors: dict[str, Tensor], path: str, lora: LoRAConfig, base_model: str | None,
                       layout: str, *, overwrite: bool = False) -> None:
    """``adapter_model.safetensors`` (``tensors``, already in ``layout``) and ``adapter_config.json`` in ``path``,
    which must be absent or empty (``ValueError`` before writing); ``overwrite``: a directory of files is accepted
    and every other file in it is removed after the two are written (:mod:`dsv4.checkpoint.export_dir`)."""
    check_export_dir(str(path), key="path", overwrite=overwrite, flag="overwrite=True")
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, ADAPTER_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(path, ADAPTER_CONFIG), "w") as f:
        json.dump(peft_config_dict(lora, base_model, layout), f, indent=2)
    if overwrite:
        remove_stale_files(str(path), [ADAPTER_WEIGHTS, ADAPTER_CONFIG])


def _full_adapters(model: nn.Module) -> dict[str, Tensor]:
    """Every adapter tensor in the release layout (fp32, CPU), in :func:`_adapter_slots`' order, with the routed
    experts of every EP rank: each stacked adapter is gathered over the world, one tensor at a time, when the ranks
    hold different experts."""
    from dsv4.checkpoint.export import expert_holders

    holders = expert_holders(model)
    group = resolve_group(None) if is_initialized() else None
    world = group_size(group)
    tensors: dict[str, Tensor] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, LoRALinear) and module.rank:
            hf_module = K.ours_to_hf(f"{module_name}.weight")[: -len(".weight")]
            for ab in "AB":
                value = full_tensor(getattr(module, f"lora_{ab}")).detach()
                tensors[f"{PREFIX}{hf_module}.lora_{ab}.weight"] = value.float().cpu().contiguous()
        elif isinstance(module, LoRAGroupedExperts) and module.rank:
            ranges = holders[module_name]
            rows: dict[tuple[str, str], list[Tensor]] = {}
            for name in module.WEIGHTS:
                for ab in "AB":
                    local = full_tensor(getattr(module, f"{name}_lora_{ab}")).detach().float().cpu().contiguous()
                    pieces = [local]
                    if world > 1 and any(r != (0, module.num_experts) for r in ranges):  # EP: the other ranks hold other experts
                        pieces = [torch.empty_like(local) for _ in range(world)]
                        dist.all_gather(pieces, local, group=group)
                    rows[name, ab] = [_expert_row(pieces, ranges, e, module_name) for e in range(module.num_experts)]
            for name in module.WEIGHTS:
                for e in range(module.num_experts):
                    hf = K.ours_to_hf(f"{module_name}.{name}", e)[: -len(".weight")]
                    for ab in "AB":
                        tensors[f"{PREFIX}{hf}.lora_{ab}.weight"] = rows[name, ab][e].clone()
    return tensors


def _expert_row(pieces: list[Tensor], ranges: list[tuple[int, int]], expert: int, module_name: str) -> Tensor:
    for piece, (offset, count) in zip(pieces, ranges):
        if offset <= expert < offset + count:
            return piece[expert - offset]
    raise ValueError(f"export_peft_adapter: expert {expert} of {module_name} is held by no rank (ranges {ranges}); "
                     "export on all EP ranks together, or call unshard_experts(model, ep_group) first")


@dataclass
class AdapterLoadReport:
    loaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # other EP ranks' experts
    layout: str = "release"


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
    r, alpha = config.get("r"), config.get("lora_alpha")
    allowed = ({}, {GATE_UP_PARAMETER: 2 * r} if isinstance(r, int) else {})
    allowed_alpha = ({}, {GATE_UP_PARAMETER: 2 * alpha} if isinstance(alpha, (int, float)) else {})
    if (config.get("rank_pattern") or {}) not in allowed or (config.get("alpha_pattern") or {}) not in allowed_alpha:
        raise ValueError(f"{file}: rank_pattern={config.get('rank_pattern')} / alpha_pattern="
                         f"{config.get('alpha_pattern')} are not supported (only the fused experts' "
                         f"{{{GATE_UP_PARAMETER!r}: 2 r}} / {{...: 2 lora_alpha}} that dsv4 writes)")
    return config


@torch.no_grad()
def load_peft_adapter(model: nn.Module, path: str) -> AdapterLoadReport:
    """Fill the adapters of a LoRA ``model`` from the PEFT adapter directory ``path``, either layout (see the module
    docstring)."""
    config = read_peft_config(path)
    ranks = {m.rank for m in model.modules() if isinstance(m, (LoRALinear, LoRAGroupedExperts)) and m.rank}
    scalings = {m.scaling for m in model.modules() if isinstance(m, (LoRALinear, LoRAGroupedExperts)) and m.rank}
    if not ranks:
        raise ValueError("load_peft_adapter: the model has no LoRA adapters (apply_lora with the adapter's targets)")
    if ranks != {config.get("r")} or scalings != {config.get("lora_alpha", 0) / config.get("r", 1)}:
        raise ValueError(f"{path}: r={config.get('r')}, lora_alpha={config.get('lora_alpha')} differ from the model's "
                         f"adapters (rank {sorted(ranks)}, alpha / rank {sorted(scalings)}); set peft.rank / peft.alpha")
    ckpt = CheckpointDir.open(path)
    layout = adapter_layout(ckpt.tensors)
    reader = TensorReader(ckpt)
    try:
        if layout == "transformers":  # converted in memory (an adapter is small next to its base)
            source = transformers_to_release({k: reader.read(k) for k in ckpt.tensors}, config["r"], path)
            shapes = {k: tuple(v.shape) for k, v in source.items()}
            read = source.__getitem__
        else:
            shapes = {k: tuple(info.shape) for k, info in ckpt.tensors.items()}
            read = reader.read
        report = _fill_adapters(model, path, shapes, read)
    finally:
        reader.close()
    report.layout = layout
    return report


def _fill_adapters(model: nn.Module, path: str, shapes: dict[str, tuple[int, ...]], read) -> AdapterLoadReport:
    slots = {key: (param, row) for key, param, row in _adapter_slots(model)}
    missing = sorted(k for k in slots if k not in shapes)
    report = AdapterLoadReport()
    unexpected = []
    for key in shapes:
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
        if shapes[key] != want:
            raise ValueError(f"{path}: {key} has shape {list(shapes[key])}, the model's adapter {list(want)}")
    for key, (param, row) in slots.items():
        dest = param if row is None else param[row]
        dest.copy_(read(key).to(dtype=dest.dtype, device=dest.device))
        report.loaded.append(key)
    return report


def _holds_expert_module(model: nn.Module, name: str, expert: int) -> bool:
    """Whether ``name`` (a stacked expert tensor) exists in ``model`` and ``expert`` is a valid global index that
    another EP rank holds."""
    try:
        module = model.get_submodule(name.rsplit(".", 1)[0])
    except AttributeError:
        return False
    return isinstance(module, LoRAGroupedExperts) and module.rank > 0 and 0 <= expert < module.num_experts
