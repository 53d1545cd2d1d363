"""The ``export`` group: what the end of training writes (:meth:`dsv4.training.module.DSV4LightningModule.on_train_end`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from omegaconf import DictConfig

from dsv4.peft.config import LoRAConfig


@dataclass(frozen=True)
class ExportSpec:
    """At the end of training: ``hf_dir`` gets the model in the Hugging Face layout in ``dtype`` (merged under LoRA
    with ``merge``), ``adapter_dir`` the LoRA adapters in the PEFT format. Each must be absent or empty at the start
    unless ``overwrite``: then every file the export does not write is removed from it after the export."""

    hf_dir: str | None = None
    dtype: str = "bfloat16"
    adapter_dir: str | None = None
    merge: bool = False
    overwrite: bool = False


def export_spec(cfg: DictConfig, lora: LoRAConfig | None, beside: bool = False) -> ExportSpec:
    """The ``export`` group as an :class:`ExportSpec`: the keys that need (or exclude) ``peft=lora``, the export
    dtype, and the directories (absent or empty, or ``export.overwrite=true`` and holding files only; the two not
    one inside the other) are checked, so nothing is refused after training. ``beside`` (a DSpark drafter): an
    ``export.hf_dir`` holding a checkpoint (its index) is accepted, the drafter goes beside it (the drafter
    recipe checks the rest: :func:`dsv4.training.options.dspark.check_export_beside`)."""
    export = ExportSpec(hf_dir=cfg.export.hf_dir, dtype=cfg.export.dtype, adapter_dir=cfg.export.adapter_dir,
                        merge=bool(cfg.export.merge), overwrite=bool(cfg.export.get("overwrite", False)))
    if lora is None and (export.adapter_dir or export.merge):
        raise ValueError("`export.adapter_dir` / `export.merge` need peft=lora (a full fine-tune has no adapters)")
    if lora is not None and export.hf_dir and not export.merge:
        raise ValueError("`export.hf_dir` with peft=lora writes the merged model: set export.merge=true (or "
                         "export.adapter_dir for the adapters alone)")
    if export.merge and not export.hf_dir:
        raise ValueError("`export.merge=true` needs `export.hf_dir` (where the merged model goes)")
    if export.hf_dir:
        from dsv4.checkpoint import EXPORT_DTYPES

        if export.dtype not in EXPORT_DTYPES:
            raise ValueError(f"`export.dtype`={export.dtype!r} must be one of {EXPORT_DTYPES}")
    if export.hf_dir and export.adapter_dir and _nested(export.hf_dir, export.adapter_dir):
        raise ValueError(f"`export.hf_dir`={export.hf_dir!r} and `export.adapter_dir`={export.adapter_dir!r}: the "
                         "merged model and the adapter go to two separate directories, neither inside the other")
    from dsv4.checkpoint.export_dir import check_export_dir

    from dsv4.checkpoint.hf_config import INDEX_FILE

    for key in ("hf_dir", "adapter_dir"):
        path = getattr(export, key)
        if path and not (beside and key == "hf_dir" and os.path.isfile(os.path.join(path, INDEX_FILE))):
            check_export_dir(path, key=f"export.{key}", overwrite=export.overwrite, flag="export.overwrite=true")
    return export


def _nested(a: str, b: str) -> bool:
    """``a`` and ``b`` are one directory, or one lies inside the other (symbolic links resolved)."""
    a, b = os.path.realpath(a), os.path.realpath(b)
    return os.path.commonpath([a, b]) in (a, b)
