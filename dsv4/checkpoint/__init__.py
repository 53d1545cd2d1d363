"""HF safetensors checkpoints (the released DeepSeek-V4 layout, or the one transformers writes) <-> the dsv4 module tree.

* :func:`load_hf_checkpoint` (``load.py``): checked, streamed, EP-aware load with FP8/FP4 dequantisation, of either
  layout (:mod:`~dsv4.checkpoint.layouts`).
* :func:`export_hf_checkpoint` (``export.py``): bf16 / fp32 / re-quantised export with an index file.
* :func:`config_from_hf` / :func:`config_to_hf` (``hf_config.py``): ``config.json`` <-> ``DSV4Config``.
* :mod:`~dsv4.checkpoint.keys`: the name adapter; :mod:`~dsv4.checkpoint.quant`: the FP8/FP4 formats.
* ``python -m dsv4.checkpoint inspect DIR``: layout, config, tensor count, dtypes and size from the headers only.
"""

from dsv4.checkpoint.export import EXPORT_DTYPES, ExportReport, export_hf_checkpoint
from dsv4.checkpoint.hf_config import config_from_hf, config_to_hf
from dsv4.checkpoint.keys import hf_to_ours, ours_to_hf
from dsv4.checkpoint.load import LoadReport, load_hf_checkpoint, load_model_from_hf
from dsv4.checkpoint.safetensors_io import CheckpointDir

__all__ = [
    "EXPORT_DTYPES",
    "CheckpointDir",
    "ExportReport",
    "LoadReport",
    "config_from_hf",
    "config_to_hf",
    "export_hf_checkpoint",
    "hf_to_ours",
    "load_hf_checkpoint",
    "load_model_from_hf",
    "ours_to_hf",
]
