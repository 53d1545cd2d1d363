"""The two on-disk layouts of a DSV4 checkpoint directory, and how the loader reads the second as the first.

* ``release``: DeepSeek's released layout (:mod:`dsv4.checkpoint.keys`): ``embed.weight``, ``layers.{i}.attn.wq_a
  .weight``, ``layers.{i}.attn.kv_norm.weight``, ``hc_head_fn``, ``head.weight``, ``mtp.{k}.*``.
* ``transformers``: what transformers' ``DeepseekV4ForCausalLM`` writes, in either of its two forms. By default
  ``save_pretrained`` reverses its own load-time renames, partly: the release's block names under a ``model.`` prefix
  (``model.layers.{i}.attn.wq_a.weight``, routed experts one ``ffn.experts.{e}.w{1,2,3}.weight`` per expert), but
  ``model.embed_tokens.weight``, ``model.norm.weight``, ``model.hc_head.hc_{fn,base,scale}``, ``head.weight`` and the
  attention's KV norm as ``attn.norm.weight``. With ``save_original_format=False`` (and when a PEFT adapter is
  attached) it writes its in-memory names instead (``model.layers.{i}.self_attn.q_a_proj.weight``, ``...mlp.
  shared_experts.gate_proj.weight``, ``...self_attn.compressor.indexer.scorer.weights_proj.weight``, ``lm_head.weight``,
  ...) with the routed experts fused per layer: ``mlp.experts.gate_up_proj [E, 2 inter, hidden]`` (``w1`` rows then
  ``w3`` rows per expert) and ``mlp.experts.down_proj [E, hidden, inter]`` (``w2``). transformers builds no MTP
  block, so neither form holds ``mtp.*`` keys.

:func:`detect_layout` tells them apart from the key names (any key under ``model.`` means transformers);
:func:`release_view` gives a :class:`~dsv4.checkpoint.safetensors_io.CheckpointDir` keyed by release names whose
:class:`~dsv4.checkpoint.safetensors_io.TensorInfo` still carries the on-disk name (so errors name the file's key).
Each expert's ``w1`` / ``w3`` / ``w2`` inside a fused tensor is a contiguous byte range of it, so the view names it
``layers.{i}.ffn.experts.{e}.w{1,2,3}.weight`` with that range: the loader reads one expert at a time and, under
expert parallelism, only its own experts, as from the release layout. A transformers-layout key with no release
name is kept as it is, and the loader reports it as unexpected.
"""

from __future__ import annotations

import re
from dataclasses import replace

from dsv4.checkpoint.safetensors_io import DTYPES, CheckpointDir, CheckpointFormatError, TensorInfo

LAYOUTS = ("release", "transformers")

_TRANSFORMERS_GLOBALS = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
    "head.weight": "head.weight",
    "lm_head.weight": "head.weight",
}
_TRANSFORMERS_BLOCK = re.compile(r"^model\.layers\.(0|[1-9][0-9]*)\.(.+)$")


# transformers' in-memory names (save_original_format=False) inside a block -> the release's; most specific first
_NATIVE_BLOCK = [
    ("self_attn.compressor.indexer.kv_proj.", "attn.indexer.compressor.wkv."),
    ("self_attn.compressor.indexer.gate_proj.", "attn.indexer.compressor.wgate."),
    ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
    ("self_attn.compressor.indexer.kv_norm.", "attn.indexer.compressor.norm."),
    ("self_attn.compressor.indexer.q_b_proj.", "attn.indexer.wq_b."),
    ("self_attn.compressor.indexer.scorer.weights_proj.", "attn.indexer.weights_proj."),
    ("self_attn.compressor.kv_proj.", "attn.compressor.wkv."),
    ("self_attn.compressor.gate_proj.", "attn.compressor.wgate."),
    ("self_attn.compressor.position_bias", "attn.compressor.ape"),
    ("self_attn.compressor.kv_norm.", "attn.compressor.norm."),
    ("self_attn.q_a_proj.", "attn.wq_a."),
    ("self_attn.q_a_norm.", "attn.q_norm."),
    ("self_attn.q_b_proj.", "attn.wq_b."),
    ("self_attn.kv_proj.", "attn.wkv."),
    ("self_attn.kv_norm.", "attn.kv_norm."),
    ("self_attn.o_a_proj.", "attn.wo_a."),
    ("self_attn.o_b_proj.", "attn.wo_b."),
    ("self_attn.sinks", "attn.attn_sink"),
    ("input_layernorm.", "attn_norm."),
    ("post_attention_layernorm.", "ffn_norm."),
    ("attn_hc.", "hc_attn_"),
    ("ffn_hc.", "hc_ffn_"),
    ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
    ("mlp.shared_experts.gate_proj.", "ffn.shared_experts.w1."),
    ("mlp.shared_experts.up_proj.", "ffn.shared_experts.w3."),
    ("mlp.shared_experts.down_proj.", "ffn.shared_experts.w2."),
    ("mlp.", "ffn."),  # gate.weight, gate.tid2eid
]
FUSED_EXPERTS = {"mlp.experts.gate_up_proj": ("w1", "w3"), "mlp.experts.down_proj": ("w2",)}


def detect_layout(keys) -> str:
    """``"transformers"`` when any key lives under ``model.`` (transformers' prefix), else ``"release"``."""
    return "transformers" if any(k.startswith("model.") for k in keys) else "release"


def transformers_to_release(key: str) -> str | None:
    """The release name of a transformers-layout key; None when it has none."""
    if key in _TRANSFORMERS_GLOBALS:
        return _TRANSFORMERS_GLOBALS[key]
    m = _TRANSFORMERS_BLOCK.match(key)
    if m is None:
        return None
    idx, rest = m.groups()
    if rest == "attn.norm.weight":  # the attention's KV norm (the release's attn.kv_norm)
        rest = "attn.kv_norm.weight"
    for native, release in _NATIVE_BLOCK:
        if native.endswith(".") and rest.startswith(native) or rest == native:
            rest = release + rest[len(native):]
            break
    return f"layers.{idx}.{rest}"


def _split_fused(key: str, info: TensorInfo) -> list[tuple[str, TensorInfo]]:
    """``(release key, view)`` of every expert weight inside a fused ``gate_up_proj`` / ``down_proj`` tensor."""
    m = _TRANSFORMERS_BLOCK.match(key)
    parts = FUSED_EXPERTS[m.group(2)]
    if len(info.shape) != 3 or info.shape[1] % len(parts) or info.dtype not in DTYPES:
        raise CheckpointFormatError(f"{key}: shape {list(info.shape)} {info.dtype} is not a fused expert tensor "
                                    f"[experts, {' + '.join(parts)} rows, in]")
    experts, rows, cols = info.shape
    rows //= len(parts)
    size = rows * cols * DTYPES[info.dtype].itemsize
    out = []
    for e in range(experts):
        for j, w in enumerate(parts):
            begin = info.begin + (e * len(parts) + j) * size
            out.append((f"layers.{m.group(1)}.ffn.experts.{e}.{w}.weight",
                        replace(info, key=f"{key}[expert {e}, {w}]", shape=(rows, cols), begin=begin, end=begin + size)))
    return out


def release_view(ckpt: CheckpointDir) -> tuple[CheckpointDir, str]:
    """``(ckpt keyed by release names, layout)``; the same object for a release-layout directory."""
    layout = detect_layout(ckpt.tensors)
    if layout == "release":
        return ckpt, layout
    out = CheckpointDir(path=ckpt.path, has_index=ckpt.has_index)
    source: dict[str, str] = {}
    for key, info in ckpt.tensors.items():
        m = _TRANSFORMERS_BLOCK.match(key)
        views = (_split_fused(key, info) if m is not None and m.group(2) in FUSED_EXPERTS
                 else [(transformers_to_release(key) or key, replace(info))])  # info.key stays the on-disk name
        for name, view in views:
            if name in out.tensors:
                raise CheckpointFormatError(
                    f"{ckpt.path}: {view.key!r} and {source[name]!r} are both {name!r} in the release layout (two keys "
                    "for one tensor)")
            out.tensors[name] = view
            source[name] = view.key
    return out, layout
