"""``config.json`` <-> :class:`~dsv4.config.DSV4Config` (or a family's subclass), in either layout
(:mod:`dsv4.checkpoint.layouts`).

The family comes from ``model_type`` (:func:`checkpoint_family`): ``deepseek_v4`` (or none: a V4 config) and
``deepseek_v41``, whose ``config.json`` is nested: ``text_config`` (``model_type: deepseek_v41_text``, the text
model's fields, read into :class:`~dsv4.config_v41.DSV41Config`), ``vision_config`` (the vision tower, which dsv4 does
not build: not read), the top-level ``image_token_id`` and ``quantization_config``. A bare ``deepseek_v41_text``
config reads the same way. Any other ``model_type`` is refused with a ``ValueError`` naming it. V4.1's YaRN may be
given as ``rope_scaling`` (the release) or ``rope_parameters`` (one dict with ``rope_type``, as transformers writes
it); a V4.1 config must hold every V4.1 field (:data:`V41_REQUIRED_FIELDS`) and no ``num_hash_layers`` other than 0.

``quantization_config`` (top level, both families) is checked against the family's weight formats
(:func:`quant_scheme_of`): ``quant_method`` fp8, ``fmt`` e4m3, ``scale_fmt`` ue8m0, ``activation_scheme`` dynamic,
``weight_block_size`` the family's tile ([128, 128] for V4, [32, 32] for V4.1), ``expert_dtype`` fp4 or fp8 (also
accepted at the top level, where dsv4's V4 export writes it). Another value, or a key dsv4 does not know, is refused
with a ``ValueError`` naming it: the loader would misread the weights.

Reading (:func:`config_from_hf`) takes every field the model uses from the file, or refuses the file with a
``KeyError`` naming the missing field; nothing falls back to a preset. The release's ``config.json`` names the fields
as ``DSV4Config`` does (``dtype`` is accepted for ``torch_dtype``). The config transformers' ``save_pretrained``
writes for ``DeepseekV4ForCausalLM`` is translated (:func:`translate_transformers_config`): ``layer_types`` +
``compress_rates`` (a ratio per layer type) give ``compress_ratios`` (the MTP blocks get ratio 0, sliding window
only, as in the release), the leading ``hash_moe`` entries of ``mlp_layer_types`` give ``num_hash_layers``,
``rope_parameters`` give ``rope_theta`` (``main``), ``compress_rope_theta`` and YaRN (``compress``), and
``partial_rotary_factor`` gives ``qk_rope_head_dim`` when the file has none; ``topk_method`` is ``noaux_tc``, the only
routing transformers implements. A value the model cannot compute as transformers does is refused with a
``ValueError`` naming the field.

Optional fields, and what their absence means (logged on the ``dsv4`` logger, never silent):
``rope_scaling`` (absent or null: no YaRN, a WARNING), ``norm_topk_prob`` (true: the reference and transformers
always renormalise the top-k weights; false is refused by ``DSV4Config``), ``hidden_act`` (silu),
``tie_word_embeddings`` (false), ``initializer_range`` (0.02; used only to initialise tensors the checkpoint does not
hold, e.g. MTP blocks missing from a transformers directory). HF bookkeeping (``architectures``, ``model_type``,
``quantization_config``, ``transformers_version``, ...) is ignored. ``overrides`` replace fields after reading (e.g.
``num_nextn_predict_layers=0`` to skip MTP, ``torch_dtype="float32"``) and count as given.

Writing (:func:`config_to_hf`) emits the release's fields: ``compress_ratios`` with one entry per MTP block after
the ``num_hidden_layers`` backbone entries (DeepSeek's inference code indexes ``compress_ratios[n_layers + k]``),
and on a re-quantised export ``quantization_config`` and ``"expert_dtype": "fp4"`` (the routed experts' format).
A V4.1 config is written nested, as released: ``text_config`` (without dsv4's training knobs), ``vision_config``
``{"num_hidden_layers": 0}`` (an export holds no vision tower, and says so), ``image_token_id`` and, re-quantised,
``quantization_config`` with ``weight_block_size`` [32, 32] and ``expert_dtype`` fp4.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, fields
from typing import Any

from dsv4.checkpoint import keys as K
from dsv4.checkpoint.quant import V4_SCHEME, V41_SCHEME, QuantScheme
from dsv4.config import DSV4Config

log = logging.getLogger("dsv4")

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
MAX_CONFIG_BYTES = 1 << 20  # a release config.json is a few KB
# dsv4 training knobs that are not part of the release format.
_DSV4_ONLY_FIELDS = ("mtp_loss_weight", "indexer_loss_coeff", "attention_chunk_size", "loss_chunk_size",
                     "activation_checkpointing", "moe_chunk_tokens", "attention_backend", "fake_quant")
QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
}
# V4.1's as released (its expert format inside quantization_config)
V41_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "weight_block_size": [32, 32],
    "scale_fmt": "ue8m0",
    "expert_dtype": "fp4",
}
V41_MODEL_TYPE, V41_TEXT_MODEL_TYPE, V41_VISION_MODEL_TYPE = "deepseek_v41", "deepseek_v41_text", "deepseek_v41_vision"
# model_type -> checkpoint family (dsv4.checkpoint.keys)
MODEL_TYPES = {"deepseek_v4": K.V4, V41_MODEL_TYPE: K.V41, V41_TEXT_MODEL_TYPE: K.V41}
SCHEMES = {K.V4: V4_SCHEME, K.V41: V41_SCHEME, K.DSPARK: V41_SCHEME}
# dsv4 training knobs of a V4.1 config that are not part of the release format
_DSV41_ONLY_FIELDS = ("engram_trainable",)


def read_hf_config_dict(path: str) -> dict[str, Any]:
    """The raw ``config.json`` of a checkpoint directory (or the file itself)."""
    file = os.path.join(path, CONFIG_FILE) if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise FileNotFoundError(f"no {CONFIG_FILE} at {file}")
    size = os.path.getsize(file)
    if size > MAX_CONFIG_BYTES:
        raise ValueError(f"{file}: {size} bytes, more than a config.json may have ({MAX_CONFIG_BYTES})")
    with open(file, "rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise ValueError(f"{file}: not a valid UTF-8 JSON config: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file}: holds a JSON {type(data).__name__}, not an object")
    return data


def checkpoint_family(data: dict[str, Any]) -> str:
    """The family (:data:`dsv4.checkpoint.keys.FAMILIES`) of a parsed ``config.json`` by its ``model_type`` (none:
    V4); a ``ValueError`` naming an unknown one."""
    model_type = data.get("model_type")
    if model_type is None:
        return K.V4
    if model_type not in MODEL_TYPES:
        raise ValueError(f"config.json: model_type={model_type!r} is not a DeepSeek family dsv4 reads (known: "
                         f"{sorted(MODEL_TYPES)})")
    return MODEL_TYPES[model_type]


def config_family(config: DSV4Config) -> str:
    """The checkpoint family of a model config (its class's ``model_type``)."""
    return MODEL_TYPES.get(getattr(config, "model_type", "deepseek_v4"), K.V4)


def model_family(model, config=None) -> str:
    """The key family of ``model``'s checkpoints: its own ``checkpoint_family`` when it declares one (the DSpark
    drafter: :data:`dsv4.checkpoint.keys.DSPARK`), else its config's (``config`` or ``model.config``; V4 without
    one)."""
    declared = getattr(model, "checkpoint_family", None)
    if declared is not None:
        return K.check_family(declared)
    config = config if config is not None else getattr(model, "config", None)
    return config_family(config) if isinstance(config, DSV4Config) else K.V4


_QUANT_VALUES: dict[str, tuple[Any, ...]] = {
    "quant_method": ("fp8",), "fmt": ("e4m3",), "scale_fmt": ("ue8m0",), "activation_scheme": ("dynamic",),
    "expert_dtype": ("fp4", "fp8"),
}


def quant_scheme_of(data: dict[str, Any], family: str | None = None) -> QuantScheme:
    """The weight formats of a parsed ``config.json`` (:class:`~dsv4.checkpoint.quant.QuantScheme` of its family,
    or of ``family``), after checking its ``quantization_config`` (see the module docstring): a ``ValueError`` naming
    each key dsv4 does not know and each value it does not read as the family's release does."""
    family = checkpoint_family(data) if family is None else K.check_family(family)
    scheme = SCHEMES[family]
    qc = data.get("quantization_config")
    problems = []
    if data.get("expert_dtype", "fp4") not in _QUANT_VALUES["expert_dtype"]:
        problems.append(f"expert_dtype={data['expert_dtype']!r} (supported: {list(_QUANT_VALUES['expert_dtype'])})")
    if qc is None:
        pass
    elif not isinstance(qc, dict):
        problems.append(f"quantization_config={qc!r} is not an object")
    else:
        unknown = sorted(set(qc) - {*_QUANT_VALUES, "weight_block_size"})
        if unknown:
            problems.append(f"quantization_config has keys dsv4 does not know: {unknown}")
        for key, allowed in _QUANT_VALUES.items():
            if key in qc and qc[key] not in allowed:
                problems.append(f"quantization_config.{key}={qc[key]!r} (supported: {list(allowed)})")
        block = qc.get("weight_block_size", list(scheme.fp8_block))
        if not isinstance(block, (list, tuple)) or [*block] != [*scheme.fp8_block]:
            problems.append(f"quantization_config.weight_block_size={block!r} (a {family} checkpoint's FP8 tiles are "
                            f"{list(scheme.fp8_block)}; dsv4 reads no other)")
    if problems:
        raise ValueError("config.json: " + "; ".join(problems))
    return scheme


# Fields the model uses that a config.json must carry (or an override give).
REQUIRED_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "qk_rope_head_dim", "q_lora_rank", "o_lora_rank", "o_groups", "n_routed_experts", "n_shared_experts",
    "num_experts_per_tok", "moe_intermediate_size", "routed_scaling_factor", "scoring_func", "topk_method",
    "swiglu_limit", "max_position_embeddings", "rope_theta", "compress_rope_theta", "compress_ratios",
    "sliding_window", "num_hash_layers", "hc_mult", "hc_sinkhorn_iters", "hc_eps", "index_head_dim", "index_n_heads",
    "index_topk", "num_nextn_predict_layers", "rms_norm_eps", "torch_dtype",
)
# Optional fields and the value their absence stands for (see the module docstring).
OPTIONAL_FIELDS: dict[str, Any] = {
    "rope_scaling": None, "norm_topk_prob": True, "hidden_act": "silu", "tie_word_embeddings": False,
    "initializer_range": 0.02,
}
# V4.1's text_config: the V4 fields but num_hash_layers (none: 0), and these
V41_REQUIRED_FIELDS = tuple(f for f in REQUIRED_FIELDS if f != "num_hash_layers") + (
    "kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id", "candidate_topk_blocks",
    "candidate_block_size", "engram_layer_ids", "engram_num_embeddings", "engram_max_ngram_size", "engram_vocab_size",
    "engram_n_heads", "engram_head_dim", "engram_pad_token_id", "engram_compressed_vocab_size", "dspark_block_size",
    "dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank", "dspark_n_routed_experts",
    "dspark_num_experts_per_tok", "image_token_id",
)
_LAYER_TYPE_KEYS = {"compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")


def is_transformers_config(data: dict[str, Any]) -> bool:
    """Whether ``data`` is the config transformers writes (``layer_types`` / ``compress_rates`` per type /
    ``rope_parameters``) rather than the release's (``compress_ratios`` per layer)."""
    return "compress_ratios" not in data and (
        "layer_types" in data or isinstance(data.get("compress_rates"), dict) or "rope_parameters" in data
        or "mlp_layer_types" in data)


def _need(data: dict[str, Any], key: str, where: str) -> Any:
    if key not in data:
        raise KeyError(f"config.json: {where} has no {key!r}")
    return data[key]


def _ratios_from_layer_types(data: dict[str, Any]) -> list[int]:
    n = int(_need(data, "num_hidden_layers", "the transformers config"))
    types = _need(data, "layer_types", "the transformers config")
    rates = _need(data, "compress_rates", "the transformers config")
    if not isinstance(types, list) or len(types) != n:
        raise ValueError(f"config.json: layer_types has {len(types) if isinstance(types, list) else types!r} entries, "
                         f"num_hidden_layers={n}")
    if not isinstance(rates, dict):
        raise ValueError(f"config.json: compress_rates={rates!r} is not a dict of layer type -> ratio")
    ratio_of = {"sliding_attention": 0}
    for kind in _LAYER_TYPE_KEYS:
        if kind in types:
            ratio_of[kind] = int(_need(rates, kind, "compress_rates"))
    if ratio_of.get("compressed_sparse_attention", 4) != 4:
        raise ValueError(f"config.json: compress_rates['compressed_sparse_attention']="
                         f"{rates['compressed_sparse_attention']}: dsv4's overlapping compressor with the indexer "
                         "(CSA) is the ratio-4 layer; other CSA ratios are not supported")
    hca = ratio_of.get("heavily_compressed_attention")
    if hca is not None and (hca < 1 or hca == 4):
        raise ValueError(f"config.json: compress_rates['heavily_compressed_attention']={hca}: an HCA ratio must be "
                         ">= 1 and not 4 (ratio 4 is CSA in dsv4)")
    unknown = sorted({t for t in types if t not in ratio_of})
    if unknown:
        raise ValueError(f"config.json: layer_types has unknown types {unknown} (expected sliding_attention, "
                         "compressed_sparse_attention, heavily_compressed_attention)")
    return [ratio_of[t] for t in types]


def _hash_layers_from_mlp_types(data: dict[str, Any]) -> int:
    types = _need(data, "mlp_layer_types", "the transformers config")
    n = int(_need(data, "num_hidden_layers", "the transformers config"))
    if not isinstance(types, list) or len(types) != n:
        raise ValueError(f"config.json: mlp_layer_types has {len(types) if isinstance(types, list) else types!r} "
                         f"entries, num_hidden_layers={n}")
    n_hash = 0
    while n_hash < n and types[n_hash] == "hash_moe":
        n_hash += 1
    bad = [(i, t) for i, t in enumerate(types[n_hash:], n_hash) if t != "moe"]
    if bad:
        raise ValueError(f"config.json: mlp_layer_types must be hash_moe layers first, then moe; got (layer, type) "
                         f"{bad[:5]}")
    return n_hash


def _rope_from_parameters(data: dict[str, Any], out: dict[str, Any], notes: list[str]) -> None:
    params = _need(data, "rope_parameters", "the transformers config")
    if not (isinstance(params, dict) and isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict)):
        raise ValueError(f"config.json: rope_parameters must hold the 'main' and 'compress' dicts transformers writes, "
                         f"got keys {sorted(params) if isinstance(params, dict) else params!r}")
    main, compress = params["main"], params["compress"]
    if main.get("rope_type", "default") != "default":
        raise ValueError(f"config.json: rope_parameters['main']['rope_type']={main.get('rope_type')!r}: dsv4 applies "
                         "no scaling to the sliding-window rope (only 'default' is supported)")
    out["rope_theta"] = _need(main, "rope_theta", "rope_parameters['main']")
    out["compress_rope_theta"] = _need(compress, "rope_theta", "rope_parameters['compress']")
    head_dim = int(_need(data, "head_dim", "the transformers config"))
    for name, sub in (("main", main), ("compress", compress)):
        factor = sub.get("partial_rotary_factor")
        if factor is not None and "qk_rope_head_dim" in out and factor * head_dim != out["qk_rope_head_dim"]:
            raise ValueError(f"config.json: rope_parameters['{name}']['partial_rotary_factor']={factor} x head_dim="
                             f"{head_dim} differs from qk_rope_head_dim={out['qk_rope_head_dim']}")
    kind = compress.get("rope_type", "default")
    if kind == "default":
        out["rope_scaling"] = None
        notes.append("rope_parameters['compress'] has rope_type 'default': no YaRN")
        return
    if kind != "yarn":
        raise ValueError(f"config.json: rope_parameters['compress']['rope_type']={kind!r}: only 'yarn' or 'default' "
                         "is supported")
    if compress.get("attention_factor", 1.0) != 1.0:
        raise ValueError(f"config.json: rope_parameters['compress']['attention_factor']={compress['attention_factor']}"
                         ": dsv4's YaRN scales no attention (the reference does not), only 1.0 is supported")
    unknown = sorted(set(compress) - {*_YARN_KEYS, "rope_type", "type", "rope_theta", "partial_rotary_factor",
                                      "attention_factor", "truncate"})
    if unknown or compress.get("truncate", True) is not True:
        raise ValueError(f"config.json: rope_parameters['compress'] has YaRN keys dsv4 does not implement: "
                         f"{unknown or ['truncate=false']}")
    scaling = {"type": "yarn", "factor": _need(compress, "factor", "rope_parameters['compress']"),
               "original_max_position_embeddings": _need(compress, "original_max_position_embeddings",
                                                         "rope_parameters['compress']")}
    for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):  # transformers' YaRN defaults
        if key in compress:
            scaling[key] = compress[key]
        else:
            scaling[key] = default
            notes.append(f"rope_parameters['compress'] has no {key}: {default} (transformers' default)")
    out["rope_scaling"] = scaling


def translate_transformers_config(data: dict[str, Any], notes: list[str] | None = None) -> dict[str, Any]:
    """The release-named fields of a transformers ``DeepseekV4Config`` dict (see the module docstring)."""
    notes = [] if notes is None else notes
    for key in ("attention_bias", "mlp_bias"):
        if data.get(key):
            raise ValueError(f"config.json: {key}=true is not supported (DSV4 has no biases there)")
    out = {k: v for k, v in data.items() if k not in ("compress_rates", "layer_types", "mlp_layer_types",
                                                      "rope_parameters", "partial_rotary_factor")}
    head_dim = int(_need(data, "head_dim", "the transformers config"))
    if "qk_rope_head_dim" not in out:
        factor = _need(data, "partial_rotary_factor", "the transformers config (nor qk_rope_head_dim)")
        if factor * head_dim != int(factor * head_dim):
            raise ValueError(f"config.json: partial_rotary_factor={factor} x head_dim={head_dim} is not an integer")
        out["qk_rope_head_dim"] = int(factor * head_dim)
    ratios = _ratios_from_layer_types(data)
    mtp = int(_need(data, "num_nextn_predict_layers", "the transformers config"))
    out["compress_ratios"] = ratios + [0] * mtp  # MTP blocks: sliding window only, as in the release
    out["num_hash_layers"] = _hash_layers_from_mlp_types(data)
    _rope_from_parameters(data, out, notes)
    if "topk_method" in out and out["topk_method"] != "noaux_tc":
        raise ValueError(f"config.json: topk_method={out['topk_method']!r}; transformers routes with noaux_tc only")
    out["topk_method"] = "noaux_tc"
    return out


def _v41_rope(text: dict[str, Any], notes: list[str]) -> None:
    """V4.1's YaRN from ``rope_parameters`` (transformers' spelling: one dict with ``rope_type`` and ``rope_theta``)
    when the file has no ``rope_scaling``."""
    if isinstance(text.get("rope_scaling"), dict):  # one spelling in memory: "type" (the release has rope_type)
        scaling = dict(text["rope_scaling"])
        kind = scaling.pop("rope_type", scaling.pop("type", None))
        text["rope_scaling"] = {"type": kind, **scaling}
    if "rope_scaling" in text or "rope_parameters" not in text:
        return
    params = text["rope_parameters"]
    if not isinstance(params, dict):
        raise ValueError(f"config.json: text_config.rope_parameters={params!r} is not an object")
    if "rope_theta" in params and "rope_theta" in text and float(params["rope_theta"]) != float(text["rope_theta"]):
        raise ValueError(f"config.json: text_config.rope_parameters.rope_theta={params['rope_theta']} differs from "
                         f"text_config.rope_theta={text['rope_theta']}")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        text["rope_scaling"] = None
        notes.append("text_config.rope_parameters has rope_type 'default': no YaRN")
        return
    if kind != "yarn":
        raise ValueError(f"config.json: text_config.rope_parameters.rope_type={kind!r}: only 'yarn' or 'default' is "
                         "supported")
    unknown = sorted(set(params) - {*_YARN_KEYS, "rope_type", "type", "rope_theta"})
    if unknown:
        raise ValueError(f"config.json: text_config.rope_parameters has keys dsv4 does not implement: {unknown}")
    text["rope_scaling"] = {"type": "yarn", **{k: params[k] for k in _YARN_KEYS if k in params}}


def v41_text_values(data: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """The flat text-model fields of a V4.1 ``config.json`` (nested, or a bare ``deepseek_v41_text`` config)."""
    if data.get("model_type") == V41_TEXT_MODEL_TYPE:
        text = dict(data)
    else:
        text = data.get("text_config")
        if not isinstance(text, dict):
            raise KeyError(f"config.json: a {V41_MODEL_TYPE} config has no 'text_config' object (got {text!r:.80})")
        if text.get("model_type", V41_TEXT_MODEL_TYPE) != V41_TEXT_MODEL_TYPE:
            raise ValueError(f"config.json: text_config.model_type={text['model_type']!r}, expected "
                             f"{V41_TEXT_MODEL_TYPE!r}")
        text = dict(text)
        if "image_token_id" in data:
            text["image_token_id"] = data["image_token_id"]
        for key in ("torch_dtype", "dtype"):
            if key not in text and key in data:
                text[key] = data[key]
    if text.get("num_hash_layers", 0) != 0:
        raise ValueError(f"config.json: num_hash_layers={text['num_hash_layers']}: V4.1 has no hash-routed layers")
    text.pop("num_hash_layers", None)
    _v41_rope(text, notes)
    return text


def config_from_hf(source: str | os.PathLike | dict[str, Any], **overrides: Any) -> DSV4Config:
    """Build a ``DSV4Config`` (a :class:`~dsv4.config_v41.DSV41Config` for a V4.1 checkpoint) from a checkpoint
    directory, a ``config.json`` path or its parsed dict, in either layout (see the module docstring: a missing field
    is a ``KeyError`` naming it, an unsupported ``model_type`` or ``quantization_config`` a ``ValueError``)."""
    data = dict(read_hf_config_dict(source) if isinstance(source, (str, os.PathLike)) else source)
    family = checkpoint_family(data)
    quant_scheme_of(data, family)
    if family == K.V41:
        return _config_from_v41(data, source, overrides)
    names = {f.name for f in fields(DSV4Config)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"config_from_hf: unknown override keys {unknown}")
    if "torch_dtype" not in data and "dtype" in data:
        data["torch_dtype"] = data["dtype"]
    notes: list[str] = []
    if is_transformers_config(data):
        data = translate_transformers_config({**data, **overrides}, notes)
    elif "compress_rates" in data and "compress_ratios" not in data:  # a per-layer list under the other spelling
        data["compress_ratios"] = data["compress_rates"]
    values = {k: v for k, v in data.items() if k in names}
    values.update(overrides)
    missing = [k for k in REQUIRED_FIELDS if k not in values]
    if missing:
        raise KeyError(f"config.json: no {missing} (every field the model uses must be in the file or given as an "
                       "override; nothing is taken from a preset)")
    _fill_optional_fields(values, notes)
    n, mtp = int(values["num_hidden_layers"]), int(values["num_nextn_predict_layers"])
    ratios = values["compress_ratios"]
    if ratios is not None and len(ratios) > n + mtp:  # e.g. MTP disabled by an override: drop its ratio entries
        values["compress_ratios"] = list(ratios)[: n + mtp]
    _log_notes(notes, values, source)
    return DSV4Config(**values)


def _fill_optional_fields(values: dict[str, Any], notes: list[str]) -> None:
    """Set every absent :data:`OPTIONAL_FIELDS` entry of ``values`` to its default, noting each in ``notes``."""
    for key, default in OPTIONAL_FIELDS.items():
        if key not in values:
            values[key] = default
            notes.append(f"no {key}: " + ("no YaRN" if key == "rope_scaling" else f"{default!r}"))
        elif key == "rope_scaling" and values[key] is None and not any("no YaRN" in n for n in notes):
            notes.append("rope_scaling is null: no YaRN")


def _log_notes(notes: list[str], values: dict[str, Any], source: Any) -> None:
    """One log line with the defaults a config read filled in (a WARNING when it runs without YaRN)."""
    if notes:
        level = logging.WARNING if values["rope_scaling"] is None else logging.INFO
        log.log(level, "%s: %s", source if isinstance(source, (str, os.PathLike)) else "config", "; ".join(notes))


def _config_from_v41(data: dict[str, Any], source: Any, overrides: dict[str, Any]) -> DSV4Config:
    from dsv4.config import config_class

    cls = config_class(V41_MODEL_TYPE)
    notes: list[str] = []
    text = v41_text_values(data, notes)
    if "torch_dtype" not in text and "dtype" in text:
        text["torch_dtype"] = text["dtype"]
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"config_from_hf: unknown override keys {unknown}")
    values = {k: v for k, v in text.items() if k in names and k not in _DSV4_ONLY_FIELDS + _DSV41_ONLY_FIELDS}
    values.update(overrides)
    missing = [k for k in V41_REQUIRED_FIELDS if k not in values]
    if missing:
        raise KeyError(f"config.json: the V4.1 text_config has no {missing} (every field the model uses must be in "
                       "the file or given as an override; nothing is taken from a preset)")
    _fill_optional_fields(values, notes)
    _log_notes(notes, values, source)
    return cls(**values)


def config_to_hf(config: DSV4Config, *, quantized: bool = False, torch_dtype: str | None = None) -> dict[str, Any]:
    """The ``config.json`` dict of an export: release field names, ``compress_ratios`` with the MTP entries,
    ``quantization_config`` and ``expert_dtype`` when ``quantized``; a V4.1 config nested (see the module
    docstring). ``torch_dtype`` replaces the config's."""
    if config_family(config) == K.V41:
        return _v41_config_to_hf(config, quantized, torch_dtype)
    data = {k: v for k, v in asdict(config).items() if k not in _DSV4_ONLY_FIELDS}
    n, mtp = config.num_hidden_layers, config.num_nextn_predict_layers
    data["compress_ratios"] = [config.ratio_for_layer(i) for i in range(n + mtp)]
    data["torch_dtype"] = torch_dtype or ("bfloat16" if quantized else data["torch_dtype"])
    out: dict[str, Any] = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", **data}
    if quantized:
        out["quantization_config"] = dict(QUANTIZATION_CONFIG)
        out["expert_dtype"] = "fp4"
    return out


def _v41_config_to_hf(config: DSV4Config, quantized: bool, torch_dtype: str | None) -> dict[str, Any]:
    text = {k: v for k, v in asdict(config).items()
            if k not in _DSV4_ONLY_FIELDS + _DSV41_ONLY_FIELDS + ("image_token_id", "num_hash_layers")}
    n, mtp = config.num_hidden_layers, config.num_nextn_predict_layers
    text["compress_ratios"] = [config.ratio_for_layer(i) for i in range(n + mtp)]
    if config.rope_scaling is not None:  # the release's spelling, rope_type (transformers reads type too)
        scaling = {k: v for k, v in config.rope_scaling.items() if k not in ("type", "rope_type")}
        text["rope_scaling"] = {"rope_type": "yarn", **scaling}
    dtype = torch_dtype or ("bfloat16" if quantized else config.torch_dtype)
    text["torch_dtype"] = dtype
    out: dict[str, Any] = {
        "architectures": ["DeepseekV41ForCausalLM"], "model_type": V41_MODEL_TYPE,
        "text_config": {"model_type": V41_TEXT_MODEL_TYPE, **text},
        "vision_config": {"model_type": V41_VISION_MODEL_TYPE, "num_hidden_layers": 0},
        "image_token_id": config.image_token_id, "torch_dtype": dtype, "tie_word_embeddings": False,
    }
    if quantized:
        out["quantization_config"] = dict(V41_QUANTIZATION_CONFIG)
    return out


def write_hf_config(config: DSV4Config, directory: str, *, quantized: bool = False, torch_dtype: str | None = None) -> str:
    data = config_to_hf(config, quantized=quantized, torch_dtype=torch_dtype)
    os.makedirs(directory, exist_ok=True)
    file = os.path.join(directory, CONFIG_FILE)
    with open(file, "w") as f:
        json.dump(data, f, indent=2)
    return file
