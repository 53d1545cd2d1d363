"""``config.json`` (HF release) <-> :class:`~dsv4.config.DSV4Config`.

Reading keeps every field ``DSV4Config`` knows (the names are the release's); ``dtype`` is accepted for ``torch_dtype``; HF bookkeeping (``architectures``,
``model_type``, ``quantization_config``, ``transformers_version``, ...) is ignored. ``overrides`` replace fields
after reading (e.g. ``num_nextn_predict_layers=0`` to skip MTP, ``torch_dtype="float32"``). Writing emits the
release's fields, plus ``quantization_config`` when the weights are re-quantised.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, fields
from typing import Any

from dsv4.config import DSV4Config

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
MAX_CONFIG_BYTES = 1 << 20  # a release config.json is a few KB
# dsv4 training knobs that are not part of the release format.
_DSV4_ONLY_FIELDS = ("mtp_loss_weight", "indexer_loss_coeff", "attention_chunk_size", "loss_chunk_size",
                     "activation_checkpointing", "attention_backend")
QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
}


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


def config_from_hf(source: str | os.PathLike | dict[str, Any], **overrides: Any) -> DSV4Config:
    """Build a ``DSV4Config`` from a checkpoint directory, a ``config.json`` path or its parsed dict."""
    data = dict(read_hf_config_dict(source) if isinstance(source, (str, os.PathLike)) else source)
    if "torch_dtype" not in data and "dtype" in data:
        data["torch_dtype"] = data["dtype"]
    names = {f.name for f in fields(DSV4Config)}
    values = {k: v for k, v in data.items() if k in names}
    if "compress_rates" in data and "compress_ratios" not in values:
        values["compress_ratios"] = data["compress_rates"]
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"config_from_hf: unknown override keys {unknown}")
    values.update(overrides)
    n = int(values.get("num_hidden_layers", DSV4Config.num_hidden_layers))
    mtp = int(values.get("num_nextn_predict_layers", DSV4Config.num_nextn_predict_layers))
    ratios = values.get("compress_ratios")
    if ratios is not None and len(ratios) > n + mtp:  # e.g. MTP disabled by an override: drop its ratio entries
        values["compress_ratios"] = list(ratios)[: n + mtp]
    return DSV4Config(**values)


def config_to_hf(config: DSV4Config, *, quantized: bool = False) -> dict[str, Any]:
    """The ``config.json`` dict of an export: release field names, ``quantization_config`` when ``quantized``."""
    data = {k: v for k, v in asdict(config).items() if k not in _DSV4_ONLY_FIELDS}
    data["torch_dtype"] = "bfloat16" if quantized else data["torch_dtype"]
    out: dict[str, Any] = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", **data}
    if quantized:
        out["quantization_config"] = dict(QUANTIZATION_CONFIG)
    return out


def write_hf_config(config: DSV4Config, directory: str, *, quantized: bool = False, torch_dtype: str | None = None) -> str:
    data = config_to_hf(config, quantized=quantized)
    if torch_dtype is not None:
        data["torch_dtype"] = torch_dtype
    os.makedirs(directory, exist_ok=True)
    file = os.path.join(directory, CONFIG_FILE)
    with open(file, "w") as f:
        json.dump(data, f, indent=2)
    return file
