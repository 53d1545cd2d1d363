"""The ``trainer`` group: what dsv4 takes out of Lightning's keywords (``precision``, ``offload``,
``engram_tables``, ``skip_nonfinite_steps``, ``startup_timeout_s``) and what it derives from them (world size, device
type)."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from dsv4.training.options import is_int

PRECISIONS = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def compute_dtype_for(precision: str, torch_dtype: str) -> torch.dtype:
    """The dtype the model computes in: ``precision`` ``auto`` follows ``model.torch_dtype`` (float32 -> fp32,
    bfloat16 -> bf16 mixed, float16 -> fp16 mixed); ``32-true`` / ``bf16-mixed`` / ``16-mixed`` choose directly.
    Lightning's own autocast is not used: mixed precision is FSDP2's, with fp32 master weights."""
    if precision == "auto":
        return _TORCH_DTYPES[torch_dtype]
    if precision not in PRECISIONS:
        raise ValueError(f"`trainer.precision`={precision!r} must be auto or one of {sorted(PRECISIONS)} (dsv4 keeps "
                         "fp32 master weights; a *-true half precision would not)")
    return PRECISIONS[precision]


def offload_mode(value: Any) -> str:
    """``trainer.offload``: ``none`` (every FSDP shard and the optimizer on the device) or ``optimizer`` (FSDP2's
    CPU offload policy: sharded fp32 master parameters, their gradients and the optimizer state in host memory, the
    optimizer step on the host; docs/memory.md)."""
    from dsv4.parallel.wrap import OFFLOAD

    if value not in OFFLOAD:
        raise ValueError(f"`trainer.offload`={value!r} must be one of {', '.join(OFFLOAD)}")
    return value


ENGRAM_TABLES = ("device", "host")


def engram_tables_mode(value: Any, config: Any) -> str:
    """``trainer.engram_tables``: ``device`` (each rank's rows of V4.1's Engram tables in device memory) or ``host``
    (frozen tables held in host memory, the looked-up rows copied to the device per lookup; docs/memory.md). ``host``
    needs a model with Engram tables (V4.1, ``model.engram_layer_ids``) that are frozen (``model.engram_trainable``
    false); otherwise a ValueError naming the keys, before any work."""
    if value not in ENGRAM_TABLES:
        raise ValueError(f"`trainer.engram_tables`={value!r} must be one of {', '.join(ENGRAM_TABLES)}")
    if value == "host":
        if not getattr(config, "engram_layer_ids", None):
            raise ValueError("`trainer.engram_tables`='host' holds DeepSeek-V4.1's Engram tables in host memory, but "
                             f"this model (model_type {getattr(config, 'model_type', None)!r}) has no Engram tables "
                             "(model.engram_layer_ids is empty); use trainer.engram_tables=device")
        if getattr(config, "engram_trainable", False):
            raise ValueError("`trainer.engram_tables`='host' holds frozen Engram tables only, but "
                             "`model.engram_trainable`=true trains them (their gradient and optimizer state live with "
                             "the rows on the device); set model.engram_trainable=false or trainer.engram_tables=device")
    return value


def skip_nonfinite_steps(value: Any) -> int:
    """``trainer.skip_nonfinite_steps``: a whole number of steps >= 0."""
    if not is_int(value) or value < 0:
        raise ValueError(f"`trainer.skip_nonfinite_steps`={value!r} must be a whole number of steps >= 0 "
                         "(0: the first non-finite loss or gradient norm stops the run)")
    return value


def startup_timeout_s(value: Any) -> float:
    """``trainer.startup_timeout_s``: seconds > 0 the process group may take to form (and its first all-reduce)
    before the start-up fails naming the cause (:func:`dsv4.training.elastic.form_process_group`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"`trainer.startup_timeout_s`={value!r} must be a number of seconds > 0 (how long the ranks "
                         "may take to form their process group)")
    return float(value)


def check_not_derived(trainer_cfg: Mapping[str, Any]) -> None:
    """Refuse the Lightning keywords dsv4 derives (``accumulate_grad_batches``, from ``global_batch_size``)."""
    if "accumulate_grad_batches" in trainer_cfg:
        raise ValueError(f"`trainer.accumulate_grad_batches`={trainer_cfg['accumulate_grad_batches']!r} is derived: "
                         "set `global_batch_size` (rows per optimizer step over all dp replicas) instead")


def world_size_of(trainer_cfg: Mapping[str, Any]) -> int | None:
    """World size implied by the trainer config (``devices`` x ``num_nodes``); None when only known at launch."""
    devices = trainer_cfg.get("devices", 1)
    if isinstance(devices, (list, tuple)):
        devices = len(devices)
    if not isinstance(devices, int) or devices < 1:
        return None
    return devices * int(trainer_cfg.get("num_nodes", 1))


def device_type_of(trainer_cfg: Mapping[str, Any]) -> str:
    """The torch device type a trainer config runs on (``trainer.accelerator``: gpu / cuda -> ``cuda``)."""
    accelerator = str(trainer_cfg.get("accelerator", "cpu"))
    return "cuda" if accelerator in ("gpu", "cuda") else accelerator
