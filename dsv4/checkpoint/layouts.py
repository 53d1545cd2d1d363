"""The two on-disk layouts of a DSV4 checkpoint directory, and how the loader reads the second as the first.

* ``release``: DeepSeek's released layout (:mod:`dsv4.checkpoint.keys`): ``embed.weight``, ``layers.{i}.attn.wq_a
  .weight``, ``layers.{i}.attn.kv_norm.weight``, ``hc_head_fn``, ``head.weight``, ``mtp.{k}.*``.
* ``transformers``: what ``save_pretrained`` of transformers' ``DeepseekV4ForCausalLM`` writes (it reverses its
  own load-time renames, partly): the release's block names under a ``model.`` prefix (``model.layers.{i}.attn
  .wq_a.weight``, routed experts one ``ffn.experts.{e}.w{1,2,3}.weight`` per expert), but ``model.embed_tokens
  .weight``, ``model.norm.weight``, ``model.hc_head.hc_{fn,base,scale}``, ``head.weight`` and the attention's KV norm
  as ``attn.norm.weight``. transformers builds no MTP block, so such a directory holds no ``mtp.*`` keys.

:func:`detect_layout` tells them apart from the key names (any key under ``model.`` means transformers);
:func:`release_view` gives a :class:`~dsv4.checkpoint.safetensors_io.CheckpointDir` keyed by release names whose
:class:`~dsv4.checkpoint.safetensors_io.TensorInfo` still carries the on-disk name (so errors name the file's key).
A transformers-layout key with no release name is kept as it is, and the loader reports it as unexpected.
"""

from __future__ import annotations

import re
from dataclasses import replace

from dsv4.checkpoint.safetensors_io import CheckpointDir, CheckpointFormatError

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
    return f"layers.{idx}.{rest}"


def release_view(ckpt: CheckpointDir) -> tuple[CheckpointDir, str]:
    """``(ckpt keyed by release names, layout)``; the same object for a release-layout directory."""
    layout = detect_layout(ckpt.tensors)
    if layout == "release":
        return ckpt, layout
    out = CheckpointDir(path=ckpt.path, has_index=ckpt.has_index)
    source: dict[str, str] = {}
    for key, info in ckpt.tensors.items():
        name = transformers_to_release(key) or key
        if name in out.tensors:
            raise CheckpointFormatError(
                f"{ckpt.path}: {key!r} and {source[name]!r} are both {name!r} in the release layout (two keys for one "
                "tensor)")
        out.tensors[name] = replace(info)  # info.key stays the on-disk name
        source[name] = key
    return out, layout
