"""Key adapter: on-disk (HF release) tensor names <-> the dsv4 state-dict names, for each checkpoint family
(:data:`FAMILIES`: ``deepseek_v4``, the default, and ``deepseek_v41``).

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
    ffn.<rest>                  <-> mlp.<rest>            (gate.weight, gate.tid2eid, gate.bias_vl,
                                                            shared_experts.w{1,2,3}.weight)
    engram.<rest>               <-> engram.<rest>         (V4.1: embed.weight, wkv.weight, q_weight, k_weight)
    MTP only: e_proj/h_proj/enorm/hnorm/norm keep their names; hc_head_{fn,base,scale} <-> hc_head.hc_*

Globals: ``embed.weight <-> model.embed_tokens.weight``, ``head.weight <-> lm_head.weight``, ``norm.weight <->
model.norm.weight``, ``hc_head_{fn,base,scale} <-> model.hc_head.hc_{fn,base,scale}``.

The DSpark drafter of a V4.1 release (``deepseek_v41_dspark``, :data:`DSPARK`; the module
:class:`~dsv4.model.v41.drafter.DSparkDrafter`) reads the same directory from the other side: its keys are
``mtp.{i}.*`` <-> ``layers.{i}.*`` with the block renames above plus the drafter's own ``main_proj``, ``main_norm``,
``norm``, ``markov_head.{embed,head}`` and ``confidence_head.proj`` (names kept), and ``embed.weight`` /
``head.weight`` <-> ``embed_tokens.weight`` / ``lm_head.weight`` (its frozen copies of the target's); every other
key of the directory (the text backbone, the vision tower) is skipped by a drafter load. On disk the drafter's
attention projections, ``main_proj`` and shared experts are FP8 with 32 x 32 tiles, its routed experts FP4, its
``hc_*``, ``attn_sink``, gate biases and ``confidence_head`` F32, the rest BF16; its ``config.json`` is the V4.1
release's (:func:`config_family_of` maps the drafter's keys to that family).

Quantisation scales are ``<module>.scale`` next to ``<module>.weight`` (never ``hc_*_scale``, which are learned
F32 parameters); they are not model keys and are handled by the loader.

DeepSeek-V4.1 (``deepseek_v41``) uses the same block names (its indexer holds ``wq_b``, ``weights_proj``, ``wk`` and
``k_norm`` and no compressor; its gate adds ``bias_vl``; Engram layers add ``engram.*``) and has no ``hc_head_*``,
``tid2eid`` or ``ape``. Its ``mtp.*`` keys are the DSpark drafter, not DeepSeek MTP blocks; they, the vision tower
(``vision.*``), the aligner (``aligner.*``) and the image marker embeddings (``image_start``, ``image_end``,
``image_newline``) are not part of the text backbone dsv4 trains: :func:`skip_reason` names them, the loader skips
them with one INFO line, and :func:`hf_to_ours` maps none of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

V4 = "deepseek_v4"
V41 = "deepseek_v41"
DSPARK = "deepseek_v41_dspark"
FAMILIES = (V4, V41, DSPARK)


def config_family_of(family: str) -> str:
    """The family whose ``config.json`` and quantisation scheme a key family's directory holds (the drafter's is
    the V4.1 release's)."""
    return V41 if check_family(family) == DSPARK else family


def check_family(family: str) -> str:
    if family not in FAMILIES:
        raise ValueError(f"unknown checkpoint family {family!r}; expected one of {FAMILIES}")
    return family

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
    ("engram.", "engram."),
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
_V41_GLOBALS = ("embed.weight", "head.weight", "norm.weight")  # V4.1 has no hc_head_*

# V4.1 keys outside the text backbone: (prefix or whole name, what it is). The loader skips them with one INFO line.
V41_SKIPPED: tuple[tuple[str, str], ...] = (
    ("mtp.", "the DSpark drafter"),
    ("vision.", "the vision tower"),
    ("aligner.", "the vision aligner"),
    ("image_", "the image marker embeddings"),
)


_DRAFTER_GLOBALS = {"embed.weight": "embed_tokens.weight", "head.weight": "lm_head.weight"}
_DRAFTER_GLOBALS_OURS = {v: k for k, v in _DRAFTER_GLOBALS.items()}
# the drafter's stage-owned tensors outside the block names (kept as they are)
_DRAFTER_RENAMES: list[tuple[str, str]] = [
    ("main_proj.weight", "main_proj.weight"),
    ("main_norm.weight", "main_norm.weight"),
    ("norm.weight", "norm.weight"),
    ("markov_head.", "markov_head."),
    ("confidence_head.", "confidence_head."),
]


def skip_reason(hf_key: str, family: str = V4) -> str | None:
    """For a family's key that is not part of the model the family builds, the group it belongs to (``"mtp.*
    (the DSpark drafter)"``); else None. V4 has none (its ``mtp.*`` blocks are MTP depths the model may build); a
    drafter load (:data:`DSPARK`) skips everything but ``mtp.*``, ``embed.weight`` and ``head.weight``."""
    if check_family(family) == DSPARK:
        if hf_key.startswith("mtp.") or hf_key in _DRAFTER_GLOBALS:
            return None
        for prefix, what in V41_SKIPPED:
            if hf_key.startswith(prefix):
                return f"{prefix}* ({what})"
        return "the target backbone"
    if family != V41:
        return None
    for prefix, what in V41_SKIPPED:
        if hf_key.startswith(prefix):
            return f"{prefix}* ({what})"
    return None

# Indices are ASCII digits without leading zeros, so that one number has one key ("experts.07" is unexpected).
_HF_EXPERT = re.compile(r"^ffn\.experts\.(0|[1-9][0-9]*)\.(w1|w2|w3)\.weight$")
_OURS_EXPERT = re.compile(r"^mlp\.experts\.(w1|w2|w3)$")
_HF_BLOCK = re.compile(r"^(layers|mtp)\.(0|[1-9][0-9]*)\.(.+)$")
_OURS_BLOCK = re.compile(r"^(model\.layers|mtp\.layers|layers)\.(\d+)\.(.+)$")  # layers.{i}: a drafter stage


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


def hf_to_ours(hf_key: str, family: str = V4) -> OurKey | None:
    """Map an on-disk tensor name of ``family`` to our state-dict name; ``None`` for a name the adapter does not
    know (and for the keys :func:`skip_reason` names)."""
    if check_family(family) == DSPARK:
        return _drafter_hf_to_ours(hf_key)
    if family == V41 and (skip_reason(hf_key, family) or hf_key.startswith("hc_head_")):
        return None
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


def ours_to_hf(name: str, expert: int | None = None, family: str = V4) -> str | None:
    """Inverse of :func:`hf_to_ours`. A stacked expert tensor (``...mlp.experts.w1``) needs the global ``expert``
    index; ``None`` for a name the adapter does not know."""
    if check_family(family) == DSPARK:
        return _drafter_ours_to_hf(name, expert)
    if name in _GLOBALS_OURS_TO_HF:
        hf = _GLOBALS_OURS_TO_HF[name]
        return hf if family == V4 or hf in _V41_GLOBALS else None
    if family == V41 and name.startswith("mtp."):
        return None
    m = _OURS_BLOCK.match(name)
    if m is None or m.group(1) == "layers":
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


def _drafter_hf_to_ours(hf_key: str) -> OurKey | None:
    if hf_key in _DRAFTER_GLOBALS:
        return OurKey(_DRAFTER_GLOBALS[hf_key])
    m = _HF_BLOCK.match(hf_key)
    if m is None or m.group(1) != "mtp":
        return None
    prefix, rest = f"layers.{m.group(2)}.", m.group(3)
    em = _HF_EXPERT.match(rest)
    if em is not None:
        return OurKey(f"{prefix}mlp.experts.{em.group(2)}", int(em.group(1)))
    mapped = _rename(_DRAFTER_RENAMES, rest, to_ours=True) or _rename(_BLOCK_RENAMES, rest, to_ours=True)
    return None if mapped is None or mapped.startswith("engram.") else OurKey(prefix + mapped)


def _drafter_ours_to_hf(name: str, expert: int | None) -> str | None:
    if name in _DRAFTER_GLOBALS_OURS:
        return _DRAFTER_GLOBALS_OURS[name]
    m = _OURS_BLOCK.match(name)
    if m is None or m.group(1) != "layers":
        return None
    prefix, rest = f"mtp.{m.group(2)}.", m.group(3)
    em = _OURS_EXPERT.match(rest)
    if em is not None:
        if expert is None:
            raise ValueError(f"ours_to_hf: {name!r} is a stacked expert tensor; give the global expert index")
        return f"{prefix}ffn.experts.{expert}.{em.group(1)}.weight"
    mapped = _rename(_DRAFTER_RENAMES, rest, to_ours=False) or _rename(_BLOCK_RENAMES, rest, to_ours=False)
    return None if mapped is None or mapped.startswith("engram.") else prefix + mapped


def is_stacked_expert(name: str) -> bool:
    m = _OURS_BLOCK.match(name)
    return m is not None and _OURS_EXPERT.match(m.group(3)) is not None


def mtp_depth(hf_key: str, family: str = V4) -> int | None:
    """``k`` of an ``mtp.{k}.*`` key of a V4 checkpoint (an MTP depth), else ``None`` (V4.1's ``mtp.*`` is the
    drafter)."""
    if check_family(family) != V4:
        return None
    m = _HF_BLOCK.match(hf_key)
    return int(m.group(2)) if m is not None and m.group(1) == "mtp" else None


# Which tensors the release stores in which format (section 2.4 of the V4 notes; the V4.1 notes), by on-disk name.
_FP8_MODULES = re.compile(
    r"(^|\.)(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.(w1|w2|w3)|e_proj|h_proj)\.weight$"
)
_F32_KEYS = re.compile(r"(^|\.)(hc_(attn|ffn)_(fn|base|scale)|hc_head_(fn|base|scale)|attn\.attn_sink|ape|ffn\.gate\.bias)$")
_V41_FP8_MODULES = re.compile(
    r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.(w1|w2|w3)|engram\.wkv)"
    r"\.weight$")
# V4.1's reference keeps in fp32 (and writes as F32) what V4 keeps, the image bias, the compressor projections (they
# run in fp32) and the head.
_V41_F32_KEYS = re.compile(r"^(head\.weight|layers\.\d+\.(hc_(attn|ffn)_(fn|base|scale)|attn\.attn_sink"
                           r"|ffn\.gate\.(bias|bias_vl)|attn\.compressor\.(wkv|wgate)\.weight))$")
_EXPERT_WEIGHT = re.compile(r"(^|\.)ffn\.experts\.\d+\.(w1|w2|w3)\.weight$")
_DRAFTER_FP8_MODULES = re.compile(r"^mtp\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|main_proj|ffn\.shared_experts\.(w1|w2|w3))"
                                  r"\.weight$")
_DRAFTER_F32_KEYS = re.compile(r"^(head\.weight|mtp\.\d+\.(hc_(attn|ffn)_(fn|base|scale)|attn\.attn_sink"
                               r"|ffn\.gate\.(bias|bias_vl)|confidence_head\.proj\.weight))$")


def on_disk_format(hf_key: str, family: str = V4) -> str:
    """Release format of a tensor of ``family``: ``"fp8"`` (e4m3 + the family's block e8m0 scale: 128x128 in V4,
    32x32 in V4.1), ``"fp8_rows"`` (V4.1 Engram tables: e4m3 + one e8m0 scale per row and 32 columns), ``"fp4"``
    (packed e2m1 + e8m0 per 32), ``"f32"``, ``"int"`` (tid2eid) or ``"bf16"``."""
    if _EXPERT_WEIGHT.search(hf_key):
        return "fp4"
    if check_family(family) == DSPARK:
        if _DRAFTER_FP8_MODULES.search(hf_key):
            return "fp8"
        return "f32" if _DRAFTER_F32_KEYS.search(hf_key) else "bf16"
    if family == V41:
        if re.fullmatch(r"layers\.\d+\.engram\.embed\.weight", hf_key):
            return "fp8_rows"
        if _V41_FP8_MODULES.search(hf_key):
            return "fp8"
        return "f32" if _V41_F32_KEYS.search(hf_key) else "bf16"
    if _FP8_MODULES.search(hf_key):
        return "fp8"
    if hf_key.endswith("tid2eid"):
        return "int"
    if _F32_KEYS.search(hf_key):
        return "f32"
    return "bf16"
