"""Typed schema of ``conf/finetune.yaml`` (registered in Hydra's ConfigStore as ``finetune_schema``).

Typos and wrong types fail while Hydra composes the config, before any process starts:
``cp=three`` -> "Value 'three' ... could not be converted to Integer / full_key: cp"; ``cpp=4`` -> "Key 'cpp' not
in 'FinetuneConfig'"; ``model.bogus=1`` -> "Key 'bogus' not in 'ModelConfig'". Semantic checks (cp dividing the
world, compress_ratios length, seq_len multiple of cp x LCM, dispatcher availability, the data itself) run in
:func:`dsv4.training.run.validate` before the Trainer launches its processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from hydra.core.config_store import ConfigStore

from dsv4.config import DSV4Config


@dataclass
class DataConfig:
    """Keyword arguments of :func:`dsv4.data.build_documents` (``kind``: stdlib | jsonl | hf)."""

    kind: str = "stdlib"
    path: Optional[str] = None
    tokenizer: str = "byte"
    split: str = "train"
    text_key: str = "text"
    messages_key: str = "messages"
    chat_template_file: Optional[str] = None
    max_documents: Optional[int] = None
    max_bytes: Optional[int] = None
    min_bytes: int = 64
    seed: int = 0


@dataclass
class OptimConfig:
    lr: float = 3e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    bias_update_rate: float = 1e-3


@dataclass
class DispatcherConfig:
    """MoE token dispatcher: local | alltoall | allgather | deepep | hybridep."""

    name: str = "local"


@dataclass
class CheckpointConfig:
    """``every_n_steps``: distributed checkpoint cadence (0 = only at the end); ``resume``: ``auto`` (the run
    dir's newest complete checkpoint, if any), ``none``, or a checkpoint directory."""

    every_n_steps: int = 50
    resume: str = "auto"


@dataclass
class ExportConfig:
    """``hf_dir``: write the trained model there at the end of training in the HF layout (``dsv4.checkpoint``);
    ``dtype``: bfloat16 | float32 | quantized (release FP8/FP4 formats)."""

    hf_dir: Optional[str] = None
    dtype: str = "bfloat16"


@dataclass
class LoggerConfig:
    """``kind``: wandb | csv | none. wandb runs offline when no credentials are configured."""

    kind: str = "wandb"
    project: str = "dsv4"
    name: Optional[str] = None
    offline: Optional[bool] = None


@dataclass
class ModelConfig(DSV4Config):
    """The model group: every :class:`DSV4Config` field, plus ``checkpoint``: a Hugging Face-format DSV4
    checkpoint directory (safetensors + index + config.json) whose weights are loaded before training."""

    checkpoint: Optional[str] = None


@dataclass
class FinetuneConfig:
    cp: int = 1
    dp: int = -1
    ep: int = 1
    seq_len: int = 2048
    seed: int = 1234
    micro_batch_size: int = 1
    dry_run: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    dispatcher: DispatcherConfig = field(default_factory=DispatcherConfig)
    trainer: Any = field(default_factory=dict)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    export: ExportConfig = field(default_factory=ExportConfig)


def register_schema() -> None:
    ConfigStore.instance().store(name="finetune_schema", node=FinetuneConfig)
