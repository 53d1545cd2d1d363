"""The ``export`` group: what the end of training writes (:meth:`dsv4.training.module.DSV4LightningModule.on_train_end`)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig

from dsv4.peft.config import LoRAConfig


@dataclass(frozen=True)
class ExportSpec:
    """At the end of training: ``hf_dir`` gets the model in the Hugging Face layout in ``dtype`` (merged under LoRA
    with ``merge``), ``adapter_dir`` the LoRA adapters in the PEFT format."""

    hf_dir: str | None = None
    dtype: str = "bfloat16"
    adapter_dir: str | None = None
    merge: bool = False


def export_spec(cfg: DictConfig, lora: LoRAConfig | None) -> ExportSpec:
    """The ``export`` group as an :class:`ExportSpec`: the keys that need (or exclude) ``peft=lora`` and the
    export dtype are checked."""
    export = ExportSpec(hf_dir=cfg.export.hf_dir, dtype=cfg.export.dtype, adapter_dir=cfg.export.adapter_dir,
                        merge=bool(cfg.export.merge))
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
    return export
