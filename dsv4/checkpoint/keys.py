"""Key adapter: on-disk (HF release) tensor names <-> the ``DSV4ForCausalLM`` state-dict names.

On disk there is no ``model.`` prefix. The renames, per block
(backbone prefix ``layers.{i}.`` <-> ``model.layers.{i}.``, MTP prefix ``mtp.{k}.`` <-> ``mtp.layers.{k}.``):

    attn_norm.weight            <-> input_layernorm.weight
    ffn_norm.weight             <-> post_attention_layernorm.weight
    hc_attn_{fn,base,scale}     <-> attn_hc.{fn,base,scale}
    hc_ffn_{fn,base,scale}      <-> ffn_hc.{fn,base,scale}
    attn.attn_sink              <-> self_attn.sink.logits
    attn.<rest>                 <-> self_attn.<rest>      (wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b,
                                                            compressor.*, indexer.* incl. indexer.compressor.*)
    ffn.gate.bias               <-> mlp.gate.e_score_correction_bias
    ffn.experts.{e}.w{1,2,3}.weight <-> mlp.experts.w{1,2,3}[e - expert_offset]   (stacked, no transpose)
    ffn.<rest>                  <-> mlp.<rest>            (gate.weight, gate.tid2eid, shared_experts.w{1,2,3}.weight)
    MTP only: e_proj/h_proj/enorm/hnorm/norm keep their names; hc_head_{fn,base,scale} <-> hc_head.hc_*

Globals: ``embed.weight <-> model.embed_tokens.weight``, ``head.weight <-> lm_head.weight``, ``norm.weight <->
model.norm.weight``, ``hc_head_{fn,base,scale} <-> model.hc_head.hc_{fn,base,scale}``.

Quantisation scales are ``<module>.scale`` next to ``<module>.weight`` (never ``hc_*_scale``, which are learned
F32 parameters); they are not model keys and are handled by the loader.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Renames inside a block, (on-disk, ours), most specific first. A trailing "." or "_" marks a prefix rename (the
# rest of the name is kept); otherwise the whole name must match. Both directions use the same table.
_BLOCK_RENAMES: list[tuple[str, str]] = [
    ("attn_norm.weight", "input_layernorm.weight"),
    ("ffn_norm.weight", "post_attention_layernorm.weight"),
    ("hc_attn_", "attn_hc."),
    ("hc_ffn_", "ffn_hc."),
    ("attn.attn_sink", "self_attn.sink.logits"),
    ("attn.", "self_attn."),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.", "mlp."),
]
_MTP_ONLY_RENAMES: list[tuple[str, str]] = [
    ("e_proj.weight", "e_proj.weight"),
    ("h_proj.weight", "h_proj.weight"),
    ("enorm.weight", "enorm.weight"),
    ("hnorm.weight", "hnorm.weight"),
    ("norm.weight", "norm.weight"),
    ("hc_head_", "hc_head.hc_"),
]


def _rename(renames: list[tuple[str, str]], key: str, to_ours: bool) -> str | None:
    """Apply the first matching rename of ``renames`` (on-disk -> ours when ``to_ours``); None if none matches."""
    for disk, ours in renames:
        src, dst = (disk, ours) if to_ours else (ours, disk)
        if src.endswith((".", "_")):
            if key.startswith(src):
                return dst + key[len(src):]
        elif key == src:
            return dst
    return None


_GLOBALS_HF_TO_OURS = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_GLOBALS_OURS_TO_HF = {v: k for k, v in _GLOBALS_HF_TO_OURS.items()}

# Indices are ASCII digits without leading zeros, so that one number has one key ("experts.07" is unexpected).
_HF_EXPERT = re.compile(r"^ffn\.experts\.(0|[1-9][0-9]*)\.(w1|w2|w3)\.weight$")
_OURS_EXPERT = re.compile(r"^mlp\.experts\.(w1|w2|w3)$")
_HF_BLOCK = re.compile(r"^(layers|mtp)\.(0|[1-9][0-9]*)\.(.+)$")
_OURS_BLOCK = re.compile(r"^(model\.layers|mtp\.layers)\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class OurKey:
    """Where an on-disk tensor goes: ``name`` in the state dict, and for a routed expert its global ``expert``
    index (the tensor is row ``expert - expert_offset`` of the stacked ``name``)."""

    name: str
    expert: int | None = None


def is_scale_key(hf_key: str) -> bool:
    """``<module>.scale`` quantisation scales (not the learned ``hc_*_scale`` parameters)."""
    return hf_key.endswith(".scale")


def weight_key_of_scale(hf_scale_key: str) -> str:
    return hf_scale_key[: -len(".scale")] + ".weight"


def scale_key_of_weight(hf_weight_key: str) -> str | None:
    return hf_weight_key[: -len(".weight")] + ".scale" if hf_weight_key.endswith(".weight") else None


def hf_to_ours(hf_key: str) -> OurKey | None:
    """Map an on-disk tensor name to our state-dict name; ``None`` for a name the adapter does not know."""
    if hf_key in _GLOBALS_HF_TO_OURS:
        return OurKey(_GLOBALS_HF_TO_OURS[hf_key])
    m = _HF_BLOCK.match(hf_key)
    if m is None:
        return None
    kind, idx, rest = m.groups()
    prefix = f"model.layers.{idx}." if kind == "layers" else f"mtp.layers.{idx}."
    em = _HF_EXPERT.match(rest)
    if em is not None:
        return OurKey(f"{prefix}mlp.experts.{em.group(2)}", int(em.group(1)))
    if kind == "mtp":
        mapped = _rename(_MTP_ONLY_RENAMES, rest, to_ours=True)
        if mapped is not None:
            return OurKey(prefix + mapped)
    mapped = _rename(_BLOCK_RENAMES, rest, to_ours=True)
    return None if mapped is None else OurKey(prefix + mapped)


def ours_to_hf(name: str, expert: int | None = None) -> str | None:
    """Inverse of :func:`hf_to_ours`. A stacked expert tensor (``...mlp.experts.w1``) needs the global ``expert``
    index; ``None`` for a name the adapter does not know."""
    if name in _GLOBALS_OURS_TO_HF:
        return _GLOBALS_OURS_TO_HF[name]
    m = _OURS_BLOCK.match(name)
    if m is None:
        return None
    kind, idx, rest = m.groups()
    prefix = f"layers.{idx}." if kind == "model.layers" else f"mtp.{idx}."
    em = _OURS_EXPERT.match(rest)
    if em is not None:
        if expert is None:
            raise ValueError(f"ours_to_hf: {name!r} is a stacked expert tensor; give the global expert index")
        return f"{prefix}ffn.experts.{expert}.{em.group(1)}.weight"
    if kind == "mtp.layers":
        mapped = _rename(_MTP_ONLY_RENAMES, rest, to_ours=False)
        if mapped is not None:
            return prefix + mapped
    mapped = _rename(_BLOCK_RENAMES, rest, to_ours=False)
    return None if mapped is None else prefix + mapped


def is_stacked_expert(name: str) -> bool:
    m = _OURS_BLOCK.match(name)
    return m is not None and _OURS_EXPERT.match(m.group(3)) is not None


def mtp_depth(hf_key: str) -> int | None:
    """``k`` of an ``mtp.{k}.*`` key, else ``None``."""
    m = _HF_BLOCK.match(hf_key)
    return int(m.group(2)) if m is not None and m.group(1) == "mtp" else None


# Which tensors the release stores in which format (section 2.4), by on-disk name.
_FP8_MODULES = re.compile(
    r"(^|\.)(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.(w1|w2|w3)|e_proj|h_proj)\.weight$"
)
_F32_KEYS = re.compile(r"(^|\.)(hc_(attn|ffn)_(fn|base|scale)|hc_head_(fn|base|scale)|attn\.attn_sink|ape|ffn\.gate\.bias)$")


def on_disk_format(hf_key: str) -> str:
    """Release format of a tensor: ``"fp8"`` (e4m3 + 128x128 e8m0 scale), ``"fp4"`` (packed e2m1 + e8m0 per 32),
    ``"f32"``, ``"int"`` (tid2eid) or ``"bf16"``."""
    if re.search(r"(^|\.)ffn\.experts\.\d+\.(w1|w2|w3)\.weight$", hf_key):
        return "fp4"
    if _FP8_MODULES.search(hf_key):
        return "fp8"
    if hf_key.endswith("tid2eid"):
        return "int"
    if _F32_KEYS.search(hf_key):
        return "f32"
    return "bf16"
